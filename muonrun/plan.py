"""`muonrun pretrain CONFIG --dry-run`: validate, build the model on the meta device, print the plan.

Needs no GPU and no data: `muonrun pretrain qwen2-muon-fsdp2 --dry-run --world-size 256` on a laptop.
"""

from __future__ import annotations

from omegaconf import DictConfig

from muonrun.config import check_world_size, to_object
from muonrun.errors import UserError

GIB = 2**30


def memory_per_rank(
    params: dict[str, int], muon_params: int, optimizer: str, dp_shard: int
) -> dict[str, float]:
    """GiB per rank for fp32 master weights, fp32 gradients and optimizer state, sharded over dp_shard.
    AdamW keeps two fp32 buffers per parameter; Muon one for its matrices (AdamW's two for the rest)."""
    total = params["total"]
    state_floats = 2 * total if optimizer == "adamw" else muon_params + 2 * (total - muon_params)
    return {
        "weights": 4 * total / dp_shard / GIB,
        "gradients": 4 * total / dp_shard / GIB,
        "optimizer": 4 * state_floats / dp_shard / GIB,
    }


def plan_summary(cfg: DictConfig, world_size: int | None) -> dict:
    from muonrun.launch import default_nproc
    from muonrun.model import build_hf_config, build_model, count_params, flops_per_token
    from muonrun.optim.groups import split_params

    c = to_object(cfg)
    world = world_size or default_nproc(c) * c.launch.nnodes
    if world < 1:
        raise UserError(f"--world-size is {world}; it must be at least 1.")
    replicate, shard = check_world_size(c, world)
    hf = build_hf_config(c.model)
    model = build_model(c.model, hf)
    params = count_params(model)
    split = split_params(
        model, muon_patterns=c.optimizer.muon.muon_patterns, adamw_patterns=c.optimizer.muon.adamw_patterns
    )
    muon_params = sum(p.numel() for _, p in split.muon)
    tokens_per_step = c.train.micro_batch_size * c.train.grad_accum_steps * c.data.seq_len * world
    return {
        "model": f"{hf.model_type} ({c.model.name_or_path or 'inline config'})",
        "parameters": params,
        "muon_parameters": muon_params if c.optimizer.name == "muon" else 0,
        "flops_per_token": flops_per_token(hf, c.data.seq_len),
        "world_size": world,
        "mesh": {"dp_replicate": replicate, "dp_shard": shard},
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_per_step * c.train.max_steps,
        "memory_gib_per_rank": memory_per_rank(params, muon_params, c.optimizer.name, shard),
    }


def print_plan(cfg: DictConfig, world_size: int | None) -> None:
    s = plan_summary(cfg, world_size)
    c = to_object(cfg)
    p = s["parameters"]
    rows = [
        ("model", s["model"]),
        ("parameters", f"{p['total']:,} ({p['embedding']:,} embedding, {p['non_embedding']:,} other)"),
        (
            "optimizer",
            c.optimizer.name
            + (f" ({s['muon_parameters']:,} params in Muon)" if s["muon_parameters"] else ""),
        ),
        ("FLOPs/token (train)", f"{s['flops_per_token']:.3e}"),
        (
            "world size",
            f"{s['world_size']} (mesh dp_replicate={s['mesh']['dp_replicate']} x dp_shard={s['mesh']['dp_shard']})",
        ),
        ("tokens/step", f"{s['tokens_per_step']:,}"),
        ("total tokens", f"{s['total_tokens']:,} over {c.train.max_steps:,} steps"),
        (
            "memory/rank (no activations)",
            ", ".join(f"{k} {v:.2f} GiB" for k, v in s["memory_gib_per_rank"].items())
            + f" = {sum(s['memory_gib_per_rank'].values()):.2f} GiB",
        ),
        ("output", c.output_dir),
    ]
    print("muonrun plan (dry run: nothing was trained)")
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
