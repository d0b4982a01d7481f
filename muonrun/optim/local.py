"""The matrices a rank steps on its own, in units: a bucket of a one-rank shard group (every bucket on
one GPU) or a chunk of stacked experts the rank holds (``muonrun.optim.experts``).

Each unit's step is ``start`` (the momentum pass, which reads the gradients, into a buffer) then
``finish`` (normalisation, Newton–Schulz, NorMuon's rows, decay and update, all from that buffer and
the step's ``UpdateScalars``). The split is where a CUDA graph begins (``muonrun.optim.graphed``):
``finish`` reads nothing that changes address between steps. Only ``muonrun.optim.muon`` uses it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from muonrun.distributed import local_tensor
from muonrun.optim.experts import chunk_shape, stacked_momentum, stacked_update
from muonrun.optim.graphed import NO_LANES, Lanes
from muonrun.optim.settings import StepSettings, UpdateScalars

Unit = tuple  # (partition, bucket) of a one-rank shard group, or (None, expert chunk)


def local_units(opt, plan: Sequence, chunks: Sequence) -> list[Unit]:
    """``opt``'s (a ``Muon``) local units this step: the buckets of its one-rank partitions in plan
    order, then the expert chunks with experts on this rank."""
    units: list[Unit] = [(part, b) for part in plan if part.shard.world == 1 for b in part.buckets]
    return units + [(None, c) for c in chunks if chunk_shape(opt, c)[0]]


def buffer_for(opt, unit: Unit) -> Tensor:
    """A new buffer of what ``start`` writes for ``unit``."""
    part, what = unit
    if part is None:
        return torch.empty(chunk_shape(opt, what), dtype=opt.ns_dtype, device=local_tensor(what[0][1]).device)
    return torch.empty(what.send_numel, dtype=opt.ns_dtype, device=part.device)


def start(opt, unit: Unit, settings: Sequence[StepSettings], buf: Tensor | None = None) -> Tensor:
    """``unit``'s momentum pass into ``buf`` (None: a new one, ``buffer_for``), which it returns."""
    part, what = unit
    if part is None:
        return stacked_momentum(opt, what, settings[what[0][0]], buf)
    return opt._prepare(part, what, settings, buf)


def finish(
    opt,
    unit: Unit,
    buf: Tensor,
    settings: Sequence[StepSettings],
    scalars: UpdateScalars,
    lanes: Lanes = NO_LANES,
) -> None:
    """The rest of ``unit``'s step from what ``start`` wrote into ``buf``: each stack on a lane of
    ``lanes``, the update after them."""
    part, what = unit
    if part is None:
        with lanes.lane():
            stacked_update(opt, what, buf, settings[what[0][0]], scalars)
    else:
        opt._orthogonalize(part, what, buf, lanes)
        with lanes.after():
            opt._apply(part, what, buf, settings, scalars)


def finish_all(
    opt,
    units: Sequence[Unit],
    bufs: Sequence[Tensor],
    settings: Sequence[StepSettings],
    scalars: UpdateScalars,
    lanes: Lanes = NO_LANES,
) -> None:
    """``finish`` of every unit, side by side on ``lanes``: what ``StepGraph`` captures."""
    lanes.open()
    for unit, buf in zip(units, bufs, strict=True):
        finish(opt, unit, buf, settings, scalars, lanes)
    lanes.close()
