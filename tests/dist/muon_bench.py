"""Optimizer-step benchmark for Muon vs fused AdamW on Qwen2-shaped, Shard(0)-sharded matrices.

usage (GPU, NCCL), from the repository root:
    torchrun --nproc-per-node N -m tests.dist.muon_bench [MODEL ...] [--profile DIR]
MODEL in {0.5b, 1.5b}. Only the hidden matrices are built (what Muon gets; embeddings go to AdamW
either way). Reports median step times for a few bucket sizes and pipeline depths (``Muon.prefetch``)
and with the folded Newton–Schulz (``FoldedMuon``), the Newton–Schulz floor (this rank's owned
matrices, batched, no communication) and achieved TFLOP/s. Not a test: it needs CUDA.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from muonrun.distributed import destroy, release_process_groups
from muonrun.optim import Muon, newton_schulz
from tests.dist.muon_worker import FoldedMuon

MODELS = {  # hidden, intermediate, layers, kv dim
    "0.5b": (896, 4864, 24, 128),
    "1.5b": (1536, 8960, 28, 256),
}


def shapes(model: str) -> list[tuple[int, int]]:
    h, i, n, kv = MODELS[model]
    per_layer = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]
    return per_layer * n


def ns_flops(shape, steps=5) -> float:
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def timed(fn, iters=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    args = sys.argv[1:]
    profile_dir = None
    if "--profile" in args:
        k = args.index("--profile")
        profile_dir = args[k + 1]
        del args[k : k + 2]
    models = args or ["0.5b", "1.5b"]
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh = init_device_mesh("cuda", (world,))
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"torch {torch.__version__}, {world} x {torch.cuda.get_device_name()}")

    for model in models:
        shp = shapes(model)
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = []
        for s in shp:
            full = torch.randn(s, device="cuda", generator=gen) * 0.02
            p = nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
            p.grad = distribute_tensor(torch.randn(s, device="cuda", generator=gen), mesh, [Shard(0)])
            params.append(p)
        total = sum(a * b for a, b in shp)
        flops = sum(ns_flops(s) for s in shp)
        log(
            f"\n== Qwen2-{model}: {len(shp)} hidden matrices, {total / 1e6:.0f}M params, NS {flops / 1e12:.1f} TFLOP/step"
        )

        adamw = torch.optim.AdamW(params, lr=1e-4, fused=True)
        t_adamw = timed(adamw.step)
        log(f"fused AdamW step on the same matrices: {t_adamw:.2f} ms")

        results = {}
        # (bucket_numel, prefetch, folded): Muon's defaults first
        configs = [
            (1 << 28, 2, False),
            (1 << 28, 2, True),
            (1 << 26, 2, False),
            (1 << 28, 1, False),
            (1 << 28, 8, False),
        ]
        for bucket_numel, prefetch, folded in configs:
            opt = (FoldedMuon if folded else Muon)(
                params, lr=0.02, adjust_lr_fn="match_rms_adamw", bucket_numel=bucket_numel
            )
            opt.prefetch = prefetch
            t = timed(opt.step)
            # host-side cost of issuing a step (the GPU runs behind)
            torch.cuda.synchronize()
            h0 = time.perf_counter()
            opt.step()
            host = (time.perf_counter() - h0) * 1e3
            torch.cuda.synchronize()
            results[(bucket_numel, prefetch, folded)] = t
            log(
                f"{'FoldedMuon' if folded else 'Muon'} step bucket_numel=2^{bucket_numel.bit_length() - 1} "
                f"prefetch={prefetch}: {t:.2f} ms "
                f"(host issue {host:.1f} ms; {flops / world / (t * 1e-3) / 1e12:.0f} TFLOP/s/GPU effective)"
            )
        best = min(results, key=results.get)

        # Newton–Schulz floor: this rank's share, batched per shape, no communication
        groups: dict[tuple, int] = {}
        for s in shp:
            groups[s] = groups.get(s, 0) + 1
        stacks = [
            torch.randn(-(-n // world), *s, device="cuda", dtype=torch.bfloat16, generator=gen)
            for s, n in groups.items()
        ]
        t_ns = timed(lambda st=stacks: [newton_schulz(x, fold_identity=True) for x in st])
        my_flops = sum(ns_flops(s) * -(-n // world) for s, n in groups.items())
        log(
            f"NS floor (owned share, batched, no comm): {t_ns:.2f} ms = {my_flops / (t_ns * 1e-3) / 1e12:.0f} TFLOP/s"
        )
        t_pe = timed(lambda st=stacks: [newton_schulz(x, 5, "polar_express", fold_identity=True) for x in st])
        log(f"NS floor, polar_express 5 steps: {t_pe:.2f} ms")
        t3 = timed(lambda st=stacks: [newton_schulz(x, 3, "polar_express", fold_identity=True) for x in st])
        log(f"NS floor, polar_express 3 steps: {t3:.2f} ms")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt = (FoldedMuon if best[2] else Muon)(params, lr=0.02, bucket_numel=best[0])
        opt.prefetch = best[1]
        opt.step()
        torch.cuda.synchronize()
        log(f"Muon step peak extra memory: {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB")

        if profile_dir:  # every rank (collectives), rank 0 writes
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    opt.step()
                torch.cuda.synchronize()
            if rank == 0:
                os.makedirs(profile_dir, exist_ok=True)
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
                with open(os.path.join(profile_dir, f"muon_{model}_w{world}.txt"), "w") as f:
                    f.write(table)
                log(table[:6000])
        del params, adamw, opt, stacks
        torch.cuda.empty_cache()
    destroy()
    release_process_groups()


if __name__ == "__main__":
    main()
