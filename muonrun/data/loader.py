"""Batches for each data-parallel rank, resumable from a small state dict.

Map-style sources (the default) are cached token streams cut into windows of seq_len+1 tokens.
Each epoch is a list of window ids: source s contributes round(N * w_s / sum(w)) windows, N being
the total window count, taken from its own endless sequence of seeded permutations (so a small source
repeats and a large one is subsampled, a different subset each epoch, nothing repeating before every
window was seen), and the list is shuffled with seed (train.seed, epoch). All ranks share one global
sample cursor: micro-batch k of rank r is global samples cursor + (k*dp_size + r)*B ... + B. The
state {epoch, cursor} does not depend on dp_size, so a run can resume on a different number of ranks.

Streaming sources are read per rank (`split_dataset_by_node`) in blocks of data.shuffle_buffer
documents, each block shuffled, tokenized and packed; each window's source is a seeded weighted
choice. The state keeps, per source, the dataset's `state_dict()` at the start of the current block,
the tokens carried over from the previous block and the windows already taken from this one, so
resume re-reads one block and continues exactly. It is per rank: resume needs the same dp_size.

Document boundaries are not exported (no cross-document attention masking): windows span documents.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import warnings
from itertools import islice

import numpy as np
import torch

from muonrun.data.cache import TokenCache, ensure_cached
from muonrun.data.sources import load_source, read_error
from muonrun.data.tokenizer import encode_docs
from muonrun.errors import UserError

log = logging.getLogger(__name__)

_CHOICE_CHUNK = 4096  # streaming mixture: source choices are drawn in seeded chunks of this many windows


def _to_batch(rows: np.ndarray, pin_memory: bool) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    batch = {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
    if pin_memory and torch.cuda.is_available():
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch


def _weights(sources: list[tuple[str, object]]) -> np.ndarray:
    w = np.array([float(src.weight) for _, src in sources])
    for (key, src), x in zip(sources, w, strict=True):
        if not x > 0:
            raise UserError(f"Config key '{key}.weight' is {src.weight}; mixture weights must be positive.")
    return w / w.sum()


class PackedLoader:
    """Infinite iterator over batches of cached windows for one rank (see the module docstring)."""

    def __init__(self, windows, probs, batch_size, seed, shuffle, dp_rank=0, dp_size=1, pin_memory=False):
        assert 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        self.windows = windows  # list of [n_s, seq_len+1] arrays (memmaps)
        self.sizes = np.array([len(w) for w in windows], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        total = int(self.sizes.sum())
        self.quotas = np.maximum(1, np.round(total * np.asarray(probs)).astype(np.int64))
        self.epoch_size = int(self.quotas.sum())
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.dp_rank, self.dp_size, self.pin_memory = dp_rank, dp_size, pin_memory
        self.epoch, self.cursor = 0, 0
        self._orders: dict[int, np.ndarray] = {}

    def _source_perm(self, s: int, lap: int) -> np.ndarray:
        n = int(self.sizes[s])
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, 1, s, lap]).permutation(n)

    def order(self, epoch: int) -> np.ndarray:
        """Global window ids of an epoch, in the order they are served (the last two are kept)."""
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = self._compute_order(epoch)
        return self._orders[epoch]

    def _compute_order(self, epoch: int) -> np.ndarray:
        parts, keys = [], []
        for s, (n, k) in enumerate(zip(self.sizes.tolist(), self.quotas.tolist(), strict=True)):
            start, end = epoch * k, (epoch + 1) * k  # this epoch's slice of the source's endless sequence
            laps = range(start // n, (end - 1) // n + 1)
            seq = np.concatenate([self._source_perm(s, lap) for lap in laps])
            parts.append(self.offsets[s] + seq[start - laps[0] * n : end - laps[0] * n])
            keys.append((np.arange(k) + 0.5) / k)
        ids = np.concatenate(parts)
        if self.shuffle:
            return np.random.default_rng([self.seed, 2, epoch]).permutation(ids)
        return ids[np.argsort(np.concatenate(keys), kind="stable")]  # sources evenly interleaved

    def _rows(self, ids: np.ndarray) -> np.ndarray:
        src = np.searchsorted(self.offsets, ids, side="right") - 1
        out = np.empty((len(ids), self.windows[0].shape[1]), dtype=self.windows[0].dtype)
        for s in np.unique(src):
            mask = src == s
            local = ids[mask] - self.offsets[s]
            out[mask] = self.windows[s][local]
        return out

    def global_samples(self, first: int, count: int) -> np.ndarray:
        """Window ids of global samples first..first+count-1, counted from the current epoch's start."""
        pos = self.epoch * self.epoch_size + first + np.arange(count)
        epochs, idx = pos // self.epoch_size, pos % self.epoch_size
        out = np.empty(count, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self.order(int(e))[idx[mask]]
        return out

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        b = self.batch_size
        ids = self.global_samples(self.cursor + self.dp_rank * b, b)
        step = self.cursor + self.dp_size * b
        self.epoch, self.cursor = self.epoch + step // self.epoch_size, step % self.epoch_size
        return _to_batch(self._rows(ids), self.pin_memory)

    def state_dict(self) -> dict:
        return {"kind": "packed", "epoch": self.epoch, "cursor": self.cursor, "epoch_size": self.epoch_size}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "packed":
            raise UserError(
                f"The checkpoint's data state is '{sd.get('kind')}' but the data sources are map-style now; "
                "resume with the same data.sources (the `streaming` setting included)."
            )
        if sd["epoch_size"] != self.epoch_size:
            warnings.warn(
                f"The data changed since the checkpoint (epoch of {sd['epoch_size']} windows, now "
                f"{self.epoch_size}); resuming at epoch {sd['epoch']}, sample {sd['cursor']} of the new data.",
                stacklevel=2,
            )
        self.epoch, self.cursor = int(sd["epoch"]), int(sd["cursor"]) % self.epoch_size


class _Background:
    """`fn()` in a daemon thread (a stuck network read never blocks interpreter exit); `result()`
    waits for it and raises its exception on the calling thread."""

    def __init__(self, fn):
        self._value = self._error = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="muonrun-stream", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # raised again by result()
            self._error = e

    def result(self):
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class _StreamPacker:
    """One streaming source on one rank: blocks of documents -> shuffled -> tokenized -> windows.

    With `lookahead`, the next block is read and tokenized in a background thread while the current
    one is trained on: a real tokenizer takes seconds per block (10,000 documents: 6.3 s on 2 CPU
    cores, docs/benchmarks.md), and its Rust core releases the GIL. The lookahead changes nothing
    in what is served or in the state: it computes exactly the block `_read_block` would."""

    def __init__(self, open_stream, tok, width, block_docs, seed, shuffle, tag, describe, lookahead=False):
        self.open_stream, self.tok, self.width = open_stream, tok, width
        self.block_docs, self.seed, self.shuffle, self.tag, self.describe = (
            block_docs,
            seed,
            shuffle,
            tag,
            describe,
        )
        self.lookahead = lookahead
        self.epoch, self.block, self.block_state, self.taken = 0, 0, None, 0
        self.carry = np.zeros(0, dtype=np.int32)
        self._ds = self._ds_epoch = None  # the open stream (only _fetch touches it) and its epoch
        self._windows = None
        self._ahead: _Background | None = None

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "block": self.block,
            "block_state": copy.deepcopy(self.block_state),
            "carry": self.carry.tolist(),
            "taken": self.taken,
        }

    def load_state_dict(self, sd: dict) -> None:
        self._drop_lookahead()
        self.epoch, self.block, self.taken = sd["epoch"], sd["block"], sd["taken"]
        self.block_state = copy.deepcopy(sd["block_state"])
        self.carry = np.asarray(sd["carry"], dtype=np.int32)
        self._ds = self._windows = None

    def _drop_lookahead(self) -> None:
        if self._ahead is not None:
            # Let it finish with the stream before anyone reopens it. Its block is never read, and
            # reading from the new position reports any error of its own.
            with contextlib.suppress(Exception):
                self._ahead.result()
            self._ahead = None

    def check(self) -> None:
        """Fail at build time, not at the first batch: the stream opens and this rank gets documents."""
        try:
            first = next(iter(self.open_stream(0)), None)  # not .take(1): it applies before the rank split
        except UserError:
            raise
        except Exception as e:
            raise self.describe(e) from None
        if first is None:
            raise self.describe(None)

    def _read_block(self) -> None:
        """Install the current block (the lookahead's, or read now) and start reading the next one."""
        if self._ahead is not None:
            block, self._ahead = self._ahead.result(), None
        else:
            block = self._fetch(self.epoch, self.block, self.carry, self.block_state)
        self._windows, self._next_carry, self._end_state, self._exhausted = block
        if self.lookahead:
            epoch, index = (self.epoch + 1, 0) if self._exhausted else (self.epoch, self.block + 1)
            carry = self._next_carry
            self._ahead = _Background(lambda: self._fetch(epoch, index, carry, None))

    def _fetch(self, epoch: int, block: int, carry: np.ndarray, resume_state) -> tuple:
        """Block `block` of `epoch`: (windows, tokens carried to the next block, the stream's state at
        the block's end, whether the stream ended in it). Reads on from the open stream; a new epoch
        opens a fresh one, and `resume_state` (a block's start) positions a reopened one."""
        if self._ds is None or self._ds_epoch != epoch:
            self._ds, self._ds_epoch = self.open_stream(epoch), epoch
            if resume_state is not None:
                self._ds.load_state_dict(copy.deepcopy(resume_state))
            self._it = iter(self._ds)
        try:
            docs = [row["text"] or "" for row in islice(self._it, self.block_docs)]
        except UserError:
            raise
        except Exception as e:
            raise self.describe(e) from None
        end_state = self._ds.state_dict()
        exhausted = len(docs) < self.block_docs
        if exhausted and not docs and block == 0:
            raise self.describe(None)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, 3, *self.tag, epoch, block])
            docs = [docs[i] for i in rng.permutation(len(docs))]
        tokens = np.concatenate([carry, encode_docs(self.tok, docs)[0]]) if docs else carry
        n = len(tokens) // self.width
        return tokens[: n * self.width].reshape(n, self.width), tokens[n * self.width :], end_state, exhausted

    def next_window(self) -> np.ndarray:
        while True:
            if self._windows is None:
                self._read_block()
            if self.taken < len(self._windows):
                self.taken += 1
                return self._windows[self.taken - 1]
            self.carry, self.taken, self._windows = self._next_carry, 0, None
            if self._exhausted:  # next epoch: a fresh stream (the carry continues across the boundary)
                self.epoch, self.block, self.block_state = self.epoch + 1, 0, None
            else:
                self.block, self.block_state = self.block + 1, self._end_state


