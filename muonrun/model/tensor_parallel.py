"""Tensor parallelism for the decoder layers: each attention and MLP projection split over the `tp` mesh
axis with torch's DTensor API (`parallelize_module`), FSDP2 sharding over the data-parallel axes on top.

The plan is the model's own: transformers' `base_model_tp_plan` for its family (Qwen2, Llama, Mistral:
q/k/v and gate/up column-wise, o and down row-wise), read for the entries inside the decoder layers;
muonrun's `DEFAULT_TP_PLAN` (the same Llama layout) where transformers defines none. Column-wise
layers keep whole heads per rank (so `tp` must divide the query and key-value heads) and hand their
local outputs on; the row-wise layer after them sums the partial products. Between the blocks the
sequence is split over tp (`apply_tensor_parallel`: sequence parallelism for the layer norms and the
residual stream). The rest (embedding, final norm, LM head and loss) runs on every tp rank on the
same batch, FSDP-sharded over the data-parallel axes alone: its results are identical there, as are
its gradients. The exception is a module the plan marks `replicated_with_grad_allreduce` (Qwen3's
per-head q_norm/k_norm): it runs inside the heads a rank computes, so each tp rank's gradient of its
weight covers only those heads; `PartialGrads` sums them over tp once per step, before clipping.

Muon steps the tensor-parallel matrices exactly as on one device: each matrix's blocks reach one owner
over the tp and FSDP axes together (muonrun/optim/sharding.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from muonrun import compat
from muonrun.distributed import local_tensor
from muonrun.errors import UserError
from muonrun.model.build import decoder_layers
from muonrun.model.moe import is_moe

if TYPE_CHECKING:
    from muonrun.config import Config
    from muonrun.features.protocol import Feature

LAYERS = "layers.*."
DEFAULT_TP_PLAN = {
    f"{LAYERS}self_attn.q_proj": "colwise",
    f"{LAYERS}self_attn.k_proj": "colwise",
    f"{LAYERS}self_attn.v_proj": "colwise",
    f"{LAYERS}self_attn.o_proj": "rowwise",
    f"{LAYERS}mlp.gate_proj": "colwise",
    f"{LAYERS}mlp.up_proj": "colwise",
    f"{LAYERS}mlp.down_proj": "rowwise",
}
"""The Llama layout, for a family whose transformers config declares no `base_model_tp_plan`."""
GRAD_SUM = "replicated_with_grad_allreduce"
"""transformers' style for a module whose weight is copied on every tp rank but used on its heads alone."""
STYLES = ("colwise", "rowwise", GRAD_SUM)
SPLIT = ("colwise", "rowwise")


