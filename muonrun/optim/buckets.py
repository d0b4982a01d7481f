"""One bucket of 2-D matrices through Muon's step, wherever its rows live: ``prepare`` (this rank's
rows), ``orthogonalize`` (the owner's side) and ``apply`` (this rank's rows again). Between them
``step_exchanged`` moves the buffers to the owners and back, pipelined (``Muon.prefetch``). On a rank
that holds its matrices whole (one GPU) the same buffer serves both sides, without an exchange
(``muonrun.optim.local``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from muonrun import compat
from muonrun.distributed import local_tensor
from muonrun.optim.fused import frobenius_divisors
from muonrun.optim.newton_schulz import normuon_row_scale, orthogonality_residual
from muonrun.optim.sharding import ROW_VALUES, Bucket, Item, Owned, Partition, scatter_rows
from muonrun.optim.step import MuonStep
from muonrun.optim.telemetry import sum_of_squares


def prepare(step: MuonStep, part: Partition, bucket: Bucket, send: Tensor) -> Tensor:
    """Momentum on local rows into the slabs of ``send`` (padding zeroed, NorMuon's v appended), returned."""
    for gi, items in bucket.by_group:
        s = step.groups[gi]
        bufs = [local_tensor(step.momentum_buffer(it.param)) for it in items]
        grads = [local_tensor(it.param.grad) for it in items]
        dsts = [local_view(send, it) for it in items]
        step.passes.momentum((id(bucket), gi), bufs, grads, dsts, s.momentum, s.nesterov)
        if step.sums is not None:
            step.sums.add(part.shard.group, "momentum", sum_of_squares(bufs))
    if part.normuon:
        vs = [local_tensor(step.second_moment(it.param)) for it in bucket.items]
        compat.foreach_copy_([it.state_view(send) for it in bucket.items], vs)
    for lo, hi in bucket.padding:
        send[lo:hi].zero_()
    return send


def orthogonalize(step: MuonStep, part: Partition, bucket: Bucket, recv: Tensor, lanes=None) -> None:
    """Owner side: every stack of same-shaped matrices this rank owns in ``recv`` (laid out by the plan,
    per source), each on a lane of ``lanes`` (``local.Lanes``: the CUDA graph's streams; None: in turn)."""
    grid = recv.view(part.shard.world, bucket.per_source)
    for own in bucket.owned:
        if lanes is None:
            orthogonalize_stack(step, part, own, grid)
        else:
            with lanes.lane():  # independent stacks: side by side on the graph's CUDA streams
                orthogonalize_stack(step, part, own, grid)


def orthogonalize_stack(step: MuonStep, part: Partition, own: Owned, grid: Tensor) -> None:
    """The owner's work on one stack (``grid``: the receive buffer as ``[world, per_source]``): normalise
    (or fold the norm), Newton–Schulz, NorMuon's row factors, and on several ranks the parts back."""
    W, eps, it = part.shard.world, step.newton_schulz.eps, own.first
    k, R, C, c = own.count, it.rows, it.cols, it.chunk
    run = grid[:, own.offset : own.offset + k * it.slab].view(W, k, it.slab)
    if W == 1:  # the buffer is ours: normalised in place (or its norm folded), the result written back
        out = step.orthogonalize(run[0, :, : c * C].view(k, c, C), base=run[0])
    elif it.blocks is None:  # rows: reassembled and normalised in one pass (padding rows are zero)
        slabs = run[..., : c * C].view(W, k, c, C)
        full = torch.empty(k, W * c, C, dtype=grid.dtype, device=grid.device)
        norm = frobenius_divisors(slabs, (0, 2, 3), eps).view(k, 1, 1, 1)
        torch.div(slabs.transpose(0, 1), norm, out=full.view(k, W, c, C))
        out = step.orthogonalize(full[:, :R])
    else:  # rectangles (tensor parallelism): each source's part put in its place
        X = torch.empty(k, R, C, dtype=grid.dtype, device=grid.device)
        for w, (r0, r1, c0, c1) in enumerate(it.blocks):
            X[:, r0:r1, c0:c1] = run[w, :, : (r1 - r0) * (c1 - c0)].view(k, r1 - r0, c1 - c0)
        X.div_(frobenius_divisors(X, (1, 2), eps).view(k, 1, 1))
        out = step.orthogonalize(X)
    if it is step.sample:  # reported by its owner, summed with the others' zeros
        step.sums.add(part.shard.group, "ortho_residual", orthogonality_residual(out[0]))
    if part.normuon:
        states = run[..., it.state_at : it.state_at + c * it.row_state]
        states = states.view(torch.float32).view(W, k, ROW_VALUES, c)  # v, then the factor, of every row
        v = rows_of(states[:, :, 0], it)
        factor, v = normuon_row_scale(out, v, *part.normuon)
        to_rows(states[:, :, 0], v, it)
        to_rows(states[:, :, 1], factor, it)  # applied with the update (``apply``)
    if it.blocks is not None:
        for w, (r0, r1, c0, c1) in enumerate(it.blocks):
            run[w, :, : (r1 - r0) * (c1 - c0)].view(k, r1 - r0, c1 - c0).copy_(out[:, r0:r1, c0:c1])
    elif W > 1:
        scatter_rows(run[..., : c * C].view(W, k, c, C), out, c)


def rows_of(slabs: Tensor, it: Item) -> Tensor:
    """Per-row values ``[k, rows]`` of matrices like ``it`` from each source's slab of them ``[W, k, chunk]``."""
    if it.blocks is None:
        return slabs.transpose(0, 1).reshape(slabs.shape[1], -1)[:, : it.rows]
    rows = slabs.new_empty(slabs.shape[1], it.rows)
    for w, (r0, r1, _, _) in enumerate(it.blocks):  # sources with the same rows hold the same values
        rows[:, r0:r1] = slabs[w, :, : r1 - r0]
    return rows


def to_rows(slabs: Tensor, rows: Tensor, it: Item) -> None:
    """``rows_of`` backwards: each source's rows of ``rows`` into its slab."""
    if it.blocks is None:
        scatter_rows(slabs, rows, it.chunk)
        return
    for w, (r0, r1, _, _) in enumerate(it.blocks):
        slabs[w, :, : r1 - r0] = rows[:, r0:r1]


def local_view(buf: Tensor, it: Item) -> Tensor:
    """This rank's part of a matrix inside an exchange buffer laid out by the plan."""
    return buf[it.offset : it.offset + it.local_rows * it.local_cols].view(it.local_rows, it.local_cols)


def apply(step: MuonStep, part: Partition, bucket: Bucket, result: Tensor) -> None:
    """Weight decay and the scaled update on this rank's rows (NorMuon: and the new v)."""
    params, updates, slots, factors, deltas = [], [], [], [], []
    for gi, rows, cols, items in bucket.by_update:
        ps = [local_tensor(it.param) for it in items]
        us = [local_view(result, it) for it in items]
        fs = [it.state_view(result, 1) for it in items] if part.normuon else None
        if step.sums is not None:  # what the step changes, before it changes it
            deltas += step.changes(gi, (rows, cols), ps, us, fs)
        params += ps
        updates += us
        factors += fs or []
        slots += [step.scalars.slots[(gi, rows, cols)]] * len(items)
    if step.sums is not None:
        step.sums.add(part.shard.group, "update", sum_of_squares(deltas))
    row_factors = factors if part.normuon else None
    step.passes.decay_and_update((id(bucket),), params, updates, step.scalars.passed, slots, row_factors)
    if part.normuon:
        vs = [local_tensor(step.second_moment(it.param)) for it in bucket.items]
        compat.foreach_copy_(vs, [it.state_view(result) for it in bucket.items])


def step_exchanged(step: MuonStep, part: Partition, prefetch: int) -> None:
    """All buckets of a partition over several ranks: exchange, orthogonalise, apply, ``prefetch`` deep."""
    pg = part.shard.group
    buckets = part.buckets

    def launch_forward(b: Bucket):
        send = prepare(step, part, b, torch.empty(b.send_numel, dtype=step.ns_dtype, device=part.device))
        recv = torch.empty(b.recv_numel, dtype=step.ns_dtype, device=part.device)
        work = dist.all_to_all_single(recv, send, b.recv_splits, b.send_splits, group=pg, async_op=True)
        step.stats["all_to_all"] += 1
        return send, recv, work

    inflight: dict[int, tuple] = {}
    for j in range(min(prefetch, len(buckets))):
        inflight[j] = launch_forward(buckets[j])
    returning: list[tuple] = []
    for j, b in enumerate(buckets):
        send, recv, work = inflight.pop(j)
        work.wait()
        orthogonalize(step, part, b, recv)
        # send buffer is free again (its forward exchange is complete): receive the results there
        back = dist.all_to_all_single(send, recv, b.send_splits, b.recv_splits, group=pg, async_op=True)
        step.stats["all_to_all"] += 1
        returning.append((b, send, recv, back))  # recv stays alive until its results are back
        nxt = j + prefetch
        if nxt < len(buckets):
            inflight[nxt] = launch_forward(buckets[nxt])
        # apply what came back while later buckets are still in flight
        while len(returning) > 1:
            rb, rsend, _, rwork = returning.pop(0)
            rwork.wait()
            apply(step, part, rb, rsend)
    for rb, rsend, _, rwork in returning:
        rwork.wait()
        apply(step, part, rb, rsend)
