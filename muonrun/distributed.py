"""Process group, device mesh and the few cross-rank reductions the trainer needs.

Works the same under torchrun (RANK/WORLD_SIZE/... set by torch.distributed.run) and in a single
in-process worker (no environment: a world of one).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from muonrun.compat import clear_mesh_caches
from muonrun.compat import local_tensor as local_tensor  # where the package imports it from
from muonrun.errors import UserError

if TYPE_CHECKING:  # only the type: this module imports torch alone, so the optimizers can use it
    from muonrun.config import Config


@dataclass
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    """The mesh, outermost axis first: ("dp_shard",) for FSDP, ("dp_replicate", "dp_shard") for HSDP,
    either with "tp" innermost for tensor parallelism."""
    expert_mesh: DeviceMesh | None = None
    """With expert parallelism, the same ranks as (dp_replicate, efsdp, ep): dp_shard split into the
    experts' FSDP axis and "ep" innermost (model/expert_parallel.py); None without."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks (1: none)."""
        return tp_mesh(self.mesh).size() if tp_mesh(self.mesh) is not None else 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads its own batches."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: the tp ranks of one data-parallel rank share it (and their
        batches). Ranks are laid out row-major over the mesh, tp innermost."""
        return self.rank // self.tp


def tp_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The tensor-parallel axis of a muonrun mesh, or None."""
    return mesh["tp"] if "tp" in (mesh.mesh_dim_names or ()) else None


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel axes of a muonrun mesh (FSDP2 shards over them): all but "tp"."""
    names = tuple(n for n in mesh.mesh_dim_names or () if n != "tp")
    return mesh if len(names) == mesh.ndim else mesh[names]


def mesh_shape(c: Config, world_size: int, how: str = "nnodes x nproc_per_node") -> tuple[int, int]:
    """The (dp_replicate, dp_shard) axes for this world size (with parallel.tp innermost beside them), or
    a UserError saying how to fix it. dp_replicate=-1 means launch.nnodes; dp_shard=-1 takes what is
    left."""
    tp = c.parallel.tp
    replicate = c.parallel.dp_replicate if c.parallel.dp_replicate != -1 else c.launch.nnodes
    shard = c.parallel.dp_shard if c.parallel.dp_shard != -1 else world_size // (replicate * tp)
    if shard < 1 or replicate * shard * tp != world_size:
        shown = f"-1 (one per node: {replicate})" if c.parallel.dp_replicate == -1 else replicate
        with_tp = f" x parallel.tp={tp}" if tp > 1 else ""
        raise UserError(
            f"parallel.dp_replicate={shown} x parallel.dp_shard={c.parallel.dp_shard}{with_tp} does not fit a "
            f"world of {world_size} workers ({how}). Make the product equal the world size, or set "
            "parallel.dp_shard=-1 with a dp_replicate (and tp) that divides it."
        )
    return replicate, shard


def pick_device_type(c: Config) -> str:
    if c.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return c.train.device


def check_device(c: Config) -> None:
    """Before any worker starts: `train.device=cuda` and `launch.backend=nccl` need a CUDA GPU on this
    machine (found later they would fail inside every worker with torch's own message)."""
    cuda = torch.cuda.is_available()
    why = (
        f"this torch build ({torch.__version__}) has no CUDA support"
        if torch.version.cuda is None
        else "torch finds no CUDA GPU (no device visible, or no driver)"
    )
    if c.train.device == "cuda" and not cuda:
        raise UserError(
            f"Config key 'train.device' is 'cuda', but {why}. Set train.device=cpu (or auto: the GPUs where "
            "there are some, else the CPU), or run on a machine with GPUs."
        )
    if c.launch.backend == "nccl" and pick_device_type(c) != "cuda":
        where = why if not cuda else f"train.device is '{c.train.device}'"
        raise UserError(
            f"Config key 'launch.backend' is 'nccl', which connects CUDA GPUs only, but this run's workers "
            f"compute on the CPU ({where}). Set launch.backend=gloo (or auto: nccl on GPUs, gloo on CPUs)."
        )


def init_distributed(c: Config) -> Dist:
    """Initialise the default process group (gloo on CPU, nccl on GPU) and the data-parallel mesh."""
    # Large, differently sized temporaries (loss chunks, Muon's buckets, FSDP2's gather buffers)
    # fragment the default CUDA caching allocator; expandable segments avoid the cudaMalloc retries
    # (torchtitan's default too). Read at the first CUDA allocation, so it must be set before it.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    # Under torch.distributed.run the environment names this worker; without it this is the single
    # in-process worker: a world of one on an in-memory store (no port, nothing written to os.environ).
    rank, local_rank, world = (
        int(os.environ.get(k, d)) for k, d in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1))
    )
    alone = "MASTER_ADDR" not in os.environ and world == 1
    device_type = pick_device_type(c)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = (
        c.launch.backend if c.launch.backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
    )
    if not dist.is_initialized():
        device_id = device if device_type == "cuda" else None
        if alone:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id
            )
        else:  # a rank that stalls stops the job after launch.collective_timeout_s (launch/stall.py)
            timeout = timedelta(seconds=c.launch.collective_timeout_s)
            dist.init_process_group(backend=backend, device_id=device_id, timeout=timeout)
    replicate, shard = mesh_shape(c, world)
    axes = [("dp_replicate", replicate)] if replicate > 1 else []
    axes += [("dp_shard", shard)] + ([("tp", c.parallel.tp)] if c.parallel.tp > 1 else [])
    mesh = init_device_mesh(
        device_type, tuple(n for _, n in axes), mesh_dim_names=tuple(name for name, _ in axes)
    )
    expert_mesh = None
    if c.parallel.ep > 1:
        ep = c.parallel.ep
        axes = [("dp_replicate", replicate)] if replicate > 1 else []
        axes += [("efsdp", shard // ep), ("ep", ep)]
        expert_mesh = init_device_mesh(
            device_type, tuple(n for _, n in axes), mesh_dim_names=tuple(name for name, _ in axes)
        )
    return Dist(rank, local_rank, world, device, mesh, expert_mesh)


@dataclass(frozen=True)
class ShardGroup:
    """The ranks over which a tensor's local shards are split, and this rank's place among them."""

    group: dist.ProcessGroup | None
    """None: this rank holds the whole tensor."""
    world: int
    rank: int
    axes: tuple[int, ...] = ()
    """The mesh axes the tensor is split over."""


WHOLE = ShardGroup(None, 1, 0)
_FLATTENED: dict[tuple, dict[tuple[int, ...], dist.ProcessGroup]] = {}


def shard_group(t: torch.Tensor) -> ShardGroup:
    """Where a tensor's shards live: the process group of the mesh axes its DTensor placements split
    (`Shard` and its strided form; `Replicate` axes hold copies), or WHOLE for a plain tensor or one
    not split. Several split axes (FSDP2 over tensor parallelism) share one group over their product,
    made on first use for every coordinate of the other axes (so every rank makes the same groups in the
    same order); its ranks are in global rank order."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return WHOLE
    mesh = t.device_mesh
    axes = tuple(d for d, pl in enumerate(t.placements) if not isinstance(pl, Replicate) and mesh.size(d) > 1)
    if not axes:
        return WHOLE
    if len(axes) == 1:
        return ShardGroup(mesh.get_group(axes[0]), mesh.size(axes[0]), mesh.get_local_rank(axes[0]), axes)
    ranks = mesh.mesh
    key = (tuple(ranks.shape), tuple(ranks.flatten().tolist()), axes)
    if key not in _FLATTENED:
        other = [d for d in range(ranks.ndim) if d not in axes]
        per_other = ranks.permute(*other, *axes).reshape(-1, math.prod(ranks.shape[d] for d in axes))
        _FLATTENED[key] = {
            tuple(sorted(row.tolist())): dist.new_group(sorted(row.tolist())) for row in per_other
        }
    me = dist.get_rank()
    members = next(m for m in _FLATTENED[key] if me in m)
    return ShardGroup(_FLATTENED[key][members], len(members), members.index(me), axes)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce_mean(values: torch.Tensor) -> torch.Tensor:
    """Average a small tensor of metrics over all ranks (one collective for many numbers)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.AVG if dist.get_backend() == "nccl" else dist.ReduceOp.SUM)
        if dist.get_backend() != "nccl":  # gloo has no AVG
            values /= dist.get_world_size()
    return values


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """A few host numbers as a float32 tensor on `device` with no host-to-device copy (each value is a
    fill kernel's argument): a copy from pageable memory would make the host wait for all GPU work
    queued so far."""
    return torch.stack([torch.full((), v, dtype=torch.float32, device=device) for v in values])


class HostCopy:
    """A small device tensor copied to pinned host memory without waiting: `.values()` blocks only
    until that copy is done, which one step later it long is (muonrun/train/agreement.py, metrics.py)."""

    def __init__(self, values: torch.Tensor):
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host, self.done = values, None

    def values(self) -> list[float]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


def destroy(barrier: bool = True) -> None:
    if dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
    _FLATTENED.clear()  # their process groups went with the default one


def release_process_groups() -> None:
    """After destroy(), once the training objects are gone: free the process groups (and gloo's threads)
    while the interpreter is whole. DTensor's caches keep DeviceMeshes, and through them every process
    group, alive to the end of the process even after destroy_process_group; freed in interpreter
    teardown instead, gloo's threads can abort the process ("terminate called without an active
    exception"), turning a finished run or exit code 3 into -6. A group still live (a rank that failed
    alone, its peers perhaps inside a collective with it) is left to the process exit."""
    import gc

    if dist.is_initialized():
        return
    clear_mesh_caches()
    _FLATTENED.clear()
    gc.collect()
