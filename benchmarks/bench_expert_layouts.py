"""Muon's step on stacked experts in the three layouts transformers' MoE families use, on one GPU.

Qwen2-MoE (and most families) store ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]``; Llama4
``[E, H, 2I]`` and ``[E, I, H]``; GPT-OSS the same with gate and up interleaved. Muon reads the last two
through strided views (``muonrun.optim.groups.ExpertLayout``). For each layout and variant, the same
parameters and gradients are stepped eagerly (``Muon(eager=True)``) and as Muon runs on GPUs (compiled
elementwise passes, the step replayed from a CUDA graph); it prints the median step time after warm-up
and the largest difference to the eager step, relative to how far the eager step moved the weights (bf16
rounding in Newton–Schulz's input: about 1%). The default shapes are GPT-OSS-20B's experts (hidden and
intermediate 2880), 4 experts in each of 3 layers::

    python benchmarks/bench_expert_layouts.py [--experts 4 --layers 3 --hidden 2880 --inter 2880]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from muonrun.optim import Muon
from muonrun.optim.groups import ExpertLayout


def layouts(e: int, h: int, i: int) -> dict:
    """Each family's (gate_up layout, down layout, gate_up shape, down shape)."""
    return {
        "qwen2_moe": (ExpertLayout(2), ExpertLayout(1), (e, 2 * i, h), (e, h, i)),
        "llama4": (ExpertLayout(2, True), ExpertLayout(1, True), (e, h, 2 * i), (e, i, h)),
        "gpt_oss": (ExpertLayout(2, True, True), ExpertLayout(1, True), (e, h, 2 * i), (e, i, h)),
    }


def step_times(init, grads, groups_of, variant: str, eager: bool) -> tuple[list, float]:
    params = [torch.nn.Parameter(t.clone()) for t in init]
    opt = Muon(
        groups_of(params),
        lr=0.02,
        weight_decay=0.1,
        eager=eager,
        variant=variant,
        gram=True,
    )
    times = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return [p.detach() for p in params], statistics.median(times[3:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=2880)
    ap.add_argument("--inter", type=int, default=2880)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    n = args.layers
    print(f"{'variant':8s} {'layout':10s} {'passes':22s} {'step ms':>8s} {'vs eager':>9s}")
    for variant in ("muon", "normuon"):
        for name, (lg, ld, sg, sd) in layouts(args.experts, args.hidden, args.inter).items():
            torch.manual_seed(0)
            init = [torch.randn(s, device="cuda") * 0.02 for s in [sg] * n + [sd] * n]
            grads = [[torch.randn_like(t) for t in init] for _ in range(args.steps)]

            def groups_of(ps, lg=lg, ld=ld):
                return [{"params": ps[:n], **lg.group_keys()}, {"params": ps[n:], **ld.group_keys()}]

            eager, eager_ms = step_times(init, grads, groups_of, variant, True)
            moved = max((p - t).abs().max().item() for p, t in zip(eager, init, strict=True))
            print(f"{variant:8s} {name:10s} {'eager':22s} {eager_ms:8.2f} {0:9.1e}")
            ps, ms = step_times(init, grads, groups_of, variant, False)
            diff = max((p - q).abs().max().item() for p, q in zip(ps, eager, strict=True)) / moved
            print(f"{variant:8s} {name:10s} {'compiled + CUDA graph':22s} {ms:8.2f} {diff:9.1e}", flush=True)


if __name__ == "__main__":
    main()
