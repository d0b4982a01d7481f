"""Muon's Newton–Schulz levers and fused passes on one GPU: time and distance to the polar factor.

usage (one CUDA GPU), from the repository root:
    python benchmarks/bench_ns_levers.py [--out results.json] [--models 0.5b,1.5b] [--skip-ns | --skip-step]
        [--steps "muon gram fused,normuon gram fused"] [--profile "muon gram fused"]

1. Per preset matrix shape (Qwen2-0.5B: 896 x 896, 128 x 896, 4864 x 896, 896 x 4864; Qwen2-1.5B:
   1536 x 1536, 256 x 1536, 8960 x 1536, 1536 x 8960), as many matrices as the model has, batched as
   Muon's owner batches them: milliseconds per batch of each Newton–Schulz evaluation (the
   normalisation included), and the distance to the exact polar factor (fp64 SVD) of a gradient-like
   matrix (singular values 1/i, benchmarks/gram_ns_numerics.py) in the GPU's own bf16 arithmetic.
2. ``Muon.step()`` on plain tensors of a model's hidden-matrix shapes (one GPU: the owner path,
   no exchange), for each configuration: median milliseconds per step. The difference to what
   ``muonrun bench`` reports as Muon's optimizer time is the AdamW step of the embeddings and norms.

Not a test: it needs CUDA. docs/performance.md quotes its numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs
from ns_blocked import BlockedProducts

from muonrun.optim import Muon  # noqa: E402
from muonrun.optim.newton_schulz import (  # noqa: E402
    DEFAULT_NS_COEFFICIENTS,
    Scaling,
    newton_schulz_flops,
    ns_iterations,
    resolve_ns_coefficients,
    uses_gram_form,
)

DEVICE = "cuda"
MODELS = {  # hidden, intermediate, layers, kv dim
    "0.5b": (896, 4864, 24, 128),
    "1.5b": (1536, 8960, 28, 256),
}

# (label, coefficients, steps, gram, precondition, folded, blocks): blocks > 0 evaluates the symmetric
# products by ns_blocked.BlockedProducts(blocks) (a study), 0 by torch's
NS_VARIANTS = [
    ("torch x5", DEFAULT_NS_COEFFICIENTS, 5, False, "frobenius", False, 0),
    ("gram x5", DEFAULT_NS_COEFFICIENTS, 5, True, "frobenius", False, 0),
    ("gram x5 folded", DEFAULT_NS_COEFFICIENTS, 5, True, "frobenius", True, 0),
    ("gram x5 folded blocked2", DEFAULT_NS_COEFFICIENTS, 5, True, "frobenius", True, 2),
    ("gram x5 folded blocked3", DEFAULT_NS_COEFFICIENTS, 5, True, "frobenius", True, 3),
    ("polar express gram x5", "polar_express", 5, True, "frobenius", True, 0),
    ("aol turbo x4", "turbo", 4, False, "aol", True, 0),
    ("aol turbo gram x4", "turbo", 4, True, "aol", True, 0),
    ("aol turbo gram x4 blocked2", "turbo", 4, True, "aol", True, 2),
    ("default gram x4", DEFAULT_NS_COEFFICIENTS, 4, True, "frobenius", True, 0),
]

# (label, Muon keyword arguments) for the whole-step timing; "blocked2" in a label: BlockedMuon
STEP_VARIANTS = [
    ("muon gram (before)", dict(gram=True)),
    ("muon gram fused", dict(gram=True, fused=True)),
    (
        "muon gram fused aol turbo x4",
        dict(gram=True, fused=True, precondition="aol", ns_coefficients="turbo", ns_steps=4),
    ),
    ("muon gram fused blocked2", dict(gram=True, fused=True)),
    (
        "muon gram fused aol turbo x4 blocked2",
        dict(gram=True, fused=True, precondition="aol", ns_coefficients="turbo", ns_steps=4),
    ),
    ("normuon gram (before)", dict(gram=True, variant="normuon")),
    ("normuon gram fused", dict(gram=True, fused=True, variant="normuon")),
    (
        "normuon gram fused aol turbo x4",
        dict(
            gram=True, fused=True, variant="normuon", precondition="aol", ns_coefficients="turbo", ns_steps=4
        ),
    ),
]


class BlockedMuon(Muon):
    """Muon whose owner evaluates Newton–Schulz's symmetric products by their upper blocks
    (ns_blocked.BlockedProducts, a study): the override point tests use too."""

    blocks = 2

    def _newton_schulz(self, X, per_step, **kw):
        products = [BlockedProducts(self.blocks)] * len(per_step)
        return ns_iterations(X, per_step, gram=self.gram, products=products, **kw)


def model_shapes(model: str) -> dict[tuple[int, int], int]:
    """Each hidden-matrix shape (out, in) of the model and how many it has."""
    h, i, n, kv = MODELS[model]
    return {(h, h): 2 * n, (kv, h): 2 * n, (i, h): 2 * n, (h, i): n}


def gradient_like(m: int, n: int, seed: int, device) -> torch.Tensor:
    """Random singular vectors, singular values 1/i (benchmarks/gram_ns_numerics.py), built on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g, device=device))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g, device=device))
    return (U * torch.arange(1, k + 1, device=device, dtype=torch.float32) ** -1.0) @ V.T


