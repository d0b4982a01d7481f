"""What one Muon step needs, in one typed object: ``MuonStep``, built by ``Muon.step`` and handed to
every path that runs a part of the step; the paths touch nothing else of the optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from muonrun import compat
from muonrun.distributed import local_tensor
from muonrun.optim.fused import Passes, with_row_factors
from muonrun.optim.groups import ExpertLayout
from muonrun.optim.newton_schulz import ADJUST_LR_FNS, NewtonSchulz, adjust_lr
from muonrun.optim.telemetry import Sums

VARIANTS = ("muon", "normuon")
NS_KEYS = ("ns_coefficients", "eps", "ns_steps")  # torch.optim.Muon's per-group Newton–Schulz settings


def to_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def check_group(group: dict) -> None:
    """Raises ValueError for a param group's setting Muon does not know."""
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if group["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {group['variant']!r}")
    if not 0.0 <= group["beta2"] < 1.0:
        raise ValueError(f"beta2 should be in [0, 1) but is: {group['beta2']}")
    per_group = [k for k in NS_KEYS if k in group]
    if per_group:  # torch.optim.Muon reads them per group; here they would be silently ignored
        raise ValueError(
            f"a param group sets {per_group}: Newton–Schulz is one iteration for the whole optimizer; pass it "
            "to Muon itself (ns_coefficients, eps, ns_steps, or newton_schulz)"
        )


@dataclass(frozen=True)
class GroupSettings:
    """One param group's hyperparameters as this step reads them (``lr`` may change every step)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None
    normuon: tuple[float, float] | None  # NorMuon's (beta2, eps), None: Muon; equal ones batch together
    layout: ExpertLayout | None  # how the group's stacked experts hold their matrices; None: 2-D matrices

    @classmethod
    def of(cls, group: dict) -> GroupSettings:
        check_group(group)  # the group may have been edited since the last step
        normuon = (
            (float(group["beta2"]), float(group["normuon_eps"])) if group["variant"] == "normuon" else None
        )
        return cls(
            lr=to_float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            nesterov=bool(group["nesterov"]),
            adjust_lr_fn=group["adjust_lr_fn"],
            normuon=normuon,
            layout=ExpertLayout.of_group(group) if group["matrices_per_expert"] else None,
        )


@dataclass
class UpdateScalars:
    """One step's decay factors ``1 - lr * weight_decay`` (one per param group) and update scales
    ``-adjust_lr(lr, adjust_lr_fn, (rows, cols))`` (one per group and shape) in one list, with the two
    slots of each ``(group, rows, cols)`` in it. The layout follows the keys alone, so a compiled update
    pass or a CUDA graph reads the same slots every step while the values change."""

    values: list[float]
    slots: dict[tuple[int, int, int], tuple[int, int]]
    on_device: Tensor | None = None  # the values as a fp32 tensor, for a compiled pass or a CUDA graph

    @property
    def passed(self) -> Tensor | list[float]:
        """What the update pass reads: the device tensor where there is one, else the host numbers."""
        return self.values if self.on_device is None else self.on_device

    @classmethod
    def of(cls, keys: Sequence[tuple[int, int, int]], groups: Sequence[GroupSettings]) -> UpdateScalars:
        values: list[float] = []
        slots: dict[tuple[int, int, int], tuple[int, int]] = {}
        decay: dict[int, int] = {}
        for key in keys:
            gi, rows, cols = key
            if key in slots:
                continue
            s = groups[gi]
            if gi not in decay:
                decay[gi] = len(values)
                values.append(1 - s.lr * s.weight_decay)
            slots[key] = (decay[gi], len(values))
            values.append(-adjust_lr(s.lr, s.adjust_lr_fn, (rows, cols)))
        return cls(values, slots)


@dataclass
class MuonStep:
    """One Muon step: its settings, the optimizer's state it updates, and what it counts."""

    state: dict  # the optimizer's per-parameter state (momentum_buffer; NorMuon: second_moment)
    groups: Sequence[GroupSettings]
    newton_schulz: NewtonSchulz
    ns_dtype: torch.dtype  # of the exchange buffers and of Newton–Schulz
    passes: Passes
    scalars: UpdateScalars
    stats: dict[str, int]  # Muon's counters (Muon.stats), advanced as the step runs
    sums: Sums | None = None  # this step's telemetry terms, while collecting
    sample: object | None = None  # the plan item whose orthogonality residual telemetry reports

    def momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def second_moment(self, p: Tensor, layout: ExpertLayout | None = None) -> Tensor:
        """NorMuon's per-row EMA of the mean square of the Newton–Schulz result: fp32, one entry per row
        of ``p`` (``[E, k * out]`` for stacked experts of ``layout``), laid out like its rows: a DTensor
        with ``p``'s mesh and placements (each rank holds its own rows' entries) or a plain tensor. DCP
        saves and reshards it like the parameter."""
        state = self.state[p]
        if "second_moment" not in state:
            local = local_tensor(p)
            per_row = () if layout is None else (layout.matrices * layout.matrix_shape(p.shape)[0],)
            v = torch.zeros(local.shape[0], *per_row, dtype=torch.float32, device=local.device)
            if isinstance(p, DTensor):
                # split like p's rows; a split of its columns (row-wise tensor parallelism) holds whole rows
                placements = [Replicate() if getattr(pl, "dim", 0) != 0 else pl for pl in p.placements]
                shape = (p.shape[0], *per_row)
                v = DTensor.from_local(
                    v, p.device_mesh, placements, shape=shape, stride=v.stride(), run_check=False
                )
            state["second_moment"] = v
        return state["second_moment"]

    def orthogonalize(self, X: Tensor, base: Tensor | None = None) -> Tensor:
        """Newton–Schulz on the normalised stack ``X`` ``[k, rows, cols]`` into a new tensor, counted in
        ``stats``. With ``base``, ``X`` is a stack held whole (one rank's bucket, stacked experts), not
        normalised, held in place as the leading elements of each row of that contiguous ``[k, slab]``
        tensor, which the result overwrites: its norm is folded into the first product
        (``NewtonSchulz.folds_norm``) or divided in a pass over ``base``. A stack reassembled from
        several ranks is normalised as it is reassembled (``buckets.orthogonalize_stack``)."""
        ns = self.newton_schulz
        if base is None:
            out = ns(X)
        else:
            folds = ns.folds_norm(X.shape)
            if not folds:
                self.passes.normalize(base, X.shape[1], X.shape[2], ns.eps)
            out = ns(X, normalized=not folds, out=X)
        self.stats["orthogonalized"] += X.shape[0]
        self.stats["gram"] += X.shape[0] * ns.uses_gram(X.shape)
        return out

    def changes(self, gi: int, shape, params: list, updates: list, row_factors: list | None) -> list[Tensor]:
        """What decay and the update will change in ``params`` (``shape``, group ``gi``), for telemetry."""
        s = self.groups[gi]
        deltas = compat.foreach_mul(params, -s.lr * s.weight_decay)
        if row_factors is not None:
            updates = with_row_factors(updates, row_factors)
        compat.foreach_add_(deltas, updates, alpha=-adjust_lr(s.lr, s.adjust_lr_fn, shape))
        return deltas
