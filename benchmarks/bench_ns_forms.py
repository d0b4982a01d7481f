"""Standard or Gram Newton–Schulz for matrices less than 1.5 times wider than tall? One CUDA GPU.

``gram_ns=true`` takes the Gram form (``newton_schulz.gram_iterations``) only from
``GRAM_MIN_ASPECT`` (1.5) on. With quack's products the symmetric results cost half their FLOPs, and
the Gram form then has fewer FLOPs than the standard one at any aspect above 1 (6 m^2 n + 14 m^3 against
15 m^2 n + 5 m^3 for 5 iterations, ``newton_schulz_flops(..., symmetric=True)``): does it also run
faster? This times both forms, with torch's and with quack's products, on the MoE preset's expert
stacks (704 x 1024, aspect 1.45, as Muon batches all layers' gate/up and down matrices), on stacks of
aspects 1.29, 1.25 and 1.5, and on square ones (where the standard form is expected to win).

    python benchmarks/bench_ns_forms.py [--out forms.json]   # needs quack-kernels (muonrun[quack])

Medians of 10 timed calls after 3, milliseconds; random inputs divided by their Frobenius norm.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs

from muonrun.optim.newton_schulz import (  # noqa: E402
    DEFAULT_NS_COEFFICIENTS,
    gram_iterations,
    standard_iterations,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS  # noqa: E402

STEPS = 5
# (matrices, rows, cols): the MoE preset's gate/up and down expert stacks, other aspects, square
STACKS = [(1024, 704, 1024), (512, 1024, 704), (64, 896, 1152), (64, 1024, 1280), (64, 1024, 1536)]
STACKS += [(56, 1536, 1536), (48, 896, 896)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from muonrun.optim.ns_quack import QuackProducts  # needs quack-kernels

    products = {"torch": TORCH_PRODUCTS, "quack": QuackProducts()}
    forms = {"standard": standard_iterations, "gram": gram_iterations}
    per_step = [DEFAULT_NS_COEFFICIENTS] * STEPS
    rows = []
    print(
        f"{'stack':>16} "
        + " ".join(f"{p + ' ' + f:>15}" for p in products for f in forms)
        + "  quack gram/standard"
    )
    for k, r, c in STACKS:
        X = torch.randn(k, r, c, device="cuda").bfloat16()
        X = X / torch.linalg.vector_norm(X.float(), dim=(-2, -1), keepdim=True).bfloat16()
        ms = {
            f"{p} {f}": timed(lambda ops=ops, fn=fn, X=X: fn(X, per_step, products=[ops] * STEPS), 10, 3)
            for p, ops in products.items()
            for f, fn in forms.items()
        }
        rows.append({"stack": [k, r, c], "ms": ms})
        print(
            f"{k:>5} x {r:>4}x{c:<4} "
            + " ".join(f"{v:15.2f}" for v in ms.values())
            + f"  {ms['quack gram'] / ms['quack standard']:.3f}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
