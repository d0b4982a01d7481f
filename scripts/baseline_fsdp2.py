"""The baseline muonrun must beat: plain transformers Qwen2 + fully_shard per decoder layer, glued by hand.

This is what a user gets without muonrun: HF's own loss
(full fp32 logits), SDPA, bf16 params / fp32 reduce, random tokens; optimizer fused AdamW or
torch.optim.Muon applied directly to the FSDP2 DTensors. Run it beside `muonrun bench` in one call:

    torchrun --standalone --nproc-per-node 2 scripts/baseline_fsdp2.py --model 0.5b --optimizer adamw
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, Qwen2Config

SIZES = {  # Qwen2.5 architectures (config.json values)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=SIZES, default="0.5b")
    ap.add_argument("--optimizer", choices=["adamw", "torch_muon"], default="adamw")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    ap.add_argument("--out", default=None, help="append the JSON result to this file (rank 0)")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    mesh = init_device_mesh("cuda", (world,))
    config = Qwen2Config(vocab_size=151936, max_position_embeddings=32768, **SIZES[args.model])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if args.compile:
            layer.compile()
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.ndim == 2 else p.fill_(1.0)
        head_dim = config.hidden_size // config.num_attention_heads
        model.model.rotary_emb.inv_freq.copy_(
            1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float) / head_dim))
        )
    if args.optimizer == "adamw":
        optimizers = [torch.optim.AdamW(model.parameters(), lr=2e-4, fused=True)]
    else:
        hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and ".layers." in n]
        rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and ".layers." in n)]
        optimizers = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=2e-4, fused=True)]

    tokens = torch.randint(0, config.vocab_size, (args.micro_batch, args.seq_len + 1), device="cuda")
    step_times, opt_times = [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step >= args.warmup:
            step_times.append(t2 - t0)
            opt_times.append(t2 - t1)
    step = statistics.median(step_times)
    tps = args.micro_batch * args.seq_len / step
    h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    head_dim = h // heads
    attn = h * heads * head_dim * 2 + h * config.num_key_value_heads * head_dim * 2
    matmul = layers * (attn + 3 * h * config.intermediate_size) + h * config.vocab_size
    flops_per_token = 3 * (2 * matmul + layers * 2 * args.seq_len * heads * head_dim)
    result = {
        "variant": f"baseline-{args.model}-{args.optimizer}{'-compile' if args.compile else ''}",
        "world_size": world,
        "step_time": step,
        "optimizer_step_time": statistics.median(opt_times),
        "tokens_per_s_per_device": tps,
        "mfu": tps * flops_per_token / 989e12,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": loss.item(),
    }
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
