"""torch.optim.AdamW stepping the local shards of FSDP2 parameters.

AdamW is elementwise, so on a parameter sharded like its gradient and its moments, stepping the
local tensors is stepping the DTensors. torch's own path sends every call through DTensor's
dispatcher, which unwraps and checks the tensors one by one: on CPU (2 gloo ranks, 24 layers = 291
parameters, `scripts/bench_host.py`) the fused step takes 14.9-16.3 ms of host time on the DTensors
and 4.3-5.1 ms on the local tensors; torch's default per-tensor loop (what CPU runs get) 164-180 vs
27-28 ms. On a GPU the step's own work now hides that host time (docs/benchmarks.md run 19: the
same tokens/s either way on the 0.5B preset at micro-batch 8 and 16); the gain is CPU runs'.

Everything else is torch's: hyperparameters, param groups, the state (moments stay DTensors, created
by torch from the parameters, so Distributed Checkpoint saves and reshards them unchanged) and the
arithmetic (the same kernels on the same numbers: results equal torch's on the full tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muonrun.distributed import local_tensor


class AdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` whose step runs on the local shards of DTensor parameters (plain tensors
    pass through). Each gradient must be laid out like its parameter, as FSDP2's are."""

    _checked: frozenset[int] = frozenset()  # ids of the param groups whose layout was checked

    def _init_group(self, group: dict, *lists: list[Tensor]):
        # torch fills (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) here and
        # hands them to its functional AdamW: swap in the local tensors before it runs.
        out = super()._init_group(group, *lists)
        params, grads = lists[0], lists[1]
        if id(group) not in self._checked:
            for p, g in zip(params, grads, strict=True):
                if isinstance(p, DTensor) and (
                    not isinstance(g, DTensor)
                    or (g.device_mesh, g.placements) != (p.device_mesh, p.placements)
                ):
                    raise ValueError(
                        f"muonrun AdamW: a gradient is laid out as {getattr(g, 'placements', 'a plain tensor')} "
                        f"but its parameter as {p.placements}; it steps local shards, so they must match "
                        "(FSDP2's do). Use torch.optim.AdamW for other layouts."
                    )
            self._checked = self._checked | {id(group)}
        for values in lists:
            values[:] = [local_tensor(t) for t in values]
        return out
