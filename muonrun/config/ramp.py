"""`train.batch_ramp`: the global batch grows over the first tokens of a run (muonrun/train/ramp.py)."""

from __future__ import annotations

from dataclasses import dataclass

from muonrun.config.checks import at_least, not_negative


@dataclass
class BatchRampConfig:
    tokens: int = 0
    """Training tokens over which the global batch grows from `start_grad_accum_steps` to
    `train.grad_accum_steps` accumulation steps (0: no ramp, the full batch from the first step). A
    step accumulates start + (full - start) x min(T, tokens) / tokens micro-batches, rounded down, T
    being the tokens seen before it: the batch is a function of the tokens seen, so a resume (on any
    number of ranks) continues the ramp where it stopped and the data position is exactly the
    micro-batches trained. Each step's learning rate is the schedule's times sqrt(batch / full batch),
    the square-root rule for adaptive optimizers (Malladi et al. 2022, arXiv:2205.10287), for every
    parameter group of either optimizer. train.max_steps and `schedule.*` still count optimizer steps,
    so a ramped run of as many steps sees fewer tokens (`--dry-run` prints the ramp and the total)."""
    start_grad_accum_steps: int = 1
    """Accumulation steps of the first step: at least 1 and fewer than train.grad_accum_steps. The ramp
    moves in whole accumulation steps (train.micro_batch_size sequences on every data-parallel rank), so
    a finer ramp wants a smaller micro-batch and more accumulation steps."""

    def __post_init__(self) -> None:
        not_negative(**{"train.batch_ramp.tokens": self.tokens})
        at_least(1, **{"train.batch_ramp.start_grad_accum_steps": self.start_grad_accum_steps})
