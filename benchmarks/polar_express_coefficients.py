"""Polar Express coefficients for T Newton–Schulz iterations, and how close each schedule gets to
the exact polar factor in bf16.

The construction is the greedy minimax one of N. Amsel et al., "The Polar Express", arXiv:2505.16932
(Algorithm 1 and its reference code): the singular values of the normalised input lie in
[l_0, u_0] = [1e-3, 1]; iteration t uses the odd quintic p(x) = a x + b x^3 + c x^5 that best
approximates 1 on [max(l_t, cushion * u_t), u_t] (Remez: the error equioscillates at both ends and
at the two interior extrema), rescaled so that 1 - p(l_t) = p(u_t) - 1 when the cushion cut the
interval; then every iteration but the last is evaluated at x / safety (``a / s, b / s^3, c / s^5``)
and the next interval is [p(l_t), 2 - p(l_t)]. With modded-nanogpt's parameters (l_0 = 1e-3,
cushion 0.02, safety 1.02, and the input divided by 1.02 ||X||_F) and T = 5 this reproduces its
published table, muonrun's POLAR_EXPRESS_COEFFICIENTS, to 3e-15 relative. Being greedy, the table
for T < 5 iterations is the 5-iteration table's first T rows with the safety factor taken off the
last one.

Then it compares, in bf16 on gradient-like matrices (power-law spectrum, the shapes of the presets'
matrices), the default quintic at 5 iterations with Polar Express at 5, 4 and 3 iterations and with
the 5-iteration table cut to 4 rows (what ``ns_steps=4`` with ``polar_express`` runs), and, in exact
arithmetic on the same spectrum, Polar Express at 4 and 3 iterations built for other l_0. Polar
Express at 5 iterations is about half as far from the polar factor as the default quintic; at 4
iterations it is farther than the default quintic at 5 (1.4x on average), and no l_0 from 1e-4 to
2e-2 changes that on 896 or 1536 rows (only on 128 rows does l_0 = 5e-3 beat it, where the FLOPs are
negligible), so fewer iterations do not save FLOPs at equal error::

    python benchmarks/polar_express_coefficients.py
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gram_ns_numerics import gradient_like  # benchmarks/: on the path when a script runs

from muonrun.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    POLAR_EXPRESS_NORM_SCALE,
    newton_schulz,
    newton_schulz_flops,
    orthogonality_residual,
)

L0 = 1e-3  # lower bound of the normalised singular values the schedule is built for
CUSHION = 0.02  # each polynomial is fitted on [max(l, CUSHION * u), u]
SAFETY = 1.02  # every polynomial but the last is evaluated at x / SAFETY (modded-nanogpt's 1 + 2e-2)

Coefficients = tuple[float, float, float]


def optimal_quintic(lo: float, hi: float) -> Coefficients:
    """The odd quintic ``a x + b x^3 + c x^5`` minimising ``max |1 - p(x)|`` on ``[lo, hi]``.

    Remez exchange on the 3-parameter family: the error equioscillates at ``lo < q < r < hi``, where
    ``q`` and ``r`` are the interior extrema (roots of ``p'(x) = a + 3 b x^2 + 5 c x^4``); solve the
    4x4 system for ``(a, b, c, E)``, move ``q, r`` to the new extrema, repeat until ``E`` is stable.
    """
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got {lo}, {hi}")
    if lo / hi >= 1 - 5e-6:  # the limit l -> u: the Taylor polynomial of x^(-1/2) at x = u^2, times x
        return 15 / 8 / hi, -10 / 8 / hi**3, 3 / 8 / hi**5
    q, r = (3 * lo + hi) / 4, (lo + 3 * hi) / 4
    error, old_error = math.inf, None
    for _ in range(1000):
        if old_error is not None and abs(old_error - error) <= 1e-15:
            break
        old_error = error
        lhs = np.array([[x, x**3, x**5, sign] for x, sign in ((lo, 1), (q, -1), (r, 1), (hi, -1))])
        a, b, c, error = np.linalg.solve(lhs, np.ones(4))
        q, r = np.sqrt((-3 * b + np.array([-1.0, 1.0]) * math.sqrt(9 * b**2 - 20 * a * c)) / (10 * c))
    else:
        raise RuntimeError(f"Remez did not converge on [{lo}, {hi}]")
    return float(a), float(b), float(c)


def polar_express_coefficients(
    steps: int, l0: float = L0, cushion: float = CUSHION, safety: float = SAFETY
) -> tuple[Coefficients, ...]:
    """Per-iteration ``(a, b, c)`` of the Polar Express schedule for ``steps`` iterations (greedy
    minimax, arXiv:2505.16932), for inputs normalised by ``safety * ||X||_F``."""
    lo, hi = l0, 1.0
    table = []
    for t in range(steps):
        a, b, c = optimal_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:  # fitted on a cut interval: centre the error on [lo, hi] again
            scale = 2 / (_p((a, b, c), lo) + _p((a, b, c), hi))
            a, b, c = a * scale, b * scale, c * scale
        if t < steps - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        table.append((a, b, c))
        lo = _p((a, b, c), lo)
        hi = 2 - lo
    return tuple(table)


def _p(coefficients: Coefficients, x: float) -> float:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def max_relative_difference(ours, published) -> float:
    return max(
        abs(x - y) / abs(y) for r, s in zip(ours, published, strict=True) for x, y in zip(r, s, strict=True)
    )


def print_tables() -> None:
    for steps in (3, 4, 5):
        print(f"# Polar Express, {steps} iterations (l0={L0}, cushion={CUSHION}, safety={SAFETY})")
        print(f"POLAR_EXPRESS_{steps}_STEPS = (")
        for row in polar_express_coefficients(steps):
            print(f"    ({row[0]!r}, {row[1]!r}, {row[2]!r}),")
        print(")")
    diff = max_relative_difference(polar_express_coefficients(5), POLAR_EXPRESS_COEFFICIENTS)
    print(f"T=5 against the published table (POLAR_EXPRESS_COEFFICIENTS): max relative difference {diff:.1e}")


def schedules() -> list[tuple[str, int, object, float]]:
    """(label, iterations, coefficients, norm scale) of the schedules compared."""
    return [
        ("default quintic x5", 5, DEFAULT_NS_COEFFICIENTS, 1.0),
        ("polar express 5", 5, polar_express_coefficients(5), POLAR_EXPRESS_NORM_SCALE),
        ("pe 5-table cut to 4", 4, polar_express_coefficients(5)[:4], POLAR_EXPRESS_NORM_SCALE),
        ("polar express 4", 4, polar_express_coefficients(4), POLAR_EXPRESS_NORM_SCALE),
        ("polar express 3", 3, polar_express_coefficients(3), POLAR_EXPRESS_NORM_SCALE),
    ]


def compare(
    shapes=((896, 4864), (1536, 8960), (896, 896), (128, 896)), seeds=(0, 1, 2), dtype=torch.bfloat16
) -> list[dict]:
    """Every schedule on gradient-like matrices: orthogonality residual, extreme singular values and
    ``||O - U V^T||_F / ||U V^T||_F`` (polar factor by fp64 SVD); one row per schedule, shape, seed."""
    rows = []
    for m, n in shapes:
        for seed in seeds:
            G = gradient_like(m, n, seed)
            U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
            polar = U @ Vh
            for label, steps, coefficients, scale in schedules():
                out = newton_schulz(G, steps, coefficients, norm_scale=scale, dtype=dtype)
                o = out.double()
                s = torch.linalg.eigvalsh(o @ o.mT if m <= n else o.mT @ o).clamp(min=0).sqrt()
                rows.append(
                    {
                        "schedule": label,
                        "shape": (m, n),
                        "seed": seed,
                        "steps": steps,
                        "residual": orthogonality_residual(out).item(),
                        "sv_min": s.min().item(),
                        "sv_max": s.max().item(),
                        "to_polar": ((o - polar).norm() / polar.norm()).item(),
                        "flops": newton_schulz_flops((m, n), steps),
                    }
                )
    return rows


def print_comparison(rows: list[dict]) -> None:
    print(
        f"\n{'shape':<11} {'schedule':<20} {'steps':>5} {'GFLOP':>7} {'residual':>9} {'sv min':>7} "
        f"{'sv max':>7} {'|O-polar|/|polar|':>18} (mean over seeds; sv min/max: extremes over seeds)"
    )
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for label in dict.fromkeys(r["schedule"] for r in rows):
            sel = [r for r in rows if r["shape"] == shape and r["schedule"] == label]
            polar = [r["to_polar"] for r in sel]
            print(
                f"{shape[0]}x{shape[1]:<6} {label:<20} {sel[0]['steps']:>5} {sel[0]['flops'] / 1e9:>7.1f} "
                f"{np.mean([r['residual'] for r in sel]):>9.3f} {min(r['sv_min'] for r in sel):>7.3f} "
                f"{max(r['sv_max'] for r in sel):>7.3f} {np.mean(polar):>8.4f} (max {max(polar):.4f})"
            )
    base = [r for r in rows if r["schedule"] == "default quintic x5"]
    print("\nmean over shapes and seeds, relative to the default quintic x5:")
    for label in dict.fromkeys(r["schedule"] for r in rows):
        sel = [r for r in rows if r["schedule"] == label]
        ratio = np.mean([r["to_polar"] / b["to_polar"] for r, b in zip(sel, base, strict=True)])
        worst = max(r["to_polar"] / b["to_polar"] for r, b in zip(sel, base, strict=True))
        flops = sum(r["flops"] for r in sel) / sum(b["flops"] for b in base)
        print(f"  {label:<20} distance to polar x{ratio:.3f} (worst x{worst:.3f}), FLOPs x{flops:.2f}")


def spectrum_distance(table, norm_scale: float, m: int) -> float:
    """``||O - U V^T||_F / ||U V^T||_F`` in exact arithmetic for ``gradient_like``'s spectrum (singular
    values ``1 / k``, k = 1..m): ``sqrt(mean((p_T(...p_1(s)) - 1)^2))`` over the normalised ``s``."""
    s = 1.0 / np.arange(1, m + 1)
    s = s / np.linalg.norm(s) / norm_scale
    for a, b, c in table:
        s = a * s + b * s**3 + c * s**5
    return float(np.sqrt(np.mean((s - 1) ** 2)))


def print_l0_sweep(ms=(128, 896, 1536), l0s=(1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2)) -> None:
    """Whether another l_0 would let fewer iterations reach the default quintic's distance."""
    print("\nexact arithmetic on gradient_like's m x n spectrum: distance to the polar factor")
    print(f"{'m':>5} {'default x5':>10} {'pe 5':>6} {'T':>2}  " + " ".join(f"l0={l0:<7g}" for l0 in l0s))
    for m in ms:
        base = spectrum_distance([DEFAULT_NS_COEFFICIENTS] * 5, 1.0, m)
        pe5 = spectrum_distance(polar_express_coefficients(5), SAFETY, m)
        for t in (4, 3):
            sweep = [spectrum_distance(polar_express_coefficients(t, l0), SAFETY, m) for l0 in l0s]
            print(f"{m:>5} {base:>10.3f} {pe5:>6.3f} {t:>2}  " + " ".join(f"{d:>10.3f}" for d in sweep))


def main() -> None:
    print_tables()
    print_l0_sweep()
    print_comparison(compare())


if __name__ == "__main__":
    main()
