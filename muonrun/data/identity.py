"""What a checkpoint's data position refers to, so that a resume on other data says so.

A training loader's state (each rank's `rankR.pt`) carries, beside its position:

- `layout`: data.seq_len, train.micro_batch_size and the number of data-parallel ranks;
- `identity` (rank 0's state only; only rank 0 speaks): per source its path and mixture weight, the
  tokenizer's fingerprint and, for local files, each file's size, modification time and a SHA-256 of
  sampled blocks (the first and last 64 KiB and 14 evenly spaced between them: at most 1 MiB read per
  file, whatever its size; a file of up to 1 MiB is hashed whole). A map-style source adds the SHA-256
  of the token stream its cache entry holds, computed while the cache was built: exact, and nothing
  to read at start-up.

What it costs: the hashes of a map-style source are taken while its cache is built (which reads every
byte anyway) and kept in the entry's meta.json; a streaming source's are taken on rank 0 at the first
save. A resume reuses the saved hash of every file whose size and modification time are unchanged, so
it reads only files that were touched (benchmarks/bench_fingerprint.py; docs/performance.md).

On resume the saved values are compared with this run's, by size and hash (a copy of the data with new
modification times is the same data). A changed layout is said once, as what it is (the data itself is
the same); changed data is one warning naming the source and the file, or with
`data.strict_resume=true` a UserError (exit 2). What the sampled hash does not see: an edit that keeps a
file's size and touches none of its sampled blocks, in a streaming source (a map-style source's token
hash sees it).

    pytest tests/test_data.py -k "resume or layout or sampled"
"""

from __future__ import annotations

import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from muonrun.errors import UserError

BLOCK = 64 << 10
BLOCKS = 16  # the first, the last and 14 evenly spaced between: 1 MiB read per file at most


def sampled_sha256(path: str, size: int) -> str:
    """SHA-256 (16 hex digits) of a file's sampled blocks, or of all of it when it is not larger than
    the samples."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= BLOCKS * BLOCK:
            digest.update(f.read())
        else:
            for i in range(BLOCKS):
                digest.update(os.pread(f.fileno(), BLOCK, (size - BLOCK) * i // (BLOCKS - 1)))
    return digest.hexdigest()[:16]


def fingerprints(files: list[str]) -> dict[str, list]:
    """{file: [size, modification time (ns), sampled SHA-256]}: what a cache entry keeps of its files."""
    out = {}
    for f in files:
        st = os.stat(f)
        out[f] = [st.st_size, st.st_mtime_ns, sampled_sha256(f, st.st_size)]
    return out


def _base(path: str) -> str:
    """The folder a local source's file names are given relative to: the part of its path before any
    glob, or that file's folder, so the same data in another place has the same identity."""
    parts = Path(os.path.abspath(os.path.expanduser(path))).parts
    plain = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    base = Path(*parts[:plain])
    return str(base if base.is_dir() else base.parent)


@dataclass
class Source:
    """One source as rank 0 finds it at start-up, before any file is read: `files` {name relative to
    `base`: (absolute path, size, modification time)}; `known` {name: sampled hash} from its cache entry."""

    entry: dict
    base: str | None = None
    files: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    known: dict[str, str] = field(default_factory=dict)

    def identity(self, saved: dict | None) -> dict:
        """The identity to save and compare: each file's hash is the cache entry's, or the saved one when
        the file's size and modification time are unchanged, or read now."""
        if self.base is None:
            return dict(self.entry)
        before = (saved or {}).get("files") or {}
        listed = {}
        for name, (path, size, mtime) in self.files.items():
            old = before.get(name)
            same = isinstance(old, list) and len(old) == 3 and old[:2] == [size, mtime]
            digest = self.known.get(name) or (old[2] if same else None) or sampled_sha256(path, size)
            listed[name] = [size, mtime, digest]
        return {**self.entry, "base": self.base, "files": listed}


def describe_source(src, files: list[str] | None, tokenizer: str, meta: dict | None = None) -> Source:
    """A source's identity-to-be (see the module docstring); `files` None: a Hub dataset; `meta`: its
    cache entry's meta.json (map-style)."""
    entry: dict = {"path": src.path, "weight": float(src.weight), "tokenizer": tokenizer}
    meta = meta or {}
    if meta.get("tokens_sha256"):
        entry["tokens_sha256"] = meta["tokens_sha256"]
    if files is None:
        return Source({**entry, "name": src.name, "split": src.split})
    base, cached = _base(src.path), meta.get("fingerprints") or {}
    source = Source(entry, base)
    for path in files:
        st = os.stat(path)
        name = os.path.relpath(path, base)
        source.files[name] = (path, st.st_size, st.st_mtime_ns)
        hit = cached.get(path)
        if hit and hit[:2] == [st.st_size, st.st_mtime_ns]:
            source.known[name] = hit[2]
    return source


def _size_and_hash(fingerprint) -> tuple | None:
    """A file's [size, mtime, hash] as compared: size and hash (a copy gets a new mtime, not new data)."""
    ok = isinstance(fingerprint, list | tuple) and len(fingerprint) == 3
    return (fingerprint[0], fingerprint[2]) if ok else None


def _bytes(pair: tuple | None) -> str:
    return f"{pair[0]:,} bytes" if pair and isinstance(pair[0], int) else "an unknown size"


