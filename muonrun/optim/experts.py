"""Muon on stacked expert weights: a mixture-of-experts layer's ``[E, out, in]`` parameter is a batch of
E matrices (or 2E with a fused gate/up projection), each orthogonalised on its own.

Where transformers stores them otherwise (``ExpertLayout``: GPT-OSS, Llama4 and Aria keep
``[E, in, out]``, GPT-OSS with gate and up interleaved), Muon reads and writes them through a strided
view ``[E, k, out, in]`` of the parameter, its gradient and its momentum, so every matrix is orthogonalised,
scaled (``adjust_lr``) and row-normalised (NorMuon: one entry per output neuron) as the same
``[out, in]`` weight would be in the usual layout.

FSDP2 shards dim 0, the expert dimension (``torch.chunk`` layout: ``ceil(E / W)`` experts per rank,
the last ranks fewer or none), so a rank's local shard is a set of whole experts and the rank that
holds an expert runs its Newton–Schulz: no exchange, unlike the row-sharded 2-D matrices
(``muonrun.optim.sharding``). ``muonrun.optim.muon.Muon`` steps these with the functions below,
through the same elementwise passes as the 2-D matrices (``muonrun.optim.fused``: compiled where fused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from muonrun import compat
from muonrun.distributed import local_tensor
from muonrun.optim.fused import with_row_factors
from muonrun.optim.newton_schulz import adjust_lr, normuon_row_scale, uses_gram_form
from muonrun.optim.settings import NSSettings
from muonrun.optim.telemetry import reduce_group, sum_of_squares

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def is_experts_module(module: nn.Module) -> bool:
    """A module holding stacked expert weights ([E, out, in] parameters): transformers names them
    `*Experts` (`Qwen2MoeExperts`, `MixtralExperts`, ...)."""
    return type(module).__name__.endswith("Experts")


@dataclass(frozen=True)
class ExpertLayout:
    """How a stacked expert parameter holds its experts' ``[out, in]`` matrices. A Muon param group of
    stacked experts carries it as ``matrices_per_expert``, ``experts_transposed`` and
    ``experts_interleaved`` (``group_keys``)."""

    matrices: int = 1
    """Matrices per expert: 2 for a fused ``gate_up_proj`` (the gate's and the up projection's)."""
    transposed: bool = False
    """Stored ``[E, in, out]`` (GPT-OSS, Llama4, Aria), else ``[E, out, in]`` (Qwen2-MoE, Mixtral, DeepSeek)."""
    interleaved: bool = False
    """A fused projection's matrices alternate along ``out`` (GPT-OSS: gate, up, gate, ...), else they
    follow one another."""

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(out, in)`` of one matrix of a parameter (or local shard) of ``shape`` ``[E, a, b]``."""
        out, fan_in = (shape[2], shape[1]) if self.transposed else (shape[1], shape[2])
        return out // self.matrices, fan_in

    def matrices_of(self, T: Tensor) -> Tensor:
        """``T`` (shaped like the parameter or its local shard, ``[E', a, b]``) as a view ``[E', k, out,
        in]`` of its matrices: contiguous in the usual layout, strided in the others."""
        M = T.mT if self.transposed else T
        k = self.matrices
        if self.interleaved:
            return M.unflatten(1, (M.shape[1] // k, k)).transpose(1, 2)
        return M.unflatten(1, (k, M.shape[1] // k))

    @property
    def strided(self) -> bool:
        """Whether ``matrices_of`` gives a strided view (any layout but the usual one)."""
        return self.transposed or self.interleaved

    def group_keys(self) -> dict:
        return {
            "matrices_per_expert": self.matrices,
            "experts_transposed": self.transposed,
            "experts_interleaved": self.interleaved,
        }

    @classmethod
    def of_group(cls, group: dict) -> ExpertLayout:
        """The layout a param group of stacked experts declares (``group_keys``; the usual one by default)."""
        return cls(
            group["matrices_per_expert"],
            bool(group.get("experts_transposed", False)),
            bool(group.get("experts_interleaved", False)),
        )


def expert_layout(module: nn.Module, param_name: str) -> ExpertLayout:
    """The layout of the stacked parameter ``param_name`` of a ``*Experts`` module. transformers declares
    it on modules it wraps with ``use_experts_implementation`` (``is_transposed``, ``is_concatenated``);
    an undeclared one (Llama4's) is read from where its hidden size sits in ``down_proj`` or
    ``gate_up_proj``."""
    k = matrices_per_expert(param_name)
    interleaved = k > 1 and getattr(module, "is_concatenated", True) is False
    return ExpertLayout(k, _stored_transposed(module), interleaved)


def _stored_transposed(module: nn.Module) -> bool:
    declared = getattr(module, "is_transposed", None)
    if declared is not None:
        return bool(declared)
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None)
    for name, out_is_hidden in (("down_proj", True), ("gate_up_proj", False)):
        p = getattr(module, name, None)
        if isinstance(p, Tensor) and p.ndim == 3 and p.shape[1] != p.shape[2] and hidden in p.shape[1:]:
            # [E, out, in]: the hidden size is down_proj's out (dim 1) and gate_up_proj's in (dim 2)
            return (p.shape[1] == hidden) != out_is_hidden
    return False


def matrices_per_expert(param_name: str) -> int:
    """How many matrices one expert's slice of a stacked parameter holds: 2 for transformers' fused
    `gate_up_proj` (the gate's and the up projection's), 1 otherwise."""
    return 2 if param_name.rsplit(".", 1)[-1] == "gate_up_proj" else 1


def check_stacked(p: Tensor, layout: ExpertLayout, name: str) -> None:
    """A stacked parameter must split into ``layout.matrices`` equal matrices per expert and be sharded
    on dim 0 alone."""
    k = layout.matrices
    out = p.shape[2] if layout.transposed else p.shape[1]
    if k < 1 or out % k:
        raise ValueError(f"Muon: stacked parameter {name} cannot be split into {k} matrices per expert")
    if DTensor is not None and isinstance(p, DTensor):
        local = local_tensor(p)
        if tuple(local.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(
                f"Muon: stacked parameter {name} is sharded inside its experts ({p.placements}); "
                "only the expert dimension (dim 0) may be sharded"
            )


def expert_rows_like(p: Tensor, layout: ExpertLayout, dtype: torch.dtype = torch.float32) -> Tensor:
    """Zeros ``[E, k * out]``: one entry per row (output neuron) of every expert matrix of ``p``, laid
    out like ``p``'s experts (a DTensor with its mesh and placements, or a plain tensor), so DCP saves
    and reshards it like the parameter."""
    local = local_tensor(p)
    out, _ = layout.matrix_shape(p.shape)
    rows = layout.matrices * out
    zeros = torch.zeros(local.shape[0], rows, dtype=dtype, device=local.device)
    if DTensor is None or not isinstance(p, DTensor):
        return zeros
    return DTensor.from_local(
        zeros, p.device_mesh, p.placements, shape=(p.shape[0], rows), stride=(rows, 1), run_check=False
    )


def expert_chunks(stacked: Sequence[tuple[int, Tensor]], bucket_numel: int) -> list[list[tuple[int, Tensor]]]:
    """Stacked parameters (``(group index, parameter)``, with gradients) in chunks stepped together: the
    same group and local shape, at most ``bucket_numel`` elements each (one parameter at least), in
    order. A chunk's elementwise passes are one call over its list, its Newton–Schulz one batch."""
    open_: dict[tuple, list[tuple[int, Tensor]]] = {}
    chunks: list[list[tuple[int, Tensor]]] = []
    for gi, p in stacked:
        local = local_tensor(p)
        key = (gi, tuple(local.shape))
        chunk = open_.get(key)
        if chunk is None or (len(chunk) + 1) * local.numel() > bucket_numel:
            chunk = open_[key] = []
            chunks.append(chunk)
        chunk.append((gi, p))
    return chunks


def chunk_shape(opt, chunk: Sequence[tuple[int, Tensor]]) -> tuple[int, int, int]:
    """``(matrices, rows, cols)`` of the Newton–Schulz stack of a chunk on this rank (no matrices where
    it holds none of these experts): each matrix ``[out, in]``, whatever the parameter's layout."""
    layout = ExpertLayout.of_group(opt.param_groups[chunk[0][0]])
    local = local_tensor(chunk[0][1])
    return len(chunk) * local.shape[0] * layout.matrices, *layout.matrix_shape(local.shape)


def stacked_momentum(opt, chunk: Sequence[tuple[int, Tensor]], s, X: Tensor | None = None) -> Tensor:
    """Step 1 of ``step_stacked``: momentum and the Nesterov look-ahead of a chunk (step settings ``s``)
    written in ``opt.ns_dtype`` into ``X`` (``chunk_shape``; a new one where None), which it returns."""
    gi = chunk[0][0]
    layout = ExpertLayout.of_group(opt.param_groups[gi])
    params = [p for _, p in chunk]
    bufs = [layout.matrices_of(local_tensor(opt._momentum_buffer(p))) for p in params]
    grads = []
    for p in params:
        if p.grad.is_sparse:
            raise RuntimeError("Muon does not support sparse gradients")
        grads.append(layout.matrices_of(local_tensor(p.grad)))
    if X is None:
        X = torch.empty(chunk_shape(opt, chunk), dtype=opt.ns_dtype, device=grads[0].device)
    updates = list(X.view(len(params), *grads[0].shape).unbind(0))
    key = ("experts", gi, layout, *grads[0].shape, len(params))
    opt._passes.momentum(key, bufs, grads, updates, s.momentum, s.nesterov, strided=layout.strided)
    if opt._sums is not None:
        opt._sums.add(reduce_group(params[0]), "momentum", sum_of_squares(bufs))
    return X


def stacked_update(opt, chunk: Sequence[tuple[int, Tensor]], X: Tensor, s, scalars) -> None:
    """Steps 2 and 3 of ``step_stacked`` on the look-ahead ``X`` that ``stacked_momentum`` wrote;
    ``scalars``: the step's ``settings.UpdateScalars``."""
    gi = chunk[0][0]
    group = opt.param_groups[gi]
    layout = ExpertLayout.of_group(group)
    ns = NSSettings.of(group)
    params = [p for _, p in chunk]
    locals_ = [layout.matrices_of(local_tensor(p)) for p in params]  # [E', k, out, in] each
    shape = locals_[0].shape
    rows, cols = shape[-2:]
    updates = list(X.view(len(params), *shape).unbind(0))
    scaling = ns.scaling(opt._passes.scale, (rows, cols) if opt.fold_norm else None)
    if scaling is None:  # Frobenius: a pass of its own; AOL (or fold_norm) folds it into the first product
        opt._passes.normalize(X.view(X.shape[0], -1), rows, cols, ns.norm_scale, ns.eps)
    opt._newton_schulz(X, ns.per_step, scaling=scaling, out=X)
    row_factors = None
    if ns.normuon:
        vs = [local_tensor(opt._second_moment(p, layout)) for p in params]
        v = torch.cat([v.view(-1, rows) for v in vs])
        factor, v = normuon_row_scale(X, v, *ns.normuon)  # applied with the update (step 3)
        compat.foreach_copy_([v.view(-1, rows) for v in vs], list(v.view(len(params), -1, rows).unbind(0)))
        row_factors = list(factor.view(len(params), *shape[:-1]).unbind(0))
    opt.stats["orthogonalized"] += X.shape[0]
    opt.stats["gram"] += X.shape[0] * (opt.gram and uses_gram_form((rows, cols), len(ns.per_step)))
    if opt._sums is not None:  # what the step changes, before it changes it
        deltas = compat.foreach_mul(locals_, -s.lr * s.weight_decay)
        scaled = with_row_factors(updates, row_factors) if ns.normuon else updates
        compat.foreach_add_(deltas, scaled, alpha=-adjust_lr(s.lr, s.adjust_lr_fn, (rows, cols)))
        opt._sums.add(reduce_group(params[0]), "update", sum_of_squares(deltas))
    slots = [scalars.slots[(gi, rows, cols)]] * len(params)
    key = ("experts", gi, layout, *shape, len(params))
    opt._passes.decay_and_update(key, locals_, updates, scalars.passed, slots, row_factors, layout.strided)


def step_stacked(opt, chunk: Sequence[tuple[int, Tensor]], s, scalars) -> None:
    """`Muon.step` for one chunk of stacked expert parameters (``expert_chunks``; step settings ``s``
    of their param group): all local, no exchange.

    1. Momentum and the Nesterov look-ahead, written in ``opt.ns_dtype`` into one buffer of all the
       chunk's matrices (``opt._passes``: one compiled pass where fused, the dense path's).
    2. Each matrix scaled as its ``NSSettings`` say (its Frobenius norm times ``norm_scale``, at least
       ``eps``, by a pass or folded into the first product with ``opt.fold_norm``; or AOL's row scaling
       inside the first product) and iterated in one batch, in place;
       NorMuon: each row's factor from ``normuon_row_scale`` and the rows' ``v`` updated.
    3. Weight decay and the scaled update (``scalars``: the step's ``settings.UpdateScalars``),
       NorMuon's row factors applied in it (``opt._passes`` again).
    """
    if chunk_shape(opt, chunk)[0] == 0:
        # No experts here. Their (empty) state still exists for DCP, and their zeros join telemetry's
        # all-reduce.
        bufs = [local_tensor(opt._momentum_buffer(p)) for _, p in chunk]
        group = opt.param_groups[chunk[0][0]]
        if NSSettings.of(group).normuon:
            for _, p in chunk:
                opt._second_moment(p, ExpertLayout.of_group(group))
        if opt._sums is not None:
            opt._sums.add(reduce_group(chunk[0][1]), "momentum", sum_of_squares(bufs))
        return
    stacked_update(opt, chunk, stacked_momentum(opt, chunk, s), s, scalars)
