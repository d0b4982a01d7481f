"""Typed configuration: schema defaults < preset YAML (with `defaults:` bases) < CLI overrides.

Every field has a docstring underneath it; those strings are the reference documentation
(`muonrun config docs` prints them). Try it:  muonrun config show tiny train.max_steps=10
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from muonrun.errors import UserError

PRESET_DIR = Path(__file__).parent / "configs"
DEFAULT_PRESET = "tiny"


def _package_dir(name: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package '{name}' is not installed")
    return list(spec.submodule_search_locations)[0]


# Text corpora that exist on any machine with muonrun installed, for offline presets:
# `${stdlib:}` is the Python standard library's source folder, `${pkg:NAME}` an installed package's.
for _name, _fn in (("stdlib", lambda: sysconfig.get_paths()["stdlib"]), ("pkg", _package_dir)):
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_resolver(_name, _fn, annotation_validation="off")


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hugging Face model id or local folder whose config.json defines the architecture. When None,
    the architecture is `model.architecture` with the keyword arguments in `model.hf`."""
    architecture: str = "qwen2"
    """transformers `model_type` (qwen2, llama, mistral, ...) used when `name_or_path` is None."""
    hf: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the transformers config (hidden_size, num_hidden_layers, ...).
    Open: add keys with `+model.hf.KEY=VALUE`. Applied on top of `name_or_path`'s config too."""
    init: str = "random"
    """`random` (fresh weights, seeded by train.seed) or `pretrained` (load `name_or_path`'s weights)."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, flash_attention_2 (if installed)."""


@dataclass
class SourceConfig:
    path: str = "???"
    """Hub dataset id (e.g. allenai/c4) or local file, folder or glob (`**` recurses). Files are read by
    extension: .jsonl/.json/.parquet/.arrow/.csv (optionally .gz/.bz2/.xz/.zst) as tables, every other
    file (.txt, .py, .md, ...) as ONE document per file, UTF-8. Folders skip hidden files and binaries."""
    name: str | None = None
    """Hub dataset configuration name (e.g. `en` for allenai/c4)."""
    split: str = "train"
    """Dataset split to read; slices work too (`train[:95%]`, `train[-1000:]`). Local files form `train`."""
    text_field: str = "text"
    """Column holding the document text (tables and Hub datasets; plain text files have no columns)."""
    weight: float = 1.0
    """Mixture weight (> 0): the source's share of training windows is weight / sum of weights. Within an
    epoch a source is repeated or subsampled to its share (a different subset each epoch)."""
    streaming: bool = False
    """Stream the dataset instead of downloading and caching it whole (for very large Hub datasets). When
    any source of a list streams, the whole list streams; resume then needs the same data-parallel size."""


@dataclass
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    """Training text sources (at least one)."""
    eval_sources: list[SourceConfig] = field(default_factory=list)
    """Held-out sources evaluated every `train.eval_interval` steps (optional): the same fixed
    `train.eval_steps` batches per rank each time."""
    tokenizer: str = "byte"
    """`byte` (built-in byte-level tokenizer, no download) or a Hub id / local folder for AutoTokenizer."""
    seq_len: int = 2048
    """Tokens per training sequence; documents (each followed by EOS) are packed into windows of this length."""
    num_proc: int = 1
    """Processes for tokenizing map-style datasets."""
    cache_dir: str | None = None
    """Folder for tokenized caches (`muonrun prepare`). None: $MUONRUN_CACHE, else `~/.cache/muonrun`."""
    shuffle: bool = True
    """Shuffle the packed windows (seeded by train.seed)."""
    shuffle_buffer: int = 10000
    """Streaming only: documents read, shuffled and tokenized together per rank (a block; training
    prepares the next one on a background thread). Resume re-reads the current block, so larger
    blocks shuffle better but resume slower."""


