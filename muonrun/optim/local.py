"""The matrices a rank steps on its own, in units: a bucket of a one-rank shard group (every bucket on
one GPU) or a chunk of stacked experts the rank holds (``muonrun.optim.experts``).

Each unit's step is ``start`` (the momentum pass, which reads the gradients, into a buffer) then
``finish`` (normalisation, Newton–Schulz, NorMuon's rows, decay and update, all from that buffer and
the step's ``UpdateScalars``). The split is where a CUDA graph begins (``muonrun.optim.graphed``):
``finish`` reads nothing that changes address between steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from muonrun.distributed import local_tensor
from muonrun.optim.buckets import apply, orthogonalize, prepare
from muonrun.optim.experts import chunk_shape, stacked_momentum, stacked_update
from muonrun.optim.graphed import NO_LANES, Lanes, StepGraph
from muonrun.optim.step import MuonStep

Unit = tuple  # (partition, bucket) of a one-rank shard group, or (None, expert chunk)


def local_units(step: MuonStep, plan: Sequence, chunks: Sequence) -> list[Unit]:
    """This step's local units: the buckets of its one-rank partitions in plan order, then the expert
    chunks with experts on this rank."""
    units: list[Unit] = [(part, b) for part in plan if part.shard.world == 1 for b in part.buckets]
    return units + [(None, c) for c in chunks if chunk_shape(step.groups, c)[0]]


def buffer_for(step: MuonStep, unit: Unit) -> Tensor:
    """A new buffer of what ``start`` writes for ``unit``."""
    part, what = unit
    if part is None:
        device = local_tensor(what[0][1]).device
        return torch.empty(chunk_shape(step.groups, what), dtype=step.ns_dtype, device=device)
    return torch.empty(what.send_numel, dtype=step.ns_dtype, device=part.device)


def start(step: MuonStep, unit: Unit, buf: Tensor | None = None) -> Tensor:
    """``unit``'s momentum pass into ``buf`` (None: a new one), which it returns."""
    part, what = unit
    if part is None:
        return stacked_momentum(step, what, buf)
    return prepare(step, part, what, buf)


def finish(step: MuonStep, unit: Unit, buf: Tensor, lanes: Lanes = NO_LANES) -> None:
    """The rest of ``unit``'s step from what ``start`` wrote into ``buf``: each stack on a lane of
    ``lanes``, the update after them."""
    part, what = unit
    if part is None:
        with lanes.lane():
            stacked_update(step, what, buf)
    else:
        orthogonalize(step, part, what, buf, lanes)
        with lanes.after():
            apply(step, part, what, buf)


def step_local(step: MuonStep, units: Sequence[Unit], graph: StepGraph | None) -> None:
    """Every local unit's step: one after another, each with buffers of its own; or with ``graph``,
    each momentum pass into the graph's buffers, then the rest replayed from it (captured at its first
    steps, side by side on its lanes)."""
    if graph is None:
        for unit in units:
            finish(step, unit, start(step, unit))
        return
    for unit, buf in zip(units, graph.buffers, strict=True):
        start(step, unit, buf)

    def body() -> None:
        graph.lanes.open()
        for unit, buf in zip(units, graph.buffers, strict=True):
            finish(step, unit, buf, graph.lanes)
        graph.lanes.close()

    graph.run(body, step.stats)
