"""Host time of the per-step work on FSDP2 shards that muonrun does on the local tensors, against
torch's path through DTensor's dispatcher:
  clip:  torch.nn.utils.clip_grad_norm_ on the DTensor gradients vs muonrun.train.clip.clip_grad_norm;
  adamw: torch.optim.AdamW on the DTensors vs muonrun.optim.AdamW, as muonrun builds it
         (fused on CUDA, torch's default elsewhere), with foreach=True and with fused=True.

usage: torchrun --standalone --nproc-per-node 2 benchmarks/bench_host.py [LAYERS]   (CPU, gloo; or GPU)
A narrow Qwen2 with the 0.5B preset's layer count by default (24 layers: 291 parameters), so the
figures are the per-tensor overhead, not arithmetic. Prints the median per call, alternating each
pair so drift biases neither, and checks that both sides of an AdamW pair end with equal weights.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2Config, Qwen2ForCausalLM

from muonrun.distributed import destroy, release_process_groups
from muonrun.optim import AdamW
from muonrun.train.clip import clip_grad_norm


def sharded_model(layers: int, mesh, device: torch.device) -> torch.nn.Module:
    """The same weights on every call (fixed seed), sharded per layer, with gradients."""
    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    )
    model = Qwen2ForCausalLM(cfg).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randint(0, 512, (2, 16), device=device)
    model(x, labels=x).loss.backward()
    return model


def time_pair(fns: dict, cuda: bool) -> dict[str, float]:
    """Median seconds per call of each function, calls alternated (5 per sample, 12 samples kept)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(15):
        for name, f in fns.items():
            start = time.perf_counter()
            for _ in range(5):
                f()
            if cuda:
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / 5)
    return {name: statistics.median(ts[3:]) for name, ts in times.items()}


def measure() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    model = sharded_model(layers, mesh, device)
    params = [p for p in model.parameters() if p.grad is not None]

    results = {
        "clip": time_pair(
            {
                "torch_dtensor": lambda: torch.nn.utils.clip_grad_norm_(
                    params, 1.0, foreach=True
                ).full_tensor(),
                "muonrun_local": lambda: clip_grad_norm(params, 1.0),
            },
            cuda,
        )
    }
    # muonrun's AdamW: fused on CUDA, torch's default elsewhere (a per-tensor loop on CPU)
    kinds = {
        "muonrun's": {"fused": True if cuda else None},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }
    for kind, flags in kinds.items():
        a, b = sharded_model(layers, mesh, device), sharded_model(layers, mesh, device)
        torch_opt = torch.optim.AdamW(a.parameters(), lr=1e-3, weight_decay=0.1, **flags)
        local_opt = AdamW(b.parameters(), lr=1e-3, weight_decay=0.1, **flags)
        results[f"adamw {kind}"] = time_pair(
            {"torch_dtensor": torch_opt.step, "muonrun_local": local_opt.step}, cuda
        )
        for p, q in zip(a.parameters(), b.parameters(), strict=True):  # 75 steps each: still equal
            torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-6, atol=0)
    if dist.get_rank() == 0:
        print(f"{len(params)} parameters, {dist.get_world_size()} ranks, {device.type}")
        for what, r in results.items():
            for name, t in r.items():
                print(f"{what:>15} {name:>14}: {t * 1e3:.2f} ms per call")


def main() -> None:
    measure()  # its models and meshes are gone on return
    destroy()
    release_process_groups()  # before interpreter teardown, where gloo's threads can abort the process


if __name__ == "__main__":
    main()
