"""What a checkpoint's data position refers to, so that a resume on other data says so.

A training loader's state (each rank's `rankR.pt`) carries, beside its position:

- `layout`: data.seq_len, train.micro_batch_size and the number of data-parallel ranks;
- `identity` (rank 0's state only; only rank 0 speaks): per source its path and mixture weight, the
  tokenizer's fingerprint and, for local files, each file's size and a SHA-256 of sampled blocks (the
  first and last 64 KiB and 14 evenly spaced between them: at most 1 MiB read per file, whatever its
  size; a file of up to 1 MiB is hashed whole). A map-style source adds the SHA-256 of the token
  stream its cache entry holds, computed while the cache was built: exact, and free at resume.

On resume the saved values are compared with this run's. A changed layout is said once, as what it is
(the data itself is the same); changed data is one warning naming the source and the file, or with
`data.strict_resume=true` a UserError (exit 2). What the sampled hash does not see: an edit that keeps
a file's size and touches none of its sampled blocks, in a streaming source (a map-style source's
token hash sees it; its cache follows each file's size and modification time).

    pytest tests/test_data.py -k resume
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from pathlib import Path

from muonrun.errors import UserError

BLOCK = 64 << 10
BLOCKS = 16  # the first, the last and 14 evenly spaced between: 1 MiB read per file at most
LISTED = 10_000  # files named one by one in the identity; a larger source keeps a digest of the list


def file_fingerprint(path: str) -> str:
    """`SIZE:HASH`: the file's size and a SHA-256 (16 hex digits) of its sampled blocks, or of all of it
    when it is not larger than the samples."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= BLOCKS * BLOCK:
            digest.update(f.read())
        else:
            for i in range(BLOCKS):
                digest.update(os.pread(f.fileno(), BLOCK, (size - BLOCK) * i // (BLOCKS - 1)))
    return f"{size}:{digest.hexdigest()[:16]}"


def _base(path: str) -> str:
    """The folder a local source's file names are given relative to: the part of its path before any
    glob, or that file's folder, so the same data in another place has the same identity."""
    parts = Path(os.path.abspath(os.path.expanduser(path))).parts
    plain = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    base = Path(*parts[:plain])
    return str(base if base.is_dir() else base.parent)


def source_identity(src, files: list[str] | None, tokenizer: str, tokens_sha256: str | None = None) -> dict:
    """One source's identity (see the module docstring); `files` None: a Hub dataset."""
    entry: dict = {"path": src.path, "weight": float(src.weight), "tokenizer": tokenizer}
    if files is None:
        entry.update(name=src.name, split=src.split)
    else:
        base = _base(src.path)
        prints = {os.path.relpath(f, base): file_fingerprint(f) for f in files}
        listed = json.dumps(sorted(prints.items())).encode()
        entry.update(base=base, count=len(prints), files_sha256=hashlib.sha256(listed).hexdigest())
        entry["files"] = prints if len(prints) <= LISTED else {}
    if tokens_sha256:
        entry["tokens_sha256"] = tokens_sha256
    return entry


def _size(fingerprint: str) -> int:
    return int(fingerprint.split(":")[0])


def _source_change(old: dict, new: dict) -> str | None:
    """What differs between a source's saved identity and its current one, in words (None: nothing)."""
    if old.get("tokenizer") != new.get("tokenizer"):
        return "it is tokenized by another tokenizer now (data.tokenizer)"
    if old.get("weight") != new.get("weight"):
        return f"its mixture weight changed from {old.get('weight')} to {new.get('weight')}"
    if old.get("files_sha256") != new.get("files_sha256"):
        then, now = old.get("files") or {}, new.get("files") or {}
        base = new.get("base", "")
        for name in sorted(then.keys() | now.keys()):
            shown = os.path.join(base, name)
            if name not in now:
                return f"'{shown}' is gone"
            if name not in then:
                return f"'{shown}' is new"
            if then[name] != now[name]:
                a, b = _size(then[name]), _size(now[name])
                how = "the same size, other contents" if a == b else f"{a:,} bytes then, {b:,} now"
                return f"'{shown}' changed ({how})"
        return f"its files changed ({old.get('count')} files then, {new.get('count')} now)"
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

    def __init__(self, sources: dict | None, layout: dict, strict: bool):
        self.sources, self.layout, self.strict = sources, layout, strict

    def state_dict(self) -> dict:
        state: dict = {"layout": dict(self.layout)}
        if self.sources is not None:
            state["identity"] = self.sources
        return state

    def on_resume(self, sd: dict) -> bool:
        """Report what changed since the saved state `sd` (layout: once, as what it is; data: a warning,
        or a UserError with data.strict_resume). Returns whether anything was reported, so the loader
        does not call a changed epoch "changed data" a second time."""
        from muonrun import log

        reported = False
        if self.sources is not None and "identity" in sd:
            changed = data_changes(sd["identity"], self.sources)
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