@dataclass
class MuonConfig:
    lr: float = 0.02
    """Learning rate of the Muon (hidden matrix) parameters; the other parameters use optimizer.lr."""
    weight_decay: float | None = None
    """Decoupled weight decay for the Muon parameters. None: optimizer.weight_decay."""
    momentum: float = 0.95
    """Momentum coefficient."""
    nesterov: bool = True
    """Orthogonalize the Nesterov look-ahead instead of the momentum buffer."""
    ns_steps: int = 5
    """Newton–Schulz iterations."""
    ns_coefficients: str = "default"
    """`default` (3.4445, -4.7750, 2.0315) every iteration, or `polar_express` (per-iteration coefficients)."""
    gram_ns: bool = False
    """Newton–Schulz on the Gram matrix (X X^T) for matrices at least 1.5x wider than tall, with one
    restart: the same iteration in exact arithmetic, 41% fewer FLOPs on Qwen2's MLP matrices (39% at
    7B), as close to the exact polar factor in bf16 as the standard form (CPU numerics:
    docs/benchmarks.md, "Cheaper Newton–Schulz"). On 2 x H200 (runs 18-19): Muon +2.5% tokens/s at
    Qwen2-1.5B, +0.7% at 0.5B, +8% at the 7B architecture, the same loss curve within 0.3% over 200 steps. On in the Muon preset;
    off by default so that `muon` alone is torch.optim.Muon's iteration."""
    adjust_lr_fn: str = "original"
    """LR scaling per matrix shape A x B: `original` lr*sqrt(max(1, A/B)); `match_rms_adamw`
    lr*0.2*sqrt(max(A, B)) (reuse AdamW's lr); `spectral` lr*sqrt(A/B)."""
    eps: float = 1e-7
    """Added to the Frobenius norm before Newton–Schulz."""
    muon_patterns: list[str] = field(default_factory=list)
    """Parameter-name globs forced into Muon (must be 2-D)."""
    adamw_patterns: list[str] = field(default_factory=list)
    """Parameter-name globs forced into AdamW."""


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """`adamw` or `muon` (Muon for hidden matrices, AdamW for embeddings, LM head, norms and biases)."""
    lr: float = 3e-4
    """Peak learning rate of AdamW (with `muon`: of the embeddings, LM head, norms and biases)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW (norms and biases are never decayed)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool | None = None
    """Fused AdamW kernel. None: on for GPUs, off on CPU."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon settings (used when name is `muon`)."""


@dataclass
class ScheduleConfig:
    name: str = "cosine"
    """`cosine`, `linear`, `constant` or `wsd` (warmup-stable-decay)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear, wsd)."""
    decay_fraction: float = 0.2
    """`wsd` only: fraction of train.max_steps spent in the final linear decay."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Replicas across the HSDP replicate axis (typically the number of nodes). 1: plain FSDP.
    -1: one replica per node (= launch.nnodes), each sharded over its node's workers."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over: consecutive ranks, so the workers per node shards within a
    node and replicates across nodes. -1: world_size / dp_replicate."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (less memory, one more all-gather in backward)."""
    param_dtype: str = "auto"
    """Compute dtype of parameters in forward/backward: `auto` (bfloat16 on GPU, float32 on CPU),
    `bfloat16` or `float32`. The master copy and optimizer state stay in float32."""
    reduce_dtype: str = "float32"
    """Dtype of gradient reduce-scatter."""
    activation_checkpointing: str = "none"
    """`none`, `full` (recompute every decoder layer) or `selective` (every other layer)."""
    compile: bool = False
    """torch.compile each decoder layer."""
    compile_loss: bool = False
    """torch.compile each loss chunk's softmax gradient into one pass over the bf16 logits (GPU; the
    eager path makes about six fp32 passes over every [chunk x vocab] block)."""


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps to train."""
    micro_batch_size: int = 1
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 42
    """Seed for weights, data order and dropout."""
    device: str = "auto"
    """`auto` (cuda when available, else cpu), `cuda` or `cpu`."""
    eval_interval: int = 0
    """Evaluate on data.eval_sources every N steps (0: never)."""
    eval_steps: int = 10
    """Batches per evaluation."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the fused LM head + cross-entropy (gradients computed chunk by chunk in
    forward), so the full fp32 logits never exist. 0: one chunk (fine for small vocabularies)."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Save every N steps (0: only at the end). Checkpoints go to OUTPUT_DIR/checkpoints/step-N."""
    keep_last: int = 2
    """Complete checkpoints to keep (>= 2); older ones are deleted after a new one is complete."""
    resume_from: str | None = None
    """Resume (weights, optimizer, data position, step) from this checkpoint folder instead of the latest
    complete one in output_dir; a run folder means its latest complete checkpoint."""
    init_from: str | None = None
    """Start from this checkpoint's weights only (ignored, with a warning, when output_dir has checkpoints)."""
    save_at_end: bool = True
    """Save a checkpoint after the last step."""
    async_save: bool = False
    """Write checkpoints in a background thread (dcp.async_save, over a separate gloo group) while training
    continues; costs one CPU copy of this rank's state. The final and the preemption checkpoints stay synchronous."""
    export_at_end: bool = False
    """After the final checkpoint, also write a Hugging Face folder to OUTPUT_DIR/hf (as `muonrun export`)."""


