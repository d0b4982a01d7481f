"""Streaming sources: read per rank (`split_dataset_by_node`) in blocks of data.shuffle_buffer documents,
each block shuffled, tokenized and packed on a background thread while the current one trains; each
window's source is a seeded weighted choice. The state keeps, per source, the dataset's `state_dict()`
at the start of the current block, the tokens carried over from the previous block and the windows
already taken from this one, so resume re-reads one block and continues exactly. It is per rank:
resume needs the same dp_size. Each block's records are checked as they are read (records.py).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from itertools import islice

import numpy as np
import torch

from muonrun.data.batches import CHOICE_CHUNK, to_batch
from muonrun.data.records import StreamChecks
from muonrun.data.sources import load_source, read_error
from muonrun.data.tokenizer import encode_docs
from muonrun.errors import UserError


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

    def __init__(
        self, open_stream, tok, width, block_docs, seed, shuffle, tag, describe, lookahead=False, checks=None
    ):
        self.open_stream, self.tok, self.width = open_stream, tok, width
        self.block_docs, self.seed, self.shuffle, self.tag, self.describe = (
            block_docs,
            seed,
            shuffle,
            tag,
            describe,
        )
        self.lookahead = lookahead
        self.checks = checks  # records.StreamChecks: bad records (None: every record is taken as text)
        self._pass = None  # [documents kept, records read] so far in the pass _fetch reads (None: unknown)
        self._tally = None  # records served and skipped in this pass, for the report
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
        self._ds = self._windows = self._tally = self._pass = None

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
        if self.checks is not None and not self.checks.skip and not isinstance(first.get("text"), str):
            raise self.checks.error(1, first.get("text"))

    def _read_block(self) -> None:
        """Install the current block (the lookahead's, or read now) and start reading the next one."""
        if self._ahead is not None:
            block, self._ahead = self._ahead.result(), None
        else:
            block = self._fetch(self.epoch, self.block, self.carry, self.block_state)
        self._windows, self._next_carry, self._end_state, self._exhausted, read, skipped = block
        if self.block == 0 or self._tally is None:
            self._tally = {"read": 0, "skipped": 0, "whole": self.block == 0}
        self._tally["read"] += read
        self._tally["skipped"] += skipped
        if self.checks is not None:
            t = self._tally
            self.checks.count(t["read"], t["skipped"], complete=self._exhausted and t["whole"])
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
            docs = [row.get("text") for row in islice(self._it, self.block_docs)]
        except UserError:
            raise
        except Exception as e:
            raise self.describe(e) from None
        end_state = self._ds.state_dict()
        read = len(docs)
        exhausted = read < self.block_docs
        if exhausted and not docs and block == 0:
            raise self.describe(None)
        good = [t for t in docs if isinstance(t, str)]  # bad records: text missing, null or not a string
        if len(good) < read and self.checks is not None and not self.checks.skip:
            i = next(i for i, t in enumerate(docs) if not isinstance(t, str))
            raise self.checks.error(block * self.block_docs + i + 1, docs[i])
        docs = good
        if self.checks is not None and (error := self.checks.reencoded(docs)) is not None:
            raise error
        if block == 0:
            self._pass = [0, 0]
        if self._pass is not None:  # None: a pass resumed in its middle, whose start was not seen
            self._pass[0] += len(docs)
            self._pass[1] += read
            if exhausted and self._pass[0] == 0 and self.checks is not None:
                raise self.checks.nothing_left(self._pass[1])
        if self.shuffle:
            rng = np.random.default_rng([self.seed, 3, *self.tag, epoch, block])
            docs = [docs[i] for i in rng.permutation(len(docs))]
        tokens = np.concatenate([carry, encode_docs(self.tok, docs)[0]]) if docs else carry
        n = len(tokens) // self.width
        windows = tokens[: n * self.width].reshape(n, self.width)
        return windows, tokens[n * self.width :], end_state, exhausted, read, read - len(docs)

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
        self.identity = None  # identity.DataIdentity, saved with the position (training loaders)

    def _choices(self, chunk: int) -> np.ndarray:
        if self._chunk[0] != chunk:
            rng = np.random.default_rng([self.seed, 4, self.dp_rank, chunk])
            self._chunk = (chunk, rng.choice(len(self.packers), size=CHOICE_CHUNK, p=self.probs))
        return self._chunk[1]

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        rows = []
        for i in range(self.count, self.count + self.batch_size):
            s = 0 if len(self.packers) == 1 else int(self._choices(i // CHOICE_CHUNK)[i % CHOICE_CHUNK])
            rows.append(self.packers[s].next_window())
        self.count += self.batch_size
        return to_batch(np.stack(rows), self.pin_memory)

    def state_dict(self) -> dict:
        return {
            "kind": "streaming",
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "count": self.count,
            "sources": [p.state_dict() for p in self.packers],
            **(self.identity.state_dict() if self.identity else {}),
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
        if self.identity:
            self.identity.on_resume(sd)
        self.count = int(sd["count"])
        for p, s in zip(self.packers, sd["sources"], strict=True):
            p.load_state_dict(s)


def streaming_loader(
    cfg, tok, sources, probs, dp_rank, dp_size, seed, pin_memory, lookahead=False
) -> StreamingLoader:
    import datasets
    from datasets.distributed import split_dataset_by_node

    from muonrun.data.cache import datasets_cache
    from muonrun.data.sources import resolve_files

    packers = []
    for i, (key, src) in enumerate(sources):
        files = resolve_files(src, key)
        checks = StreamChecks(
            src, key, files, cfg.data.skip_bad_records, dp_rank, dp_size, report=dp_rank == 0
        )

        def open_stream(epoch, src=src, key=key, files=files, checks=checks):
            ds = load_source(src, key, streaming=True, files=files, cache_dir=datasets_cache(cfg.data))
            checks.text_is_json = isinstance((ds.features or {}).get("text"), getattr(datasets, "Json", ()))
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
            open_stream, tok, width, block, seed, cfg.data.shuffle, (dp_rank, i), describe, lookahead, checks
        )
        packer.check()
        packers.append(packer)
    return StreamingLoader(packers, probs, cfg.train.micro_batch_size, seed, dp_rank, dp_size, pin_memory)
