"""`muonrun pretrain CONFIG --dry-run`: validate, build the model on the meta device, print the plan.

Needs no GPU and no data: `muonrun pretrain qwen2-muon-fsdp2 --dry-run --world-size 256` on a laptop.
"""

from __future__ import annotations

import shutil
import textwrap

from muonrun import log
from muonrun.config import Config
from muonrun.distributed import mesh_shape
from muonrun.errors import UserError
from muonrun.tools.figures import flop, gib, share
from muonrun.tools.memory import (
    ASSUMED_GPUS,
    activation_gib,
    fit_row,
    fit_verdicts,
    memory_per_rank,
    memory_targets,
    memory_warning,
)


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


def muon_iteration(cfg: Config):
    """The Newton–Schulz iteration Muon runs for this config on this machine's kind of device (its
    products: quack's on a Hopper GPU with quack-kernels installed): the one the step runs."""
    from muonrun.distributed import pick_device_type
    from muonrun.optim.build import muon_iteration as iteration_for

    return iteration_for(cfg.optimizer, pick_device_type(cfg))


def tokenizer_and_data(c, check_data_here: bool = True, offline: bool = False) -> tuple[int | None, str, str]:
    """(vocabulary size, the plan's tokenizer line, its data line). With a tokenizer this machine can
    load, the data gets the launcher's own checks (``check_data``: the files exist, the text column is
    there, the first record holds text, a Hub dataset is reachable), and a problem fails the plan as it
    would fail the launch. A tokenizer this machine cannot load (a Hub id, offline) is reported as
    unchecked instead, and so is the data: the launcher checks both before training. Not
    ``check_data_here`` (``--world-size``: a plan for other machines, whose data this one may not
    see): the data is left unchecked, and the plan says so. `offline`: the Hub cannot be asked (its
    cache is all there is), which is then why a Hub tokenizer does not load."""
    from muonrun.data import build_tokenizer, check_data
    from muonrun.eval import check_tasks

    try:
        tok = build_tokenizer(c.data.tokenizer)
    except UserError as e:
        why = "it is not in the local Hugging Face cache and the Hub is offline here" if offline else str(e)
        return (
            None,
            f"{c.data.tokenizer}: not loadable here, so the vocabulary is not checked (the launch checks it): {why}",
            "not checked (the tokenizer is not loadable here)",
        )
    tokenizer = f"{c.data.tokenizer} ({tok.vocab_size:,} tokens, fits the model's vocabulary)"
    if not check_data_here:
        return tok.vocab_size, tokenizer, "not checked (--world-size plans for other machines)"
    check_data(c, tok)
    check_tasks(c, tok)
    counts = f"{len(c.data.sources)} train source(s)" + (
        f", {len(c.data.eval_sources)} eval source(s)" if c.data.eval_sources else ""
    )
    if c.eval.tasks:
        counts += f", {len(c.eval.tasks)} eval task(s)"
    return tok.vocab_size, tokenizer, f"{counts}, checked as the launch checks them"


def check_cpu_plan(cfg: Config, features) -> None:
    """The launcher's checks of what a CPU cannot run (refused: launch.backend=nccl, parallel.float8) and
    of the settings that do nothing there (one warning each, config/inert.py)."""
    from muonrun.config.inert import warn_inert
    from muonrun.distributed import check_device

    check_device(cfg)
    for feature in features:
        feature.check("cpu")
    warn_inert(cfg, "cpu")


