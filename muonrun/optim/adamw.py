"""torch.optim.AdamW stepping the local shards of FSDP2 parameters.

AdamW is elementwise, so on a parameter sharded like its gradient and its moments, stepping the
local tensors is stepping the DTensors. torch's own path sends every call through DTensor's
dispatcher, which unwraps and checks the tensors one by one: host time per parameter, several times
the local step's, which sets the step time wherever the host is the bottleneck (CPU runs above all;
on a GPU the step's own work mostly hides it). `torchrun --standalone --nproc-per-node 2
benchmarks/bench_host.py` measures both paths; docs/performance.md has the figures.

Everything else is torch's: hyperparameters, param groups, the state (moments stay DTensors, created
by torch from the parameters, so Distributed Checkpoint saves and reshards them unchanged) and the
arithmetic (the same kernels on the same numbers: results equal torch's on the full tensors).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from muonrun import compat
from muonrun.distributed import local_tensor, shard_group
from muonrun.optim.telemetry import Sums, sum_of_squares


class AdamW(compat.AdamWWithGroupLists):
    """`torch.optim.AdamW` whose step runs on the local shards of DTensor parameters (plain tensors
    pass through). Each gradient must be laid out like its parameter, as FSDP2's are.

    Telemetry (`collect_telemetry = True`; `muonrun.optim.telemetry`): every `step()` fills
    `self.telemetry` with `update_rms`, the RMS of what the step changed (weight decay included) over all
    the parameters it stepped, and `momentum_norm`, the L2 norm of all the `exp_avg` after the step. It
    keeps a copy of the stepped local shards during the step.
    """

    _checked: frozenset[int] = frozenset()  # ids of the param groups whose layout was checked
    collect_telemetry: bool = False  # set by the trainer
    telemetry: dict[str, Tensor] = {}  # replaced, never mutated: each collecting step assigns a new dict

    @torch.no_grad()
    def step(self, closure=None):
        if not self.collect_telemetry:
            return super().step(closure)
        loss = None
        if closure is not None:  # first, so that the gradients it makes are known
            with torch.enable_grad():
                loss = closure()
        stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        before = [local_tensor(p).clone() for p in stepped]
        super().step()
        if not stepped:
            return loss
        sums = Sums(("update", "momentum"), local_tensor(stepped[0]).device)
        by_group: dict[int, tuple[object, list[int]]] = {}
        for i, p in enumerate(stepped):
            group = shard_group(p).group
            by_group.setdefault(id(group), (group, []))[1].append(i)
        for group, idx in by_group.values():
            now = [local_tensor(stepped[i]) for i in idx]
            sums.add(group, "update", sum_of_squares(compat.foreach_sub(now, [before[i] for i in idx])))
            exp_avg = [local_tensor(self.state[stepped[i]]["exp_avg"]) for i in idx]
            sums.add(group, "momentum", sum_of_squares(exp_avg))
        self.telemetry = sums.telemetry(sum(p.numel() for p in stepped))
        return loss

    def group_lists(self, group: dict, lists) -> None:
        # torch filled (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) and hands
        # them to its functional AdamW next: swap in the local tensors before it runs.
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