def _source_change(old: dict, new: dict) -> str | None:
    """What differs between a source's saved identity and its current one, in words (None: nothing)."""
    if old.get("tokenizer") != new.get("tokenizer"):
        return "it is tokenized by another tokenizer now (data.tokenizer)"
    if old.get("weight") != new.get("weight"):
        return f"its mixture weight changed from {old.get('weight')} to {new.get('weight')}"
    then, now = old.get("files") or {}, new.get("files") or {}
    for name in sorted(then.keys() | now.keys()):
        shown = os.path.join(new.get("base", ""), name)
        if name not in now:
            if old.get("base") != new.get("base"):  # the data is read from another folder now
                return f"'{name}', read from '{old.get('base')}' then, is not in '{new.get('base')}'"
            return f"'{shown}' is gone"
        if name not in then:
            return f"'{shown}' is new"
        before, after = _size_and_hash(then[name]), _size_and_hash(now[name])
        if before != after:
            same_size = before is not None and after is not None and before[0] == after[0]
            how = (
                "the same size, other contents"
                if same_size
                else f"{_bytes(before)} then, {_bytes(after)} now"
            )
            return f"'{shown}' changed ({how})"
    hub = ("path", "name", "split")
    if "base" not in new and [old.get(k) for k in hub] != [new.get(k) for k in hub]:
        return "it is another Hub dataset, configuration or split now"
    if old.get("tokens_sha256") and new.get("tokens_sha256") and old["tokens_sha256"] != new["tokens_sha256"]:
        return "its text changed (the tokens differ)"
    return None


def data_changes(saved: dict, now: dict) -> list[str]:
    """`KEY (PATH): what changed` for every source whose data differs from the saved identity."""
    lines = []
    for key in sorted(saved.keys() | now.keys(), key=lambda k: (len(k), k)):
        old, new = saved.get(key), now.get(key)
        if old is None:
            lines.append(f"{key} ({new['path']}) is a new source")
        elif new is None:
            lines.append(f"{key} ({old['path']}) is no longer a source")
        elif change := _source_change(old, new):
            lines.append(f"{key} ({new['path']}): {change}")
    return lines


def epoch_changed(old_size: int, new_size: int, cursor: int) -> None:
    """The warning for an epoch of another size that nothing saved explains (a checkpoint saved before
    loaders kept their identity)."""
    from muonrun import log

    log.warning(
        f"The data changed since the checkpoint (an epoch of {old_size:,} windows then, {new_size:,} now); "
        f"training resumes at the same fraction of the epoch ({cursor / old_size:.1%})."
    )


class DataIdentity:
    """The identity (rank 0; None elsewhere) and layout a training loader saves with its position, and
    the report a resume makes of what changed."""

    def __init__(self, sources: dict[str, Source] | None, layout: dict, strict: bool):
        self.sources, self.layout, self.strict = sources, layout, strict
        self._identity: dict | None = None

    def _resolved(self, saved: dict | None = None) -> dict:
        if self._identity is None:
            saved = saved or {}
            self._identity = {key: s.identity(saved.get(key)) for key, s in self.sources.items()}
        return self._identity

    def state_dict(self) -> dict:
        state: dict = {"layout": dict(self.layout)}
        if self.sources is not None:
            state["identity"] = self._resolved()
        return state

    def on_resume(self, sd: dict) -> bool:
        """Report what changed since the saved state `sd` (layout: once, as what it is; data: a warning,
        or a UserError with data.strict_resume). Returns whether anything was reported, so the loader
        does not call a changed epoch "changed data" a second time."""
        from muonrun import log

        reported = False
        if self.sources is not None and isinstance(sd.get("identity"), dict):
            changed = data_changes(sd["identity"], self._resolved(sd["identity"]))
            if changed and self.strict:
                raise UserError(
                    f"The data changed since the checkpoint was saved: {'; '.join(changed)}. data.strict_resume "
                    "is true, so this run does not resume on it: restore the data as it was, or set "
                    "data.strict_resume=false to resume on the data as it is now."
                )
            if changed:
                log.warning(
                    f"The data changed since the checkpoint was saved: {'; '.join(changed)}. Training resumes "
                    "on the data as it is now, at the same point of its order (data.strict_resume=true refuses "
                    "instead)."
                )
                reported = True
        old = sd.get("layout")
        if old:
            reported |= self._report_layout(old)
        return reported

    def _report_layout(self, old: dict) -> bool:
        from muonrun import log

        new = self.layout
        if old.get("seq_len") != new["seq_len"]:
            log.warning(
                f"data.seq_len is {new['seq_len']}, the checkpoint was saved with {old.get('seq_len')}: the same "
                "data is cut into windows of the new length, so the rest of this epoch is a new order of them "
                "(some text comes again, some only in the next epoch); training resumes at the same fraction "
                "of the epoch."
            )
            return True
        moved = [
            f"{what} {old.get(key)} -> {new[key]}"
            for key, what in (
                ("micro_batch_size", "train.micro_batch_size"),
                ("dp_size", "data-parallel ranks"),
            )
            if old.get(key) != new[key]
        ]
        if moved:
            log.info(
                f"the batch layout changed since the checkpoint ({', '.join(moved)}): the data continues from "
                "the same sample, in the same order."
            )
            return True
        return False
