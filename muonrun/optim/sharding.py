"""Muon's exchange plan: which rank orthogonalises which matrix, and where each row travels.

FSDP2 shards a parameter's dim 0 in the ``torch.chunk`` layout: ``c = ceil(rows / W)`` rows per rank
of a shard group of W ranks, the last ranks fewer or none. Muon gives every matrix one owner rank,
which receives every rank's rows (padded to ``c``), runs Newton–Schulz on the whole matrix and sends
the rows back. The plan says, per bucket of matrices, who owns what and the offsets of each rank's
rows in the send and receive buffers of the two ``all_to_all_single`` calls. It is built once per
set of parameters with gradients, from shapes alone, so it is the same on every rank of a shard
group (``verify_plan`` checks that). Only ``muonrun.optim.muon`` uses this module.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonrun.distributed import local_tensor

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = Shard = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class ShardInfo:
    group: Any  # ProcessGroup of the Shard(0) mesh dim, or None when the full matrix is local
    world: int
    rank: int


LOCAL = ShardInfo(None, 1, 0)


def shard_info(p: Tensor, name: str) -> ShardInfo:
    """Where a parameter's rows live. Raises ValueError for any layout but (Replicate*, Shard(0))."""
    if DTensor is None or not isinstance(p, DTensor):
        return LOCAL
    mesh = p.device_mesh
    shard_dims = []
    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is Shard and pl.dim == 0:
            shard_dims.append(mesh_dim)
            continue
        raise ValueError(
            f"Muon: parameter {name} has placements {p.placements} on mesh {mesh}; only FSDP/HSDP "
            "layouts (Replicate() and one Shard(0)) are supported. Tensor-parallel or partial "
            "placements are not."
        )
    if not shard_dims:
        return LOCAL
    if len(shard_dims) > 1:
        raise ValueError(
            f"Muon: parameter {name} is sharded on dim 0 over several mesh dims {p.placements}; "
            "flatten them into one mesh dim."
        )
    md = shard_dims[0]
    world = mesh.size(md)
    if world == 1:
        return LOCAL
    return ShardInfo(mesh.get_group(md), world, mesh.get_local_rank(md))


def chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    c = chunk_rows(rows, world)
    return max(0, min(rows, (rank + 1) * c) - rank * c)


@dataclass
class Item:
    """One matrix in the plan."""

    param: Tensor
    group_index: int
    rows: int
    cols: int
    chunk: int  # rows per rank slab (ceil(rows / world)); == rows when local
    local_rows: int
    owner: int = 0
    offset: int = 0  # element offset of this rank's slab in the bucket's send/receive buffer


@dataclass
class Owned:
    """Matrices of one shape that this rank owns in a bucket (one batched Newton–Schulz)."""

    rows: int
    cols: int
    chunk: int
    count: int
    offset: int  # element offset inside each source's segment of the owner buffer


@dataclass
class Bucket:
    """Matrices exchanged together: one all-to-all each way, one batched Newton–Schulz per shape."""

    items: list[Item]  # ordered by owner, then shape
    send_splits: list[int]
    recv_splits: list[int]
    send_numel: int
    recv_numel: int
    owned: list[Owned]
    per_source: int  # elements per source in the owner buffer
    by_group: list[tuple[int, list[Item]]] = field(default_factory=list)  # momentum, decay
    by_update: list[tuple[int, int, int, list[Item]]] = field(default_factory=list)  # (group, rows, cols)
    padding: list[tuple[int, int]] = field(default_factory=list)  # send-buffer ranges to zero


@dataclass
class Partition:
    """Matrices that share a shard group and Newton–Schulz settings, in buckets."""

    shard: ShardInfo
    ns: Hashable  # the Newton–Schulz settings of these matrices (muon.py's NSSettings)
    device: torch.device
    buckets: list[Bucket] = field(default_factory=list)


@dataclass(frozen=True)
class Entry:
    """A matrix with a gradient, as the optimizer hands it to ``build_plan``."""

    group_index: int
    name: str  # for error messages
    param: Tensor
    ns: Hashable


def build_plan(entries: Sequence[Entry], bucket_numel: int) -> list[Partition]:
    """The plan for these matrices: partitions, their buckets and every offset. Every rank of a
    shard group must call it with the same matrices: ``verify_plan`` all-reduces once to check."""
    plan = []
    for part, by_shape in _collect(entries):
        pieces = _assign_owners(by_shape, part.shard.world, bucket_numel)
        part.buckets = [_lay_out(items, part.shard) for items in _pack(pieces, bucket_numel)]
        plan.append(part)
    verify_plan(plan)
    return plan


def _collect(entries: Sequence[Entry]) -> list[tuple[Partition, dict[tuple[int, int], list[Item]]]]:
    """Group the matrices into partitions, and by shape inside each (in parameter order).

    One partition per (shard group, Newton–Schulz settings): an all-to-all runs over one process
    group and a batched Newton–Schulz runs with one setting; same-shaped matrices batch together.
    """
    partitions: dict[tuple, tuple[Partition, dict[tuple[int, int], list[Item]]]] = {}
    for e in entries:
        info = shard_info(e.param, e.name)
        key = (id(info.group), e.ns)
        if key not in partitions:
            partitions[key] = (Partition(info, e.ns, local_tensor(e.param).device), {})
        item = _item(e, info)
        partitions[key][1].setdefault((item.rows, item.cols), []).append(item)
    return list(partitions.values())


