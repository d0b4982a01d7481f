"""Newton–Schulz with float8 (e4m3) products in its first iterations, on one GPU: time and distance to the polar factor.

usage (one CUDA GPU with float8 matmuls, Hopper or newer), from the repository root:
    python benchmarks/bench_ns_float8.py [--out results.json] [--models 0.5b,1.5b] [--iters 10]

1. Per preset matrix shape (Qwen2-0.5B: 896 x 896, 128 x 896, 4864 x 896, 896 x 4864; Qwen2-1.5B:
   1536 x 1536, 256 x 1536, 8960 x 1536, 1536 x 8960), as many matrices as the model has, batched
   as Muon's owner batches them, in the form Muon uses with ``gram_ns=true`` (the Gram form where
   wide, the standard one for the others): milliseconds per batch of ``ns_iterations`` with the
   first k = 0, 1, 2, 3 iterations' products in float8 (``Float8Products``: a stack in one
   ``_scaled_grouped_mm`` and one ``_scaled_mm`` per matrix, both timed), and the distance to the
   exact polar factor (fp64 SVD) of a gradient-like matrix (singular values 1/i). Muon keeps the
   Gram form's restart and what follows in bf16, so there k stops at 2.
2. Per shape, each product on its own: torch's (bf16 ``bmm``) against float8's, milliseconds.

JSON (``--out``) and a table on stdout; a shape that fails prints its error and the run goes on.
Not a test: it needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs
from bench_ns_levers import gradient_like, model_shapes
from bench_ns_products import normalised
from ns_float8 import Float8Products  # noqa: E402

from muonrun.optim.newton_schulz import (  # noqa: E402
    DEFAULT_NS_COEFFICIENTS,
    GRAM_RESTART,
    newton_schulz_flops,
    ns_iterations,
    uses_gram_form,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS  # noqa: E402

STEPS = 5
PER_STEP = [DEFAULT_NS_COEFFICIENTS] * STEPS
KS = (0, 1, 2, 3)
MATMULS = ("grouped", "loop")
DEVICE = "cuda"


def products(k: int, ops: Float8Products) -> tuple | None:
    return None if k == 0 else (ops,) * k + (TORCH_PRODUCTS,) * (STEPS - k)


def ns_rows(model: str, shape: tuple[int, int], count: int, f8: dict, iters: int) -> list[dict]:
    rows_, cols = shape
    dev = torch.device(DEVICE)
    gram = uses_gram_form(shape, STEPS)
    G = gradient_like(rows_, cols, 0, dev)
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    one = normalised(G)[None]
    batch = normalised(torch.randn(count, rows_, cols, device=dev))
    flops = count * newton_schulz_flops(shape, STEPS, gram=True)
    out = []
    for k in KS:
        if gram and k > GRAM_RESTART:
            continue  # Muon keeps the Gram form's restart in bf16
        for matmul in MATMULS if k else ("bf16",):
            ops = f8.get(matmul)
            row = {
                "model": model,
                "shape": list(shape),
                "count": count,
                "form": "gram" if gram else "standard",
                "float8_steps": k,
                "matmul": matmul,
            }
            try:
                o = ns_iterations(one, PER_STEP, gram=True, products=products(k, ops))[0]
                row["to_polar"] = ((o.double() - polar).norm() / polar.norm()).item()
                row["ms"] = timed(
                    lambda k=k, ops=ops: ns_iterations(batch, PER_STEP, gram=True, products=products(k, ops)),
                    iters,
                )
            except Exception as e:  # e.g. no grouped float8 matmul in this torch: the others still run
                print(
                    f"FAILED {model} {rows_}x{cols} k={k} {matmul}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                    flush=True,
                )
                continue
            row["bf16_equiv_tflops"] = flops / row["ms"] / 1e9
            out.append(row)
    base = out[0]
    for r in out:
        r["speedup"] = base["ms"] / r["ms"]
        r["distance_change"] = r["to_polar"] / base["to_polar"] - 1
        print(
            f"{model} {rows_}x{cols} x{count} {r['form']:<8} k={r['float8_steps']} {r['matmul']:<7} "
            f"{r['ms']:8.3f} ms {r['speedup']:5.2f}x  distance {r['to_polar']:.4f} ({r['distance_change']:+.2%})",
            flush=True,
        )
    return out


def op_rows(model: str, shape: tuple[int, int], count: int, f8: dict, iters: int) -> list[dict]:
    """Each product on the batch: torch's against float8's (the casts included)."""
    rows_, cols = shape
    tall = rows_ > cols
    m = min(shape)
    Y = normalised(torch.randn(count, rows_, cols, device=DEVICE))
    A = TORCH_PRODUCTS.gram(Y, tall)
    P = TORCH_PRODUCTS.poly(A, -4.775, 2.0315)
    a = 3.4445
    ops = {
        "gram": (lambda o: o.gram(Y, tall), 2 * m * m * max(shape)),
        "poly": (lambda o: o.poly(A, -4.775, 2.0315), 2 * m**3),
        "sym_mm": (lambda o: o.sym_mm(P, A), 2 * m**3),
        "apply": (lambda o: o.apply(P, Y, tall), 2 * m * m * max(shape)),
        "apply_add": (lambda o: o.apply_add(P, Y, a, tall), 2 * m * m * max(shape)),
    }
    out = []
    for name, (fn, flops) in ops.items():
        row = {"model": model, "shape": list(shape), "count": count, "op": name}
        row["torch_ms"] = timed(lambda fn=fn: fn(TORCH_PRODUCTS), iters)
        for matmul, o in f8.items():
            try:
                row[f"{matmul}_ms"] = timed(lambda fn=fn, o=o: fn(o), iters)
            except Exception as e:
                print(
                    f"FAILED {model} {rows_}x{cols} op {name} {matmul}: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                    flush=True,
                )
                row[f"{matmul}_ms"] = float("nan")
        row["torch_tflops"] = count * flops / row["torch_ms"] / 1e9
        out.append(row)
        print(
            f"{model} {rows_}x{cols} x{count} op {name:<9} torch {row['torch_ms']:7.3f} ms ({row['torch_tflops']:5.0f} TFLOP/s) "
            + " ".join(
                f"{mm} {row[f'{mm}_ms']:7.3f} ms ({row['torch_ms'] / row[f'{mm}_ms']:4.2f}x)" for mm in f8
            ),
            flush=True,
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--fast-accum", action="store_true", help="Hopper's faster float8 accumulation")
    args = ap.parse_args()
    env = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "fast_accum": args.fast_accum,
    }
    print(env, flush=True)
    f8 = {mm: Float8Products(matmul=mm, fast_accum=args.fast_accum) for mm in MATMULS}
    result: dict = {"env": env, "newton_schulz": [], "ops": [], "errors": []}
    for model in args.models.split(","):
        for shape, count in model_shapes(model).items():
            for part, fn in (("newton_schulz", ns_rows), ("ops", op_rows)):
                try:
                    result[part] += fn(model, shape, count, f8, args.iters)
                except Exception as e:  # one shape's failure is reported, the others still run
                    msg = f"{model} {shape[0]}x{shape[1]} {part}: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                    print(f"FAILED {msg}\n{traceback.format_exc(limit=4)}", flush=True)
                    result["errors"].append(msg)
                    f8 = {mm: Float8Products(matmul=mm, fast_accum=args.fast_accum) for mm in MATMULS}
                torch.cuda.empty_cache()
            if args.out:  # written as it grows: a later shape may be cut short
                Path(args.out).write_text(json.dumps(result, indent=1))
    print("\nsummary: Newton–Schulz ms per batch (speedup against k = 0; distance change)")
    for r in result["newton_schulz"]:
        if r["float8_steps"]:
            print(
                f"  {r['model']} {r['shape'][0]}x{r['shape'][1]} {r['form']:<8} k={r['float8_steps']} {r['matmul']:<7} "
                f"{r['ms']:8.3f} ms {r['speedup']:5.2f}x {r['distance_change']:+.2%}"
            )
    print(f"errors: {len(result['errors'])}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