def evaluate(
    G: torch.Tensor, coefficients, steps: int, gram: bool, precondition: str, folded: bool, blocks: int = 0
):
    """One Newton–Schulz evaluation of a bf16 stack as Muon's owner runs it (normalisation included)."""
    per_step, norm_scale = resolve_ns_coefficients(coefficients, steps)
    products = [BlockedProducts(blocks)] * steps if blocks else None
    if precondition == "frobenius" and not folded:
        norm = torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True)
        X = G / (norm * norm_scale).clamp(min=1e-7)
        return ns_iterations(X, per_step, gram=gram, products=products)
    return ns_iterations(G, per_step, gram=gram, scaling=Scaling(precondition, norm_scale), products=products)


def ns_table(models: list[str], iters: int) -> list[dict]:
    rows = []
    dev = torch.device(DEVICE)
    for model in models:
        for (rows_, cols), count in model_shapes(model).items():
            G = gradient_like(rows_, cols, 0, dev)
            U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
            polar = U @ Vh
            batch = torch.randn(count, rows_, cols, device=dev).bfloat16()
            for label, coefficients, steps, gram, precondition, folded, blocks in NS_VARIANTS:
                out = evaluate(G.bfloat16()[None], coefficients, steps, gram, precondition, folded, blocks)[0]
                distance = ((out.double() - polar).norm() / polar.norm()).item()
                args = (batch, coefficients, steps, gram, precondition, folded, blocks)
                ms = timed(lambda args=args: evaluate(*args), iters)
                flops = count * newton_schulz_flops((rows_, cols), steps, gram)
                row = {
                    "model": model,
                    "shape": [rows_, cols],
                    "count": count,
                    "variant": label,
                    "gram_form": gram and uses_gram_form((rows_, cols), steps),
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "to_polar": distance,
                }
                rows.append(row)
                print(
                    f"{model} {rows_}x{cols} x{count} {label:<24} {ms:8.3f} ms {row['tflops']:6.1f} TFLOP/s "
                    f"distance {distance:.4f}",
                    flush=True,
                )
    return rows


def profile_step(opt: Muon, label: str, steps: int = 3, top: int = 25) -> None:
    """Where one configuration's step spends GPU time: torch.profiler over ``steps`` steps, the
    ``top`` kernels by total device time (a table to read, not a figure to quote)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            opt.step()
        torch.cuda.synchronize()
    print(f"--- profile of {label}, {steps} steps", flush=True)
    print(
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60)
    )


def step_table(
    models: list[str], iters: int, profiled: tuple[str, ...] = (), chosen: set[str] | None = None
) -> list[dict]:
    """Each configuration from the same parameters and gradients for the same number of steps; the
    fused ones (the same arithmetic as the one before them, up to rounding) are compared with it."""
    rows = []
    dev = torch.device(DEVICE)
    for model in models:
        shapes = [s for s, count in model_shapes(model).items() for _ in range(count)]
        gen = torch.Generator(device=dev).manual_seed(0)
        params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
        grads = [torch.randn(s, device=dev, generator=gen) * 1e-3 for s in shapes]
        finals: dict[str, list[torch.Tensor]] = {}
        for label, kw in STEP_VARIANTS:
            if chosen is not None and label not in chosen:
                continue
            ps = [p.clone() for p in params]
            for p, g in zip(ps, grads, strict=True):
                p.grad = g
            opt = (BlockedMuon if "blocked2" in label else Muon)(ps, lr=0.02, weight_decay=0.01, **kw)
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            ms = timed(opt.step, iters, warmup=2)
            if label in profiled:
                profile_step(opt, f"{model} {label}")
            sample = [p.detach().clone() for p in ps[:7]]  # one layer
            finals[label] = sample
            row = {"model": model, "variant": label, "ms": ms, "first_step_s": first}
            row["finite"] = all(torch.isfinite(p).all().item() for p in sample)
            before = label.replace(" fused", " (before)")
            if " fused" in label and "aol" not in label and before in finals:
                ref = finals[before]
                row["vs_before"] = max(
                    ((p - q).abs().max() / (q - p0).abs().max()).item()
                    for p, q, p0 in zip(sample, ref, params[:7], strict=True)
                )
            rows.append(row)
            print(
                f"{model} step {label:<32} {ms:8.2f} ms (first step {first:.1f} s, finite {row['finite']}"
                + (f", vs before {row['vs_before']:.4f} of the movement" if "vs_before" in row else "")
                + ")",
                flush=True,
            )
            del ps, opt
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--step-models", default=None, help="models for the step timing (default: --models)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-ns", action="store_true")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--steps", default=None, help="comma-separated step variants to time (default: all)")
    ap.add_argument("--profile", default="", help="comma-separated step variants to profile after timing")
    args = ap.parse_args()
    models = args.models.split(",")
    chosen = set(args.steps.split(",")) if args.steps else None
    profiled = tuple(filter(None, args.profile.split(",")))
    labels = [label for label, _ in STEP_VARIANTS]
    unknown = sorted({*(chosen or ()), *profiled} - set(labels))
    if unknown or (chosen is not None and not set(profiled) <= chosen):  # checked before any timing
        sys.exit(
            f"bench_ns_levers.py: --steps/--profile name {unknown or list(profiled)}; step variants: {labels}"
            " (a profiled variant must also be timed)"
        )
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    print(env, flush=True)
    result = {"env": env}
    if not args.skip_ns:
        result["newton_schulz"] = ns_table(models, args.iters)
        if args.out:  # written as soon as it exists: a later part may be cut short
            Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.skip_step:
        result["step"] = step_table(
            args.step_models.split(",") if args.step_models else models,
            args.iters,
            profiled,
            chosen,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