def _item(e: Entry, info: ShardInfo) -> Item:
    """The matrix's slab size and local rows; refuses a local shard that is not the chunk layout,
    since the owner reassembles rows by position."""
    rows, cols = e.param.shape
    if info.world == 1:
        return Item(e.param, e.group_index, rows, cols, chunk=rows, local_rows=rows)
    local = local_tensor(e.param)
    n_local = local_rows(rows, info.world, info.rank)
    if local.shape[0] != n_local or local.shape[1] != cols:
        raise ValueError(
            f"{e.name}: local shard {tuple(local.shape)} is not the torch.chunk layout "
            f"({n_local} rows expected on shard rank {info.rank})"
        )
    return Item(e.param, e.group_index, rows, cols, chunk_rows(rows, info.world), n_local)


def _assign_owners(
    by_shape: dict[tuple[int, int], list[Item]], world: int, bucket_numel: int
) -> list[list[Item]]:
    """Split each shape's matrices into pieces of a multiple of ``world`` matrices that fit a bucket,
    and give each piece's matrices consecutive owners.

    Every rank then owns equally many matrices of each full piece. The first owner rotates from
    piece to piece, so the remainders of partial pieces spread over the ranks instead of all
    landing on rank 0.
    """
    pieces = []
    start = 0
    for (rows, cols), items in by_shape.items():
        per_piece = max(world, (bucket_numel // max(rows * cols, 1)) // world * world)
        for s in range(0, len(items), per_piece):
            piece = items[s : s + per_piece]
            for j, item in enumerate(piece):
                item.owner = (start + j) % world
            start = (start + len(piece)) % world
            pieces.append(piece)
    return pieces


def _pack(pieces: list[list[Item]], bucket_numel: int) -> list[list[Item]]:
    """Fill buckets with whole pieces in order, opening a new one when the next piece would overflow.

    Bigger buckets mean fewer, larger collectives and batched matmuls; the bound caps the transient
    memory (send and receive buffers, the owner's reassembled matrices) of a bucket.
    """
    buckets: list[list[Item]] = []
    current: list[Item] = []
    numel = 0
    for piece in pieces:
        piece_numel = piece[0].rows * piece[0].cols * len(piece)
        if current and numel + piece_numel > bucket_numel:
            buckets.append(current)
            current, numel = [], 0
        current.extend(piece)
        numel += piece_numel
    if current:
        buckets.append(current)
    return buckets


def _lay_out(items: list[Item], shard: ShardInfo) -> Bucket:
    """Offsets and splits of one bucket's exchange, and what this rank owns in it.

    Items are sorted by owner, then shape (stable, so parameter order holds inside): each
    destination's rows are then one contiguous send split, and on the owner the same-shaped
    matrices from one source are adjacent, so one batched Newton–Schulz reads them in place. Every
    source sends an owner the same layout, so all receive splits are equal.
    """
    world, me = shard.world, shard.rank
    shape_rank = {s: k for k, s in enumerate(dict.fromkeys((it.rows, it.cols) for it in items))}
    items = sorted(items, key=lambda it: (it.owner, shape_rank[(it.rows, it.cols)]))
    send_splits = [0] * world
    offset = 0
    for it in items:
        it.offset = offset
        send_splits[it.owner] += it.chunk * it.cols
        offset += it.chunk * it.cols
    per_source = send_splits[me]
    bucket = Bucket(
        items=items,
        send_splits=send_splits,
        recv_splits=[per_source] * world,
        send_numel=offset,
        recv_numel=per_source * world,
        owned=_owned(items, me),
        per_source=per_source,
    )
    by_group: dict[int, list[Item]] = {}
    by_update: dict[tuple[int, int, int], list[Item]] = {}
    for it in items:
        by_group.setdefault(it.group_index, []).append(it)
        by_update.setdefault((it.group_index, it.rows, it.cols), []).append(it)
        if it.local_rows < it.chunk:  # zero rows: the owner's norm runs over whole slabs
            bucket.padding.append((it.offset + it.local_rows * it.cols, it.offset + it.chunk * it.cols))
    bucket.by_group = list(by_group.items())
    bucket.by_update = [(g, r, c, its) for (g, r, c), its in by_update.items()]
    return bucket


def _owned(items: list[Item], me: int) -> list[Owned]:
    """This rank's matrices in a sorted bucket, as runs of one shape, with their offset in each
    source's segment of the receive buffer."""
    owned: list[Owned] = []
    offset = 0
    for it in items:
        if it.owner != me:
            continue
        if owned and (owned[-1].rows, owned[-1].cols) == (it.rows, it.cols):
            owned[-1].count += 1
        else:
            owned.append(Owned(it.rows, it.cols, it.chunk, 1, offset))
        offset += it.chunk * it.cols
    return owned


def verify_plan(plan: list[Partition]) -> None:
    """Check that every rank of each shard group built the same buckets.

    A rank with a different plan would send rows to the wrong owner or hang in the all-to-all, so
    this runs whenever the plan is built: the optimizer's only host synchronisation, normally once,
    at the first step.
    """
    for part in plan:
        if part.shard.group is None:
            continue
        sig = [len(part.buckets)]
        for b in part.buckets:
            sig.append(len(b.items))
            sig.append(sum(it.rows * 1_000_003 + it.cols for it in b.items) % (1 << 30))
        h = 0
        for x in sig:
            h = (h * 1_000_000_007 + x) % (1 << 61)
        t = torch.tensor([h, -h], dtype=torch.int64, device=part.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=part.shard.group)
        if int(t[0]) != h or int(t[1]) != -h:
            raise RuntimeError(
                "Muon: ranks of a shard group disagree on which parameters have gradients or on their "
                "shapes; every rank must step the same matrices (a grad that is None on one rank must "
                "be None on all)."
            )
