"""Muon's exchange plan: which rank orthogonalises which matrix, and where each row travels.

FSDP2 shards a parameter's dim 0 in the ``torch.chunk`` layout: ``c = ceil(rows / W)`` rows per rank
of a shard group of W ranks, the last ranks fewer or none. Every matrix is orthogonalised once per
shard group, by one owner rank:

1. momentum / Nesterov run elementwise on each rank's own rows;
2. same-shaped matrices are grouped and packed into buckets ("megabatches"); every matrix gets an
   owner so that the ranks' Newton–Schulz FLOPs are balanced (``assign_owners``);
3. one ``all_to_all_single`` per bucket sends every rank's rows of matrix j (padded to ``c`` rows;
   NorMuon: with the rows' fp32 ``v`` appended bit for bit) to j's owner;
4. the owner reassembles its matrices and runs one batched Newton–Schulz per shape (NorMuon: then
   its row factors, which need the whole matrix);
5. a second ``all_to_all_single`` returns each rank its rows of the result, which it applies.

The plan holds, per bucket, the owners and the offsets of each rank's rows in the two buffers. It is
built from shapes alone, once per set of parameters with gradients, so every rank of a shard group
builds the same one (``verify_plan`` checks). On an HSDP mesh ``(dp_replicate, dp_shard)`` the
exchange runs over the ``Shard(0)`` dimension (gradients are already averaged over the other).

Tensor parallelism splits a matrix over more than one mesh axis (FSDP2's rows of a tensor-parallel
column shard, or of a row-wise layer's column block): each rank then holds a rectangle of it, not a
run of rows. The exchange is the same, over the group of all the axes that split it
(``distributed.shard_group``): the owner places each rank's rectangle where it belongs (``Item.blocks``,
gathered once when the plan is built) and sends the result's rectangles back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from muonrun import compat
from muonrun.distributed import local_tensor, shard_group


@dataclass(frozen=True)
class ShardInfo:
    group: Any  # ProcessGroup of the mesh axes that split the matrix, or None when it is local
    world: int
    rank: int
    rows_only: bool = True  # split by rows alone, in the torch.chunk layout (FSDP2, HSDP); else rectangles


LOCAL = ShardInfo(None, 1, 0)
ROW_VALUES = 2  # fp32 values per row in a NorMuon slab's state: its v, then the factor its owner sends back
DEFAULT_BUCKET_NUMEL = 1 << 28
Block = tuple[int, int, int, int]  # rows [r0, r1) x columns [c0, c1) of a matrix


def shard_info(p: Tensor, name: str) -> ShardInfo:
    """Where a parameter's parts live (``distributed.shard_group``); ValueError for pending partial sums."""
    if not isinstance(p, DTensor):
        return LOCAL
    if any(pl.is_partial() for pl in p.placements):
        raise ValueError(
            f"Muon: parameter {name} has placements {p.placements}: a partial (unreduced) parameter "
            "cannot be orthogonalised; only split (Shard) and replicated placements are supported."
        )
    group = shard_group(p)
    if group.world == 1:
        return LOCAL
    splits = [p.placements[a] for a in group.axes]
    rows_only = [type(pl) for pl in splits] == [Shard] and splits[0].dim == 0
    return ShardInfo(group.group, group.world, group.rank, rows_only)


def chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def local_rows(rows: int, world: int, rank: int) -> int:
    c = chunk_rows(rows, world)
    return max(0, min(rows, (rank + 1) * c) - rank * c)