@dataclass
class LoggingConfig:
    log_interval: int = 1
    """Log metrics every N steps (metrics are reduced across ranks only on these steps)."""
    console: str = "auto"
    """`auto` (rich live view on a terminal, plain lines otherwise), `rich` or `plain`."""
    tensorboard: bool = False
    """Also write TensorBoard event files to OUTPUT_DIR/tensorboard (needs the tensorboard extra)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device for MFU. None: look the GPU up in the built-in table (bf16, or
    fp32/tf32 by parallel.param_dtype); MFU is left out, with one warning, for a GPU not in it (and on CPU)."""
    all_ranks: bool = False
    """Print output from every rank, not only rank 0."""
    wandb_project: str | None = None
    """Weights & Biases project to log the same rows to (needs `pip install wandb`; warns if missing).
    The run is named after `name` and resumes with the run folder (its id is kept in OUTPUT_DIR/wandb_id)."""
    wandb_entity: str | None = None
    """Weights & Biases entity (user or team). None: your default entity."""
    time_optimizer: bool = False
    """Log `optimizer_step_time`: the optimizer step timed with CUDA events around it (no host sync;
    on CPU, wall time)."""
    profile: bool = False
    """Profile steps 6-8 on rank 0 with torch.profiler; writes OUTPUT_DIR/profile/ops.txt,
    trace.json.gz and timeline.txt (GPU busy/idle/communication per step and per phase)."""


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = None
    """Workers per node. None: every local GPU, or 1 on a machine without GPUs."""
    nnodes: int = 1
    """Nodes in the job. Under srun: SLURM's node count (docs/clusters.md)."""
    node_rank: int = 0
    """This node's rank (0 .. nnodes-1); node 0 hosts the rendezvous. Under srun: SLURM_NODEID. Global
    worker ranks are assigned by the rendezvous (consecutive per node), not by node_rank."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous on node 0 for multi-node jobs (every node passes the same). None on one
    node: a free local port. Under srun: the job step's first node and MUONRUN_RDZV_PORT (default 29500)."""
    rdzv_id: str = "muonrun"
    """Job id shared by every node of one job. Under srun: SLURM_JOB_ID."""
    local_addr: str | None = None
    """Address other nodes use to reach this one (node 0's becomes the workers' MASTER_ADDR). None: this
    machine's fully qualified host name; set it when that resolves to a loopback or wrong interface."""
    max_restarts: int = 0
    """Restart the workers this many times after a failure (they resume from the latest checkpoint). On
    several nodes every node restarts its workers together; a node's launcher must stay alive."""
    backend: str = "auto"
    """Process-group backend: `auto` (nccl on GPU, gloo on CPU), `nccl` or `gloo`."""


@dataclass
class Config:
    name: str = "run"
    """Run name, used in output_dir and in comparison plots."""
    output_dir: str = "runs/${name}"
    """Folder for config.yaml, metrics.jsonl, logs and checkpoints."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)


# Closed vocabularies checked by validate(); the optimizer names come from the registry itself.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.init": ("random", "pretrained"),
    "optimizer.muon.ns_coefficients": ("default", "polar_express"),
    "optimizer.muon.adjust_lr_fn": ("original", "match_rms_adamw", "spectral"),
    "schedule.name": ("cosine", "linear", "constant", "wsd"),
    "parallel.param_dtype": ("auto", "bfloat16", "float32"),
    "parallel.reduce_dtype": ("bfloat16", "float32"),
    "parallel.activation_checkpointing": ("none", "full", "selective"),
    "train.device": ("auto", "cuda", "cpu"),
    "logging.console": ("auto", "rich", "plain"),
    "launch.backend": ("auto", "nccl", "gloo"),
}


def resolve_preset(path_or_name: str | os.PathLike) -> Path:
    """A preset is a YAML path, or the name of a file in the built-in presets (`tiny`, `qwen2-muon-fsdp2`)."""
    path = Path(path_or_name)
    if path.is_file():
        return path
    builtin = PRESET_DIR / f"{path.name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") and builtin.is_file():
        return builtin
    known = ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml") if not p.stem.startswith("_")))
    raise UserError(f"Config file '{path}' does not exist. Pass a YAML path or a built-in preset: {known}.")


def _load_yaml(path: Path, seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load one YAML file, merging the files its `defaults:` list names (relative paths) underneath it."""
    path = path.resolve()
    if path in seen:
        raise UserError(f"Config file '{path}' includes itself through `defaults:`.")
    try:
        node = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends: report the file, not the parser internals
        raise UserError(f"Config file '{path}' is not valid YAML: {e}") from None
    if not isinstance(node, DictConfig):
        raise UserError(f"Config file '{path}' must hold a mapping of keys, not a {type(node).__name__}.")
    bases = node.pop("defaults", [])
    if isinstance(bases, str):
        bases = [bases]
    layers = []
    for base in bases:
        base_path = path.parent / (base if str(base).endswith(".yaml") else f"{base}.yaml")
        if not base_path.is_file():
            raise UserError(
                f"Config file '{path}' lists '{base}' under `defaults:`, but '{base_path}' does not exist."
            )
        layers.append(_load_yaml(base_path, (*seen, path)))
    return OmegaConf.merge(*layers, node) if layers else node


