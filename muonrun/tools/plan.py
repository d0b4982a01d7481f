"""`muonrun pretrain CONFIG --dry-run`: validate, build the model on the meta device, print the plan.

Needs no GPU and no data: `muonrun pretrain qwen2-muon-fsdp2 --dry-run --world-size 256` on a laptop.
"""

from __future__ import annotations

from omegaconf import DictConfig

from muonrun.config import to_object
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError

GIB = 2**30


def memory_per_rank(
    params: dict[str, int], muon_params: int, optimizer: str, dp_shard: int, frozen_bytes: int = 4
) -> dict[str, float]:
    """GiB per rank for fp32 master weights, fp32 gradients and optimizer state, sharded over dp_shard.
    AdamW keeps two fp32 buffers per parameter; Muon one for its matrices (AdamW's two for the rest).
    Frozen parameters (LoRA's base) are kept in the compute dtype (`frozen_bytes` each), with neither
    gradients nor optimizer state."""
    total = params["total"]
    trainable = params.get("trainable", total)
    state_floats = 2 * trainable if optimizer == "adamw" else muon_params + 2 * (trainable - muon_params)
    return {
        "weights": (4 * trainable + frozen_bytes * (total - trainable)) / dp_shard / GIB,
        "gradients": 4 * trainable / dp_shard / GIB,
        "optimizer": 4 * state_floats / dp_shard / GIB,
    }


