"""The batch-size ramp (`train.batch_ramp`) as pure functions of the tokens seen, like the learning-rate
schedule of the step (muonrun/train/schedule.py): nothing to checkpoint beyond the tokens seen, which
the train state holds, so a resume recomputes the same batch.

`pytest tests/test_schedule.py` checks them; `muonrun pretrain tiny --dry-run train.grad_accum_steps=4
train.batch_ramp.tokens=200000` prints a ramp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from muonrun.config.ramp import BatchRampConfig


def accum_steps(tokens_seen: int, full: int, ramp: BatchRampConfig) -> int:
    """Micro-batches the next step accumulates, `tokens_seen` tokens into the run: from the ramp's start
    to `full` (train.grad_accum_steps), linear in tokens and rounded down, `full` from `ramp.tokens` on."""
    if not ramp.tokens or tokens_seen >= ramp.tokens:
        return full
    start = ramp.start_grad_accum_steps
    return start + (full - start) * tokens_seen // ramp.tokens


def lr_scale(accum: int, full: int) -> float:
    """The learning rate's factor for a step of `accum` of `full` accumulation steps: the square root
    of its share of the full batch (1 once the ramp is done)."""
    return 1.0 if accum == full else math.sqrt(accum / full)


@dataclass(frozen=True)
class Level:
    """One stretch of the ramp: `steps` optimizer steps of `accum` accumulation steps from `first_step`
    (1-based), starting `tokens` tokens into the run."""

    accum: int
    first_step: int
    steps: int
    tokens: int


def levels(full: int, ramp: BatchRampConfig, tokens_per_accum: int, max_steps: int) -> list[Level]:
    """The ramp as a fresh run of `max_steps` steps goes through it, with `tokens_per_accum` tokens per
    accumulation step over all ranks: one Level per batch size, the last one the full batch (if reached)."""
    out: list[Level] = []
    tokens, step = 0, 1
    while step <= max_steps:
        accum = accum_steps(tokens, full, ramp)
        if accum == full:  # the rest of the run: one stretch
            out.append(Level(full, step, max_steps - step + 1, tokens))
            break
        first, first_tokens = step, tokens
        while step <= max_steps and accum_steps(tokens, full, ramp) == accum:
            tokens += accum * tokens_per_accum
            step += 1
        out.append(Level(accum, first, step - first, first_tokens))
    return out


def tokens_after(
    steps: int, tokens_seen: int, full: int, ramp: BatchRampConfig, tokens_per_accum: int
) -> int:
    """The tokens seen after `steps` more steps from `tokens_seen` (the ramp's steps counted one by one,
    the full batch's at once)."""
    while steps > 0 and (accum := accum_steps(tokens_seen, full, ramp)) != full:
        tokens_seen += accum * tokens_per_accum
        steps -= 1
    return tokens_seen + max(steps, 0) * full * tokens_per_accum
