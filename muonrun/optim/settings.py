"""Muon's per-param-group settings, read from the groups: what batches together on an owner
(``NSSettings``, part of the exchange plan's key), what one step applies (``StepSettings``, and its
learning-rate-dependent numbers laid out for the update pass: ``UpdateScalars``) and the check of the
values (``check_settings``). Only Muon's modules (``muonrun.optim``) use it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from muonrun.optim.newton_schulz import (
    ADJUST_LR_FNS,
    PRECONDITIONS,
    Coefficients,
    Scaling,
    adjust_lr,
    resolve_ns_coefficients,
    uses_gram_form,
)

VARIANTS = ("muon", "normuon")


@dataclass(frozen=True)
class NSSettings:
    """How one param group's matrices are orthogonalised (and, for NorMuon, normalised on the owner);
    matrices that share it batch together."""

    per_step: tuple[Coefficients, ...]
    norm_scale: float
    eps: float
    normuon: tuple[float, float] | None  # NorMuon's (beta2, eps); None: plain Muon
    precondition: str = "frobenius"  # newton_schulz.PRECONDITIONS

    @classmethod
    def of(cls, group: dict) -> NSSettings:
        per_step, norm_scale = resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        normuon = (
            (float(group["beta2"]), float(group["normuon_eps"])) if group["variant"] == "normuon" else None
        )
        return cls(per_step, norm_scale, float(group["eps"]), normuon, group["precondition"])

    def scaling(
        self, multiply: Callable[[Tensor, Tensor], None], fold_for: Sequence[int] | None = None
    ) -> Scaling | None:
        """How the owner scales a stack: AOL's ``Scaling``, folded into the first Gram product; the
        Frobenius norm folded the same way for a stack of shape ``fold_for`` that the Gram form takes
        (None: never); else None, a pass dividing by the Frobenius norm (torch's). ``multiply``: the
        pass that applies a folded scale."""
        folds = fold_for is not None and uses_gram_form(fold_for, len(self.per_step))
        if self.precondition == "frobenius" and not folds:
            return None
        return Scaling(self.precondition, self.norm_scale, self.eps, multiply)


def check_settings(group: dict) -> None:
    """Raises ValueError for a param group's setting Muon does not know."""
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
    if group["variant"] not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {group['variant']!r}")
    if not 0.0 <= group["beta2"] < 1.0:
        raise ValueError(f"beta2 should be in [0, 1) but is: {group['beta2']}")
    if group["precondition"] not in PRECONDITIONS:
        raise ValueError(f"precondition must be one of {PRECONDITIONS}, got {group['precondition']!r}")
    resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])


@dataclass(frozen=True)
class StepSettings:
    """One param group's hyperparameters, read once per step (the schedule may change ``lr``)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None

    @classmethod
    def of(cls, group: dict) -> StepSettings:
        return cls(
            lr=to_float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            nesterov=bool(group["nesterov"]),
            adjust_lr_fn=group["adjust_lr_fn"],
        )


def to_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


@dataclass
class UpdateScalars:
    """One step's decay factors ``1 - lr * weight_decay`` (one per param group) and update scales
    ``-adjust_lr(lr, adjust_lr_fn, (rows, cols))`` (one per group and shape) in one list, with the two
    slots of each ``(group, rows, cols)`` in it. The layout follows the keys alone, so a compiled pass
    or a CUDA graph reads the same slots every step while a schedule changes the values."""

    values: list[float]
    slots: dict[tuple[int, int, int], tuple[int, int]]
    on_device: Tensor | None = None
    """The values as a float32 tensor, where the update pass is compiled or replayed from a graph."""

    @property
    def passed(self) -> Tensor | list[float]:
        """What the update pass reads: the device tensor where there is one, else the host numbers."""
        return self.values if self.on_device is None else self.on_device

    @classmethod
    def of(cls, keys: Sequence[tuple[int, int, int]], settings: Sequence[StepSettings]) -> UpdateScalars:
        values: list[float] = []
        slots: dict[tuple[int, int, int], tuple[int, int]] = {}
        decay: dict[int, int] = {}
        for key in keys:
            gi, rows, cols = key
            if key in slots:
                continue
            s = settings[gi]
            if gi not in decay:
                decay[gi] = len(values)
                values.append(1 - s.lr * s.weight_decay)
            slots[key] = (decay[gi], len(values))
            values.append(-adjust_lr(s.lr, s.adjust_lr_fn, (rows, cols)))
        return cls(values, slots)