def activation_gib(hf, c, param_bytes: int) -> float:
    """ROUGH activation memory per rank (GiB) at the peak of one micro-batch's backward, counting the
    tensors autograd keeps per token and decoder layer with sdpa/flash attention (no seq x seq scores):
    norm inputs/outputs, q/k/v before and after rotary, attention output, MLP gate/up/act/product, the
    fp32 copies inside RMSNorm when computing in bf16; plus the fused LM head's stored gradients and one
    chunk of logits. Activation checkpointing keeps only layer inputs (plus one layer being recomputed).
    Kernels' workspaces, the allocator's fragmentation and FSDP's gathered parameters are not in it.
    Counted for eager layers: compiled ones save fewer intermediates, so for them this is an upper
    bound (docs/performance.md, "Memory", sets it beside measured peaks)."""
    tokens = c.train.micro_batch_size * c.data.seq_len
    h, inter, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(hf, "num_key_value_heads", None) or heads) * head_dim
    per_layer = param_bytes * (4 * h + 3 * q + 3 * kv + 4 * inter) + (16 * h if param_bytes == 2 else 0)
    kept = {"none": layers, "full": 0, "selective": layers // 2}[c.parallel.activation_checkpointing]
    layer_bytes = tokens * (
        kept * per_layer + (layers - kept) * h * param_bytes + (per_layer if kept < layers else 0)
    )
    chunk = min(c.train.loss_chunk_tokens or tokens, tokens)
    head_bytes = (
        tokens * h * param_bytes
        + hf.vocab_size * h * param_bytes
        + chunk * hf.vocab_size * (param_bytes + 12)
    )
    return (layer_bytes + head_bytes) / GIB


def ns_flops_per_rank(shapes: list, steps: int, dp_shard: int, gram: bool = False) -> dict[str, list[int]]:
    """Muon's Newton–Schulz FLOPs of each of the dp_shard ranks per optimizer step: every matrix is
    orthogonalized once in each shard group, by one owner rank. `"balanced"`: the owners Muon picks
    (balanced by cost); `"round_robin"`: each shape's matrices dealt to the ranks in turn."""
    from muonrun.optim.sharding import owner_flops

    return owner_flops(shapes, dp_shard, steps, gram)


def ns_settings(m) -> str:
    """The Newton–Schulz settings the FLOPs are counted for, in words."""
    parts = [f"{m.ns_steps} iterations", f"{m.ns_coefficients} coefficients", f"{m.ns_precondition} scaling"]
    if m.gram_ns:
        parts.append("Gram form where wide")
    return ", ".join(parts)


def tokenizer_vocab(c) -> tuple[int | None, str]:
    """(vocabulary size, a line for the plan). A tokenizer this machine cannot load (a Hub id, offline)
    is reported as unchecked instead of failing the plan: the launcher checks it before training."""
    from muonrun.data import build_tokenizer

    try:
        tok = build_tokenizer(c.data.tokenizer)
    except UserError as e:
        return None, f"{c.data.tokenizer}: not loadable here, vocabulary not checked ({str(e)[:120]}...)"
    return tok.vocab_size, f"{c.data.tokenizer} ({tok.vocab_size:,} tokens, fits the model's vocabulary)"


def plan_summary(cfg: DictConfig, world_size: int | None) -> dict:
    from muonrun.launch.launcher import default_nproc
    from muonrun.model.build import check_model, count_params, flops_per_token
    from muonrun.optim.groups import split_params

    c = to_object(cfg)
    nnodes = c.launch.nnodes
    world = world_size or default_nproc(c) * nnodes
    if world < 1:
        raise UserError(f"--world-size is {world}; it must be at least 1.")
    if world % nnodes:
        raise UserError(f"--world-size {world} cannot be split evenly over --nnodes {nnodes}.")
    how = f"--world-size {world}" if world_size else f"{nnodes} node(s) x {world // nnodes} workers per node"
    replicate, shard = mesh_shape(c, world, how)
    vocab, tokenizer = tokenizer_vocab(c)
    model = check_model(c.model, vocab, c.data.seq_len)
    hf = model.config
    params = count_params(model)
    split = split_params(
        model, muon_patterns=c.optimizer.muon.muon_patterns, adamw_patterns=c.optimizer.muon.adamw_patterns
    )
    muon_params = sum(p.numel() for _, p in split.muon)
    tokens_per_step = c.train.micro_batch_size * c.train.grad_accum_steps * c.data.seq_len * world
    fpt = flops_per_token(hf, c.data.seq_len)
    if c.model.lora.enabled:
        from muonrun.features.lora import lora_flops_per_token

        fpt = lora_flops_per_token(fpt, model)
    # bf16 compute unless asked for fp32 or planned for CPU (`auto` is bf16 on GPU, the usual target)
    param_bytes = 4 if c.parallel.param_dtype == "float32" or c.train.device == "cpu" else 2
    return {
        "model": f"{hf.model_type} ({c.model.name_or_path or 'inline config'})",
        "tokenizer": tokenizer,
        "parameters": params,
        "muon_parameters": muon_params if c.optimizer.name == "muon" else 0,
        "flops_per_token": fpt,
        "world_size": world,
        "nnodes": nnodes,
        "mesh": {"dp_replicate": replicate, "dp_shard": shard},
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * c.train.max_steps,
        "model_flops_per_rank_step": fpt * tokens_per_step / world,
        "ns_flops_per_rank_step": (
            ns_flops_per_rank(
                [p.shape for _, p in split.muon], c.optimizer.muon.ns_steps, shard, c.optimizer.muon.gram_ns
            )
            if c.optimizer.name == "muon"
            else 0
        ),
        "memory_gib_per_rank": memory_per_rank(params, muon_params, c.optimizer.name, shard, param_bytes),
        "activation_gib_per_rank": activation_gib(hf, c, param_bytes),
        "float8": float8_row(model, c.parallel.float8) if c.parallel.float8 != "none" else None,
    }


def lora_row(c, p: dict) -> str:
    lo = c.model.lora
    return (
        f"; LoRA rank {lo.rank} on {', '.join(lo.target_modules)}: {p['trainable']:,} train "
        f"({p['trainable'] / p['total']:.2%}), the rest frozen in the compute dtype"
    )


def float8_row(model, recipe: str) -> str:
    """Which Linear layers run in float8 (muonrun/features/float8.py's rule), by shape."""
    from collections import Counter

    from muonrun.features.float8 import chosen

    picks = chosen(model, recipe)
    shapes = {name: (m.out_features, m.in_features) for name, m in model.named_modules() if name in picks}
    yes = Counter(shapes[n] for n, ok in picks.items() if ok)
    no = Counter(shapes[n] for n, ok in picks.items() if not ok)

    def fmt(counts):
        return ", ".join(f"{n} x {o}x{i}" for (o, i), n in sorted(counts.items())) or "none"

    return (
        f"{recipe}: {sum(yes.values())} of {len(picks)} decoder Linear layers run in float8 ({fmt(yes)}; "
        f"too small to gain, kept bf16: {fmt(no)}); the LM head stays bf16. Needs a GPU of compute "
        "capability 8.9+ and torchao"
    )


def print_plan(cfg: DictConfig, world_size: int | None) -> None:
    s = plan_summary(cfg, world_size)
    c = to_object(cfg)
    p = s["parameters"]
    rows = [
        ("model", s["model"]),
        ("tokenizer", s["tokenizer"]),
        (
            "parameters",
            f"{p['total']:,} ({p['embedding']:,} embedding, {p['non_embedding']:,} other)"
            + (lora_row(c, p) if c.model.lora.enabled else ""),
        ),
        (
            "optimizer",
            c.optimizer.name
            + (f" ({s['muon_parameters']:,} params in Muon)" if s["muon_parameters"] else ""),
        ),
        ("FLOPs/token (train)", f"{s['flops_per_token']:.3e}"),
        (
            "world size",
            f"{s['world_size']} (mesh dp_replicate={s['mesh']['dp_replicate']} x dp_shard={s['mesh']['dp_shard']})"
            + (f", {s['nnodes']} nodes x {s['world_size'] // s['nnodes']}" if s["nnodes"] > 1 else ""),
        ),
        ("tokens/step", f"{s['tokens_per_step']:,}"),
        ("total tokens", f"{s['total_tokens']:,} over {c.train.max_steps:,} steps"),
        (
            "memory/rank (no activations)",
            ", ".join(f"{k} {v:.2f} GiB" for k, v in s["memory_gib_per_rank"].items())
            + f" = {sum(s['memory_gib_per_rank'].values()):.2f} GiB",
        ),
        (
            "activations/rank (rough)",
            f"~{s['activation_gib_per_rank']:.2f} GiB per micro-batch of {c.train.micro_batch_size} x "
            f"{c.data.seq_len} (activation checkpointing {c.parallel.activation_checkpointing}"
            + ("; an upper bound: compiled layers keep less)" if c.parallel.compile else ")"),
        ),
        ("output", c.output_dir),
    ]
    if c.parallel.float8 != "none":
        rows.insert(-1, ("float8", s["float8"]))
    if s["ns_flops_per_rank_step"]:
        per_rank, model = s["ns_flops_per_rank_step"], s["model_flops_per_rank_step"]
        ns, rr = max(per_rank["balanced"]), max(per_rank["round_robin"])
        average = sum(per_rank["balanced"]) / len(per_rank["balanced"])
        rows.insert(
            -1,
            (
                "Muon Newton–Schulz",
                f"{ns / 1e12:.2f} TFLOP per rank per optimizer step ({ns_settings(c.optimizer.muon)}) "
                f"= {ns / model:.1%} of the model's "
                f"{model / 1e12:.1f} TFLOP per rank and step (busiest rank: {ns / 1e12:.2f} TFLOP, "
                f"{ns / average:.1%} of the average, with owners balanced by cost; {rr / 1e12:.2f} TFLOP, "
                f"{rr / average:.1%}, with each shape dealt round-robin): the arithmetic Muon adds; its momentum, "
                "exchange and update add more (docs/performance.md sets both beside measured step "
                "times); more tokens per step (train.grad_accum_steps) or more ranks shrink it",
            ),
        )
    print("muonrun plan (dry run: nothing was trained)")
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
