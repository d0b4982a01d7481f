"""Muon's step for matrices sharded across ranks: each bucket's rows go to its owner and back.

``muonrun.optim.sharding`` builds the plan (owners, buckets, offsets); this module runs it, pipelined:
``prefetch`` buckets' forward all-to-alls are in flight while one bucket is orthogonalised, and the
results of a bucket are applied while later ones are still on their way. One-rank shard groups (one
GPU) do not come here: their buckets step without an exchange (``muonrun.optim.local``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonrun.optim.buckets import apply, orthogonalize, prepare
from muonrun.optim.sharding import Bucket, Partition
from muonrun.optim.step import MuonStep


def step_exchanged(step: MuonStep, part: Partition, prefetch: int) -> None:
    """All buckets of one partition whose shard group has several ranks: exchange, orthogonalise and
    apply, pipelined ``prefetch`` buckets deep."""
    pg = part.shard.group
    buckets = part.buckets

    def launch_forward(b: Bucket):
        send = prepare(step, part, b)
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
