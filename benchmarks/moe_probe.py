"""Anchor probe: plain transformers Qwen2-MoE + FSDP2 on one GPU, eager vs grouped_mm experts, AdamW.
Run: torchrun --standalone --nproc-per-node 1 benchmarks/moe_probe.py --impl grouped_mm [--compile]"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--impl", default="grouped_mm")
ap.add_argument("--mbs", type=int, default=8)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--compile", action="store_true")
a = ap.parse_args()
dist.init_process_group("nccl")
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
mesh = init_device_mesh("cuda", (dist.get_world_size(),))
H, L, E, K, EI, SI = 1024, 16, 32, 4, 704, 2816  # EI: one expert's width
kw = dict(
    vocab_size=151936,
    hidden_size=H,
    num_hidden_layers=L,
    num_attention_heads=16,
    num_key_value_heads=4,
    intermediate_size=2816,
    moe_intermediate_size=EI,
    shared_expert_intermediate_size=SI,
    num_experts=E,
    num_experts_per_tok=K,
    max_position_embeddings=a.seq,
    tie_word_embeddings=True,
    output_router_logits=True,
    router_aux_loss_coef=0.001,
    attn_implementation="sdpa",
)
try:
    cfg = Qwen2MoeConfig(experts_implementation=a.impl, **kw)
except TypeError as e:
    print("RESULT no experts_implementation kwarg:", e)
    cfg = Qwen2MoeConfig(**kw)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen2MoeForCausalLM(cfg)
print(
    "impl",
    getattr(cfg, "_experts_implementation", None),
    "transformers",
    transformers.__version__,
    "torch",
    torch.__version__,
)
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    if a.compile:
        layer.compile()
    fully_shard(layer, mesh=mesh, mp_policy=mp)
fully_shard(model, mesh=mesh, mp_policy=mp)
total = sum(p.numel() for p in model.parameters())
emb = H * 151936
per_expert = 3 * H * EI
active = total - emb - L * (E - K) * per_expert
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
x = torch.randint(0, 151936, (a.mbs, a.seq), device="cuda")
times = []
for _ in range(a.steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
st = sorted(times[4:])[len(times[4:]) // 2]
tok = a.mbs * a.seq / st
flops = 6 * (active + emb) + 12 * L * H * a.seq  # per token, active params incl. LM head, + attention
print(
    f"RESULT impl={a.impl} compile={a.compile} total={total / 1e9:.2f}B active={active / 1e6:.0f}M step={st * 1e3:.1f}ms "
    f"tok/s={tok:,.0f} mfu989={tok * flops / 989e12:.1%} loss={out.loss.item():.3f} mem={torch.cuda.max_memory_allocated() / 2**30:.1f}GiB"
)
dist.destroy_process_group()
