"""QK-clip (MuonClip) and the largest pre-softmax attention logit of every head, measured under SDPA.

Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv:2507.20534 (MuonClip): S_max^h is the largest
pre-softmax attention logit of head h seen in a training step. After the optimizer step, every head with
S_max^h > tau gets its query and key projections rescaled so that the product of their scales is
gamma_h = tau / S_max^h (K2: sqrt(gamma_h) on each, for plain multi-head attention). K2 uses tau = 100.

Grouped-query attention: a key head g serves the query heads h of its group. Key rows of head g are
scaled by sqrt(gamma_g), gamma_g = min over the group of gamma_h (the group's largest logit), and query
rows of head h by gamma_h / sqrt(gamma_g): every head's logits scale by exactly gamma_h, however the
group's heads differ, and a group of one is K2's sqrt split. Biases (Qwen2 has query and key biases) are
scaled with their rows, and RoPE rotates each head's vector, so the logit q.k scales exactly. Optimizer
state is left as it is, as in K2.

The measurement (exact, on every training forward, no sampling). SDPA never materializes the logits,
so muonrun's attention function (muonrun/model/attention.py) hands the query (after RoPE) and key (before
the GQA repeat) it passes to SDPA to `observe`, which computes max over i >= j of (q_i . k_j) * scaling
for each head under no_grad:

- on a GPU with Triton, one kernel (muonrun/features/max_logit_triton.py) tiles Q K^T like a flash-attention
  forward (key tiles in the causal range only, fp32 sums of the bf16 products, which are exact in
  fp32) and keeps only the running maximum: the logits SDPA computes, up to fp32 summation order. Its
  FLOPs are 2 * seq_len * d_attn / 2 per token per layer, a sixth of the attention's training FLOPs
  (`python benchmarks/bench_max_logit.py` times it against SDPA);
- elsewhere plain matmuls over chunks of query positions: in fp32 exactly the largest entry of the
  materialized logits, in bf16 that entry rounded once to bf16. Fine on CPU; on a GPU without Triton
  it materializes every logit and costs far more than the kernel.

Each attention module holds a view of one [layers, heads] fp32 tensor, updated in place with
torch.maximum, so it works inside compiled layers (the mutation is traced, layers share one graph),
under activation checkpointing (the recompute in backward sees the same logits: max is idempotent, but
the measurement runs again there) and over gradient accumulation (the maximum over the step's micro-batches). Evaluation (eval mode) is not
counted. Under FSDP2 the tensor is per rank: `after_step` takes one MAX all-reduce of it, then
computes the scales and rescales each rank's rows of q_proj/k_proj on the device, with no branch and
no host sync (a scale of exactly 1 where nothing is clipped). Under tensor parallelism a rank's
attention computes its tp rank's heads (`local_heads`) and measures those; the others stay -inf
there until the all-reduce, and each rank rescales the rows of q_proj/k_proj it holds, whichever
heads they belong to.

Try: muonrun pretrain tiny --nproc-per-node 1 train.max_steps=20 train.qk_clip.tau=5 logging.log_interval=5
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from muonrun import compat
from muonrun.config import Config
from muonrun.distributed import all_reduce_max, local_tensor, tp_mesh
from muonrun.errors import UserError
from muonrun.features.protocol import Feature
from muonrun.model.attention import ATTENTION_NAME, OBSERVER

ATTR = "muonrun_max_logit"
"""The attention module attribute holding its heads' running maximum (a [heads] fp32 view)."""

SCORES_PER_CHUNK = 1 << 24
"""Logits materialized at once by the matmul path (64 MiB in fp32)."""


def observe(module: nn.Module, query: Tensor, key: Tensor, scaling: float | None) -> None:
    """Fold this forward's largest logit per head into `module`'s running maximum, if it has one
    (only while training). query: [batch, heads, seq, head_dim]; key: [batch, kv_heads, seq, head_dim]."""
    running = getattr(module, ATTR, None)
    if running is None or not module.training:
        return
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    with torch.no_grad():
        running.copy_(torch.maximum(running, causal_max_logit(query.detach(), key.detach()) * scale))


def causal_max_logit(query: Tensor, key: Tensor) -> Tensor:
    """max over batch, i >= j of q_i . k_j for each query head (unscaled), as fp32 [heads]."""
    if query.is_cuda and HAS_TRITON:
        return torch.ops.muonrun.causal_max_logit(query, key)
    return causal_max_logit_matmul(query, key)


