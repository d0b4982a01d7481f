"""Muon on stacked expert weights: a mixture-of-experts layer's ``[E, out, in]`` parameter is a batch of
E matrices (or 2E with a fused gate/up projection), each orthogonalised on its own.

Where transformers stores them otherwise (``groups.ExpertLayout``), Muon reads and writes them through
a strided view ``[E, k, out, in]`` of the parameter, its gradient and its momentum, so every matrix is
orthogonalised, scaled (``adjust_lr``) and row-normalised (NorMuon: one entry per output neuron) as the
same ``[out, in]`` weight would be in the usual layout.

FSDP2 shards dim 0, the expert dimension (``torch.chunk`` layout: the last ranks may hold none), so the
rank that holds an expert runs its Newton–Schulz: no exchange, unlike the row-sharded 2-D matrices
(``sharding``). A chunk of stacked parameters steps as one of a rank's own units (``local``),
Newton–Schulz on the whole chunk at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muonrun import compat
from muonrun.distributed import local_tensor, shard_group
from muonrun.optim.groups import ExpertLayout
from muonrun.optim.newton_schulz import normuon_row_scale
from muonrun.optim.step import GroupSettings, MuonStep
from muonrun.optim.telemetry import sum_of_squares

Chunk = Sequence[tuple[int, Tensor]]  # (param group index, stacked parameter), one group and local shape


def check_stacked(p: Tensor, layout: ExpertLayout, name: str) -> None:
    """A stacked parameter must split into ``layout.matrices`` matrices per expert, sharded on dim 0 alone."""
    k = layout.matrices
    out = p.shape[2] if layout.transposed else p.shape[1]
    if k < 1 or out % k:
        raise ValueError(f"Muon: stacked parameter {name} cannot be split into {k} matrices per expert")
    if isinstance(p, DTensor):
        local = local_tensor(p)
        if tuple(local.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(
                f"Muon: stacked parameter {name} is sharded inside its experts ({p.placements}); "
                "only the expert dimension (dim 0) may be sharded"
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


def chunk_shape(groups: Sequence[GroupSettings], chunk: Chunk) -> tuple[int, int, int]:
    """``(matrices, rows, cols)`` of the Newton–Schulz stack of a chunk on this rank (no matrices where
    it holds none of these experts): each matrix ``[out, in]``, whatever the parameter's layout."""
    layout = groups[chunk[0][0]].layout
    local = local_tensor(chunk[0][1])
    return len(chunk) * local.shape[0] * layout.matrices, *layout.matrix_shape(local.shape)


def create_state(step: MuonStep, chunk: Chunk) -> None:
    """A chunk with no experts on this rank: its (empty) state exists for DCP, its zeros join telemetry."""
    s = step.groups[chunk[0][0]]
    bufs = [local_tensor(step.momentum_buffer(p)) for _, p in chunk]
    if s.normuon:
        for _, p in chunk:
            step.second_moment(p, s.layout)
    if step.sums is not None:
        step.sums.add(shard_group(chunk[0][1]).group, "momentum", sum_of_squares(bufs))


def stacked_momentum(step: MuonStep, chunk: Chunk, X: Tensor) -> Tensor:
    """Momentum and Nesterov look-ahead of a chunk into ``X`` (``chunk_shape``, ``ns_dtype``), returned."""
    gi = chunk[0][0]
    s = step.groups[gi]
    params = [p for _, p in chunk]
    bufs = [s.layout.matrices_of(local_tensor(step.momentum_buffer(p))) for p in params]
    grads = [s.layout.matrices_of(local_tensor(p.grad)) for p in params]
    updates = list(X.view(len(params), *grads[0].shape).unbind(0))
    key = ("experts", gi, s.layout, *grads[0].shape, len(params))
    step.passes.momentum(key, bufs, grads, updates, s.momentum, s.nesterov, strided=s.layout.strided)
    if step.sums is not None:
        step.sums.add(shard_group(params[0]).group, "momentum", sum_of_squares(bufs))
    return X


def stacked_update(step: MuonStep, chunk: Chunk, X: Tensor) -> None:
    """The rest of a chunk's step from ``stacked_momentum``'s ``X``: Newton–Schulz in one batch in place
    (``MuonStep.orthogonalize``), NorMuon's row factors and ``v``, weight decay and the scaled update."""
    gi = chunk[0][0]
    s = step.groups[gi]
    params = [p for _, p in chunk]
    locals_ = [s.layout.matrices_of(local_tensor(p)) for p in params]  # [E', k, out, in] each
    shape = locals_[0].shape
    rows, cols = shape[-2:]
    updates = list(X.view(len(params), *shape).unbind(0))
    step.orthogonalize(X, base=X.view(X.shape[0], -1))
    row_factors = None
    if s.normuon:
        vs = [local_tensor(step.second_moment(p, s.layout)) for p in params]
        v = torch.cat([v.view(-1, rows) for v in vs])
        factor, v = normuon_row_scale(X, v, *s.normuon)
        compat.foreach_copy_([v.view(-1, rows) for v in vs], list(v.view(len(params), -1, rows).unbind(0)))
        row_factors = list(factor.view(len(params), *shape[:-1]).unbind(0))
    if step.sums is not None:  # what the step changes, before it changes it
        deltas = step.changes(gi, (rows, cols), locals_, updates, row_factors)
        step.sums.add(shard_group(params[0]).group, "update", sum_of_squares(deltas))
    slots = [step.scalars.slots[(gi, rows, cols)]] * len(params)
    key = ("experts", gi, s.layout, *shape, len(params))
    step.passes.decay_and_update(
        key, locals_, updates, step.scalars.passed, slots, row_factors, s.layout.strided
    )
