"""The dry run's memory per rank: exact weights, gradients and optimizer state, rough activations, and the
verdict whether a micro-batch fits what a worker has (this machine's GPU or memory share, or the cards of
ASSUMED_GPUS where a GPU plan is made on a machine without one).

    muonrun pretrain qwen2-muon-fsdp2 --dry-run --world-size 64
"""

from __future__ import annotations

from muonrun.tools.figures import figure, gib

GIB = 2**30
# What a GPU plan is judged against on a machine without GPUs: the memory torch reports on each card.
ASSUMED_GPUS = (("an H100 80 GB", 79.1), ("an H200 141 GB", 139.8))


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


def activation_gib(hf, c, param_bytes: int, micro_batch: int | None = None) -> float:
    """ROUGH activation memory per rank (GiB) at the peak of one micro-batch's backward, counting the
    tensors autograd keeps per token and decoder layer with sdpa/flash attention (no seq x seq scores):
    norm inputs/outputs, q/k/v before and after rotary, attention output, MLP gate/up/act/product, the
    fp32 copies inside RMSNorm when computing in bf16; plus the fused LM head's stored gradients and one
    chunk of logits. Activation checkpointing keeps only layer inputs (plus one layer being recomputed).
    Kernels' workspaces, the allocator's fragmentation and FSDP's gathered parameters are not in it.
    Counted for eager layers: compiled ones save fewer intermediates, so for them this is an upper
    bound (docs/performance.md, "Memory", sets it beside measured peaks). `micro_batch`: in place of
    train.micro_batch_size."""
    tokens = (micro_batch or c.train.micro_batch_size) * c.data.seq_len
    h, inter, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    q, kv = heads * head_dim, (getattr(hf, "num_key_value_heads", None) or heads) * head_dim
    if moe_inter := mlp_width(hf):  # MoE: each token's top-k experts and the shared expert, plus routing
        inter = moe_inter
    # A tp rank keeps its heads' and its MLP columns' activations, and between the blocks its share of
    # the sequence (sequence parallelism: norms and layer inputs); the blocks' gathered inputs are whole.
    tp = c.parallel.tp
    q, kv, inter, shared = q // tp, kv // tp, inter // tp, h // tp
    per_layer = param_bytes * (2 * h + 2 * shared + 3 * q + 3 * kv + 4 * inter) + (
        16 * shared if param_bytes == 2 else 0
    )
    kept = {"none": layers, "full": 0, "selective": layers // 2}[c.parallel.activation_checkpointing]
    layer_bytes = tokens * (
        kept * per_layer + (layers - kept) * shared * param_bytes + (per_layer if kept < layers else 0)
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


def memory_targets(c, workers_per_node: int) -> tuple[list[tuple[str, float]], bool]:
    """([(what a worker has, GiB)], whether that is this machine's own): the first GPU's memory for a GPU
    plan on a machine with GPUs; for a GPU plan without them, the cards of ASSUMED_GPUS; for a CPU plan,
    an even share of this machine's memory."""
    import os

    import torch

    if c.train.device == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        return [
            (
                f"this machine's memory, {figure(total)} GiB / {workers_per_node} workers",
                total / workers_per_node,
            )
        ], True
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return [(f"this machine's {props.name}", props.total_memory / GIB)], True
    return list(ASSUMED_GPUS), False


def largest_micro_batch(hf, c, param_bytes: int, states: float, have: float, limit: int = 1 << 16) -> int:
    """The largest micro-batch whose states and rough activations fit in `have` GiB (0: not even one)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if states + activation_gib(hf, c, param_bytes, mid) <= have:
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit_verdicts(hf, c, param_bytes: int, states: float, targets) -> list[tuple[str, float, bool, int]]:
    """(device, its GiB, whether this micro-batch fits, the largest that does) for each device judged."""
    need = states + activation_gib(hf, c, param_bytes)
    return [
        (name, have, need <= have, largest_micro_batch(hf, c, param_bytes, states, have))
        for name, have in targets
    ]


def fit_row(s: dict, c) -> str:
    """The plan's verdict: whether one micro-batch fits the memory a worker has, judged on each device."""
    states, acts = sum(s["memory_gib_per_rank"].values()), s["activation_gib_per_rank"]
    mb = f"{c.train.micro_batch_size} x {c.data.seq_len}"
    head = f"{gib(states + acts)} per rank ({gib(states)} states + ~{gib(acts)} activations for {mb})"
    parts = []
    for name, have, fits, largest in s["fits"]:
        verdict = "fits" if fits else "does NOT fit"
        biggest = f"up to micro-batch {largest} fits" if largest else "no micro-batch fits"
        parts.append(f"{verdict} {name} ({figure(have)} GiB; {biggest})")
        if fits:
            break  # a larger card than the first that fits says nothing more
    return f"{head}: " + "; ".join(parts)


def memory_warning(s: dict, c) -> str | None:
    """A warning when the planned memory per rank (states + rough activations) exceeds what a worker on this
    machine has (a plan judged against assumed cards says so in its row)."""
    if not s["fits_here"] or s["fits"][0][2]:
        return None
    name, have = s["fits"][0][:2]
    states, acts = sum(s["memory_gib_per_rank"].values()), s["activation_gib_per_rank"]
    return (
        f"this plan needs about {gib(states + acts)} per rank ({gib(states)} of weights, gradients and "
        f"optimizer state, ~{gib(acts)} of activations), more than a worker has ({name}, {figure(have)} GiB): it "
        "will run out of memory. Shard over more ranks, set parallel.activation_checkpointing=full, or lower "
        "train.micro_batch_size or data.seq_len."
    )
