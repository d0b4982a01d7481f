"""Activation checkpointing, torch.compile and FSDP2 for a model on the meta device.

Order matters (as in torchtitan): the features' conversions (float8), then tensor parallelism, then compile and
checkpoint each decoder layer, then `fully_shard` each layer, then the root (embedding, final norm and the possibly tied LM head).
Parameter names never change: the wrappers patch `forward` in place.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from muonrun.config import ParallelConfig
from muonrun.distributed import dp_mesh, tp_mesh
from muonrun.model.build import decoder_layers
from muonrun.model.expert_parallel import apply_expert_parallel
from muonrun.model.tensor_parallel import PartialGrads, apply_tensor_parallel, layer_plan

if TYPE_CHECKING:
    from muonrun.features.protocol import Feature

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def recomputed(i: int, mode: str) -> bool:
    """Whether layer i is recomputed in backward: `full` every layer, `selective` every other one (half
    the saving, a third less recompute), `none` none."""
    return mode == "full" or (mode == "selective" and i % 2 == 0)


def apply_compile_and_checkpointing(
    layers: list[nn.Module], mode: str, compile: bool, backend: str = "inductor"
) -> None:
    """Activation checkpointing and torch.compile, per decoder layer. A recomputed layer runs its
    compiled forward inside `checkpoint`: compiling a forward that calls `checkpoint` compiles nothing
    (dynamo skips that frame and the layer runs eagerly). Patching the instance's forward keeps
    FSDP2's hooks (on __call__) outside the recompute. Identical layers share one compiled graph
    (tests/test_parallelize.py checks that every layer runs it and none recompiles)."""
    for i, layer in enumerate(layers):
        if recomputed(i, mode):
            forward = torch.compile(layer.forward, backend=backend) if compile else layer.forward
            layer.forward = functools.partial(checkpoint, forward, use_reentrant=False)
        elif compile:
            layer.compile(backend=backend)


def apply_fsdp(
    model: nn.Module,
    layers: list[nn.Module],
    mesh: DeviceMesh,
    p: ParallelConfig,
    device_type: str,
    experts: list[nn.Module] = (),
    expert_mesh: DeviceMesh | None = None,
):
    """`experts`: expert-parallel experts modules, sharded on their own over `expert_mesh` (inside their
    layer's unit, which then holds the rest of the layer)."""
    param_dtype = DTYPES.get(p.param_dtype) or (torch.bfloat16 if device_type == "cuda" else torch.float32)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[p.reduce_dtype])
    for param in model.parameters():
        if not param.requires_grad:  # frozen (LoRA's base): stored as computed, no fp32 master copy
            param.data = param.data.to(param_dtype)
    inside = {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again right away by backward: keep them gathered.
        reshard = p.reshard_after_forward and i < len(layers) - 1
        for module in experts:
            if inside.get(id(module)) == i:
                fully_shard(module, mesh=expert_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=p.reshard_after_forward)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    p: ParallelConfig,
    device_type: str,
    features: list[Feature] = (),
    expert_mesh: DeviceMesh | None = None,
) -> PartialGrads:
    """`mesh`: the run's whole mesh; the decoder layers are split over its "tp" axis where it has one
    (model/tensor_parallel.py), and FSDP2 shards over the others. `expert_mesh` (expert parallelism,
    model/expert_parallel.py): the experts split over its "ep" axis, FSDP2 over the others. Returns the
    gradients to sum over tp after each step's backward (`PartialGrads`; none without tp)."""
    layers = decoder_layers(model)
    for feature in features:
        feature.convert(model)
    partial_grads = PartialGrads([], None)
    if tp_mesh(mesh) is not None:
        hf_config = next(m.config for m in model.modules() if hasattr(m, "config"))
        partial_grads = apply_tensor_parallel(layers, tp_mesh(mesh), layer_plan(hf_config))
    experts = []
    if expert_mesh is not None:
        experts = apply_expert_parallel(model, expert_mesh["ep"])
        expert_mesh = expert_mesh[tuple(n for n in expert_mesh.mesh_dim_names if n != "ep")]
    apply_compile_and_checkpointing(layers, p.activation_checkpointing, p.compile)
    apply_fsdp(model, layers, dp_mesh(mesh), p, device_type, experts, expert_mesh)
    return partial_grads
