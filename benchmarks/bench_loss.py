"""LM head + cross-entropy on one GPU: the full-logits loss a plain transformers model uses, muonrun's
fused chunked loss (eager), and the same with each chunk's softmax gradient compiled.

    python benchmarks/bench_loss.py [--tokens 16384] [--hidden 896 1536] [--chunk 4096]

Prints forward+backward milliseconds (median of 10 after 3 warm-up runs, CUDA events) and the peak
memory above the inputs, for Qwen2's 151,936-way vocabulary.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from muonrun.model.loss import linear_cross_entropy_sum


def full_logits(h, w, y, chunk):
    return F.cross_entropy((h @ w.t()).float(), y, reduction="sum")


def fused(compiled):
    return lambda h, w, y, chunk: linear_cross_entropy_sum(h, w, y, chunk, compiled=compiled)


def measure(fn, h, w, y, chunk) -> tuple[float, float]:
    times = []
    for i in range(13):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(h, w, y, chunk).backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, nargs="+", default=[896, 1536])
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    print(f"{'hidden':>6} {'variant':<16} {'fwd+bwd ms':>10} {'peak GiB':>9} {'loss':>14}")
    for d in args.hidden:
        torch.manual_seed(0)
        h = torch.randn(args.tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(args.vocab, d, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        y = torch.randint(0, args.vocab, (args.tokens,), device="cuda")
        for name, fn in (
            ("full logits", full_logits),
            ("fused eager", fused(False)),
            ("fused compiled", fused(True)),
        ):
            ms, gib = measure(fn, h, w, y, args.chunk)
            loss = fn(h, w, y, args.chunk).item()
            print(f"{d:>6} {name:<16} {ms:>10.2f} {gib:>9.2f} {loss:>14.2f}")


if __name__ == "__main__":
    main()