def _parse_overrides(overrides: list[str]) -> list[tuple[str, str, bool]]:
    parsed = []
    for item in overrides:
        key, sep, value = item.partition("=")
        add = key.startswith("+")
        key = key.removeprefix("+").strip()
        if not sep or not key or any(c.isspace() for c in key):
            raise UserError(
                f"Override '{item}' is malformed: write KEY=VALUE with a dotted key, e.g. train.max_steps=100 "
                "(or +model.hf.KEY=VALUE to add a key to an open section)."
            )
        parsed.append((key, value, add))
    return parsed


# Keys that existed once: a saved config.yaml holding one still loads (the key is dropped), and an
# override or preset setting one is told why it went.
RETIRED_KEYS = {
    "train.sync_each_step": "It was removed: its measured speed-up was a step-time artifact (docs/benchmarks.md, run 18)",
}


def _did_you_mean(cfg: DictConfig, full_key: str) -> str:
    if full_key in RETIRED_KEYS:
        return f" {RETIRED_KEYS[full_key]}; delete the setting."
    parent_key, _, leaf = full_key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return ""
    close = difflib.get_close_matches(leaf, [str(k) for k in parent], n=3)
    prefix = f"{parent_key}." if parent_key else ""
    return f" Did you mean {' or '.join(repr(prefix + c) for c in close)}?" if close else ""


def _merge(base: DictConfig, layer: Any, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, layer)
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        raise UserError(f"Unknown config key '{key}' in {source}.{_did_you_mean(base, key)}") from None
    except ValidationError as e:
        raise UserError(
            f"Config key '{e.full_key}' in {source} has the wrong type: {e.msg.splitlines()[0]}."
        ) from None
    except OmegaConfBaseException as e:
        raise UserError(
            f"Config {source} could not be merged at '{getattr(e, 'full_key', '?')}': {e.msg}."
        ) from None


def load_config(
    preset: str | os.PathLike | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environment: dict[str, Any] | None = None,
) -> DictConfig:
    """Schema defaults < `environment` ({dotted key: value}, e.g. from SLURM) < preset (with its
    `defaults:` bases) < `key=value` overrides, validated. A `preset` that is itself a `key=value`
    (and no file) is the first override of the default preset: `muonrun pretrain train.max_steps=5`."""
    if preset is not None and "=" in str(preset) and not Path(preset).is_file():
        preset, overrides = None, [str(preset), *overrides]
    path = resolve_preset(preset or DEFAULT_PRESET)
    cfg = OmegaConf.structured(Config)
    for key, value in (environment or {}).items():
        OmegaConf.update(cfg, key, value)
    cfg = _merge(cfg, _load_yaml(path), f"'{path}'")
    for key, value, add in _parse_overrides(list(overrides)):
        if not add and OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
            hint = (
                _did_you_mean(cfg, key) or " Prefix it with '+' to add a key to an open section (model.hf)."
            )
            raise UserError(f"Unknown config key '{key}' in override '{key}={value}'.{hint}")
        cfg = _merge(cfg, OmegaConf.from_dotlist([f"{key}={value}"]), f"override '{key}={value}'")
    validate(cfg)
    return cfg


def to_object(cfg: DictConfig) -> Config:
    """Resolve interpolations and turn the OmegaConf tree into the typed dataclasses."""
    return OmegaConf.to_object(cfg)


