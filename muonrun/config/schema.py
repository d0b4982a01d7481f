"""The typed configuration: one dataclass per section, a docstring under every field.

Those docstrings are the reference documentation (`muonrun config docs` prints them as a table). A
field with a closed set of values is a `Literal` (OmegaConf refuses other values; `load.choices` lists them); range
checks that need only their own section live in that section's `__post_init__`, which runs whenever
OmegaConf turns a config into these objects (`load._typed`). Checks across sections, and the one
that every float anywhere is finite (`nan` and `inf` pass a range check), are in `load.validate`.
The optimizer sections (`optimizer`, `optimizer.muon`) are in `config.optimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from muonrun.config.checks import at_least, not_negative
from muonrun.config.evaluation import EvalConfig
from muonrun.config.optimizer import OptimizerConfig
from muonrun.config.ramp import BatchRampConfig
from muonrun.errors import UserError


@dataclass
class LoraSettings:
    enabled: bool = False
    """Train LoRA adapters (peft; `pip install 'muonrun[lora]'`) on the frozen pretrained model of
    `model.name_or_path` instead of all its weights (needs `model.init=pretrained`). The frozen weights
    stay in the compute dtype (no fp32 copy, gradients or optimizer state); checkpoints hold only what
    trains. With optimizer.name=muon the adapters' A and B matrices are Muon's, everything else that
    trains is AdamW's."""
    rank: int = 16
    """Rank r of every adapter: A is r x in_features, B is out_features x r (B starts at zero)."""
    alpha: float = 32.0
    """LoRA scaling: an adapted layer computes W x + (alpha / rank) B A x."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout), in [0, 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Modules that get an adapter: a name matches every module whose name is it or ends with `.NAME`
    (`q_proj`), a glob is matched against the full module name (`model.layers.1*.mlp.*`). Each entry
    must match a linear layer; the default is the attention and MLP projections of Qwen2-, Llama- and
    Mistral-style models. Embeddings and the LM head cannot take an adapter: train them with
    `model.lora.train`."""
    train: list[str] = field(default_factory=list)
    """Globs on the base model's parameter names that train fully beside the adapters, in fp32 with
    optimizer state and saved in checkpoints: e.g. `model.embed_tokens.weight`, `lm_head.weight`,
    `*norm.weight`. Each must match a parameter. Empty: only the adapters train."""

    def __post_init__(self) -> None:
        at_least(1, **{"model.lora.rank": self.rank})
        if self.alpha <= 0:
            raise UserError(f"Config key 'model.lora.alpha' is {self.alpha}; it must be positive.")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"Config key 'model.lora.dropout' is {self.dropout}; it must be in [0, 1).")
        if self.enabled and not self.target_modules:
            raise UserError(
                "Config key 'model.lora.target_modules' is empty; name at least one module (q_proj)."
            )


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hugging Face model id or local folder whose config.json defines the architecture. When None,
    the architecture is `model.architecture` with the keyword arguments in `model.hf`."""
    architecture: str = "qwen2"
    """transformers `model_type` (qwen2, llama, mistral, ...) used when `name_or_path` is None."""
    hf: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the transformers config (hidden_size, num_hidden_layers, ...), applied on
    top of `name_or_path`'s config too. Add one with `+model.hf.KEY=VALUE`; a key the architecture's
    config class does not know is refused with a "did you mean" (a typo would otherwise be kept
    silently); `model.hf_extra_keys` admits custom keys deliberately."""
    hf_extra_keys: list[str] = field(default_factory=list)
    """Keys of `model.hf` to pass to the transformers config even though its class does not define
    them (custom attributes a remote or patched model reads)."""
    init: Literal["random", "pretrained"] = "random"
    """`random` (fresh weights, seeded by train.seed) or `pretrained` (load `name_or_path`'s weights)."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, flash_attention_2 (if installed)."""
    trust_remote_code: bool = False
    """Let transformers run Python code shipped with `name_or_path`'s model. Off: only architectures
    built into transformers load (tokenizers never run remote code); turn it on only for a repository
    you trust."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters on a pretrained model (off by default): `model.lora.*`."""


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
    """Training text sources (at least one). From the command line: `data.sources.0.path=x.jsonl` sets
    a field of the first source; `data.sources=[{path: a.jsonl},{path: b.txt}]` replaces the list."""
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
    skip_bad_records: bool = False
    """Records whose text field is missing, null or not a string stop the run, naming the file and the
    first such record (its line in JSON-lines files). True: skip them; rank 0 prints how many
    (streaming: per pass over rank 0's share). JSON whose text changes type after the first 10 MB is
    misread by datasets and stops the run either way."""

    strict_resume: bool = False
    """What a resume does when the data changed since its checkpoint (a source file edited, added or
    removed, another tokenizer or mixture weight; see docs/checkpoints.md, "Data identity"): False warns
    once, naming the source and file, and trains on the data as it is now; True refuses to resume (exit 2).
    A changed data.seq_len, micro-batch size or number of ranks is reported either way, never refused."""

    def __post_init__(self) -> None:
        at_least(1, **{"data.seq_len": self.seq_len, "data.num_proc": self.num_proc})
        # Here, not with the files: a cached source skips those checks.
        for field_name in ("sources", "eval_sources"):
            for i, source in enumerate(getattr(self, field_name)):
                if not source.weight > 0:
                    raise UserError(
                        f"Config key 'data.{field_name}.{i}.weight' is {source.weight}; mixture weights must be "
                        "positive (a source's share of the windows is its weight over their sum)."
                    )


