"""Figures as the dry run prints them: three significant digits in the unit that shows them best, so that a
tiny model's plan reads 203 KiB and 1.18 GFLOP, not 0.00 GiB and 0.0 TFLOP."""

from __future__ import annotations

import math


def figure(x: float) -> str:
    """`x` to three significant figures, never in exponent form: 57.2, 1.84, 0.0424, 1,234."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.{2 - math.floor(math.log10(abs(x)))}f}"


def gib(x: float) -> str:
    """A size given in GiB, in the unit that shows it best (12.3 GiB, 45.6 MiB, 789 KiB)."""
    for unit, scale in (("GiB", 1), ("MiB", 2**10), ("KiB", 2**20)):
        if abs(x) * scale >= 1000 / 1024:  # 0.978 GiB, not 1,001 MiB
            return f"{figure(x * scale)} {unit}"
    return f"{x * 2**30:,.0f} bytes"


def flop(x: float) -> str:
    """A FLOP count in the unit that shows it best (1.23 TFLOP, 45.6 GFLOP)."""
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(x) >= scale:
            return f"{figure(x / scale)} {unit}"
    return f"{figure(x)} FLOP"


def share(x: float) -> str:
    return f"{figure(100 * x)}%"
