"""Every private torch name muonrun uses, in one place, each with a test in tests/test_compat.py that fails
naming it when a torch release changes or removes it. Nothing else in muonrun touches a private torch name.

Why each one is here, and not torch's public API:
- `torch._foreach_*`: the multi-tensor kernels behind torch's own optimizers and `clip_grad_norm_`; the
  public API has no list-of-tensors arithmetic, and a Python loop costs a kernel launch per tensor.
- `DTensor._local_tensor`: the local shard without `to_local()`'s autograd node, read on hundreds of
  tensors per step by the optimizers and the clip.
- `torch.distributed.tensor._utils.compute_local_shape_and_global_offset`: which rows of a sharded
  parameter this rank holds (HF weights read shard by shard, QK-clip's per-head rows); DTensor has no
  public accessor for its global offset.
- `torch.optim.AdamW._init_group`: where torch gathers a param group's lists for its functional AdamW;
  muonrun's AdamW swaps in the local shards there (muonrun/optim/adamw.py says why).
- `FileSystemReader._get_metadata_path`: the path of DCP's metadata file, which muonrun reads itself
  through an allow-listing unpickler (muonrun/checkpoint/safe.py).
- `torch.distributed.checkpoint.filesystem._write_files_from_queue`: the function DCP's extra writer
  threads run, whose name their default thread names carry. A save that runs out of room raises from
  DCP's own writer while the others may still be writing and dying of it; muonrun waits for them
  (`dcp_writer_threads`) so that their tracebacks are kept, not printed (muonrun/checkpoint/room.py).
- DTensor's caches (`MESH_CACHES`): they keep every DeviceMesh, and through them every process group,
  alive to the end of the process; torch offers no public way to empty them.
- `torch._dynamo.exc.TorchDynamoException`: what `torch.compile` raises when it cannot compile a
  function (`BackendCompilerFailed`, `Unsupported`, ... derive from it). Muon's fused passes
  (muonrun/optim/fused.py) catch it on their first call, before anything ran, to fall back to the
  eager ops; torch exports no public base class for compile failures, and catching every exception
  would also swallow a failure that happened after some kernels had run.
- inductor's `loop_ordering_after_fusion` (and `loop_reindexing_after_fusion` where torch has it), passed
  as `torch.compile(options=...)` (the public parameter; the names are inductor's config): turned off for
  Muon's passes over stacked experts read through strided views (GPT-OSS's `[E, in, out]`), where with
  several parameters in one foreach its reordering of a combined kernel's loops fails an assertion
  (`reorder_loops_by_dep_pair`, torch 2.11 on an H200) and the passes would run eagerly.
- inductor's `emulate_precision_casts`, passed the same way: on for the split restart's kernel that
  writes an fp32 matrix as two bf16 halves (muonrun/optim/ns_products.py, `split_bf16`). By default
  inductor keeps a value cast down and back up within one kernel at full precision, which makes the low
  half (the value minus its bf16 rounding) zero: the split restart would then run on a bf16 Gram matrix,
  which is what it exists to avoid.
- `nn.Module._parameters`: where a module keeps its parameters. Expert parallelism (muonrun/model/
  expert_parallel.py) runs transformers' experts forward on the local shards of its DTensor weights for
  the duration of one call (`local_parameters`), as transformers' own expert parallelism does; a
  module's `__setattr__` refuses a plain tensor where a Parameter is registered.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from collections.abc import Callable, Sequence
from functools import reduce
from typing import Any

import torch
from torch import Tensor

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]

# -- multi-tensor kernels --------------------------------------------------------------------------------

FOREACH = ("norm", "sub", "mul", "mul_", "add_", "lerp", "lerp_", "copy_")
"""The `torch._foreach_<name>` kernels muonrun calls."""

foreach_norm: Callable[..., list[Tensor]] = torch._foreach_norm
foreach_sub: Callable[..., list[Tensor]] = torch._foreach_sub
foreach_mul: Callable[..., list[Tensor]] = torch._foreach_mul
foreach_mul_: Callable[..., None] = torch._foreach_mul_
foreach_add_: Callable[..., None] = torch._foreach_add_
foreach_lerp: Callable[..., list[Tensor]] = torch._foreach_lerp
foreach_lerp_: Callable[..., None] = torch._foreach_lerp_
foreach_copy_: Callable[..., None] = torch._foreach_copy_


# -- DTensor ---------------------------------------------------------------------------------------------


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view sharing its storage), or the tensor itself. Reads the
    attribute instead of calling `to_local()`, which records an autograd node on every call: the
    optimizers and the clip call it on hundreds of tensors per step."""
    return t._local_tensor if DTensor is not None and isinstance(t, DTensor) else t