@dataclass
class ScheduleConfig:
    name: Literal["cosine", "linear", "constant", "wsd"] = "cosine"
    """`cosine`, `linear`, `constant` or `wsd` (warmup-stable-decay)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine, linear, wsd)."""
    decay_fraction: float = 0.2
    """`wsd` only: fraction of train.max_steps spent in the final linear decay."""

    def __post_init__(self) -> None:
        not_negative(**{"schedule.warmup_steps": self.warmup_steps})
        if not 0.0 < self.decay_fraction <= 1.0:
            raise UserError(
                f"Config key 'schedule.decay_fraction' is {self.decay_fraction}; it must be in (0, 1]."
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(
                f"Config key 'schedule.min_lr_ratio' is {self.min_lr_ratio}; it must be in [0, 1]."
            )


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Replicas across the HSDP replicate axis (typically the number of nodes). 1: plain FSDP.
    -1: one replica per node (= launch.nnodes), each sharded over its node's workers."""
    dp_shard: int = -1
    """Ranks each parameter is sharded over: consecutive ranks, so the workers per node shards within a
    node and replicates across nodes. -1: world_size / (dp_replicate x tp)."""
    tp: int = 1
    """Tensor-parallel ranks (the innermost mesh axis, so within a node): each decoder layer's attention
    and MLP projections are split over them (the model's own `base_model_tp_plan` from transformers:
    column-wise in, row-wise out), FSDP2 shards over the data-parallel axes, and the tp ranks of one
    data-parallel rank read the same batch. It must divide the attention heads, the key-value heads
    and launch.nproc_per_node. Pays for models whose layers outgrow FSDP alone (docs/clusters.md)."""
    ep: int = 1
    """Expert-parallel ranks for a mixture of experts: each MoE layer's routed experts are split whole over
    ep consecutive ranks of a shard group, and every token travels to the ranks holding its experts and
    back (two all-to-alls per layer); the experts are FSDP-sharded over the dp_shard / ep ranks left, the
    rest of the model over all of them. It must divide parallel.dp_shard and the experts per layer.
    Pays where gathering every expert of a layer costs more than sending the tokens (docs/moe.md)."""
    reshard_after_forward: bool = True
    """Free the gathered parameters after forward (less memory, one more all-gather in backward)."""
    param_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype of parameters in forward/backward: `auto` (bfloat16 on GPU, float32 on CPU),
    `bfloat16` or `float32`. The master copy and optimizer state stay in float32."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of gradient reduce-scatter."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """`none`, `full` (recompute every decoder layer) or `selective` (every other layer)."""
    compile: bool = False
    """torch.compile each decoder layer."""
    compile_loss: bool = False
    """torch.compile each loss chunk's softmax gradient into one pass over the bf16 logits (GPU; the
    eager path makes about six fp32 passes over every [chunk x vocab] block)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Run the decoder's large matmuls in float8 (torchao; `pip install 'muonrun[float8]'`, a GPU of
    compute capability 8.9+): `tensorwise` or `rowwise` scaling. Weights, optimizer state and Muon's
    Newton–Schulz are unchanged. Which Linear layers it serves follows torchao's size rule (small ones
    lose more to the casts than they gain; the LM head never): `--dry-run` lists them. The gain grows
    with the matmuls: a larger `train.micro_batch_size` gains more (docs/performance.md). See
    muonrun/features/float8.py."""

    def __post_init__(self) -> None:
        for key, value in (
            ("parallel.dp_replicate", self.dp_replicate),
            ("parallel.dp_shard", self.dp_shard),
        ):
            if value != -1 and value < 1:
                raise UserError(
                    f"Config key '{key}' is {value}; it must be at least 1, or -1 (see `muonrun config docs`)."
                )
        if self.ep < 1:
            raise UserError(
                f"Config key 'parallel.ep' is {self.ep}; it must be at least 1 (1: no expert parallelism)."
            )
        if self.tp < 1:
            raise UserError(
                f"Config key 'parallel.tp' is {self.tp}; it must be at least 1 (1: no tensor parallelism)."
            )


@dataclass
class QKClipConfig:
    tau: float | None = None
    """QK-clip (MuonClip, Kimi K2: arXiv:2507.20534). After every optimizer step, each attention head
    whose largest pre-softmax logit in that step exceeded tau gets its query and key projection rows
    (and biases) rescaled so that logit becomes tau; with grouped-query attention the shared key head
    takes the square root of its group's strongest clip and each query head the rest, so each head's
    logits scale by exactly its own factor. None: off (K2 uses 100). Works with either optimizer; needs
    SDPA attention, full causal, without QK-norm. The logits are measured exactly in every training
    forward (one extra Q K^T pass without backward: a sixth of the attention FLOPs, muonrun/features/qkclip.py);
    logs `max_attention_logit` per layer and `qk_clipped_heads`."""

    def __post_init__(self) -> None:
        if self.tau is not None and self.tau <= 0:
            raise UserError(
                f"Config key 'train.qk_clip.tau' is {self.tau}; it must be positive (or null: off)."
            )


@dataclass
class TrainConfig:
    max_steps: int = 1000
    """Optimizer steps to train."""
    micro_batch_size: int = 1
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (once train.batch_ramp has reached it)."""
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    """A batch-size ramp over the first tokens (off by default): `train.batch_ramp.*`."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 42
    """Seed for weights, data order and dropout: 0 to 2**32 - 1 (numpy's seeds are unsigned; the
    per-weight seeds derived from it must fit torch's 64 bits)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """`auto` (cuda when available, else cpu), `cuda` or `cpu`."""
    eval_interval: int = 0
    """Evaluate every N steps and at the last (0: never): the loss on data.eval_sources and the
    multiple-choice tasks of eval.tasks."""
    eval_steps: int = 10
    """Batches per evaluation."""
    loss_chunk_tokens: int = 4096
    """Tokens per chunk of the fused LM head + cross-entropy (gradients computed chunk by chunk in
    forward), so the full fp32 logits never exist. 0: one chunk (fine for small vocabularies)."""
    router_aux_loss_coef: float | None = None
    """Mixture-of-experts models: weight of the router's load-balancing loss added to the LM loss
    (logged apart as `aux_loss`; the logged `loss` is the LM loss). null: the model config's own
    `router_aux_loss_coef` (0.001 for Qwen2-MoE); 0: no balancing. Dense models ignore it. The loss is
    the Switch Transformer's per MoE layer, averaged over layers (k, the experts per token, when
    balanced); it weighs each expert's share of the tokens by its mean router probability, so it sees
    crowding late, once the router is confident (docs/moe.md, "Balancing the experts")."""
    router_z_loss_coef: float = 0.0
    """Mixture-of-experts models: weight of the router z-loss (ST-MoE, arXiv:2202.08906: the mean squared
    logsumexp of each token's router logits, averaged over MoE layers; ST-MoE uses 0.001), added to the
    LM loss and logged as `z_loss`. It keeps router logits small, which keeps training stable; it does not
    balance the experts. 0: off; a dense model refuses anything else."""
    router_bias_update_rate: float = 0.0
    """Mixture-of-experts models: auxiliary-loss-free balancing (DeepSeek-V3, arXiv:2408.15437 §2.1.2).
    Each router gets a per-expert bias b, added to the router's probabilities for choosing the top-k
    experts only; the gate weights that scale the chosen experts' outputs stay the router's own
    probabilities. After every optimizer step, b_e moves by rate * sign(mean load - load_e), the loads
    being the step's top-k assignment counts summed over all ranks and micro-batches, so b is the same on
    every rank. The bias is model state: checkpointed, resumed and resharded with the weights; the
    Hugging Face export leaves it out (transformers' routers have none) and writes it beside the weights
    as `router_expert_bias.safetensors`, so the exported model routes by the router alone (docs/moe.md).
    DeepSeek-V3 uses 0.001 on sigmoid scores; softmax probabilities over few experts need more (`tiny-moe`
    uses 0.01). 0: off. Needs a router module with a `weight` [E, H] that returns (logits, gate
    weights, expert indices) from a softmax top-k, as transformers' Qwen2-MoE, Qwen3-MoE, Mixtral and
    OLMoE routers do."""
    qk_clip: QKClipConfig = field(default_factory=QKClipConfig)
    """QK-clip (off by default): `train.qk_clip.tau`."""

    def __post_init__(self) -> None:
        at_least(
            1,
            **{
                "train.max_steps": self.max_steps,
                "train.micro_batch_size": self.micro_batch_size,
                "train.grad_accum_steps": self.grad_accum_steps,
                "train.eval_steps": self.eval_steps,
            },
        )
        not_negative(
            **{
                "train.grad_clip": self.grad_clip,
                "train.eval_interval": self.eval_interval,
                "train.loss_chunk_tokens": self.loss_chunk_tokens,
            }
        )
        if not 0 <= self.seed < 2**32:
            raise UserError(f"Config key 'train.seed' is {self.seed}; it must be in 0 .. 2**32 - 1.")
        if self.router_aux_loss_coef is not None:
            not_negative(**{"train.router_aux_loss_coef": self.router_aux_loss_coef})
        not_negative(
            **{
                "train.router_z_loss_coef": self.router_z_loss_coef,
                "train.router_bias_update_rate": self.router_bias_update_rate,
            }
        )
        if self.batch_ramp.tokens and self.batch_ramp.start_grad_accum_steps >= self.grad_accum_steps:
            raise UserError(
                f"Config key 'train.batch_ramp.start_grad_accum_steps' is {self.batch_ramp.start_grad_accum_steps} "
                f"but train.grad_accum_steps is {self.grad_accum_steps}: the ramp grows the batch to the latter "
                "from fewer accumulation steps. Lower the start, raise train.grad_accum_steps, or set "
                "train.batch_ramp.tokens=0."
            )


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
    """After the final checkpoint, also write a Hugging Face folder to OUTPUT_DIR/hf (as `muonrun export`),
    replacing the run's earlier export there once the new one is complete."""

    def __post_init__(self) -> None:
        not_negative(**{"checkpoint.interval": self.interval})
        if self.keep_last < 2:
            raise UserError(f"Config key 'checkpoint.keep_last' is {self.keep_last}; keep at least 2.")
        if self.export_at_end and not self.save_at_end:
            raise UserError(
                "Config key 'checkpoint.export_at_end' needs checkpoint.save_at_end=true (it exports that one)."
            )


@dataclass
class LoggingConfig:
    log_interval: int = 1
    """Log metrics every N steps (metrics are reduced across ranks only on these steps)."""
    console: Literal["auto", "rich", "plain"] = "auto"
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
    max_attention_logit: bool = False
    """Log `max_attention_logit` (and `max_attention_logit_<layer>`): the largest pre-softmax attention
    logit since the last logged step, measured exactly in every training forward (the cost of
    train.qk_clip.tau's measurement, which logs them anyway), without clipping anything."""
    optimizer_telemetry: bool = False
    """Log, on logged steps, what each optimizer reports about its step, suffixed by its name:
    `update_rms_<opt>` (RMS of the step's update), `momentum_norm_<opt>`, and for Muon
    `ortho_residual_<opt>` (how far a sampled orthogonalized matrix is from orthogonal). Computed only
    on logged steps, on the device; read one step late like the other metrics."""
    profile: bool = False
    """Profile steps 6-8 on rank 0 with torch.profiler; writes OUTPUT_DIR/profile/ops.txt,
    trace.json.gz and timeline.txt (GPU busy/idle/communication per step and per phase)."""

    def __post_init__(self) -> None:
        at_least(1, **{"logging.log_interval": self.log_interval})
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise UserError(
                f"Config key 'logging.peak_tflops' is {self.peak_tflops}; it must be positive (or null: "
                "the built-in table)."
            )


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
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: `auto` (nccl on GPU, gloo on CPU), `nccl` or `gloo`."""
    collective_timeout_s: float = 1800.0
    """Seconds a collective (an all-reduce, all-gather, barrier) waits for every rank before the job stops
    and says which rank stalled (a hung filesystem, a stuck GPU, a lost node) instead of waiting forever;
    nothing of the step it stalled in is saved, and a rerun resumes from the latest checkpoint. It must
    outlast the longest wait of a healthy job: a save or a pretrained model's download on one rank while
    the others wait, the first step's compilation (docs/clusters.md)."""

    def __post_init__(self) -> None:
        if not self.collective_timeout_s > 0:
            raise UserError(
                f"Config key 'launch.collective_timeout_s' is {self.collective_timeout_s}; it must be positive "
                "(seconds a collective waits for every rank)."
            )
        at_least(1, **{"launch.nnodes": self.nnodes})
        not_negative(**{"launch.max_restarts": self.max_restarts})
        if self.nproc_per_node is not None:
            at_least(1, **{"launch.nproc_per_node": self.nproc_per_node})
        if not 0 <= self.node_rank < self.nnodes:
            raise UserError(
                f"Config key 'launch.node_rank' is {self.node_rank}; it must be in 0..{self.nnodes - 1} "
                f"(launch.nnodes is {self.nnodes})."
            )


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
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Multiple-choice tasks scored during training: `eval.*`."""

    def tokens_per_step(self, world_size: int) -> int:
        """Training tokens of one optimizer step over all `world_size` ranks (the tp ranks of one
        data-parallel rank share its batch)."""
        dp = world_size // self.parallel.tp
        return self.train.micro_batch_size * self.train.grad_accum_steps * self.data.seq_len * dp
