"""Time the max-logit measurement of muonrun/features/qkclip.py against the attention it watches, per layer.

    python benchmarks/bench_max_logit.py                 # the 0.5B preset's shapes: 16 x 2048, 14/2 heads, dim 64
    python benchmarks/bench_max_logit.py --batch 8 --heads 28 --kv-heads 4 --dim 128
    python benchmarks/bench_max_logit.py --sweep         # and every tile setting of the kernel

Prints milliseconds per layer call (median of CUDA-event timings): the Triton kernel, the matmul path
(the CPU fallback, run here in bf16), and SDPA's forward and forward + backward on the same tensors.
The share of a training step is the kernel's time x layers / the step time of `muonrun bench`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics

import torch
import torch.nn.functional as F

from muonrun.features.qkclip import causal_max_logit, causal_max_logit_matmul


def timed(fn, repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of `fn` on the GPU (CUDA events around each call), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--sweep", action="store_true", help="time every tile setting of the kernel")
    a = p.parse_args()
    shape = (a.batch, a.seq)
    # the model's memory layout: [batch, seq, heads, dim] viewed as [batch, heads, seq, dim]
    q = torch.randn(*shape, a.heads, a.dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(*shape, a.kv_heads, a.dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn_like(k)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def sdpa_forward_backward() -> None:
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))

    with torch.no_grad():
        exact = causal_max_logit(q, k)
        matmul = causal_max_logit_matmul(q, k)
    print(
        f"max |kernel - matmul path| / max: {((exact - matmul).abs().max() / exact.abs().max()).item():.2e}"
    )
    rows = {
        "max logit, Triton kernel": lambda: causal_max_logit(q, k),
        "max logit, matmul path (bf16)": lambda: causal_max_logit_matmul(q, k),
        "SDPA forward": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "SDPA forward + backward": sdpa_forward_backward,
    }
    flops = 2 * a.batch * a.heads * a.seq * a.seq / 2 * a.dim  # causal Q K^T
    print(f"shape: batch {a.batch}, seq {a.seq}, heads {a.heads}/{a.kv_heads}, dim {a.dim}")
    for name, fn in rows.items():
        with torch.no_grad() if "backward" not in name else torch.enable_grad():
            ms = timed(fn)
        extra = f"  ({flops / ms / 1e9:.0f} TFLOP/s on causal Q K^T)" if name.startswith("max logit") else ""
        print(f"{name:32s} {ms:8.3f} ms{extra}")
    if a.sweep:
        sweep(q, k, flops)


def sweep(q: torch.Tensor, k: torch.Tensor, flops: float) -> None:
    """Every tile setting: its time, and its result against an fp64 reference (sums in fp32: ~1e-6)."""
    from muonrun.features import max_logit_triton as kernel

    with torch.no_grad():
        want = causal_max_logit_matmul(q.double(), k.double())
    for m, n, warps, stages in itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4]):
        tiles = dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)
        try:
            got = kernel.causal_max_logit(q, k, **tiles)
            ms = timed(lambda t=tiles: kernel.causal_max_logit(q, k, **t), repeats=10)
        except Exception as e:  # e.g. out of shared memory for this tile
            print(f"{tiles}: {type(e).__name__}")
            continue
        error = ((got.double() - want).abs() / want.abs()).max().item()
        print(f"{ms:7.3f} ms {flops / ms / 1e9:4.0f} TFLOP/s  rel err {error:.1e}  {tiles}")


if __name__ == "__main__":
    main()