@dataclass
class Item:
    """One matrix in the plan."""

    param: Tensor | None  # None in ``owner_flops``, which plans shapes alone
    group_index: int
    rows: int
    cols: int
    chunk: int  # rows per rank slab (ceil(rows / world); the most any rank holds); == rows when local
    local_rows: int
    local_cols: int  # this rank's columns (cols, but for a tensor-parallel column block)
    cost: int = 0  # Newton–Schulz FLOPs (NewtonSchulz.flops), for owner balancing
    row_state: int = 0  # buffer elements per row of fp32 per-row state (NorMuon's ROW_VALUES), 0: none
    owner: int = 0
    offset: int = 0  # element offset of this rank's slab in the bucket's send/receive buffer
    blocks: tuple[Block, ...] | None = None  # each rank's rectangle by shard-group rank; None: chunk rows
    own: Block = (0, 0, 0, 0)  # this rank's rectangle, until ``blocks`` are known

    @property
    def block(self) -> int:
        """Elements of the largest rank's part (the rows, or rectangle, a slab holds)."""
        if self.blocks is None:
            return self.chunk * self.cols
        return max((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in self.blocks)

    @property
    def state_at(self) -> int:
        """Offset of the per-row state in a slab: after the part, aligned for fp32 (to ``row_state``)."""
        x = max(self.row_state, 1)
        return -(-self.block // x) * x

    def state_view(self, buf: Tensor, index: int = 0) -> Tensor:
        """This rank's rows' ``index``-th fp32 per-row value (``ROW_VALUES``) in an exchange buffer laid
        out by the plan; the state region holds each value of all ``chunk`` rows in turn."""
        per_row = 4 // buf.element_size()  # buffer elements per fp32 value
        start = self.offset + self.state_at + index * self.chunk * per_row
        return buf[start : start + self.local_rows * per_row].view(torch.float32)

    @property
    def slab(self) -> int:
        """Elements of one rank's slab: its part (padded to ``block``) and its rows' per-row state (a
        multiple of ``row_state``, so every slab's state region in a bucket starts aligned)."""
        return self.state_at + self.chunk * self.row_state if self.row_state else self.block


@dataclass
class Owned:
    """Matrices of one shape, split the same way, that this rank owns in a bucket (one batched
    Newton–Schulz): ``count`` of them like ``first`` (the one telemetry samples), from ``offset`` in
    each source's segment of the owner buffer."""

    first: Item
    count: int
    offset: int


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
    normuon: tuple[float, float] | None  # NorMuon's (beta2, eps) for these matrices; None: Muon
    device: torch.device
    buckets: list[Bucket] = field(default_factory=list)


@dataclass(frozen=True)
class Entry:
    """A matrix with a gradient, as the optimizer hands it to ``build_plan``."""

    group_index: int
    name: str  # for error messages
    param: Tensor
    normuon: tuple[float, float] | None  # GroupSettings.normuon: matrices with the same one batch together
    cost: int = 0  # Newton–Schulz FLOPs the owner runs (NewtonSchulz.flops)
    row_state: int = 0  # Item.row_state


def build_plan(entries: Sequence[Entry], bucket_numel: int = DEFAULT_BUCKET_NUMEL) -> list[Partition]:
    """The plan: partitions, their buckets and every offset (the same on every rank: ``verify_plan``)."""
    plan = []
    for part, by_shape in _collect(entries):
        buckets = _pack(by_shape, bucket_numel)
        assign_owners(buckets, part.shard.world)
        verify_plan(part, buckets)
        if not part.shard.rows_only:
            _gather_blocks(part, [it for items in buckets for it in items])
        part.buckets = [_lay_out(items, part.shard) for items in buckets]
        plan.append(part)
    return plan


def _collect(entries: Sequence[Entry]) -> list[tuple[Partition, dict[tuple[int, int], list[Item]]]]:
    """The matrices by partition, one per shard group and NorMuon setting (an all-to-all runs over one
    process group, a batched NorMuon normalisation with one setting), and by shape inside each, in
    parameter order (split the same way: a row-wise layer's rectangles are not a column-wise one's)."""
    partitions: dict[tuple, tuple[Partition, dict[tuple[int, int], list[Item]]]] = {}
    for e in entries:
        info = shard_info(e.param, e.name)
        key = (id(info.group), info.rows_only, e.normuon)
        if key not in partitions:
            partitions[key] = (Partition(info, e.normuon, local_tensor(e.param).device), {})
        item = _item(e, info)
        item.cost, item.row_state = e.cost, e.row_state
        layout = () if info.rows_only else tuple(e.param.placements)
        partitions[key][1].setdefault((item.rows, item.cols, layout), []).append(item)
    return list(partitions.values())


def _item(e: Entry, info: ShardInfo) -> Item:
    """The matrix's slab size and local part; refuses a row-split shard that is not the chunk layout,
    since the owner reassembles rows by position."""
    rows, cols = e.param.shape
    if info.world == 1:
        return Item(e.param, e.group_index, rows, cols, chunk=rows, local_rows=rows, local_cols=cols)
    local = local_tensor(e.param)
    if not info.rows_only:  # a rectangle: its place is gathered with the others' (``_gather_blocks``)
        (n_rows, n_cols), (r0, c0) = compat.local_shape_and_offset(e.param)
        own = (r0, r0 + n_rows, c0, c0 + n_cols)
        return Item(e.param, e.group_index, rows, cols, n_rows, n_rows, n_cols, own=own)
    n_local = local_rows(rows, info.world, info.rank)
    if local.shape[0] != n_local or local.shape[1] != cols:
        raise ValueError(
            f"{e.name}: local shard {tuple(local.shape)} is not the torch.chunk layout "
            f"({n_local} rows expected on shard rank {info.rank})"
        )
    return Item(e.param, e.group_index, rows, cols, chunk_rows(rows, info.world), n_local, cols)


def _gather_blocks(part: Partition, items: list[Item]) -> None:
    """Every rank's rectangle of each matrix (``Item.blocks``), by rank of the shard group: one
    all-gather when the plan is built. ``chunk`` becomes the most rows any rank holds."""
    mine = torch.tensor([it.own for it in items], dtype=torch.int64, device=part.device).reshape(-1, 4)
    every = [torch.empty_like(mine) for _ in range(part.shard.world)]
    dist.all_gather(every, mine, group=part.shard.group)
    for i, it in enumerate(items):
        it.blocks = tuple(tuple(int(x) for x in every[w][i].tolist()) for w in range(part.shard.world))
        it.chunk = max(r1 - r0 for r0, r1, _, _ in it.blocks)


def assign_owners(buckets: Sequence[Sequence[Item]], world: int) -> None:
    """Give every matrix an owner so that Newton–Schulz FLOPs (``Item.cost``) are balanced per rank:
    deterministic greedy (longest processing time first), the largest matrix first, onto the rank with
    the least work so far (the whole step's first: the pipelined exchange lets a rank run ahead into the
    next bucket), then the least in the matrix's bucket, then the lowest rank. Equal matrices are thus
    dealt in turn within each bucket, and smaller shapes fill in where a shape's count does not divide
    by the world size, which dealing each shape round-robin cannot. Depends on shapes alone, so every
    rank computes the same owners."""
    total = [0] * world
    loads = [[0] * world for _ in buckets]
    order = sorted(
        ((it, load) for items, load in zip(buckets, loads, strict=True) for it in items),
        key=lambda pair: -pair[0].cost,  # stable: parameter order among equals
    )
    for it, load in order:
        r = min(range(world), key=lambda r: (total[r], load[r], r))
        it.owner = r
        total[r] += it.cost
        load[r] += it.cost


def owner_flops(
    shapes: Iterable[Sequence[int]],
    world: int,
    flops: Callable[[Sequence[int]], int],
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> list[int]:
    """Newton–Schulz FLOPs per rank of one step for matrices of these shapes on ``world`` ranks, each
    ``flops(shape)`` (``NewtonSchulz.flops``), owners assigned as Muon assigns them (``assign_owners``)."""
    by_shape: dict[tuple, list[Item]] = {}
    for shape in shapes:
        rows, cols = int(shape[0]), int(shape[1])
        by_shape.setdefault((rows, cols), []).append(
            Item(None, 0, rows, cols, rows, rows, cols, flops((rows, cols)))
        )
    assign_owners(_pack(by_shape, bucket_numel), world)
    per_rank = [0] * world
    for it in (it for items in by_shape.values() for it in items):
        per_rank[it.owner] += it.cost
    return per_rank


def _pack(by_shape: dict[tuple, list[Item]], bucket_numel: int) -> list[list[Item]]:
    """Each shape's matrices in runs that fit a bucket (one matrix at least), the runs in order into
    buckets, a new one opened where the next run would overflow it. Bigger buckets mean fewer, larger
    collectives and batched matmuls; the bound caps a bucket's transient memory (send and receive
    buffers, the owner's reassembled matrices)."""
    buckets: list[list[Item]] = [[]]
    numel = 0
    for (rows, cols, *_), items in by_shape.items():
        per_run = max(1, bucket_numel // max(rows * cols, 1))
        for start in range(0, len(items), per_run):
            run = items[start : start + per_run]
            if buckets[-1] and numel + rows * cols * len(run) > bucket_numel:
                buckets.append([])
                numel = 0
            buckets[-1].extend(run)
            numel += rows * cols * len(run)
    return [b for b in buckets if b]


def _lay_out(items: list[Item], shard: ShardInfo) -> Bucket:
    """Offsets and splits of one bucket's exchange, and what this rank owns in it. Items are sorted by
    owner, then shape (stable: parameter order inside), so each destination's rows are one contiguous
    send split and an owner's same-shaped matrices from one source are adjacent (one batched
    Newton–Schulz reads them in place). Every source sends an owner the same layout: all receive
    splits are equal."""
    world, me = shard.world, shard.rank
    shape_rank = {s: k for k, s in enumerate(dict.fromkeys(_stack_key(it) for it in items))}
    items = sorted(items, key=lambda it: (it.owner, shape_rank[_stack_key(it)]))
    send_splits = [0] * world
    offset = 0
    for it in items:
        it.offset = offset
        send_splits[it.owner] += it.slab
        offset += it.slab
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
        if it.local_rows * it.local_cols < it.block:  # zeros: the owner's norm runs over whole slabs
            bucket.padding.append((it.offset + it.local_rows * it.local_cols, it.offset + it.block))
    bucket.by_group = list(by_group.items())
    bucket.by_update = [(g, r, c, its) for (g, r, c), its in by_update.items()]
    return bucket


def _owned(items: list[Item], me: int) -> list[Owned]:
    """This rank's matrices in a sorted bucket: runs of one shape, at offsets in each source's segment."""
    owned: list[Owned] = []
    offset = 0
    for it in items:
        if it.owner != me:
            continue
        if owned and _stack_key(owned[-1].first) == _stack_key(it):
            owned[-1].count += 1
        else:
            owned.append(Owned(it, 1, offset))
        offset += it.slab
    return owned


def _stack_key(it: Item) -> tuple:
    """Matrices that batch into one Newton–Schulz stack: the same shape, split the same way."""
    return it.rows, it.cols, it.blocks


def scatter_rows(dst: Tensor, src: Tensor, c: int) -> None:
    """Write matrices ``src`` ``[k, R, ...]`` into the slabs ``dst`` ``[W, k, c, ...]`` of their rows
    (slab w holds rows ``[w c, (w + 1) c)``; its padding rows past ``R`` are left as they are)."""
    W, k, R = dst.shape[0], src.shape[0], src.shape[1]
    rest = src.shape[2:]
    if W * c == R:
        dst.copy_(src.reshape(k, W, c, *rest).transpose(0, 1))
        return
    nfull, rem = divmod(R, c)
    if nfull:
        dst[:nfull].copy_(src[:, : nfull * c].reshape(k, nfull, c, *rest).transpose(0, 1))
    if rem:
        dst[nfull, :, :rem].copy_(src[:, nfull * c :])


def verify_plan(part: Partition, buckets: Sequence[Sequence[Item]]) -> None:
    """Check that every rank of a shard group is about to build the same buckets: a rank with another
    plan would send parts to the wrong owner or hang in a collective. It runs whenever a plan is built,
    before anything is exchanged: the optimizer's only host synchronisation, normally once, at the
    first step."""
    if part.shard.group is None:
        return
    # Python hashes ints and tuples of them the same in every process (PYTHONHASHSEED is for strings)
    h = hash(tuple(tuple((it.rows, it.cols, it.owner) for it in items) for items in buckets)) % (1 << 62)
    t = torch.tensor([h, -h], dtype=torch.int64, device=part.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=part.shard.group)
    if int(t[0]) != h or int(t[1]) != -h:
        raise RuntimeError(
            "Muon: ranks of a shard group disagree on which parameters have gradients or on their "
            "shapes; every rank must step the same matrices (a grad that is None on one rank must "
            "be None on all)."
        )
