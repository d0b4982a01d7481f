"""The one cross-rank collective per step, read one step late.

Every step all ranks must agree on: is the loss or gradient norm non-finite anywhere (stop together),
did any rank get SIGTERM/SIGUSR1 (save and stop together), is any rank's async checkpoint write still
running (publish together). Reading that answer right away would make the host wait for the whole
backward pass every step, and then the next forward's launch overhead could never hide behind GPU
work (the GPU would sit idle while the host launches the next forward's kernels). So the MAX
all-reduce and its copy to pinned host memory are queued at step N and read at step N+1, when the
GPU finished them long ago.

This rank's two host flags reach the GPU as fill kernels (`to_device`), not as a pageable copy,
which would make the host wait for the queued forward/backward every step after all.

The price: a NaN at step N is seen before step N+1's update, after step N's update was applied in
memory. Nothing bad is ever saved: a checkpoint first settles its own step's agreement (`settle`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from muonrun.distributed import HostCopy, all_reduce_max, to_device


@dataclass
class Agreed:
    """What every rank agreed about one step."""

    step: int
    bad_loss_rank: int | None  # the lowest rank whose loss is not finite, if any
    norm_bad: bool
    stop: bool
    writing: bool
    grad_norm: torch.Tensor  # the global norm: the same on every rank

    @property
    def loss_bad(self) -> bool:
        return self.bad_loss_rank is not None


class StepAgreement:
    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self._pending: tuple | None = None

    def launch(
        self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, local_flags: list[float]
    ) -> None:
        """Queue step's agreement; `local_flags` are this rank's [stop requested, async write running].
        A non-finite loss enters as world_size - rank, so the MAX names the lowest rank that has one."""
        local = torch.cat(
            [
                torch.stack(
                    [
                        (~torch.isfinite(loss)).float() * (self.world_size - self.rank),
                        (~torch.isfinite(grad_norm)).to(loss.device).float(),
                    ]
                ),
                to_device(local_flags, loss.device),
            ]
        )
        self._pending = (step, HostCopy(all_reduce_max(local)), grad_norm)

    def settle(self) -> Agreed | None:
        """The pending agreement (waits only for its own collective), or None if nothing is pending."""
        if self._pending is None:
            return None
        step, agreed, grad_norm = self._pending
        self._pending = None
        bad_loss, norm_bad, stop, writing = agreed.values()
        bad_loss_rank = self.world_size - round(bad_loss) if bad_loss > 0 else None
        return Agreed(step, bad_loss_rank, norm_bad > 0, stop > 0, writing > 0, grad_norm)


def non_finite_message(agreed: Agreed, world_size: int, resume_step: int | None) -> str:
    """The error for a non-finite step, in the same words on every rank (the launcher prints each
    distinct report once); `resume_step`: the newest checkpoint, which a rerun resumes from."""
    found = []
    if agreed.loss_bad:
        where = f" on rank {agreed.bad_loss_rank} (the lowest such rank)" if world_size > 1 else ""
        found.append(f"loss not finite{where}")
    if agreed.norm_bad:
        found.append(f"gradient norm {agreed.grad_norm.item()}")
    then = (
        f"rerun the command: it resumes from the last checkpoint, step-{resume_step}, which is intact."
        if resume_step is not None
        else "start again (no checkpoint was saved before that step)."
    )
    if agreed.step == 1:  # computed by the model as built, before any update: not the learning rate's doing
        return (
            f"Loss or gradient norm is not finite at step 1 ({', '.join(found)}), before any update: the model "
            "as built and initialised gives it, so the learning rate is not the cause. Look at the model's "
            "settings (model.hf: rope_theta, router_aux_loss_coef, initializer_range, ...; `muonrun config "
            "show` prints them) and its weights (model.init, checkpoint.init_from); nothing was saved."
        )
    return (
        f"Loss or gradient norm is not finite at step {agreed.step} ({', '.join(found)}); stopped, and "
        f"nothing from that step on was saved. Lower the learning rate or raise warmup, then {then}"
    )
