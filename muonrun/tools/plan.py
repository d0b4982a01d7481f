"""`muonrun pretrain CONFIG --dry-run`: validate, build the model on the meta device, print the plan.

Needs no GPU and no data: `muonrun pretrain qwen2-muon-fsdp2 --dry-run --world-size 256` on a laptop.
"""

from __future__ import annotations

from muonrun import log
from muonrun.config import Config
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
    if moe_inter := mlp_width(hf):  # MoE: each token's top-k experts and the shared expert, plus routing
        inter = moe_inter
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


def mlp_width(hf) -> int | None:
    """An MoE layer's MLP width per token for activations: top-k routed experts, the shared expert and
    the gathered copies of the tokens each expert runs (about one more width); None for a dense model."""
    from muonrun.model.moe import expert_width, experts_per_token, is_moe

    if not is_moe(hf):
        return None
    shared = getattr(hf, "shared_expert_intermediate_size", None) or 0
    return experts_per_token(hf) * (expert_width(hf) + hf.hidden_size // 2) + shared


def expert_ns_flops(stacked: list, flops, dp_shard: int) -> list[int]:
    """Newton–Schulz FLOPs per rank for stacked expert parameters (their shape [E, a, b] and
    ``groups.ExpertLayout``: k matrices per expert, each costing ``flops(shape)``): each rank
    orthogonalises the k matrices of each expert it holds (torch.chunk over dp_shard ranks: ceil(E /
    dp_shard) each, the last ranks fewer)."""
    from muonrun.optim.sharding import local_rows

    per_rank = [0] * dp_shard
    for shape, layout in stacked:
        cost = flops(layout.matrix_shape(shape))
        for r in range(dp_shard):
            per_rank[r] += local_rows(shape[0], dp_shard, r) * layout.matrices * cost
    return per_rank


def device_memory(c, workers_per_node: int) -> tuple[float, str] | None:
    """(GiB one worker has, what that is) on this machine: the first GPU's memory for a GPU plan, an even
    share of the machine's memory for a CPU plan; None for a GPU plan on a machine without GPUs."""
    import os

    import torch

    if c.train.device != "cpu":
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        return props.total_memory / GIB, f"{props.name}'s {props.total_memory / GIB:.0f} GiB"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return total / workers_per_node, f"{total:.0f} GiB of this machine's memory / {workers_per_node} workers"


def memory_warning(s: dict, c) -> str | None:
    """A warning when the planned memory per rank (states + rough activations) exceeds what a worker has."""
    have = device_memory(c, s["world_size"] // s["nnodes"])
    states, acts = sum(s["memory_gib_per_rank"].values()), s["activation_gib_per_rank"]
    if have is None or states + acts <= have[0]:
        return None
    return (
        f"this plan needs about {states + acts:.1f} GiB per rank ({states:.1f} GiB of weights, gradients and "
        f"optimizer state, ~{acts:.1f} GiB of activations), more than a worker has ({have[1]}): it will run out "
        "of memory. Shard over more ranks, set parallel.activation_checkpointing=full, or lower "
        "train.micro_batch_size or data.seq_len."
    )


def muon_iteration(cfg: Config):
    """The Newton–Schulz iteration Muon runs for this config on this machine's kind of device (its
    products: quack's on a Hopper GPU with quack-kernels installed): the one the step runs."""
    from muonrun.distributed import pick_device_type
    from muonrun.optim.build import muon_iteration as iteration_for

    return iteration_for(cfg.optimizer, pick_device_type(cfg))


def tokenizer_and_data(c, check_data_here: bool = True) -> tuple[int | None, str, str]:
    """(vocabulary size, the plan's tokenizer line, its data line). With a tokenizer this machine can
    load, the data gets the launcher's own checks (``check_data``: the files exist, the text column is
    there, the first record holds text, a Hub dataset is reachable), and a problem fails the plan as it
    would fail the launch. A tokenizer this machine cannot load (a Hub id, offline) is reported as
    unchecked instead, and so is the data: the launcher checks both before training. Not
    ``check_data_here`` (``--world-size``: a plan for other machines, whose data this one may not
    see): the data is left unchecked, and the plan says so."""
    from muonrun.data import build_tokenizer, check_data

    try:
        tok = build_tokenizer(c.data.tokenizer)
    except UserError as e:
        return (
            None,
            f"{c.data.tokenizer}: not loadable here, vocabulary not checked ({str(e)[:120]}...)",
            "not checked (the tokenizer is not loadable here)",
        )
    tokenizer = f"{c.data.tokenizer} ({tok.vocab_size:,} tokens, fits the model's vocabulary)"
    if not check_data_here:
        return tok.vocab_size, tokenizer, "not checked (--world-size plans for other machines)"
    check_data(c, tok)
    counts = f"{len(c.data.sources)} train source(s)" + (
        f", {len(c.data.eval_sources)} eval source(s)" if c.data.eval_sources else ""
    )
    return tok.vocab_size, tokenizer, f"{counts}, checked as the launch checks them"


def plan_summary(cfg: Config, world_size: int | None) -> dict:
    from muonrun.features import enabled, flops_per_token
    from muonrun.launch.launcher import default_nproc
    from muonrun.model.build import check_model, count_params
    from muonrun.model.build import flops_per_token as model_flops_per_token
    from muonrun.optim.groups import split_params
    from muonrun.optim.sharding import owner_flops

    nnodes = cfg.launch.nnodes
    world = default_nproc(cfg) * nnodes if world_size is None else world_size
    if world < 1:
        raise UserError(f"--world-size is {world}; it must be at least 1.")
    if world % nnodes:
        raise UserError(f"--world-size {world} cannot be split evenly over --nnodes {nnodes}.")
    how = f"--world-size {world}" if world_size else f"{nnodes} node(s) x {world // nnodes} workers per node"
    replicate, shard = mesh_shape(cfg, world, how)
    vocab, tokenizer, data = tokenizer_and_data(cfg, check_data_here=world_size is None)
    features = enabled(cfg)
    model = check_model(cfg.model, vocab, cfg.data.seq_len, features, cfg.train.router_z_loss_coef)
    hf = model.config
    params = count_params(model)
    split = split_params(
        model,
        muon_patterns=cfg.optimizer.muon.muon_patterns,
        adamw_patterns=cfg.optimizer.muon.adamw_patterns,
    )
    muon_params = sum(p.numel() for _, p in split.muon + split.experts)
    tokens_per_step = cfg.tokens_per_step(world)
    iteration = muon_iteration(cfg) if cfg.optimizer.name == "muon" else None
    fpt = flops_per_token(features, model_flops_per_token(hf, cfg.data.seq_len), model)
    # bf16 compute unless asked for fp32 or planned for CPU (`auto` is bf16 on GPU, the usual target)
    param_bytes = 4 if cfg.parallel.param_dtype == "float32" or cfg.train.device == "cpu" else 2
    return {
        "model": f"{hf.model_type} ({cfg.model.name_or_path or 'inline config'})",
        "tokenizer": tokenizer,
        "data": data,
        "parameters": params,
        "muon_parameters": muon_params if cfg.optimizer.name == "muon" else 0,
        "flops_per_token": fpt,
        "world_size": world,
        "nnodes": nnodes,
        "mesh": {"dp_replicate": replicate, "dp_shard": shard},
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * cfg.train.max_steps,
        "model_flops_per_rank_step": fpt * tokens_per_step / world,
        "ns_flops_per_rank_step": (
            owner_flops([p.shape for _, p in split.muon], shard, iteration.flops) if iteration else 0
        ),
        "ns_iteration": iteration.describe() if iteration else "",
        "expert_ns_flops_per_rank_step": (
            expert_ns_flops(
                [(p.shape, split.expert_layouts[n]) for n, p in split.experts], iteration.flops, shard
            )
            if iteration
            else [0] * shard
        ),
        "memory_gib_per_rank": memory_per_rank(params, muon_params, cfg.optimizer.name, shard, param_bytes),
        "activation_gib_per_rank": activation_gib(hf, cfg, param_bytes),
        "feature_rows": [row for f in features for row in f.plan_rows(model)],
    }


def print_plan(cfg: Config, world_size: int | None) -> None:
    s = plan_summary(cfg, world_size)
    p = s["parameters"]
    rows = [
        ("model", s["model"]),
        ("tokenizer", s["tokenizer"]),
        ("data", s["data"]),
        (
            "parameters",
            f"{p['total']:,} ({p['embedding']:,} embedding, {p['non_embedding']:,} other)",
        ),
        (
            "optimizer",
            cfg.optimizer.name
            + (f" ({s['muon_parameters']:,} params in Muon)" if s["muon_parameters"] else ""),
        ),
        ("FLOPs/token (train)", f"{s['flops_per_token']:.3e}"),
        (
            "world size",
            f"{s['world_size']} (mesh dp_replicate={s['mesh']['dp_replicate']} x dp_shard={s['mesh']['dp_shard']})"
            + (f", {s['nnodes']} nodes x {s['world_size'] // s['nnodes']}" if s["nnodes"] > 1 else ""),
        ),
        ("tokens/step", f"{s['tokens_per_step']:,}"),
        ("total tokens", f"{s['total_tokens']:,} over {cfg.train.max_steps:,} steps"),
        (
            "memory/rank (no activations)",
            ", ".join(f"{k} {v:.2f} GiB" for k, v in s["memory_gib_per_rank"].items())
            + f" = {sum(s['memory_gib_per_rank'].values()):.2f} GiB",
        ),
        (
            "activations/rank (rough)",
            f"~{s['activation_gib_per_rank']:.2f} GiB per micro-batch of {cfg.train.micro_batch_size} x "
            f"{cfg.data.seq_len} (activation checkpointing {cfg.parallel.activation_checkpointing}"
            + ("; an upper bound: compiled layers keep less)" if cfg.parallel.compile else ")"),
        ),
        ("output", cfg.output_dir),
    ]
    rows[-1:-1] = s["feature_rows"]
    if s["ns_flops_per_rank_step"]:
        per_rank, model = s["ns_flops_per_rank_step"], s["model_flops_per_rank_step"]
        experts = s["expert_ns_flops_per_rank_step"]  # on the ranks that hold the experts, no choice of owner
        per_rank = {k: [a + b for a, b in zip(v, experts, strict=True)] for k, v in per_rank.items()}
        ns, rr = max(per_rank["balanced"]), max(per_rank["round_robin"])
        average = sum(per_rank["balanced"]) / len(per_rank["balanced"])
        rows.insert(
            -1,
            (
                "Muon Newton–Schulz",
                f"{ns / 1e12:.2f} TFLOP per rank per optimizer step ({s['ns_iteration']}) "
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
    warning = memory_warning(s, cfg)
    if warning:
        log.warning(warning)
