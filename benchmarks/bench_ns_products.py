"""Newton–Schulz's products on one GPU: torch's matmuls against the upper-triangle Triton kernels.

usage (one CUDA GPU with triton), from the repository root:
    python benchmarks/bench_ns_products.py [--out results.json] [--models 0.5b,1.5b] [--iters 10]

Per preset matrix shape (benchmarks/bench_ns_levers.py's: Qwen2-0.5B and 1.5B hidden matrices, as
many as the model has, batched as Muon's owner batches them):

1. each symmetric product of ``ns_products.Products`` (``gram`` on the shape's own orientation,
   ``poly``, ``sym_mm``), torch's against ``ns_triton.TritonProducts(min_size=1)`` (the kernel on
   every shape, below ``TRITON_MIN_SIZE`` too, to check that threshold): median milliseconds and the
   largest difference to torch's result relative to its largest entry (bf16 rounds to 2^-8 ~ 0.004);
2. the whole ``ns_iterations`` (5 default quintic iterations, Frobenius-normalised input) in the
   standard form and, where it applies, the Gram form, with ``products=None`` (torch) and
   ``TritonProducts()`` for every iteration (torch's below ``TRITON_MIN_SIZE``): milliseconds, the
   rate of torch's FLOPs (``newton_schulz_flops``, every product counted in full) and the distance to
   the exact polar factor (fp64 SVD) of a gradient-like matrix (singular values 1/i).

The kernels (``ns_triton.py`` here, beside this script) are a study, not part of muonrun: on an H200
they lose to cuBLAS (docs/performance.md), so Muon keeps torch's products.

A shape whose kernels fail is reported with its error and the others still run. Prints a table and
writes JSON with ``--out``. Not a test: it needs CUDA. It runs in well under 2 minutes on an H200,
the kernels' autotuning included.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs
from bench_ns_levers import gradient_like, model_shapes

from muonrun.optim.newton_schulz import (  # noqa: E402
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz_flops,
    ns_iterations,
    resolve_ns_coefficients,
    uses_gram_form,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS  # noqa: E402

STEPS = 5


def normalised(G: torch.Tensor) -> torch.Tensor:
    """A bf16 stack divided by each matrix's Frobenius norm, as Muon's owner does before iterating."""
    X = G.bfloat16()
    return X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=1e-7)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def op_rows(model: str, shape: tuple[int, int], count: int, iters: int, kernel) -> list[dict]:
    rows_, cols = shape
    tall = rows_ > cols
    X = normalised(torch.randn(count, rows_, cols, device="cuda"))
    A = TORCH_PRODUCTS.gram(X, tall)
    P = TORCH_PRODUCTS.poly(A, -4.775, 2.0315)
    P.diagonal(dim1=-2, dim2=-1).add_(3.4445)
    Q = TORCH_PRODUCTS.sym_mm(P, P)
    cases = {
        "gram": lambda ops: ops.gram(X, tall),
        "poly": lambda ops: ops.poly(A, -4.775, 2.0315),
        "sym_mm": lambda ops: ops.sym_mm(P, Q),
    }
    out = []
    for op, fn in cases.items():
        ref, got = fn(TORCH_PRODUCTS), fn(kernel)
        torch_ms = timed(lambda fn=fn: fn(TORCH_PRODUCTS), iters)
        triton_ms = timed(lambda fn=fn: fn(kernel), iters)
        out.append(
            {
                "model": model,
                "shape": [rows_, cols],
                "count": count,
                "op": op,
                "m": A.shape[-1],
                "torch_ms": torch_ms,
                "triton_ms": triton_ms,
                "speedup": torch_ms / triton_ms,
                "max_rel_err": rel_err(got, ref),
                "symmetric": bool(torch.equal(got, got.mT)),
            }
        )
    return out


def ns_rows(model: str, shape: tuple[int, int], count: int, iters: int) -> list[dict]:
    rows_, cols = shape
    per_step, _ = resolve_ns_coefficients(DEFAULT_NS_COEFFICIENTS, STEPS)
    G = gradient_like(rows_, cols, 0, torch.device("cuda"))
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    one = normalised(G[None])
    batch = normalised(torch.randn(count, rows_, cols, device="cuda"))
    from ns_triton import TritonProducts  # benchmarks/: needs triton

    triton_products = (TritonProducts(),) * STEPS
    forms = [False, True] if uses_gram_form(shape, STEPS) else [False]
    out = []
    for gram in forms:
        flops = count * newton_schulz_flops(shape, STEPS, gram)  # torch's count, every product in full
        row = {"model": model, "shape": [rows_, cols], "count": count, "form": "gram" if gram else "standard"}
        row["gflop"] = flops / 1e9
        for label, products in (("torch", None), ("triton", triton_products)):
            result = ns_iterations(one, per_step, gram=gram, products=products)[0]
            row[f"{label}_to_polar"] = ((result.double() - polar).norm() / polar.norm()).item()
            row[f"{label}_ms"] = timed(
                lambda g=gram, p=products: ns_iterations(batch, per_step, gram=g, products=p), iters
            )
        row["torch_tflops"] = flops / row["torch_ms"] / 1e9
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["to_polar_ratio"] = row["triton_to_polar"] / row["torch_to_polar"]
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    t0 = time.perf_counter()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    try:
        import triton
        from ns_triton import TritonProducts

        env["triton"] = triton.__version__
    except ImportError as e:
        print(f"ERROR: triton does not import ({e}); nothing to compare", flush=True)
        sys.exit(1)
    print(env, flush=True)
    kernel = TritonProducts(min_size=1)
    result: dict = {"env": env, "ops": [], "newton_schulz": [], "errors": []}
    for model in args.models.split(","):
        for shape, count in model_shapes(model).items():
            try:
                result["ops"] += op_rows(model, shape, count, args.iters, kernel)
                result["newton_schulz"] += ns_rows(model, shape, count, args.iters)
            except Exception as e:  # one shape's failure must not hide the others' numbers
                msg = f"{model} {shape[0]}x{shape[1]}: {type(e).__name__}: {e}"
                result["errors"].append({"model": model, "shape": list(shape), "error": msg})
                print(f"ERROR {msg}\n{traceback.format_exc(limit=3)}", flush=True)
            torch.cuda.empty_cache()
            if args.out:  # written as soon as it exists: a later shape may be cut short
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - t0
    print("\nper product (kernel on every shape; torch's result the reference)")
    print(
        f"{'model':<5} {'shape':>11} {'x':>3} {'op':<7} {'m':>5} {'torch ms':>9} {'triton ms':>9} "
        f"{'speedup':>7} {'max rel err':>11} sym"
    )
    for r in result["ops"]:
        print(
            f"{r['model']:<5} {r['shape'][0]:>5}x{r['shape'][1]:<5} {r['count']:>3} {r['op']:<7} {r['m']:>5} "
            f"{r['torch_ms']:9.3f} {r['triton_ms']:9.3f} {r['speedup']:6.2f}x {r['max_rel_err']:11.2e} "
            f"{'yes' if r['symmetric'] else 'NO'}"
        )
    print("\nwhole Newton–Schulz (5 iterations; triton = TritonProducts, torch below m=256)")
    print(
        f"{'model':<5} {'shape':>11} {'x':>3} {'form':<8} {'torch ms':>9} {'triton ms':>9} {'speedup':>7} "
        f"{'torch TF/s':>10} {'GFLOP':>9} {'to polar torch':>14} {'triton':>8}"
    )
    for r in result["newton_schulz"]:
        print(
            f"{r['model']:<5} {r['shape'][0]:>5}x{r['shape'][1]:<5} {r['count']:>3} {r['form']:<8} "
            f"{r['torch_ms']:9.3f} {r['triton_ms']:9.3f} {r['speedup']:6.2f}x {r['torch_tflops']:10.1f} "
            f"{r['gflop']:9.1f} {r['torch_to_polar']:14.4f} {r['triton_to_polar']:8.4f}"
        )
    for model in args.models.split(","):
        rows = [r for r in result["newton_schulz"] if r["model"] == model]
        # Muon's preset runs the Gram form where it applies: the last form listed for each shape
        chosen = {tuple(r["shape"]): r for r in rows}
        t, k = sum(r["torch_ms"] for r in chosen.values()), sum(r["triton_ms"] for r in chosen.values())
        if chosen:
            print(
                f"{model}: all hidden matrices, Muon's forms: torch {t:.2f} ms, triton {k:.2f} ms ({t / k:.2f}x)"
            )
    print(f"errors: {len(result['errors'])}; {result['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
