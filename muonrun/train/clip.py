"""Global gradient-norm clipping on FSDP2 shards, without DTensor dispatch.

`torch.nn.utils.clip_grad_norm_` works on DTensor gradients, but then each of its foreach ops goes
through DTensor's dispatcher, per gradient: on a model with hundreds of gradients that is many times
more host time than GPU work, and it limits the step wherever the host is the bottleneck (small
micro-batches, CPU). Here each rank takes the norms of its own shards in one foreach op, one
all-reduce per split mesh dimension adds the squares up (the replicate dimension of HSDP holds
copies, so it is not summed; with tensor parallelism, the layers split over tp and the rest, copied
on the tp ranks, are summed layout by layout), and the scale is applied to the local shards: the same result as
torch's, a few plain kernels. `benchmarks/bench_host.py` measures both paths; docs/performance.md has
the figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from muonrun import compat
from muonrun.distributed import local_tensor


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the gradients in place so that their global L2 norm is at most `max_norm` (`inf`: only
    measure). Returns the norm before clipping as a plain tensor, identical on every rank. Gradients on
    several meshes (tensor-parallel layers beside FSDP-only ones) are summed layout by layout."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    layouts: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        layouts.setdefault((id(g.device_mesh), g.placements) if isinstance(g, DTensor) else None, []).append(
            g
        )
    if any(pl.is_partial() for g in grads if isinstance(g, DTensor) for pl in g.placements):
        # pending partial sums: torch's general path
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    squares = []
    for same in layouts.values():  # in parameter order: the same collectives in the same order everywhere
        local = [local_tensor(g) for g in same]
        part = torch.stack(compat.foreach_norm(local)).float().square().sum()
        if isinstance(same[0], DTensor):
            mesh = same[0].device_mesh
            for dim, placement in enumerate(same[0].placements):
                if not isinstance(placement, Replicate) and mesh.size(dim) > 1:  # split, not copied
                    dist.all_reduce(part, group=mesh.get_group(dim))
        squares.append(part)
    norm = torch.stack(squares).sum().sqrt()
    if not math.isinf(max_norm):
        # torch's formula: the 1e-6 keeps a zero norm finite, the clamp never scales up
        compat.foreach_mul_([local_tensor(g) for g in grads], (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm
