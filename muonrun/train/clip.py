"""Global gradient-norm clipping on FSDP2 shards, without DTensor dispatch.

`torch.nn.utils.clip_grad_norm_` works on DTensor gradients, but then each of its foreach ops goes
through DTensor's dispatcher, per gradient: on a model with hundreds of gradients that is many times
more host time than GPU work, and it limits the step wherever the host is the bottleneck (small
micro-batches, CPU). Here each rank takes the norms of its own shards in one foreach op, one
all-reduce per sharded mesh dimension adds the squares up (the replicate dimension of HSDP holds
copies, so it is not summed), and the scale is applied to the local shards: the same result as
torch's, a few plain kernels. `benchmarks/bench_host.py` measures both paths; docs/performance.md has
the figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from muonrun import compat
from muonrun.distributed import local_tensor


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients in place so that their global L2 norm is at most `max_norm` (`inf`: only
    measure). Returns the norm before clipping as a plain tensor, identical on every rank."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    mesh, placements = (
        (grads[0].device_mesh, grads[0].placements) if isinstance(grads[0], DTensor) else (None, ())
    )
    one_layout = all(
        g.device_mesh is mesh and g.placements == placements if isinstance(g, DTensor) else mesh is None
        for g in grads
    )
    if not one_layout or not all(p.is_shard() or p.is_replicate() for p in placements):
        # gradients on several meshes or with pending partial sums: torch's general path
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    local = [local_tensor(g) for g in grads]
    squares = torch.stack(compat.foreach_norm(local)).float().square().sum()
    for dim, placement in enumerate(placements):
        if placement.is_shard() and mesh.size(dim) > 1:
            dist.all_reduce(squares, group=mesh.get_group(dim))
    norm = squares.sqrt()
    if not math.isinf(max_norm):
        # torch's formula: the 1e-6 keeps a zero norm finite, the clamp never scales up
        compat.foreach_mul_(local, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm
