"""Is the Gram form as close to the polar factor as torch's iteration, in bf16? The CPU numerics check behind
`optimizer.muon.gram_ns` (docs/performance.md, row N1).

For each hidden-matrix shape of the 0.5B and 1.5B presets, on two spectra (singular values 1/i, like a
gradient's, and the flatter 1/sqrt(i)) with random singular vectors, mean of two draws:
``||O - U V^T|| / ||U V^T||`` for torch.optim.Muon's standard iteration, the Gram form restarting from X,
and the Gram form as Muon runs it (its split restart where the matrix is 3x wider than tall, its norm
folded into the first product). A few minutes on two cores:

    python benchmarks/gram_ns_numerics.py
"""

from __future__ import annotations

import torch

from muonrun.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, NewtonSchulz, gram_iterations, newton_schulz

SHAPES = {
    "0.5B": [(896, 896), (128, 896), (4864, 896)],
    "1.5B": [(1536, 1536), (256, 1536), (8960, 1536)],
}
PER_STEP = (DEFAULT_NS_COEFFICIENTS,) * 5


def with_spectrum(m: int, n: int, power: float, seed: int) -> torch.Tensor:
    """An m x n matrix with singular values i^-power and random singular vectors."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    return (U * torch.arange(1, k + 1, dtype=torch.float32) ** -power) @ V.T


def gradient_like(m: int, n: int, seed: int) -> torch.Tensor:
    """Singular values 1/i: the steep spectrum of a gradient."""
    return with_spectrum(m, n, 1.0, seed)


def distances(G: torch.Tensor) -> dict[str, float]:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    X = G.bfloat16()
    normalized = (X / torch.linalg.vector_norm(X.float()).clamp(min=1e-7)).bfloat16()[None]
    outputs = {
        "standard x5 (torch's)": newton_schulz(G),
        "Gram x5, restart from X": gram_iterations(normalized, PER_STEP)[0],
        "Gram x5 (Muon's)": NewtonSchulz(gram=True)(X[None], normalized=False)[0],
    }
    return {k: ((v.double() - polar).norm() / polar.norm()).item() for k, v in outputs.items()}


def main() -> None:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print("| shape (preset) | " + " | ".join(distances(gradient_like(8, 24, 0))) + " |")
    print("|---|---:|---:|---:|")
    for preset, shapes in SHAPES.items():
        for m, n in shapes:
            steep = [distances(with_spectrum(m, n, 1.0, seed)) for seed in (0, 1)]
            flat = [distances(with_spectrum(m, n, 0.5, seed)) for seed in (0, 1)]
            cells = [
                f"{sum(d[k] for d in steep) / 2:.3f} / {sum(d[k] for d in flat) / 2:.3f}" for k in steep[0]
            ]
            print(f"| {m} x {n} ({preset}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