def layer_plan(hf_config) -> dict[str, str]:
    """{module path inside a decoder layer: "colwise" or "rowwise"} for this model family."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or DEFAULT_TP_PLAN
    return {key.removeprefix(LAYERS): style for key, style in plan.items() if key.startswith(LAYERS)}


def check_tensor_parallel(cfg: Config, model: nn.Module, features: list[Feature]) -> None:
    """Before any worker starts: `parallel.tp` fits the model and the features (UserError naming the key
    otherwise; the launcher checks that it divides the workers per node). `model` is the meta model
    (`check_model`)."""
    tp = cfg.parallel.tp
    if tp == 1:
        return
    hf = model.config
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(hf, key, None)
        if heads is not None and heads % tp:
            raise UserError(
                f"Config key 'parallel.tp' is {tp}, which does not divide model.hf.{key}={heads}: each tp rank "
                "computes whole heads. Choose a tp that divides the query and the key-value heads."
            )
    if is_moe(hf):
        raise UserError(
            f"Config key 'parallel.tp' is {tp}, but this model ({hf.model_type}) has experts: muonrun splits "
            "dense layers only. Set parallel.tp=1 (FSDP2 shards the experts; parallel.ep splits them over ranks)."
        )
    unsupported = [f.name for f in features if not f.tensor_parallel]
    if unsupported:
        raise UserError(
            f"Config key 'parallel.tp' is {tp}, but {', '.join(unsupported)} does not run on tensor-parallel "
            "layers. Set parallel.tp=1 for this run, or turn the feature off."
        )
    plan = layer_plan(hf)
    odd = {k: s for k, s in plan.items() if s not in STYLES}
    layer = decoder_layers(model)[0]
    missing = [
        k
        for k, style in plan.items()
        if not isinstance(module := _submodule(layer, k), nn.Linear if style in SPLIT else nn.Module)
        or not any(True for _ in module.parameters())
    ]
    if odd or missing or not any(style in SPLIT for style in plan.values()):
        raise UserError(
            f"Config key 'parallel.tp' is {tp}, but the tensor-parallel plan of {hf.model_type} ({plan or 'empty'}) "
            f"has entries muonrun does not apply ({odd or missing or 'nothing to split'}): it splits Linear "
            f"layers column-wise or row-wise and sums the gradients of {GRAD_SUM} modules. Set parallel.tp=1 "
            "for this model."
        )
    # sequence parallelism: every other part of a layer with weights sees the rank's share of the tokens
    blocks = _blocks(plan)
    mixing = [
        name
        for name, child in layer.named_children()
        if name not in blocks and not _is_norm(child) and any(True for _ in child.parameters())
    ]
    if mixing:
        raise UserError(
            f"Config key 'parallel.tp' is {tp}, but the decoder layers of {hf.model_type} hold {mixing} beside the "
            "blocks its tensor-parallel plan splits and their norms: muonrun splits the sequence between the "
            "blocks, and those would see part of it. Set parallel.tp=1 for this model."
        )


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def check_tp_fits_node(tp: int, per_node: int) -> None:
    """The tensor-parallel ranks of a layer exchange activations in every layer: they share a node."""
    if per_node % tp:
        raise UserError(
            f"Config key 'parallel.tp' is {tp}, which does not divide the {per_node} workers per node: the "
            "tensor-parallel ranks of a layer exchange activations in every layer and must share a node. "
            "Choose a tp that divides --nproc-per-node (launch.nproc_per_node)."
        )


def split_numel(model: nn.Module) -> int:
    """Elements of the parameters tensor parallelism splits (the plan's Linear layers, every layer)."""
    plan = layer_plan(model.config)
    return sum(
        p.numel()
        for layer in decoder_layers(model)
        for path, style in plan.items()
        if style in SPLIT and (module := _submodule(layer, path)) is not None
        for p in module.parameters()
    )


def traffic_bytes_per_step(hf, cfg: Config, param_bytes: int) -> float:
    """Bytes each tp rank sends per optimizer step: per block (attention, MLP) of every layer and
    micro-batch, an all-gather of its input and a reduce-scatter of its row-wise output in forward, the
    same two in backward, of the hidden states each: in a ring, the bytes of one all-reduce per
    collective pair."""
    tp = cfg.parallel.tp
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len * cfg.train.grad_accum_steps
    per_reduce = tokens * hf.hidden_size * param_bytes * 2 * (tp - 1) / tp
    return 4 * hf.num_hidden_layers * per_reduce


def apply_tensor_parallel(layers: list[nn.Module], tp_mesh: DeviceMesh, plan: dict[str, str]) -> PartialGrads:
    """Split each decoder layer's projections over `tp_mesh` as `plan` says (`layer_plan`), with sequence
    parallelism between them. Returns the modules whose gradients the tp ranks hold in part (`GRAD_SUM`).

    Between the blocks (the residual stream and the layer's own norms) each tp rank holds its share of
    the sequence, a DTensor `Shard(1)`: the norms run on it (`SequenceParallel`), the input of each
    block that ends in a row-wise layer (attention, MLP) is all-gathered once, and the row-wise layer's
    partial sums are reduce-scattered back to the shares; the same bytes as one all-reduce, and the
    activations between blocks 1/tp the size. Inside a block the column-wise outputs stay local tensors
    (the attention's view into heads and the MLP's product see their own part). The first layer takes
    its share of the (replicated) embeddings; the last one's output is all-gathered for the final norm,
    LM head and loss, which run on every tp rank."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq, full = (Shard(1),), (Replicate(),)
    blocks = _blocks(plan)
    for layer in layers:
        split = {
            path: ColwiseParallel()
            if style == "colwise"
            else RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            for path, style in plan.items()
            if style in SPLIT
        }
        norms = {name: SequenceParallel() for name, child in layer.named_children() if _is_norm(child)}
        parallelize_module(layer, tp_mesh, {**split, **norms})
        for block in blocks:
            layer.get_submodule(block).register_forward_pre_hook(_gather_sequence, with_kwargs=True)
    parallelize_module(
        layers[0],
        tp_mesh,
        PrepareModuleInput(input_layouts=full, desired_input_layouts=seq, use_local_output=False),
    )
    layers[-1].register_forward_hook(_gather_output)
    summed = [
        layer.get_submodule(path) for layer in layers for path, style in plan.items() if style == GRAD_SUM
    ]
    return PartialGrads(summed, tp_mesh.get_group())


def _blocks(plan: dict[str, str]) -> set[str]:
    """The decoder layer's children that the plan splits (attention, MLP): each takes the whole sequence."""
    return {path.split(".")[0] for path, style in plan.items() if style in SPLIT}


def _gather_sequence(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block's sequence-split inputs (the hidden states, however the layer passes them) all-gathered,
    as DTensors: the column-wise layers' input gradients then come back reduce-scattered."""

    def whole(x):
        return x.redistribute(placements=[Replicate()]) if isinstance(x, DTensor) else x

    return tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}


def _gather_output(module: nn.Module, args: tuple, out: DTensor) -> Tensor:
    """The last layer's sequence shares all-gathered into a plain tensor for the final norm, LM head and
    loss (a copy: FSDP2 hooks the output for backward, and a view would lose that hook to an in-place op)."""
    return out.redistribute(placements=[Replicate()]).to_local().clone()


def _is_norm(module: nn.Module) -> bool:
    """A decoder layer's own normalisation (RMSNorm, LayerNorm): elementwise along the sequence."""
    return type(module).__name__.endswith("Norm")


class PartialGrads:
    """Modules copied on every tp rank whose weights each rank uses on its own heads alone (`GRAD_SUM`):
    `sum_()` adds their gradients up over the tp ranks, in one all-reduce, after the step's last
    backward and before clipping (each rank then holds the whole gradient, as for the other copies).
    Written here because torch's tensor-parallel API has no such style, and transformers' own one
    all-reduces each parameter's gradient as it accumulates: a collective per norm, layer and
    micro-batch, on parameters FSDP2 swaps between their sharded and unsharded forms."""

    def __init__(self, modules: list[nn.Module], group) -> None:
        self.modules = modules
        self.group = group

    def sum_(self) -> None:
        grads = [local_tensor(p.grad) for m in self.modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        compat.foreach_copy_(
            grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)]
        )
