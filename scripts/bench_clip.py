"""Host time of gradient clipping over FSDP2 shards: torch.nn.utils.clip_grad_norm_ on the DTensor
gradients vs muonrun.clip.clip_grad_norm on the local shards.

usage: torchrun --standalone --nproc-per-node 2 scripts/bench_clip.py [LAYERS]   (CPU, gloo; or GPU)
A narrow Qwen2 with the 0.5B preset's layer count by default (24 layers: 291 gradients), so the
figure is the per-gradient overhead, not arithmetic. Prints the median per call, alternating the
two so drift biases neither.
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

from muonrun.clip import clip_grad_norm


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 24
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", dist.get_rank()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
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
    params = [p for p in model.parameters() if p.grad is not None]

    def torch_dtensor() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True).full_tensor()

    def muonrun_local() -> None:
        clip_grad_norm(params, 1.0)

    times: dict[str, list[float]] = {f.__name__: [] for f in (torch_dtensor, muonrun_local)}
    for _ in range(15):
        for f in (torch_dtensor, muonrun_local):
            start = time.perf_counter()
            for _ in range(5):
                f()
            if cuda:
                torch.cuda.synchronize()
            times[f.__name__].append((time.perf_counter() - start) / 5)
    if dist.get_rank() == 0:
        print(f"{len(params)} gradients, {dist.get_world_size()} ranks, {device.type}")
        for name, ts in times.items():
            print(f"{name:>14}: {statistics.median(ts[3:]) * 1e3:.2f} ms per call (median of {len(ts) - 3})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
