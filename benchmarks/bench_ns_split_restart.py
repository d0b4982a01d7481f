"""The Gram form's split restart against its restart from X, alone, on the presets' stacks. One CUDA GPU.

``optimizer.muon.ns_split_restart`` rebuilds the Gram matrix at the restart from the first one, kept in
fp32 as two bf16 halves (``gram_iterations``' ``split_restart``): four m x m products and a final
``Q' Q`` instead of ``Q X`` and its Gram matrix on the n-sized side. This times Newton–Schulz on the
stacks Muon forms on one GPU for the 0.5B preset and the 1.5B model (the MLP's gate/up and down
matrices, the stacks the split restart changes) and on part of Qwen2-7B's, with torch's products
and, where quack-kernels is installed, quack's; and each form's distance to the exact polar factor
of one gradient-like matrix per stack (singular values 1/i, ``||O - U V^T||_F / ||U V^T||_F``,
fp64 SVD). docs/performance.md, [w8].

    python benchmarks/bench_ns_split_restart.py [--out split.json]

Medians of 20 timed calls after 3, milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs

from muonrun.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, gram_iterations, newton_schulz_flops  # noqa: E402
from muonrun.optim.ns_products import TORCH_PRODUCTS, quack_installed  # noqa: E402

STEPS = 5
# (model, matrices, rows, cols): gate and up of every layer in one stack, down in another
STACKS = [
    ("0.5B", 48, 4864, 896),
    ("0.5B", 24, 896, 4864),
    ("1.5B", 56, 8960, 1536),
    ("1.5B", 28, 1536, 8960),
]
STACKS += [("7B", 16, 18944, 3584), ("7B", 8, 3584, 18944)]  # Qwen2-7B's MLP, part of each stack


def gradient_like(k: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``k`` matrices with singular values ``1/i`` and random singular vectors, normalised, bf16."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = min(rows, cols)
    U, _ = torch.linalg.qr(torch.randn(k, rows, n, device="cuda", generator=g))
    V, _ = torch.linalg.qr(torch.randn(k, cols, n, device="cuda", generator=g))
    X = (U * torch.arange(1, n + 1, device="cuda") ** -1.0) @ V.mT
    return (X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)).bfloat16()


def distance(out: torch.Tensor, G: torch.Tensor) -> float:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    return ((out.double() - polar).norm() / polar.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    products = {"torch": TORCH_PRODUCTS}
    if quack_installed():
        from muonrun.optim.ns_quack import QuackProducts

        products["quack"] = QuackProducts()
    per_step = [DEFAULT_NS_COEFFICIENTS] * STEPS
    rows = []
    print(f"{'model':>5} {'stack':>16} {'products':>8} {'from X ms':>9} {'split ms':>9} {'ratio':>6} "
          f"{'GFLOP X / split':>16} {'distance X / split':>19}")  # fmt: skip
    for model, k, r, c in STACKS:
        X = gradient_like(k, r, c)
        for name, ops in products.items():
            symmetric = name == "quack"

            def run(split: bool, X=X, ops=ops) -> torch.Tensor:
                return gram_iterations(X, per_step, products=[ops] * STEPS, split_restart=split)

            ms = {split: timed(lambda split=split: run(split), 20, 3) for split in (False, True)}
            gflop = {
                split: k * newton_schulz_flops((r, c), STEPS, True, symmetric, split) / 1e9
                for split in (False, True)
            }
            dist = {split: distance(run(split)[0], X[0]) for split in (False, True)}
            rows.append(
                {
                    "model": model,
                    "stack": [k, r, c],
                    "products": name,
                    "ms": ms,
                    "gflop": gflop,
                    "distance": dist,
                }
            )
            print(
                f"{model:>5} {f'{k} x {r}x{c}':>16} {name:>8} {ms[False]:9.2f} {ms[True]:9.2f} "
                f"{ms[True] / ms[False]:6.3f} {gflop[False]:7.0f} / {gflop[True]:<7.0f} "
                f"{dist[False]:.4f} / {dist[True]:.4f}",
                flush=True,
            )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
