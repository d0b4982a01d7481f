"""Expert parallelism: a mixture of experts' routed experts split over the `ep` mesh axis, tokens sent
to the ranks holding their experts and the results sent back.

The experts of every MoE layer are sharded whole over the `ep` ranks (`Shard(0)` of each stacked
`[E, ...]` parameter: `E / ep` experts each) and FSDP2-sharded over the data-parallel ranks left
within each expert group (`efsdp` = dp_shard / ep); attention, router, shared expert, embeddings and
norms stay FSDP2-sharded over all data-parallel ranks, as without it. Every rank reads its own batch.

The dispatch plugs into transformers' experts interface: the model's `experts_implementation` becomes
`muonrun_ep`, registered in transformers' `ALL_EXPERTS_FUNCTIONS`, which wraps the implementation the
model asked for (`grouped_mm`, `eager`, ...). Per layer and micro-batch:

1. each (token, expert) pair is sorted by expert, so by the rank that holds it; the counts per expert
   go to every rank in one small all-to-all (the one host sync of the layer: the split sizes);
2. an all-to-all with those variable splits sends the tokens; the receiving rank runs its own experts on
   them (top-1, unit weights) through the wrapped implementation, on its local expert weights;
3. a second all-to-all returns the outputs, which the sender weights by its routing weights and sums over
   each token's top k. Dropless: every pair is computed. The collectives are autograd's
   (`AllToAll`), so backward sends the gradients back the same way.

Muon steps each expert's matrices on the rank holding them, as without expert parallelism (muonrun/optim/
experts.py); checkpoints hold the global `[E, ...]` tensors, so a run resumes at another `ep`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from functools import partial
from types import MethodType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from muonrun import compat
from muonrun.errors import UserError
from muonrun.model.moe import is_moe, num_experts
from muonrun.optim.groups import is_experts_module

if TYPE_CHECKING:
    from muonrun.config import Config

IMPLEMENTATION = "muonrun_ep"


@dataclass
class Dispatch:
    """One experts module's place in the expert-parallel group, and what its dispatch has counted."""

    group: dist.ProcessGroup
    size: int
    local_experts: int
    inner: str
    """The experts implementation the model asked for, which runs the local experts."""
    received: list[int] = field(default_factory=list)
    """Tokens (pairs) this rank's experts received, per forward since the last `take_counts`."""
    seconds: float = 0.0
    """Host time spent in the dispatch and combine collectives since the last `take_counts`."""


def check_expert_parallel(cfg: Config, model: nn.Module, dp_shard: int) -> None:
    """Before any worker starts: `parallel.ep` fits the model and the mesh (UserError naming the key)."""
    ep = cfg.parallel.ep
    if ep == 1:
        return
    hf = model.config
    if not is_moe(hf):
        raise UserError(
            f"Config key 'parallel.ep' is {ep}, but this model ({hf.model_type}) has no experts to split. Set "
            "parallel.ep=1, or train a mixture-of-experts model (tiny-moe, the qwen2-moe presets)."
        )
    if cfg.parallel.tp > 1:
        raise UserError(
            f"Config keys 'parallel.ep' ({ep}) and 'parallel.tp' ({cfg.parallel.tp}) are both above 1: muonrun "
            "splits either a dense model's layers (tp) or a mixture of experts' experts (ep). Set one to 1."
        )
    if dp_shard % ep:
        raise UserError(
            f"Config key 'parallel.ep' is {ep}, which does not divide parallel.dp_shard={dp_shard}: the experts "
            "are split over ep ranks of each shard group and FSDP-sharded over the rest. Choose an ep that "
            "divides the workers each parameter is sharded over (the workers per node with HSDP)."
        )
    experts = num_experts(hf)
    if experts % ep:
        raise UserError(
            f"Config key 'parallel.ep' is {ep}, which does not divide the {experts} experts of each layer "
            f"(model.hf): each ep rank holds the same number of whole experts. Choose an ep that divides {experts}."
        )
    own = {id(block.experts) for block in presorted_blocks(model)}
    odd = sorted(
        {
            type(m).__name__
            for m in model.modules()
            if is_experts_module(m) and not _dispatchable(m) and id(m) not in own
        }
    )
    if odd:
        raise UserError(
            f"Config key 'parallel.ep' is {ep}, but {', '.join(odd)} does not route through transformers' experts "
            "interface (its forward takes no per-token expert choice), so its tokens cannot be dispatched. "
            "Set parallel.ep=1 for this model."
        )