def from_yaml(text: str) -> DictConfig:
    """Rebuild a validated config from `to_yaml` output: how the launcher hands the config to workers, and
    how a run's saved config.yaml is read back (`muonrun export`)."""
    saved = OmegaConf.create(text)
    for key in RETIRED_KEYS:  # config.yaml of a run saved before the key was retired
        parent_key, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(saved, parent_key)
        if isinstance(parent, DictConfig) and leaf in parent:
            del parent[leaf]
    return _merge(OmegaConf.structured(Config), saved, "from the launcher")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def validate(cfg: DictConfig) -> None:
    """Checks that need more than a type: choices, ranges and combinations. Raises UserError."""
    try:
        c = to_object(cfg)
    except OmegaConfBaseException as e:
        raise UserError(f"Config key '{getattr(e, 'full_key', '?')}' cannot be resolved: {e.msg}.") from None
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"Config key '{key}' is '{value}'; choose one of: {', '.join(allowed)}.")
    from muonrun.optim import OPTIMIZERS  # the registry is the single list of optimizer names

    if c.optimizer.name not in OPTIMIZERS:
        raise UserError(
            f"Config key 'optimizer.name' is '{c.optimizer.name}'; choose one of: {', '.join(OPTIMIZERS)}."
        )
    positive = {
        "train.max_steps": c.train.max_steps,
        "train.micro_batch_size": c.train.micro_batch_size,
        "train.grad_accum_steps": c.train.grad_accum_steps,
        "data.seq_len": c.data.seq_len,
        "logging.log_interval": c.logging.log_interval,
        "launch.nnodes": c.launch.nnodes,
        "data.num_proc": c.data.num_proc,
    }
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"Config key '{key}' is {value}; it must be at least 1.")
    nonneg = {
        "optimizer.lr": c.optimizer.lr,
        "optimizer.muon.lr": c.optimizer.muon.lr,
        "optimizer.weight_decay": c.optimizer.weight_decay,
        "train.grad_clip": c.train.grad_clip,
        "schedule.warmup_steps": c.schedule.warmup_steps,
        "checkpoint.interval": c.checkpoint.interval,
        "train.eval_interval": c.train.eval_interval,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise UserError(f"Config key '{key}' is {value}; it must not be negative.")
    for key, value in (
        ("parallel.dp_replicate", c.parallel.dp_replicate),
        ("parallel.dp_shard", c.parallel.dp_shard),
    ):
        if value != -1 and value < 1:
            raise UserError(
                f"Config key '{key}' is {value}; it must be at least 1, or -1 (see `muonrun config docs`)."
            )
    if c.launch.nproc_per_node is not None and c.launch.nproc_per_node < 1:
        raise UserError(
            f"Config key 'launch.nproc_per_node' is {c.launch.nproc_per_node}; it must be at least 1."
        )
    if not 0 <= c.launch.node_rank < c.launch.nnodes:
        raise UserError(
            f"Config key 'launch.node_rank' is {c.launch.node_rank}; it must be in 0..{c.launch.nnodes - 1} "
            f"(launch.nnodes is {c.launch.nnodes})."
        )
    if c.checkpoint.keep_last < 2:
        raise UserError(f"Config key 'checkpoint.keep_last' is {c.checkpoint.keep_last}; keep at least 2.")
    if c.checkpoint.export_at_end and not c.checkpoint.save_at_end:
        raise UserError(
            "Config key 'checkpoint.export_at_end' needs checkpoint.save_at_end=true (it exports that one)."
        )
    if not 0.0 <= c.schedule.min_lr_ratio <= 1.0:
        raise UserError(
            f"Config key 'schedule.min_lr_ratio' is {c.schedule.min_lr_ratio}; it must be in [0, 1]."
        )
    if len(c.optimizer.betas) != 2 or not all(0.0 <= b < 1.0 for b in c.optimizer.betas):
        raise UserError(f"Config key 'optimizer.betas' is {c.optimizer.betas}; give two numbers in [0, 1).")
    if not c.data.sources:
        raise UserError("Config key 'data.sources' is empty; list at least one source with a `path`.")
    if c.train.eval_interval and not c.data.eval_sources:
        raise UserError(
            f"Config key 'train.eval_interval' is {c.train.eval_interval} but 'data.eval_sources' is empty; "
            "add an eval source or set train.eval_interval=0."
        )
    if c.model.init == "pretrained" and not c.model.name_or_path:
        raise UserError("Config key 'model.init' is 'pretrained' but 'model.name_or_path' is not set.")


def field_docs(cls: type = Config, prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """{dotted key: (type, default, docstring)} read from the dataclass source: the reference docs."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    out: dict[str, tuple[str, str, str]] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
            sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            if dataclasses.is_dataclass(sub):
                out.update(field_docs(type(sub), f"{key}."))
                continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if (
            isinstance(default, list | dict | ListConfig | DictConfig)
            and default
            and dataclasses.is_dataclass(default[0] if isinstance(default, list) else None)
        ):
            default = "[...]"
        out[key] = (str(f.type), repr(default), docs.get(f.name, ""))
    if cls is DataConfig:
        for k, v in field_docs(SourceConfig, f"{prefix}sources[].").items():
            out[k] = v
    return out
