"""Learning-rate schedules as pure functions of the step: a multiplier of the peak learning rate.

Nothing to checkpoint: a resumed run recomputes the same value from the step number.
"""

from __future__ import annotations

import math

from muonrun.config import ScheduleConfig


def _cosine(progress: float, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _linear(progress: float, floor: float) -> float:
    return 1 - (1 - floor) * progress


def _constant(progress: float, floor: float) -> float:
    return 1.0


DECAYS = {"cosine": _cosine, "linear": _linear, "constant": _constant}


def lr_multiplier(step: int, s: ScheduleConfig, max_steps: int) -> float:
    """Multiplier for optimizer step `step` (1-based: the first update is step 1)."""
    if s.warmup_steps and step <= s.warmup_steps:
        return step / s.warmup_steps
    if s.name == "wsd":
        decay_steps = max(1, round(s.decay_fraction * max_steps))
        decay_start = max(s.warmup_steps, max_steps - decay_steps)
        if step <= decay_start:
            return 1.0
        return _linear(min(1.0, (step - decay_start) / max(1, max_steps - decay_start)), s.min_lr_ratio)
    progress = min(1.0, (step - s.warmup_steps) / max(1, max_steps - s.warmup_steps))
    return DECAYS[s.name](progress, s.min_lr_ratio)
