"""Is Gram Newton–Schulz usable in bf16? The CPU numerics check behind Muon's `gram=True`.

For a wide m x n matrix (m <= n) standard Newton–Schulz costs 4 m^2 n + 2 m^3 FLOPs per iteration.
The Gram form iterates on the m x m matrix R = X X^T instead: P = aI + bR + cR^2, Q <- P Q,
R <- P R P, and returns Q X at the end, so the n-sized products happen only at the start and end.
Exact arithmetic gives the same result; bf16 does not, so this compares both against the exact
polar factor on gradient-like matrices (power-law spectrum), without and with one restart
(X <- Q X, R <- X X^T) part-way:

    python benchmarks/gram_ns_numerics.py
"""

import torch

from muonrun.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    gram_iterations,
    newton_schulz,
    newton_schulz_flops,
    resolve_ns_coefficients,
)


def gradient_like(m: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    return (U * torch.arange(1, m + 1, dtype=torch.float32) ** -1.0) @ V.T


def gram_newton_schulz(G, per_step, norm_scale, restart):
    X = G.to(torch.bfloat16)
    X = X / (X.float().norm() * norm_scale).to(torch.bfloat16)
    return gram_iterations(X[None], per_step, restart)[0]


def main() -> None:
    print("shape        coefficients   method          sv min  sv max  |O - polar|/|polar|  |O - standard|")
    for m, n in [(256, 1354), (192, 1120)]:  # the aspect ratios of the 7B (5.29) and 1.5B (5.83) MLPs
        G = gradient_like(m, n, seed=m)
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        polar = U @ Vh
        for label, coeffs in [("torch", DEFAULT_NS_COEFFICIENTS), ("polar_express", "polar_express")]:
            per_step, scale = resolve_ns_coefficients(coeffs, 5)
            standard = newton_schulz(G, 5, coeffs).float()
            variants = [("standard", standard)] + [
                (f"gram, restart {r}", gram_newton_schulz(G, per_step, scale, r).float())
                for r in (None, 2, 3)
            ]
            for name, out in variants:
                s = torch.linalg.svdvals(out)
                to_polar = ((out - polar).norm() / polar.norm()).item()
                to_std = ((out - standard).norm() / standard.norm()).item()
                print(
                    f"{m}x{n:<6} {label:<14} {name:<15} {s.min():6.3f} {s.max():9.3f} {to_polar:12.3f} {to_std:16.3f}"
                )
    for name, (m, n) in {"7B MLP": (3584, 18944), "1.5B MLP": (1536, 8960), "square": (3584, 3584)}.items():
        std, gram = newton_schulz_flops((m, n)), newton_schulz_flops((m, n), gram=True)
        print(
            f"{name}: standard {std / 1e12:.2f} TFLOP, gram=True {gram / 1e12:.2f} ({gram / std - 1:+.0%}; square: the standard form)"
        )


if __name__ == "__main__":
    main()
