"""Muon's one-GPU step: host time against GPU time, and the same step replayed from a CUDA graph.

usage (one CUDA GPU, quack installed for its products), from the repository root:
    python benchmarks/bench_muon_host.py [--models 0.5b,1.5b,study] [--variants muon,normuon]

For each model's hidden-matrix shapes (plain tensors: the owner path, no exchange) and Muon as the GPU
presets build it (Gram form, compiled passes, the norm folded, quack's products), the median of ten
steps of:
  host:   wall time of ``step()`` on the host, the GPU idle before it (what a host-bound run pays);
  GPU:    CUDA-event time of the same step when the host starts it on an idle GPU (launch-bound
          where host > GPU) and when the GPU is first kept busy, so its launches queue as they do
          after a training step's backward (the step's own GPU time);
  graph:  the step captured once in a CUDA graph and replayed (no host launches at all);
and the same with Muon's own ``cuda_graph=True`` (``muonrun.optim.graphed``: the momentum pass
eager, the rest replayed), the row marked "graphed".
A training run shows which of these it pays in `logging.profile`'s timeline.txt (the optimizer row's
idle and lag): at the presets' sizes the host runs ahead and the step costs its GPU time; a small
model's host-bound step pays the host time (docs/performance.md, [w5] and [y]). Capture works on
this step as it stands (static shapes, no host syncs); in training ``cuda_graph`` leaves out what
changes address or value between steps (the gradients, the learning rates).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_max_logit import timed  # benchmarks/: on the path when a script runs
from bench_ns_levers import MODELS, model_shapes

from muonrun.optim import Muon  # noqa: E402
from muonrun.optim.ns_quack import QuackProducts  # noqa: E402

# bench_ns_levers' table (hidden, intermediate, layers, kv dim), which model_shapes reads, gains the
# optimizer study's 101M model (muonrun/configs/_study.yaml)
MODELS.setdefault("study", (768, 2048, 16, 256))
REPEATS = 10


def host_and_gpu_ms(fn) -> tuple[float, float]:
    """One call of ``fn``: its wall time on the host, and its CUDA-event time on the GPU."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    fn()
    end.record()
    host = (time.perf_counter() - t0) * 1e3
    end.synchronize()
    return host, start.elapsed_time(end)


def measure(model: str, variant: str, graphed: bool) -> dict[str, float | str]:
    dev = torch.device("cuda")
    shapes = [s for s, count in model_shapes(model).items() for _ in range(count)]
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev, generator=gen) * 1e-3
    opt = Muon(
        params,
        lr=0.02,
        weight_decay=0.01,
        gram=True,
        fused=True,
        fold_norm=True,
        products=QuackProducts(),
        variant=variant,
        cuda_graph=graphed,
    )
    for _ in range(3):  # compilation, quack's kernels, the plan; graphed: warm-up and capture
        opt.step()
    torch.cuda.synchronize()
    host, gpu, queued = [], [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        host_ms, gpu_ms = host_and_gpu_ms(opt.step)
        host.append(host_ms)
        gpu.append(gpu_ms)
    busy = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        for _ in range(20):  # about 30 ms of GPU work for the host to run ahead of
            busy @ busy
        queued.append(host_and_gpu_ms(opt.step)[1])
    row: dict[str, float | str] = {
        "model": model,
        "variant": variant + (" graphed" if graphed else ""),
        "host_ms": statistics.median(host),
        "gpu_idle_start_ms": statistics.median(gpu),
        "gpu_queued_ms": statistics.median(queued),
    }
    if graphed:
        row["graph_ms"] = "-"
        return row
    try:  # capture on a side stream after warm-up there, as torch.cuda.graphs asks
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            opt.step()
        row["graph_ms"] = timed(graph.replay, REPEATS, warmup=0)
    except Exception as e:  # a capture failure is a result too
        row["graph_ms"] = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="0.5b,1.5b,study")
    ap.add_argument("--variants", default="muon,normuon")
    args = ap.parse_args()
    print(
        f"{'model':<6} {'variant':<16} {'host ms':>8} {'GPU ms (idle start)':>20} {'GPU ms (queued)':>16} {'graph ms':>9}"
    )
    for model in args.models.split(","):
        for variant, graphed in itertools.product(args.variants.split(","), (False, True)):
            r = measure(model, variant, graphed)
            graph = r["graph_ms"] if isinstance(r["graph_ms"], str) else f"{r['graph_ms']:9.2f}"
            print(
                f"{model:<6} {r['variant']:<16} {r['host_ms']:8.2f} {r['gpu_idle_start_ms']:20.2f} "
                f"{r['gpu_queued_ms']:16.2f} {graph}",
                flush=True,
            )
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
