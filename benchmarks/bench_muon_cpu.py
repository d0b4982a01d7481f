"""Muon on CPU: bf16 against fp32 Newton–Schulz, and the optimizer step against AdamW's.

usage, from the repository root (2 workers, one thread each, as `muonrun pretrain tiny` runs):
    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/bench_muon_cpu.py [tiny] [25m]

Prints, on rank 0: one batched bf16 and fp32 matmul of the presets' shapes; then, per model, the
median optimizer step of the local-shard AdamW and of Muon with bf16, fp32 and `auto` Newton–Schulz
(`ns_dtype_for`, what `optimizer.muon.ns_dtype=auto` picks) on FSDP2-sharded hidden matrices. A CPU
without native bf16 matmuls can be imitated on one that has them with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`. Tokens/s of whole runs:
    muonrun bench tiny --variant adamw --variant muon:optimizer.name=muon --steps 10 --warmup 3
Figures are in docs/performance.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from muonrun.distributed import destroy, release_process_groups
from muonrun.optim import AdamW, Muon
from muonrun.optim.newton_schulz import ns_dtype_for

MODELS = {  # hidden, intermediate, layers, kv dim: the tiny preset, and ~25M hidden parameters
    "tiny": (128, 384, 4, 64),
    "25m": (512, 1536, 8, 128),
}


def shapes(model: str) -> list[tuple[int, int]]:
    h, i, n, kv = MODELS[model]
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * n


def median_ms(fn, steps: int, warmup: int = 1) -> float:
    times = []
    for k in range(warmup + steps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        if k >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def matmul_ms(shape: tuple[int, int, int], dtype: torch.dtype) -> float:
    a = torch.randn(shape, dtype=dtype)
    b = torch.randn(shape[0], shape[2], shape[1], dtype=dtype)
    torch.bmm(a, b)
    best = float("inf")
    for _ in range(10):
        t = time.perf_counter()
        torch.bmm(a, b)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def measure() -> None:
    models = sys.argv[1:] or ["tiny", "25m"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    auto = ns_dtype_for("auto", "cpu")
    log(
        f"torch {torch.__version__}, {world} ranks x {torch.get_num_threads()} thread(s), CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}; ns_dtype auto -> {auto}"
    )
    for shape in [(4, 128, 384), (4, 512, 1536)]:
        bf16, fp32 = matmul_ms(shape, torch.bfloat16), matmul_ms(shape, torch.float32)
        log(f"bmm {shape} x its transpose: bf16 {bf16:.2f} ms, fp32 {fp32:.2f} ms ({bf16 / fp32:.1f}x)")
    mesh = init_device_mesh("cpu", (world,))
    for model in models:
        shp = shapes(model)
        layers = nn.Sequential(*[nn.Linear(i, o, bias=False) for o, i in shp])
        fully_shard(layers, mesh=mesh)
        params = list(layers.parameters())
        for p in params:
            local = torch.randn(p.to_local().shape)
            p.grad = DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride())
        steps = 10 if model == "tiny" else 3
        log(f"\n== {model}: {len(shp)} hidden matrices, {sum(a * b for a, b in shp) / 1e6:.1f}M parameters")
        t_adamw = median_ms(AdamW(params, lr=1e-3).step, steps)
        log(f"AdamW (local shards) step: {t_adamw:.1f} ms")
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("auto", auto)):
            t = median_ms(Muon(params, lr=0.02, ns_dtype=dtype).step, steps)
            log(f"Muon step, {name} Newton–Schulz: {t:.1f} ms ({t / t_adamw:.1f}x AdamW's)")


def main() -> None:
    measure()  # its models and meshes are gone on return
    destroy()
    release_process_groups()  # before interpreter teardown, where gloo's threads can abort the process


if __name__ == "__main__":
    main()