class StreamingLoader:
    """Infinite iterator over batches from streaming sources for one rank (see the module docstring)."""

    def __init__(self, packers, probs, batch_size, seed, dp_rank=0, dp_size=1, pin_memory=False):
        self.packers, self.probs = packers, np.asarray(probs)
        self.batch_size, self.seed, self.pin_memory = batch_size, seed, pin_memory
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.count = 0  # windows served by this rank
        self._chunk: tuple[int, np.ndarray | None] = (-1, None)

    def _choices(self, chunk: int) -> np.ndarray:
        if self._chunk[0] != chunk:
            rng = np.random.default_rng([self.seed, 4, self.dp_rank, chunk])
            self._chunk = (chunk, rng.choice(len(self.packers), size=_CHOICE_CHUNK, p=self.probs))
        return self._chunk[1]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        for i in range(self.count, self.count + self.batch_size):
            s = 0 if len(self.packers) == 1 else int(self._choices(i // _CHOICE_CHUNK)[i % _CHOICE_CHUNK])
            rows.append(self.packers[s].next_window())
        self.count += self.batch_size
        return _to_batch(np.stack(rows), self.pin_memory)

    def state_dict(self) -> dict:
        return {
            "kind": "streaming",
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "count": self.count,
            "sources": [p.state_dict() for p in self.packers],
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "streaming":
            raise UserError(
                f"The checkpoint's data state is '{sd.get('kind')}' but the data sources stream now; resume "
                "with the same data.sources (the `streaming` setting included)."
            )
        if (sd["dp_size"], sd["dp_rank"]) != (self.dp_size, self.dp_rank):
            raise UserError(
                f"The checkpoint was written with {sd['dp_size']} data-parallel ranks, this run has "
                f"{self.dp_size} (rank {self.dp_rank} got rank {sd['dp_rank']}'s state). Streaming sources are "
                "read per rank, so their position cannot be moved to a different number of ranks: resume with "
                f"{sd['dp_size']} data-parallel ranks, or use map-style sources (streaming: false), whose "
                "position is global and resumes exactly on any number of ranks."
            )
        if len(sd["sources"]) != len(self.packers):
            raise UserError(
                f"The checkpoint's data state has {len(sd['sources'])} streaming sources, the config has "
                f"{len(self.packers)}; resume with the same data.sources."
            )
        self.count = int(sd["count"])
        for p, s in zip(self.packers, sd["sources"], strict=True):
            p.load_state_dict(s)


class EvalLoader:
    """A fixed, finite set of batches; every `iter()` starts again from the same first batch."""

    def __init__(self, make_loader, num_batches: int):
        self.make_loader, self.num_batches = make_loader, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        return islice(self.make_loader(), self.num_batches)


def _as_config(cfg):
    from omegaconf import DictConfig

    if isinstance(cfg, DictConfig):
        from muonrun.config import to_object

        return to_object(cfg)
    return cfg


def named_sources(cfg, split: str) -> list[tuple[str, object]]:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    field = "sources" if split == "train" else "eval_sources"
    sources = list(getattr(cfg.data, field))
    if not sources:
        raise UserError(f"Config key 'data.{field}' is empty; list at least one source with a `path`.")
    return [(f"data.{field}[{i}]", s) for i, s in enumerate(sources)]


def _streaming_loader(
    cfg, tok, sources, probs, dp_rank, dp_size, seed, pin_memory, lookahead=False
) -> StreamingLoader:
    from datasets.distributed import split_dataset_by_node

    from muonrun.data.sources import resolve_files

    packers = []
    for i, (key, src) in enumerate(sources):
        files = resolve_files(src, key)

        def open_stream(epoch, src=src, key=key, files=files):
            ds = load_source(src, key, streaming=True, files=files)
            return split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size) if dp_size > 1 else ds

        def describe(e, src=src, key=key, files=files):
            if e is None:
                return UserError(
                    f"Source '{key}' ({src.path}) yields no documents on data-parallel rank {dp_rank} of "
                    f"{dp_size}; it is empty or has fewer documents/shards than ranks."
                )
            return read_error(e, src, key, files)

        width, block = cfg.data.seq_len + 1, cfg.data.shuffle_buffer
        packer = _StreamPacker(
            open_stream, tok, width, block, seed, cfg.data.shuffle, (dp_rank, i), describe, lookahead
        )
        packer.check()
        packers.append(packer)
    return StreamingLoader(packers, probs, cfg.train.micro_batch_size, seed, dp_rank, dp_size, pin_memory)


def build_loader(
    cfg, tok, dp_rank: int = 0, dp_size: int = 1, split: str = "train", pin_memory: bool = False
):
    """The training loader (infinite, stateful) or, with split="eval", the finite EvalLoader."""
    cfg = _as_config(cfg)
    sources = named_sources(cfg, split)
    probs = _weights(sources)
    seed, batch = cfg.train.seed, cfg.train.micro_batch_size
    if cfg.data.shuffle_buffer < 1:
        raise UserError(
            f"Config key 'data.shuffle_buffer' is {cfg.data.shuffle_buffer}; it must be at least 1."
        )
    if any(src.streaming for _, src in sources):

        def make():
            # Only training reads on: evaluation takes a few batches from the first block.
            return _streaming_loader(
                cfg, tok, sources, probs, dp_rank, dp_size, seed, pin_memory, lookahead=split == "train"
            )

        loader = make()  # opens every stream once, so a bad source fails here
        return loader if split == "train" else EvalLoader(make, cfg.train.eval_steps)

    windows = [ensure_cached(src, key, tok, cfg.data).windows(cfg.data.seq_len, key) for key, src in sources]

    def make():
        return PackedLoader(windows, probs, batch, seed, cfg.data.shuffle, dp_rank, dp_size, pin_memory)

    if split == "train":
        return make()
    num = sum(len(w) for w in windows)
    per_step = batch * dp_size
    if num < per_step:
        raise UserError(
            f"data.eval_sources hold {num} windows of data.seq_len + 1 tokens, fewer than one evaluation batch on "
            f"every rank (train.micro_batch_size x data-parallel ranks = {per_step}); add eval data or lower them."
        )
    return EvalLoader(make, min(cfg.train.eval_steps, num // per_step))


def _tokenizer_name(cfg) -> str:
    return cfg.data.tokenizer


def check_data(cfg):
    """Cheap validation in the launcher before workers start: sources, columns, tokenizer. Raises
    UserError; returns the tokenizer."""
    from muonrun.data.sources import check_source
    from muonrun.data.tokenizer import build_tokenizer

    cfg = _as_config(cfg)
    tok = build_tokenizer(_tokenizer_name(cfg))
    if cfg.data.shuffle_buffer < 1:
        raise UserError(
            f"Config key 'data.shuffle_buffer' is {cfg.data.shuffle_buffer}; it must be at least 1."
        )
    splits = ["train"] + (["eval"] if cfg.data.eval_sources else [])
    for split in splits:
        for key, src in named_sources(cfg, split):
            if not src.streaming and _cached(src, key, tok, cfg.data):
                continue  # a cached Hub dataset needs no network
            check_source(src, key)
    return tok


def _cached(src, key, tok, data_cfg) -> bool:
    from muonrun.data.cache import cache_key, cache_root, entry_dir
    from muonrun.data.sources import resolve_files

    files = resolve_files(src, key)
    return (entry_dir(cache_root(data_cfg), src, cache_key(src, tok, files)) / "meta.json").is_file()


def prepare(cfg):
    """Tokenize and cache every map-style source (train and eval) now; returns the cache folder."""
    from muonrun.data.cache import cache_root
    from muonrun.data.tokenizer import build_tokenizer

    cfg = _as_config(cfg)
    tok = build_tokenizer(_tokenizer_name(cfg))
    splits = ["train"] + (["eval"] if cfg.data.eval_sources else [])
    for split in splits:
        for key, src in named_sources(cfg, split):
            if src.streaming:
                log.info("%s (%s) streams; nothing to prepare", key, src.path)
                continue
            entry: TokenCache = ensure_cached(src, key, tok, cfg.data)
            entry.windows(cfg.data.seq_len, key)  # fail now, not at step 0, when it is too short
            log.info("%s: %d tokens in %s", key, entry.meta["num_tokens"], entry.path)
    return cache_root(cfg.data)