def causal_max_logit_matmul(query: Tensor, key: Tensor) -> Tensor:
    """The matmul path: chunks of query positions against the keys up to the chunk's last position."""
    batch, heads, seq, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(batch, kv_heads, group, seq, dim)
    k = key.unsqueeze(2).transpose(-1, -2)  # [batch, kv_heads, 1, dim, seq]
    chunk = max(1, min(seq, SCORES_PER_CHUNK // max(1, batch * heads * seq)))
    out = torch.full((kv_heads, group), float("-inf"), device=query.device)
    positions = torch.arange(seq, device=query.device)
    for start in range(0, seq, chunk):
        end = min(start + chunk, seq)
        scores = torch.matmul(q[..., start:end, :], k[..., :end])  # [batch, kv, group, chunk, end]
        future = positions[start:end, None] < positions[None, :end]
        scores = scores.masked_fill_(future, float("-inf")).amax(dim=-1)
        out = torch.maximum(out, scores.amax(dim=(0, 3)).float())
    return out.reshape(heads)


HAS_TRITON = importlib.util.find_spec("triton") is not None


# An opaque op to torch.compile: the compiled layer calls the kernel as it is.
@torch.library.custom_op("muonrun::causal_max_logit", mutates_args=(), device_types="cuda")
def _causal_max_logit_cuda(query: Tensor, key: Tensor) -> Tensor:
    from muonrun.features.max_logit_triton import causal_max_logit

    return causal_max_logit(query, key)


@_causal_max_logit_cuda.register_fake
def _(query: Tensor, key: Tensor) -> Tensor:
    return query.new_empty(query.shape[1], dtype=torch.float32)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules (those with q_proj and k_proj), in model order."""
    return [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "k_proj")]


def local_rows(p: Tensor) -> range:
    """The global rows of `p` (a Shard(0) DTensor or a plain tensor) that this rank holds."""
    if not isinstance(p, DTensor):
        return range(p.shape[0])
    shape, offset = compat.local_shape_and_offset(p)
    assert tuple(shape) == tuple(local_tensor(p).shape), (shape, local_tensor(p).shape)
    return range(offset[0], offset[0] + shape[0])


def local_heads(q_weight: Tensor, heads: int) -> slice:
    """The query heads this rank's attention computes: all of them, or under tensor parallelism its tp
    rank's share, in order (a column-wise q_proj hands each tp rank whole heads)."""
    mesh = q_weight.device_mesh if isinstance(q_weight, DTensor) else None
    tp = tp_mesh(mesh) if mesh is not None else None
    if tp is None:
        return slice(0, heads)
    share = heads // tp.size()
    return slice(tp.get_local_rank() * share, (tp.get_local_rank() + 1) * share)


def check_clippable(modules: list[nn.Module]) -> None:
    """QK-clip rescales plain q_proj/k_proj Linear weights: a UserError for models where that would not
    scale the logits (QK-norm) or where those weights are not what trains (LoRA adapters)."""
    if any(getattr(m, "q_norm", None) is not None for m in modules):
        raise UserError(
            "train.qk_clip.tau cannot bound this model's logits: it normalizes queries and keys "
            "(q_norm/k_norm), so rescaling q_proj and k_proj changes nothing. Leave train.qk_clip.tau unset."
        )
    if not all(isinstance(p, nn.Linear) for m in modules for p in (m.q_proj, m.k_proj)):
        raise UserError(
            "train.qk_clip.tau rescales q_proj and k_proj, which here are not plain linear layers (LoRA "
            "adapters?): QK-clip is not supported for them. Leave train.qk_clip.tau unset "
            "(logging.max_attention_logit=true still measures the logits)."
        )


def check_measurable(model: nn.Module, tau: float | None) -> list[nn.Module]:
    """The attention modules whose logits can be measured (and with `tau`, clipped); a UserError
    naming the setting otherwise."""
    modules = attention_modules(model)
    what = "train.qk_clip.tau" if tau is not None else "logging.max_attention_logit"
    if not modules:
        raise UserError(f"{what} needs attention layers with q_proj and k_proj; this model has none.")
    impl = getattr(modules[0].config, "_attn_implementation", None)
    if impl != ATTENTION_NAME:
        raise UserError(
            f"{what} measures attention logits inside muonrun's SDPA attention, which this model does not "
            f"use (its attention is '{impl}'): it needs model.attn_implementation=sdpa and full causal "
            "attention in every layer (no sliding window)."
        )
    if tau is not None:
        check_clippable(modules)
    return modules


class QKClip:
    """The running maxima of every attention layer's heads; with `tau`, the clip after each step.

    `after_step()` once per optimizer step (after it), `telemetry()` on logged steps: device tensors,
    never read here."""

    def __init__(self, model: nn.Module, tau: float | None, device: torch.device):
        modules = check_measurable(model, tau)
        self.tau = tau
        self.modules = modules
        config = modules[0].config
        self.head_dim = modules[0].head_dim
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.group = self.heads // self.kv_heads
        layers = len(modules)
        self.current = torch.full((layers, self.heads), float("-inf"), device=device)
        for i, m in enumerate(modules):
            setattr(m, ATTR, self.current[i, local_heads(m.q_proj.weight, self.heads)])
            setattr(m, OBSERVER, observe)
        self.window = torch.full_like(self.current, float("-inf"))
        self.clipped = torch.zeros((), device=device)
        if tau is not None:
            self.q = [(m.q_proj.weight, m.q_proj.bias) for m in modules]
            self.k = [(m.k_proj.weight, m.k_proj.bias) for m in modules]
            self.q_index, self.q_sizes = self._row_index(self.q, self.heads, device)
            self.k_index, self.k_sizes = self._row_index(self.k, self.kv_heads, device)

    def _row_index(self, params, heads: int, device) -> tuple[Tensor, list[int]]:
        """For every local row of every layer's weight: its index into the flattened [layers, heads]."""
        index, sizes = [], []
        for layer, (weight, _) in enumerate(params):
            rows = local_rows(weight)
            index.append(torch.arange(rows.start, rows.stop) // self.head_dim + layer * heads)
            sizes.append(len(rows))
        return torch.cat(index).to(device), sizes

    @torch.no_grad()
    def after_step(self) -> None:
        """Fold this step's maxima into the logging window and reset them; with tau, rescale."""
        current = self.current.clone()
        self.current.fill_(float("-inf"))
        if self.tau is not None:
            current = all_reduce_max(current)  # every rank computes the same scales
            self.clip(current)
        torch.maximum(self.window, current, out=self.window)

    def clip(self, current: Tensor) -> None:
        """Rescale q_proj/k_proj (and biases) of the heads whose largest logit exceeded tau."""
        gamma = self.tau / current.clamp(min=self.tau)  # exactly 1 where S <= tau
        self.clipped += (current > self.tau).sum()
        layers = gamma.shape[0]
        k_scale = gamma.view(layers, self.kv_heads, self.group).amin(dim=-1).sqrt()
        q_scale = gamma / k_scale.repeat_interleave(self.group, dim=1)
        for params, scale, index, sizes in (
            (self.q, q_scale, self.q_index, self.q_sizes),
            (self.k, k_scale, self.k_index, self.k_sizes),
        ):
            rows = scale.flatten()[index].split(sizes)
            compat.foreach_mul_([local_tensor(w) for w, _ in params], [r.unsqueeze(1) for r in rows])
            biases = [(local_tensor(b), r) for (_, b), r in zip(params, rows, strict=True) if b is not None]
            if biases:
                compat.foreach_mul_([b for b, _ in biases], [r for _, r in biases])

    def telemetry(self) -> dict[str, Tensor]:
        """This logging window's values (0-d device tensors, per rank: reduce them with MAX), then a new
        window: `max_attention_logit` and per layer `max_attention_logit_<i>` (the largest pre-softmax
        logit seen, before any clip), with tau `qk_clipped_heads` (heads clipped, summed over the steps)."""
        per_layer = self.window.amax(dim=1)
        values = {"max_attention_logit": per_layer.max()}
        values.update({f"max_attention_logit_{i}": v for i, v in enumerate(per_layer.unbind())})
        if self.tau is not None:
            values["qk_clipped_heads"] = self.clipped.clone()
            self.clipped.zero_()
        self.window = torch.full_like(self.window, float("-inf"))
        return values


class MaxLogit(Feature):
    """`train.qk_clip.tau` (the clip) or `logging.max_attention_logit` (the measurement alone): checked
    on every build of the model, measured in the worker's forward passes, clipped after each step."""

    tensor_parallel = True

    @staticmethod
    def wanted(cfg: Config) -> bool:
        return cfg.train.qk_clip.tau is not None or cfg.logging.max_attention_logit

    def adapt(self, model: nn.Module) -> None:
        check_measurable(model, self.cfg.train.qk_clip.tau)

    def start(self, model: nn.Module, device: torch.device) -> None:
        self.tracker = QKClip(model, self.cfg.train.qk_clip.tau, device)

    def after_step(self) -> None:
        self.tracker.after_step()

    def telemetry(self) -> dict[str, Tensor]:
        return self.tracker.telemetry()
