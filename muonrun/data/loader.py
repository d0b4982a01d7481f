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

Records whose text is missing, null or not a string (records.py) stop the run with a UserError naming
the file and the record, or with data.skip_bad_records=true are left out and counted: rank 0 prints one
line (map-style: the count stored in the cache entry; streaming: when a pass over the source ends, and
once early for a long pass). A streaming source checks each block as it reads it.
"""

from __future__ import annotations

from itertools import islice

import numpy as np
import torch

from muonrun import log
from muonrun.data.batches import to_batch
from muonrun.data.cache import TokenCache, ensure_cached
from muonrun.data.identity import DataIdentity, describe_source, epoch_changed
from muonrun.data.streaming import streaming_loader
from muonrun.errors import UserError


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
        self.identity: DataIdentity | None = None  # saved with the position (training loaders)

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
        return to_batch(self._rows(ids), self.pin_memory)

    def state_dict(self) -> dict:
        state = {"kind": "packed", "epoch": self.epoch, "cursor": self.cursor, "epoch_size": self.epoch_size}
        return {**state, **(self.identity.state_dict() if self.identity else {})}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "packed":
            raise UserError(
                f"The checkpoint's data state is '{sd.get('kind')}' but the data sources are map-style now; "
                "resume with the same data.sources (the `streaming` setting included)."
            )
        reported = self.identity.on_resume(sd) if self.identity else False
        cursor, size = int(sd["cursor"]), int(sd["epoch_size"])
        if size != self.epoch_size:  # other windows: continue at the same fraction of the epoch
            if not reported:
                epoch_changed(size, self.epoch_size, cursor)
            cursor = cursor * self.epoch_size // size
        self.epoch, self.cursor = int(sd["epoch"]), cursor


class EvalLoader:
    """A fixed, finite set of batches; every `iter()` starts again from the same first batch."""

    def __init__(self, make_loader, num_batches: int):
        self.make_loader, self.num_batches = make_loader, num_batches

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        return islice(self.make_loader(), self.num_batches)


def named_sources(cfg, split: str) -> list[tuple[str, object]]:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    field = "sources" if split == "train" else "eval_sources"
    sources = list(getattr(cfg.data, field))
    if not sources:
        raise UserError(f"Config key 'data.{field}' is empty; list at least one source with a `path`.")
    return [(f"data.{field}.{i}", s) for i, s in enumerate(sources)]


def build_loader(
    cfg, tok, dp_rank: int = 0, dp_size: int = 1, split: str = "train", pin_memory: bool = False
):
    """The training loader (infinite, stateful) or, with split="eval", the finite EvalLoader."""
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
            return streaming_loader(
                cfg, tok, sources, probs, dp_rank, dp_size, seed, pin_memory, lookahead=split == "train"
            )

        loader = make()  # opens every stream once, so a bad source fails here
        if split != "train":
            return EvalLoader(make, cfg.train.eval_steps)
        loader.identity = data_identity(cfg, tok, sources, {}, dp_rank, dp_size)
        return loader

    entries = {key: ensure_cached(src, key, tok, cfg.data, report=dp_rank == 0) for key, src in sources}
    windows = [entries[key].windows(cfg.data.seq_len, key) for key, _ in sources]

    def make():
        return PackedLoader(windows, probs, batch, seed, cfg.data.shuffle, dp_rank, dp_size, pin_memory)

    if split == "train":
        loader = make()
        loader.identity = data_identity(cfg, tok, sources, entries, dp_rank, dp_size)
        return loader
    num = sum(len(w) for w in windows)
    per_step = batch * dp_size
    if num < per_step:
        raise UserError(
            f"data.eval_sources hold {num} windows of data.seq_len + 1 tokens, fewer than one evaluation batch on "
            f"every rank (train.micro_batch_size x data-parallel ranks = {per_step}); add eval data or lower them."
        )
    return EvalLoader(make, min(cfg.train.eval_steps, num // per_step))


def data_identity(cfg, tok, sources, entries: dict, dp_rank: int, dp_size: int) -> DataIdentity:
    """What the training loader saves beside its position (identity.py): the sources' identity on rank 0
    (the one that reports), the layout on every rank. `entries`: map-style sources' cache entries."""
    from muonrun.data.sources import resolve_files

    identity = None
    if dp_rank == 0:
        identity = {
            key: describe_source(
                src, resolve_files(src, key), tok.fingerprint, entries[key].meta if key in entries else None
            )
            for key, src in sources
        }
    layout = {"seq_len": cfg.data.seq_len, "micro_batch_size": cfg.train.micro_batch_size, "dp_size": dp_size}
    return DataIdentity(identity, layout, cfg.data.strict_resume)


def _tokenizer_name(cfg) -> str:
    return cfg.data.tokenizer


def check_data(cfg, tok=None):
    """Cheap validation before workers start (the launcher, and the dry run): sources, columns,
    tokenizer (``tok``: one already built from ``data.tokenizer``). Raises UserError; returns the
    tokenizer."""
    from muonrun.data.cache import cached_entry, check_entry, datasets_cache
    from muonrun.data.sources import check_source
    from muonrun.data.tokenizer import build_tokenizer

    if tok is None:
        tok = build_tokenizer(_tokenizer_name(cfg))
    check_cache_folder(cfg.data)
    if cfg.data.shuffle_buffer < 1:
        raise UserError(
            f"Config key 'data.shuffle_buffer' is {cfg.data.shuffle_buffer}; it must be at least 1."
        )
    splits = ["train"] + (["eval"] if cfg.data.eval_sources else [])
    for split in splits:
        for key, src in named_sources(cfg, split):
            entry = None if src.streaming else cached_entry(src, key, tok, cfg.data)
            if entry is not None:  # a cached Hub dataset needs no network
                check_entry(entry, src, key, cfg.data, report=False)
                continue
            check_source(src, key, cfg.data.skip_bad_records, datasets_cache(cfg.data))
    return tok


def check_cache_folder(data_cfg) -> None:
    """The token cache (data.cache_dir, MUONRUN_CACHE or ~/.cache/muonrun) must be a folder this user can
    write, or be creatable as one: checked without creating anything."""
    from muonrun.data.cache import cache_root
    from muonrun.paths import unwritable

    root = cache_root(data_cfg)
    problem = unwritable(root, "folder")
    if problem:
        raise UserError(
            f"The token cache '{root}' cannot be used: {problem}. Set data.cache_dir (or MUONRUN_CACHE) to "
            "a folder you can write."
        )


def prepare(cfg):
    """Tokenize and cache every map-style source (train and eval) now; returns the cache folder."""
    from muonrun.data.cache import cache_root
    from muonrun.data.tokenizer import build_tokenizer

    tok = build_tokenizer(_tokenizer_name(cfg))
    check_cache_folder(cfg.data)
    splits = ["train"] + (["eval"] if cfg.data.eval_sources else [])
    for split in splits:
        for key, src in named_sources(cfg, split):
            if src.streaming:
                log.info(f"{key} ({src.path}) streams; nothing to prepare")
                continue
            entry: TokenCache = ensure_cached(src, key, tok, cfg.data)
            entry.windows(cfg.data.seq_len, key)  # fail now, not at step 0, when it is too short
            log.info(f"{key}: {entry.meta['num_tokens']} tokens in {entry.path}")
    return cache_root(cfg.data)