def local_shape_and_offset(t: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's shard of `t`: its shape and the global index of its first element."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


MESH_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_python_sharding_prop_cache", ""),
    ("torch.distributed.tensor.debug", "_clear_fast_path_sharding_prop_cache", ""),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache", ""),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos", "cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh", "cache_clear"),
)
"""DTensor's caches that hold DeviceMeshes for the life of the process: (module, attribute path, the
method that empties it, or "" when the attribute is that function)."""


def mesh_cache_clearer(module: str, path: str, method: str) -> Callable[[], Any]:
    """The function that empties one of `MESH_CACHES`; ImportError or AttributeError if this torch
    lacks it."""
    cache = reduce(getattr, path.split("."), importlib.import_module(module))
    return getattr(cache, method) if method else cache


def clear_mesh_caches() -> None:
    """Empty DTensor's mesh caches (those this torch has: the test names any that went missing)."""
    for entry in MESH_CACHES:
        with contextlib.suppress(ImportError, AttributeError):
            mesh_cache_clearer(*entry)()


# -- optimizers ------------------------------------------------------------------------------------------


class AdamWWithGroupLists(torch.optim.AdamW):
    """`torch.optim.AdamW` that hands a subclass the lists torch gathers for each param group
    (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps) after torch filled them and
    before its functional AdamW runs on them: `group_lists` may replace their items in place."""

    def group_lists(self, group: dict, lists: Sequence[list[Tensor]]) -> None:
        """Override: edit `lists` in place."""

    def _init_group(self, group: dict, *lists: list[Tensor]):
        out = super()._init_group(group, *lists)
        self.group_lists(group, lists)
        return out


# -- distributed checkpoint ------------------------------------------------------------------------------


def dcp_metadata_path(reader, rank: int | None = None):
    """The metadata file a `torch.distributed.checkpoint.FileSystemReader` reads (per rank, or the
    global one)."""
    return reader._get_metadata_path(rank)


def dcp_writer_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """DCP FileSystemWriter's extra writer threads alive now that were not among `before`."""
    return [
        t for t in threading.enumerate() if t not in before and t.name.endswith("(_write_files_from_queue)")
    ]


# -- torch.compile -----------------------------------------------------------------------------------------


def compile_error() -> type[Exception]:
    """The base class of `torch.compile`'s own errors (imported when first needed: it loads dynamo)."""
    from torch._dynamo.exc import TorchDynamoException

    return TorchDynamoException


def no_loop_reordering() -> dict[str, bool]:
    """`torch.compile` options that turn off inductor's loop reordering during fusion: the option names
    this torch has, each False (see the module docstring)."""
    from torch._inductor import config

    names = ("loop_ordering_after_fusion", "loop_reindexing_after_fusion")
    return {name: False for name in names if hasattr(config, name)}


def precise_casts() -> dict[str, bool]:
    """`torch.compile` options under which each cast in a compiled kernel rounds as it does eagerly (see
    the module docstring); raises where this torch's inductor lacks the option, rather than compile a
    split whose low half is zero."""
    from torch._inductor import config

    if not hasattr(config, "emulate_precision_casts"):
        raise RuntimeError(
            "torch._inductor.config.emulate_precision_casts is gone from this torch; muonrun.compat."
            "precise_casts needs another way to keep casts' rounding in compiled kernels"
        )
    return {"emulate_precision_casts": True}


@contextlib.contextmanager
def local_parameters(module: torch.nn.Module, through: Callable[[Tensor], Tensor] = lambda t: t):
    """Within the block, `module`'s own DTensor parameters are their local shards passed `through` a
    differentiable function (gradients reach the DTensors); restored after it."""
    from torch.distributed.tensor import DTensor

    originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    module._parameters.update({n: through(p.to_local()) for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)
