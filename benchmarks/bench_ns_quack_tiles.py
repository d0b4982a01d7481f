"""quack's symmetric GEMM at the presets' Newton–Schulz shapes, per tile configuration, on one GPU.

usage (one CUDA GPU, quack-kernels installed), from the repository root:
    python benchmarks/bench_ns_quack_tiles.py [--models 0.5b,1.5b] [--out results.json]

``quack.gemm_interface.gemm_symmetric`` uses one tile configuration per GPU family: on Hopper 128 x
256 tiles in clusters of 2 along M, so 256 x 256 per cluster, which leaves 896 (the 0.5B preset's
side) at 3.5 clusters. ``quack.gemm_symmetric.gemm_symmetric`` takes the tile and cluster shape
(``muonrun.optim.ns_quack.hopper_tiles`` picks one per product from this table); this times each symmetric product of an iteration (the Gram matrix
on the shape's own orientation, the polynomial ``b A + c A A``, the product ``P A`` of two commuting
polynomials) per configuration, against cuBLAS (torch's ``bmm``) on the same operands, and checks each
result against torch's (largest difference relative to the largest entry; bf16 rounds to 2^-8).
A configuration that does not compile or run is reported with its error. Prints a table; ``--out``
writes JSON. Not a test: it needs CUDA and quack.
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
from bench_ns_levers import model_shapes

from muonrun.optim.ns_products import TORCH_PRODUCTS, runs_symmetric  # noqa: E402

# (tile_M, tile_N, cluster_M, pingpong): the cluster's tile stays square, as the triangular schedule needs
CONFIGS = [(128, 256, 2, False), (128, 128, 1, False), (128, 128, 1, True), (64, 128, 2, False)]


def symmetric_ops(shape: tuple[int, int], count: int) -> dict:
    """Each symmetric product's operands as the low-level call takes them (D = alpha A B^T + beta C)."""
    rows, cols = shape
    Y = torch.randn(count, rows, cols, device="cuda").bfloat16()
    Y = Y / torch.linalg.vector_norm(Y, dim=(-2, -1), keepdim=True)
    Z = Y.mT if rows > cols else Y  # the wide orientation, as a view
    A = TORCH_PRODUCTS.gram(Y, rows > cols)
    P = TORCH_PRODUCTS.poly(A, -4.775, 2.0315)
    P.diagonal(dim1=-2, dim2=-1).add_(3.4445)
    return {
        "gram": (Z, Z, None, 1.0, 1.0, lambda: TORCH_PRODUCTS.gram(Y, rows > cols)),
        "poly": (A, A, A, 2.0315, -4.775, lambda: TORCH_PRODUCTS.poly(A, -4.775, 2.0315)),
        "sym_mm": (P, A, None, 1.0, 1.0, lambda: TORCH_PRODUCTS.sym_mm(P, A)),
    }


def main() -> None:
    from quack.gemm_symmetric import gemm_symmetric

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--out", default=None)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rows_out = []
    for model in args.models.split(","):
        for shape, count in model_shapes(model).items():
            if not runs_symmetric(shape, True):  # torch's products below the side quack takes
                continue
            for op, (a, b, c, alpha, beta, reference) in symmetric_ops(shape, count).items():
                ref = reference()
                torch_ms = timed(reference, args.iters)
                for tile_m, tile_n, cluster_m, pingpong in CONFIGS:
                    row = {"model": model, "shape": list(shape), "count": count, "op": op, "m": a.shape[-2]}
                    row.update(config=[tile_m, tile_n, cluster_m, pingpong], torch_ms=torch_ms)
                    out = torch.empty(count, a.shape[-2], a.shape[-2], dtype=a.dtype, device="cuda")

                    def run(
                        out=out,
                        a=a,
                        b=b,
                        c=c,
                        alpha=alpha,
                        beta=beta,
                        cfg=(tile_m, tile_n, cluster_m, pingpong),
                    ):
                        gemm_symmetric(
                            a, b, out, c, None, tile_M=cfg[0], tile_N=cfg[1], cluster_M=cfg[2], cluster_N=1,
                            pingpong=cfg[3], persistent=True, is_dynamic_persistent=False, alpha=alpha, beta=beta,
                        )  # fmt: skip

                    try:
                        run()
                        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                        ms = timed(run, args.iters)
                        row.update(ms=ms, speedup=torch_ms / ms, max_rel_err=err)
                    except Exception as e:  # one configuration's failure must not hide the others
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        print(traceback.format_exc(limit=2), flush=True)
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows_out}, indent=1)
        )
    print(
        f"\n{'model':<5} {'shape':>11} {'op':<7} {'m':>5} {'torch ms':>9} "
        + " ".join(f"{str(c):>22}" for c in CONFIGS)
    )
    keys = sorted(
        {(r["model"], tuple(r["shape"]), r["op"]) for r in rows_out}, key=lambda k: (k[0], k[1], k[2])
    )
    for key in keys:
        rs = [r for r in rows_out if (r["model"], tuple(r["shape"]), r["op"]) == key]
        cells = [
            f"{r['ms']:8.3f} {r['speedup']:5.2f}x {r['max_rel_err']:.0e}" if "ms" in r else f"{'error':>22}"
            for r in rs
        ]
        print(
            f"{key[0]:<5} {key[1][0]:>5}x{key[1][1]:<5} {key[2]:<7} {rs[0]['m']:>5} {rs[0]['torch_ms']:9.3f} "
            + " ".join(f"{c:>22}" for c in cells)
        )


if __name__ == "__main__":
    main()
