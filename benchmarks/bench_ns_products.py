"""Newton–Schulz's products on one GPU: torch's matmuls against other evaluations of the symmetric ones.

usage (one CUDA GPU), from the repository root:
    python benchmarks/bench_ns_products.py [--evaluations triton,blocked2,blocked3] [--out results.json]
        [--models 0.5b,1.5b] [--iters 10]

The evaluations (``ns_products.Products`` subclasses beside this script, studies, not part of muonrun):
``triton``, the upper-triangle Triton kernels of ``ns_triton.py`` (needs triton); ``blockedN``, the
``N x N`` upper blocks as cuBLAS products of ``ns_blocked.py``; ``quack``, quack's symmetric GEMM
(``muonrun/optim/ns_quack.py``, needs quack-kernels). Per preset matrix shape
(benchmarks/bench_ns_levers.py's: Qwen2-0.5B and 1.5B hidden matrices, as many as the model has,
batched as Muon's owner batches them):

1. each symmetric product of ``ns_products.Products`` (``gram`` on the shape's own orientation,
   ``poly``, ``sym_mm``) and, for shapes that take the standard form, its ``apply_add`` (``a X + B
   X``), torch's against each evaluation (the Triton kernel on every shape, below
   ``TRITON_MIN_SIZE`` too, to check that threshold): median milliseconds and the largest difference
   to torch's result relative to its largest entry (bf16 rounds to 2^-8 ~ 0.004);
2. the whole ``ns_iterations`` (5 default quintic iterations, Frobenius-normalised input) in the
   standard form and, where it applies, the Gram form, with torch's products and each evaluation's
   for every iteration (Triton: torch's below ``TRITON_MIN_SIZE``): milliseconds, the rate of torch's
   FLOPs (``newton_schulz_flops``, every product counted in full) and the distance to the exact polar
   factor (fp64 SVD) of a gradient-like matrix (singular values 1/i).

On an H200 the Triton kernels lose to cuBLAS (docs/performance.md), so Muon keeps torch's products.
A shape whose products fail is reported with its error and the others still run. Prints a table and
writes JSON with ``--out``. Not a test: it needs CUDA. It runs in about 2 minutes on an H200, the
kernels' autotuning included.
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
from ns_blocked import BlockedProducts

from muonrun.optim.newton_schulz import (  # noqa: E402
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz_flops,
    ns_iterations,
    resolve_ns_coefficients,
    uses_gram_form,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products  # noqa: E402

STEPS = 5


def normalised(G: torch.Tensor) -> torch.Tensor:
    """A bf16 stack divided by each matrix's Frobenius norm, as Muon's owner does before iterating."""
    X = G.bfloat16()
    return X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=1e-7)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def evaluations(names: str) -> dict[str, tuple[Products, Products]]:
    """Each named evaluation as (its products for the per-product table, for the whole iteration)."""
    out = {}
    for name in names.split(","):
        if name == "triton":
            from ns_triton import TritonProducts  # benchmarks/: needs triton

            out[name] = (TritonProducts(min_size=1), TritonProducts())
        elif name == "quack":
            from muonrun.optim.ns_quack import QuackProducts  # needs quack-kernels

            out[name] = (QuackProducts(min_size=1), QuackProducts())
        elif name.startswith("blocked") and name.removeprefix("blocked").isdigit():
            blocked = BlockedProducts(int(name.removeprefix("blocked")))
            out[name] = (blocked, blocked)
        else:
            raise SystemExit(f"unknown evaluation {name!r}: triton, quack or blockedN (N blocks per side)")
    return out


def op_rows(model: str, shape: tuple[int, int], count: int, iters: int, evals: dict) -> list[dict]:
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
    if not uses_gram_form(shape, STEPS):  # the standard form's a X + B X (quack: the addend in its epilogue)
        cases["apply_add"] = lambda ops: ops.apply_add(P, X, 3.4445, tall)
    out = []
    for op, fn in cases.items():
        ref = fn(TORCH_PRODUCTS)
        torch_ms = timed(lambda fn=fn: fn(TORCH_PRODUCTS), iters)
        for name, (ops, _) in evals.items():
            got = fn(ops)
            ms = timed(lambda fn=fn, ops=ops: fn(ops), iters)
            out.append(
                {
                    "model": model,
                    "shape": [rows_, cols],
                    "count": count,
                    "op": op,
                    "m": A.shape[-1],
                    "evaluation": name,
                    "torch_ms": torch_ms,
                    "ms": ms,
                    "speedup": torch_ms / ms,
                    "max_rel_err": rel_err(got, ref),
                    "symmetric": op != "apply_add" and bool(torch.equal(got, got.mT)),
                }
            )
    return out


def ns_rows(model: str, shape: tuple[int, int], count: int, iters: int, evals: dict) -> list[dict]:
    rows_, cols = shape
    per_step, _ = resolve_ns_coefficients(DEFAULT_NS_COEFFICIENTS, STEPS)
    G = gradient_like(rows_, cols, 0, torch.device("cuda"))
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    one = normalised(G[None])
    batch = normalised(torch.randn(count, rows_, cols, device="cuda"))
    forms = [False, True] if uses_gram_form(shape, STEPS) else [False]
    out = []
    for gram in forms:
        flops = count * newton_schulz_flops(shape, STEPS, gram)  # torch's count, every product in full
        row = {"model": model, "shape": [rows_, cols], "count": count, "form": "gram" if gram else "standard"}
        row["gflop"] = flops / 1e9
        for label, products in [("torch", None)] + [(n, (ops,) * STEPS) for n, (_, ops) in evals.items()]:
            result = ns_iterations(one, per_step, gram=gram, products=products)[0]
            row[f"{label}_to_polar"] = ((result.double() - polar).norm() / polar.norm()).item()
            row[f"{label}_ms"] = timed(
                lambda g=gram, p=products: ns_iterations(batch, per_step, gram=g, products=p), iters
            )
        row["torch_tflops"] = flops / row["torch_ms"] / 1e9
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--evaluations", default="triton,blocked2,blocked3")
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    t0 = time.perf_counter()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if "triton" in args.evaluations.split(","):
        import triton

        env["triton"] = triton.__version__
    evals = evaluations(args.evaluations)
    print(env, flush=True)
    result: dict = {"env": env, "ops": [], "newton_schulz": [], "errors": []}
    for model in args.models.split(","):
        for shape, count in model_shapes(model).items():
            try:
                result["ops"] += op_rows(model, shape, count, args.iters, evals)
                result["newton_schulz"] += ns_rows(model, shape, count, args.iters, evals)
            except Exception as e:  # one shape's failure must not hide the others' numbers
                msg = f"{model} {shape[0]}x{shape[1]}: {type(e).__name__}: {e}"
                result["errors"].append({"model": model, "shape": list(shape), "error": msg})
                print(f"ERROR {msg}\n{traceback.format_exc(limit=3)}", flush=True)
            torch.cuda.empty_cache()
            if args.out:  # written as soon as it exists: a later shape may be cut short
                Path(args.out).write_text(json.dumps(result, indent=1))
    result["seconds"] = time.perf_counter() - t0
    print("\nper product (torch's result the reference)")
    print(
        f"{'model':<5} {'shape':>11} {'x':>3} {'op':<7} {'m':>5} {'evaluation':<10} {'torch ms':>9} {'ms':>9} "
        f"{'speedup':>7} {'max rel err':>11} sym"
    )
    for r in result["ops"]:
        print(
            f"{r['model']:<5} {r['shape'][0]:>5}x{r['shape'][1]:<5} {r['count']:>3} {r['op']:<7} {r['m']:>5} "
            f"{r['evaluation']:<10} {r['torch_ms']:9.3f} {r['ms']:9.3f} {r['speedup']:6.2f}x "
            f"{r['max_rel_err']:11.2e} {'yes' if r['symmetric'] else 'no'}"
        )
    print("\nwhole Newton–Schulz (5 iterations): ms and distance to the polar factor per evaluation")
    names = ["torch", *evals]
    print(
        f"{'model':<5} {'shape':>11} {'x':>3} {'form':<8} {'GFLOP':>8} {'torch TF/s':>10} "
        + " ".join(f"{n + ' ms':>12} {'polar':>6}" for n in names)
    )
    for r in result["newton_schulz"]:
        print(
            f"{r['model']:<5} {r['shape'][0]:>5}x{r['shape'][1]:<5} {r['count']:>3} {r['form']:<8} "
            f"{r['gflop']:8.1f} {r['torch_tflops']:10.1f} "
            + " ".join(f"{r[n + '_ms']:12.3f} {r[n + '_to_polar']:6.3f}" for n in names)
        )
    for model in args.models.split(","):
        rows = [r for r in result["newton_schulz"] if r["model"] == model]
        # Muon's preset runs the Gram form where it applies: the last form listed for each shape
        chosen = {tuple(r["shape"]): r for r in rows}
        if chosen:
            totals = {n: sum(r[n + "_ms"] for r in chosen.values()) for n in names}
            print(
                f"{model}: all hidden matrices, Muon's forms: "
                + ", ".join(f"{n} {t:.2f} ms ({totals['torch'] / t:.2f}x)" for n, t in totals.items())
            )
    print(f"errors: {len(result['errors'])}; {result['seconds']:.0f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