def plan_summary(cfg: Config, world_size: int | None) -> dict:
    from muonrun.features import enabled, flops_per_token
    from muonrun.launch.launcher import default_nproc
    from muonrun.model.build import check_model, count_params
    from muonrun.model.build import flops_per_token as model_flops_per_token
    from muonrun.model.expert_parallel import check_expert_parallel, plan_numbers
    from muonrun.model.tensor_parallel import (
        check_tensor_parallel,
        check_tp_fits_node,
        split_numel,
        traffic_bytes_per_step,
    )
    from muonrun.optim.groups import split_params
    from muonrun.optim.sharding import owner_flops
    from muonrun.tools.hub import hub_access
    from muonrun.train.ramp import tokens_after

    nnodes = cfg.launch.nnodes
    world = default_nproc(cfg) * nnodes if world_size is None else world_size
    if world < 1:
        raise UserError(f"--world-size is {world}; it must be at least 1.")
    if world % nnodes:
        raise UserError(f"--world-size {world} cannot be split evenly over --nnodes {nnodes}.")
    how = f"--world-size {world}" if world_size else f"{nnodes} node(s) x {world // nnodes} workers per node"
    replicate, shard = mesh_shape(cfg, world, how)
    tp = cfg.parallel.tp
    check_tp_fits_node(tp, world // nnodes)
    hub = hub_access(cfg)  # before anything asks the Hub: offline, it is asked nothing
    offline = hub is not None and hub != "reachable"
    vocab, tokenizer, data = tokenizer_and_data(cfg, check_data_here=world_size is None, offline=offline)
    features = enabled(cfg)
    if cfg.train.device == "cpu":  # a CPU plan: refused and warned about as the launch does
        check_cpu_plan(cfg, features)
    model = check_model(cfg.model, vocab, cfg.data.seq_len, features, cfg.train.router_z_loss_coef)
    check_tensor_parallel(cfg, model, features)
    check_expert_parallel(cfg, model, shard)
    hf = model.config
    params = count_params(model)
    split = split_params(
        model,
        muon_patterns=cfg.optimizer.muon.muon_patterns,
        adamw_patterns=cfg.optimizer.muon.adamw_patterns,
    )
    muon_params = sum(p.numel() for _, p in split.muon + split.experts)
    tokens_per_step = cfg.tokens_per_step(world)
    accum = cfg.train.grad_accum_steps
    iteration = muon_iteration(cfg) if cfg.optimizer.name == "muon" else None
    fpt = flops_per_token(features, model_flops_per_token(hf, cfg.data.seq_len), model)
    # bf16 compute unless asked for fp32 or planned for CPU (`auto` is bf16 on GPU, the usual target)
    param_bytes = 4 if cfg.parallel.param_dtype == "float32" or cfg.train.device == "cpu" else 2
    # the layers tensor parallelism splits are sharded over tp x dp_shard, the rest over dp_shard
    split_tp = split_numel(model) if tp > 1 else 0
    muon_tp = split_tp if cfg.optimizer.name == "muon" else 0
    rest = {k: v - split_tp for k, v in params.items() if k in ("total", "trainable")}
    states = memory_per_rank(rest, muon_params - muon_tp, cfg.optimizer.name, shard, param_bytes)
    if split_tp:
        tp_part = {"total": split_tp, "trainable": split_tp}
        tp_states = memory_per_rank(tp_part, muon_tp, cfg.optimizer.name, shard * tp, param_bytes)
        states = {k: v + tp_states[k] for k, v in states.items()}
    targets, here = memory_targets(cfg, world // nnodes)
    return {
        "hub": hub,
        "model": f"{hf.model_type} ({cfg.model.name_or_path or 'inline config'})",
        "tokenizer": tokenizer,
        "data": data,
        "parameters": params,
        "muon_parameters": muon_params if cfg.optimizer.name == "muon" else 0,
        "flops_per_token": fpt,
        "world_size": world,
        "nnodes": nnodes,
        "mesh": {"dp_replicate": replicate, "dp_shard": shard, "tp": tp},
        "tp_bytes_per_rank_step": traffic_bytes_per_step(hf, cfg, param_bytes) if tp > 1 else 0,
        "ep": plan_numbers(hf, cfg, param_bytes) if cfg.parallel.ep > 1 else None,
        "tokens_per_step": tokens_per_step,
        "total_tokens": tokens_after(
            cfg.train.max_steps, 0, accum, cfg.train.batch_ramp, tokens_per_step // accum
        ),
        "model_flops_per_rank_step": fpt * tokens_per_step / world,
        "ns_flops_per_rank_step": (
            # tensor-parallel matrices: one owner among all tp x dp_shard ranks holding a part
            owner_flops([p.shape for _, p in split.muon], shard * tp, iteration.flops) if iteration else 0
        ),
        "ns_iteration": iteration.describe() if iteration else "",
        "expert_ns_flops_per_rank_step": (
            expert_ns_flops(
                [(p.shape, split.expert_layouts[n]) for n, p in split.experts], iteration.flops, shard
            )
            if iteration and tp == 1  # tensor parallelism refuses experts
            else [0] * shard * tp
        ),
        "memory_gib_per_rank": states,
        "activation_gib_per_rank": activation_gib(hf, cfg, param_bytes),
        "param_bytes": param_bytes,
        "fits": fit_verdicts(hf, cfg, param_bytes, sum(states.values()), targets),
        "fits_here": here,
        "hsdp_states_gib_per_rank": (
            sum(
                memory_per_rank(
                    params, muon_params, cfg.optimizer.name, world // nnodes, param_bytes
                ).values()
            )
            if nnodes > 1
            else None
        ),
        "feature_rows": [row for f in features for row in f.plan_rows(model)],
    }


def ramp_rows(cfg: Config, tokens_per_step: int) -> list[tuple[str, str]]:
    """The dry run's line for train.batch_ramp: each batch size and the steps it lasts (none without one)."""
    from muonrun.train.ramp import levels

    t = cfg.train
    if not t.batch_ramp.tokens:
        return []
    per = tokens_per_step // t.grad_accum_steps
    parts = [
        f"{lv.accum} accum ({lv.accum * per:,} tokens) at steps {lv.first_step:,}-{lv.first_step + lv.steps - 1:,}"
        for lv in levels(t.grad_accum_steps, t.batch_ramp, per, t.max_steps)
    ]
    if len(parts) > 6:
        parts = [*parts[:3], "...", *parts[-2:]]
    rule = "lr x sqrt(batch / full batch) while it ramps"
    return [
        ("batch ramp", f"over the first {t.batch_ramp.tokens:,} tokens: " + ", ".join(parts) + f"; {rule}")
    ]


def command_line_row(cfg: Config, s: dict, world_size: int | None, overridden) -> list[tuple[str, str]]:
    """What the command line changed in the config file: each override and flag with the file's value,
    and the workers per node a --world-size implies in place of launch.nproc_per_node."""
    parts = [
        f"{key} {before} -> {after}" if before != after else f"{key} {after} (as in the file)"
        for key, before, after in overridden
    ]
    per_node = s["world_size"] // s["nnodes"]
    if world_size is not None and cfg.launch.nproc_per_node not in (None, per_node):
        parts.append(
            f"--world-size {world_size} over {s['nnodes']} node(s) is {per_node} workers per node, in place of "
            f"launch.nproc_per_node {cfg.launch.nproc_per_node}"
        )
    return [("command line", "; ".join(parts))] if parts else []


def device_row(cfg: Config, s: dict, world_size: int | None) -> tuple[str, str]:
    """What the plan computes on, and which memory it judges a micro-batch against."""
    compute = "fp32" if s["param_bytes"] == 4 else "bf16"
    if cfg.train.device == "cpu":
        value = f"CPU (train.device=cpu), {compute}"
        if world_size is not None:
            value += f": planned as {s['world_size']} CPU workers; train.device=cuda plans for GPUs"
        return "device", value
    if s["fits_here"]:
        return "device", f"GPU ({s['fits'][0][0]}), {compute}"
    value = (
        f"GPU (train.device={cfg.train.device}), {compute}; this machine has no GPU, so memory is judged "
        f"against {ASSUMED_GPUS[0][0]}, then {ASSUMED_GPUS[1][0]}"
    )
    if world_size is None and cfg.train.device == "auto":
        value += "; a launch on this machine would train on its CPU"
    return "device", value


def hsdp_row(cfg: Config, s: dict) -> list[tuple[str, str]]:
    """On several nodes with plain FSDP, the hint that HSDP keeps the sharding's traffic inside each node."""
    if s["nnodes"] < 2 or s["mesh"]["dp_replicate"] > 1:
        return []
    per_node = s["world_size"] // s["nnodes"]
    return [
        (
            "hint",
            f"plain FSDP over {s['nnodes']} nodes: every layer's all-gather and reduce-scatter crosses nodes. "
            f"HSDP (parallel.dp_replicate=-1) shards within each node's {per_node} workers and sends only the "
            f"gradient all-reduce across nodes, at {gib(s['hsdp_states_gib_per_rank'])} of weights, gradients "
            "and optimizer state per rank (docs/clusters.md)",
        )
    ]


def ep_row(cfg: Config, s: dict) -> list[tuple[str, str]]:
    """What expert parallelism sends and saves (none without it)."""
    if s["ep"] is None:
        return []
    ep, efsdp = cfg.parallel.ep, s["mesh"]["dp_shard"] // cfg.parallel.ep
    return [
        (
            "expert parallel",
            f"experts split over ep={ep} ranks, FSDP-sharded over the {efsdp} left of each shard group; each "
            f"rank gathers {gib(s['ep']['gathered_bytes'] / 2**30)} of expert weights per layer (its experts "
            f"alone) and sends {gib(s['ep']['all_to_all_bytes'] / 2**30)} of tokens per optimizer step in 4 "
            "all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and backward)",
        )
    ]


def tp_row(s: dict) -> list[tuple[str, str]]:
    """What tensor parallelism sends (none without it)."""
    if s["mesh"]["tp"] == 1:
        return []
    sent = s["tp_bytes_per_rank_step"]
    return [
        (
            "tensor parallel",
            f"attention and MLP projections split over tp={s['mesh']['tp']} ranks of a node (the model's "
            f"base_model_tp_plan), the sequence split between them; {gib(sent / 2**30)} sent per rank and "
            "optimizer step (an all-gather and a reduce-scatter per block, forward and backward, per layer and "
            "micro-batch); embedding, final norm and LM head run on every tp rank",
        )
    ]


def ns_row(s: dict) -> list[tuple[str, str]]:
    """Muon's Newton–Schulz FLOPs per rank beside the model's (none without Muon)."""
    if not s["ns_flops_per_rank_step"]:
        return []
    per_rank, model = s["ns_flops_per_rank_step"], s["model_flops_per_rank_step"]
    experts = s["expert_ns_flops_per_rank_step"]  # on the ranks that hold the experts, no choice of owner
    per_rank = [a + b for a, b in zip(per_rank, experts, strict=True)]
    ns, average = max(per_rank), sum(per_rank) / len(per_rank)
    return [
        (
            "Muon Newton–Schulz",
            f"{flop(ns)} per rank per optimizer step ({s['ns_iteration']}) = {share(ns / model)} of the model's "
            f"{flop(model)} per rank and step (the busiest rank, {share(ns / average)} of the average: owners "
            "balanced by cost): the arithmetic Muon adds; its momentum, exchange and update add more "
            "(docs/performance.md sets both beside measured step times); more tokens per step "
            "(train.grad_accum_steps) or more ranks shrink it",
        )
    ]


def print_rows(rows: list[tuple[str, str]], columns: int | None = None) -> None:
    """Each row as `key  value`, the value wrapped to the terminal's width under its own column (paths and
    other long words are never split)."""
    width = max(len(key) for key, _ in rows)
    columns = columns or shutil.get_terminal_size((100, 24)).columns
    indent = " " * (width + 4)
    for key, value in rows:
        lines = textwrap.wrap(
            value, max(40, columns - len(indent)), break_long_words=False, break_on_hyphens=False
        ) or [""]
        print(f"  {key:<{width}}  {lines[0]}")
        for line in lines[1:]:
            print(indent + line)


def print_plan(cfg: Config, world_size: int | None, overridden=()) -> None:
    """The plan, row by row. `overridden`: (key, value in the file, value run) for each setting the
    command line changed (`config.load.overridden_settings`)."""
    s = plan_summary(cfg, world_size)
    p = s["parameters"]
    memory = s["memory_gib_per_rank"]
    rows = [
        *command_line_row(cfg, s, world_size, overridden),
        *([("Hugging Face Hub", s["hub"])] if s["hub"] else []),
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
        device_row(cfg, s, world_size),
        (
            "world size",
            f"{s['world_size']} (mesh dp_replicate={s['mesh']['dp_replicate']} x dp_shard={s['mesh']['dp_shard']}"
            + (f" x tp={s['mesh']['tp']}" if s["mesh"]["tp"] > 1 else "")
            + ")"
            + (f", {s['nnodes']} nodes x {s['world_size'] // s['nnodes']}" if s["nnodes"] > 1 else ""),
        ),
        *hsdp_row(cfg, s),
        *tp_row(s),
        *ep_row(cfg, s),
        ("tokens/step", f"{s['tokens_per_step']:,}"),
        *ramp_rows(cfg, s["tokens_per_step"]),
        ("total tokens", f"{s['total_tokens']:,} over {cfg.train.max_steps:,} steps"),
        (
            "memory/rank (no activations)",
            ", ".join(f"{k} {gib(v)}" for k, v in memory.items()) + f" = {gib(sum(memory.values()))}",
        ),
        (
            "activations/rank (rough)",
            f"~{gib(s['activation_gib_per_rank'])} per micro-batch of {cfg.train.micro_batch_size} x "
            f"{cfg.data.seq_len} (activation checkpointing {cfg.parallel.activation_checkpointing}"
            + ("; an upper bound: compiled layers keep less)" if cfg.parallel.compile else ")"),
        ),
        ("micro-batch fits?", fit_row(s, cfg)),
        *s["feature_rows"],
        *ns_row(s),
        ("output", cfg.output_dir),
    ]
    print("muonrun plan (dry run: nothing was trained)")
    print_rows(rows)
    warning = memory_warning(s, cfg)
    if warning:
        log.warning(warning)