def _dispatchable(module: nn.Module) -> bool:
    """Whether transformers' experts interface serves the module (`use_experts_implementation`)."""
    return hasattr(module, "is_concatenated") and hasattr(module, "config")


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every experts module's stacked parameters over `ep_mesh` (whole experts, `Shard(0)`), route
    their forward through `muonrun_ep`; returns the experts modules (FSDP2 shards each on its own)."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, experts_forward)
    size, group = ep_mesh.size(), ep_mesh.get_group()
    own = set()
    for block in presorted_blocks(model):
        block.forward = MethodType(PRESORTED[type(block).__name__], block)
        _as_grouped_experts(block.experts)
        own.add(id(block.experts))
    experts = [m for m in model.modules() if is_experts_module(m)]
    # the implementation each model asked for (configs are shared: read before any is changed)
    inner = {id(m.config): m.config._experts_implementation or "eager" for m in experts if id(m) not in own}
    for module in experts:
        for name, p in list(module.named_parameters(recurse=False)):
            placed = distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(placed, requires_grad=p.requires_grad))
        if id(module) in own:  # its block dispatches; its own experts run as transformers' grouped_mm
            module.muonrun_ep = Dispatch(group, size, module.num_experts // size, "grouped_mm")
        else:
            module.muonrun_ep = Dispatch(group, size, module.num_experts // size, inner[id(module.config)])
            module.config._experts_implementation = IMPLEMENTATION
    return experts


def presorted_blocks(model: nn.Module) -> list[nn.Module]:
    """The MoE blocks whose experts take pre-sorted tokens and that dispatch themselves (`PRESORTED`)."""
    return [m for m in model.modules() if type(m).__name__ in PRESORTED]


def llama4_moe_forward(self: nn.Module, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """`Llama4TextMoe.forward` under expert parallelism. Llama4 scales each expert's *input* by its router
    score and runs every expert on every token (a token's other experts get a zero input, so a zero
    output: its SwiGLU experts have no bias); here only each token's top-k pairs travel (`dispatch`),
    each input times its score, and their outputs are summed: the same sum, dropless."""
    hidden = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(hidden)
    top_index = torch.topk(router_logits, self.top_k, dim=1).indices  # the router's own choice
    pairs = self.experts(hidden, top_index, router_scores.gather(1, top_index))  # `dispatch`
    return self.shared_expert(hidden) + pairs.sum(dim=1).to(hidden.dtype), router_logits


PRESORTED = {"Llama4TextMoe": llama4_moe_forward}
"""MoE blocks whose experts take tokens already sorted per expert (not transformers' experts interface),
and their forward under expert parallelism: the block dispatches, its experts run as `grouped_mm`."""


def _as_grouped_experts(module: nn.Module) -> None:
    """Let transformers' `grouped_mm` experts function run a stacked `[E, in, out]` experts module of
    fused gate/up SwiGLU experts that transformers does not declare to its experts interface (Llama4's):
    what `use_experts_implementation` would set, and `dispatch` as its forward."""
    module.has_gate, module.has_bias, module.has_post_expert_norm = True, False, False
    module.is_transposed, module.is_concatenated, module._is_expert_parallel = True, True, False
    module._apply_gate = _swiglu_gate(module.act_fn)
    module.forward = MethodType(dispatch, module)  # called as a module: FSDP2 gathers its weights first


def plan_numbers(hf, cfg: Config, param_bytes: int) -> dict[str, float]:
    """For the dry run, per rank and optimizer step: the bytes its all-to-alls send (dispatch and combine,
    forward and backward, every MoE layer and micro-batch, the (ep - 1) / ep of the pairs that leave
    the rank) and the expert weights FSDP2 gathers for one layer (its E / ep experts)."""
    from muonrun.model.moe import expert_width, experts_per_token

    ep = cfg.parallel.ep
    pairs = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps * experts_per_token(hf)
    layers = sum(1 for i in range(hf.num_hidden_layers) if _is_moe_layer(hf, i))
    sent = 4 * layers * pairs * hf.hidden_size * param_bytes * (ep - 1) / ep
    per_expert = 3 * hf.hidden_size * expert_width(hf) * param_bytes
    return {"all_to_all_bytes": sent, "gathered_bytes": num_experts(hf) // ep * per_expert}


def _is_moe_layer(hf, i: int) -> bool:
    """Whether decoder layer i routes to experts (Llama4's `moe_layers`; Qwen2-MoE's `mlp_only_layers`,
    `decoder_sparse_step`)."""
    if getattr(hf, "moe_layers", None) is not None:
        return i in hf.moe_layers
    step = getattr(hf, "decoder_sparse_step", 1) or 1
    return i not in (getattr(hf, "mlp_only_layers", None) or []) and (i + 1) % step == 0


def dispatches(model: nn.Module) -> list[Dispatch]:
    return [m.muonrun_ep for m in model.modules() if isinstance(getattr(m, "muonrun_ep", None), Dispatch)]


def take_counts(model: nn.Module) -> dict[str, float]:
    """Tokens this rank's experts received per forward (mean over the layers and forwards since the last
    call) and the host seconds spent in the all-to-alls; empty without expert parallelism."""
    parts = dispatches(model)
    received = [n for d in parts for n in d.received]
    if not parts:
        return {}
    seconds = sum(d.seconds for d in parts)
    for d in parts:
        d.received, d.seconds = [], 0.0
    return {"ep_tokens_received": sum(received) / max(len(received), 1), "ep_all_to_all_s": seconds}


def experts_forward(module: nn.Module, hidden_states, top_k_index, top_k_weights):
    """`muonrun_ep` in transformers' experts interface: dispatch, the local experts, combine."""
    pairs = dispatch(module, hidden_states, top_k_index)
    return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(dim=1).to(hidden_states.dtype)


def dispatch(
    module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, input_scale: Tensor | None = None
) -> Tensor:
    """Each token's top-k experts' outputs `[tokens, k, hidden]`: every (token, expert) pair sent to the
    rank holding the expert (its input times `input_scale` `[tokens, k]` where given), the local experts
    run through the wrapped implementation, the outputs sent back in the pairs' order."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    d: Dispatch = module.muonrun_ep
    start = time.perf_counter()
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    send_tokens = hidden_states[order // top_k]
    if input_scale is not None:
        send_tokens = send_tokens * input_scale.reshape(-1)[order].unsqueeze(-1).to(send_tokens.dtype)
    counts = torch.bincount(expert_ids, minlength=d.local_experts * d.size).view(d.size, d.local_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=d.group)
    send_sizes, recv_sizes = (c.sum(dim=1).tolist() for c in (counts, recv_counts))
    recv_tokens = AllToAll.apply(send_tokens, recv_sizes, send_sizes, d.group)
    local_ids = torch.arange(d.local_experts, device=hidden_states.device).repeat(d.size)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1)).unsqueeze(-1)
    d.received.append(int(sum(recv_sizes)))
    d.seconds += time.perf_counter() - start
    inner = ALL_EXPERTS_FUNCTIONS.get_interface(d.inner, getattr(type(module).forward, "__wrapped__", None))
    rows = recv_tokens
    if rows.shape[0] == 0:
        # Nothing came: one zero row keeps this rank's experts (FSDP reduces their gradients) and both
        # exchanges (their backward is a collective every rank must join) in the backward graph.
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
        local_ids = local_ids.new_zeros(1, 1)
    # The experts' gradients hold the tokens of all ep ranks of their group, and FSDP2 averages them over
    # the other data-parallel ranks alone: 1 / ep makes them a mean over every data-parallel rank's
    # tokens, as the rest of the model's gradients are (FSDP2's own divide factor needs PREMUL_SUM,
    # which gloo lacks).
    scale = partial(ScaleGrad.apply, factor=1.0 / d.size)
    with compat.local_parameters(module, scale), local_experts(module, d.local_experts):
        out = inner(module, rows, local_ids, rows.new_ones(rows.shape[0], 1))
    out = out[: recv_tokens.shape[0]]
    start = time.perf_counter()
    back = AllToAll.apply(out, send_sizes, recv_sizes, d.group)
    d.seconds += time.perf_counter() - start
    pairs = torch.empty_like(back)
    pairs[order] = back
    return pairs.view(*top_k_index.shape, pairs.shape[-1])


class AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` of rows with variable splits, differentiable: backward sends each row's
    gradient back to where the row came from (the same exchange with the splits swapped). torch's own
    differentiable form (`torch.distributed.nn.functional.all_to_all_single`) is deprecated in favour of
    a private one."""

    @staticmethod
    def forward(ctx, rows, recv_sizes: list[int], send_sizes: list[int], group):
        ctx.sizes, ctx.group = (recv_sizes, send_sizes), group
        out = rows.new_empty(sum(recv_sizes), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        recv_sizes, send_sizes = ctx.sizes
        back = grad.new_empty(sum(send_sizes), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return back, None, None, None


class ScaleGrad(torch.autograd.Function):
    """The identity forward; backward scales the gradient by `factor`."""

    @staticmethod
    def forward(ctx, t, factor: float):
        ctx.factor = factor
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _swiglu_gate(act_fn):
    def gate(gate_up: Tensor) -> Tensor:
        g, up = gate_up.chunk(2, dim=-1)  # concatenated: [gate | up]
        return act_fn(g) * up

    return gate


@contextlib.contextmanager
def local_experts(module: nn.Module, count: int):
    """The experts module counts only this rank's experts while they run (transformers' implementations
    size their routing tables by `num_experts`)."""
    saved, module.num_experts = module.num_experts, count
    try:
        yield
    finally:
        module.num_experts = saved
