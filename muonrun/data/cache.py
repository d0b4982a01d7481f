"""Tokenize a map-style source once into `<cache_dir>/<name>-<hash>/{tokens.bin,meta.json}`.

tokens.bin is the source's whole token stream (every document followed by EOS), uint16 when the
vocabulary fits, else uint32, read back as a numpy memmap. Windows of seq_len+1 tokens are a reshape
of that stream, so the cache does not depend on seq_len and changing it does not retokenize. The key
hashes the source (path, name, split, text field, and for local files each file's size and mtime), the
tokenizer's fingerprint (vocabulary and EOS) and CACHE_VERSION. meta.json also keeps what a run's data
identity needs (identity.py): the SHA-256 of tokens.bin and each file's sampled fingerprint.

Before tokenizing, the text column's bad records are counted (records.py; free for a string column:
its null count is Arrow metadata). By default any stops the build; with data.skip_bad_records they are
left out and meta.json keeps `num_records`, `skipped_records` and `first_bad`, so a cached run reports
the count too, and a run without the switch refuses the entry.

Several ranks may build the same entry at once: an advisory lock lets one build while the others wait,
and the build goes to a private temporary folder renamed into place, so a reader only ever sees a
complete entry even where the lock does not work (the first rename wins, later ones are discarded).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from muonrun import faults, log
from muonrun.checkpoint.stop import check_stop, requested
from muonrun.data.identity import fingerprints
from muonrun.data.sources import load_parts, read_error, resolve_files
from muonrun.data.tokenizer import encode_docs
from muonrun.errors import UserError

CACHE_VERSION = 2
"""Bump when the layout of tokens.bin or the tokenization rule changes: old entries are then ignored.
2: records whose text is missing, null or not a string are no longer empty documents (records.py)."""


def cache_root(data_cfg) -> Path:
    root = data_cfg.cache_dir or os.environ.get("MUONRUN_CACHE") or "~/.cache/muonrun"
    return Path(root).expanduser()


def datasets_cache(data_cfg) -> str:
    """Where `datasets` keeps its own files for local sources (the Arrow copy it reads them into, locks):
    inside muonrun's cache, so nothing lands in ~/.cache/huggingface when data.cache_dir is set."""
    return str(cache_root(data_cfg) / "datasets")


def cache_key(src, tok, files: list[str] | None) -> dict:
    key = {
        "version": CACHE_VERSION,
        "tokenizer": tok.fingerprint,
        "path": src.path if files is None else None,
        "name": src.name,
        "split": src.split,
        "text_field": src.text_field,
    }
    if files is not None:  # the content of local files, by proxy: edit a file and it retokenizes
        stats = [[f, (st := os.stat(f)).st_size, st.st_mtime_ns] for f in files]
        key["files"] = {"count": len(files), "sha256": hashlib.sha256(json.dumps(stats).encode()).hexdigest()}
    return key


def entry_dir(root: Path, src, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    parts = Path(src.path).parts  # a readable name: the last path component before any glob
    plain = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(*parts[:plain]).name or "data")[:40]
    return root / f"{stem}-{digest}"


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class TokenCache:
    """A finished cache entry: the token stream as a read-only memmap, plus meta.json."""

    def __init__(self, path: Path):
        self.path = path
        self.meta = json.loads((path / "meta.json").read_text())
        self.tokens = np.memmap(path / "tokens.bin", dtype=self.meta["dtype"], mode="r")
        assert len(self.tokens) == self.meta["num_tokens"], f"{path}: tokens.bin is truncated"

    def windows(self, seq_len: int, key: str) -> np.ndarray:
        """Non-overlapping windows of seq_len+1 tokens, shape [n, seq_len+1]; the remainder is dropped."""
        width = seq_len + 1
        n = len(self.tokens) // width
        if n == 0:
            raise UserError(
                f"Source '{key}' ({self.meta['source']}) has {len(self.tokens)} tokens, fewer than one window "
                f"of data.seq_len + 1 = {width}. Add text to it or lower data.seq_len."
            )
        return self.tokens[: n * width].reshape(n, width)


@contextlib.contextmanager
def _file_lock(path: Path):
    try:
        import fcntl

        fh = open(path, "a+")  # noqa: SIM115 (held for the duration of the context)
    except (ImportError, OSError):
        yield False  # no locking here: the atomic rename alone keeps it correct
        return
    try:
        locked = False
        while True:  # waits for the rank building the entry, but stops on a stop request
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                check_stop()
                time.sleep(0.2)
            except OSError:
                break  # no locking on this filesystem
        yield locked
    finally:
        fh.close()


def _check_records(src, key: str, parts, skip: bool) -> dict:
    """Count the bad records of each part (records.py); raise for the first unless skipping (or when
    nothing would be left). Returns the meta fields `num_records`, `skipped_records`, `first_bad`."""
    from muonrun.data.records import count_bad

    total, bad, first = 0, 0, None
    for i, part in enumerate(parts):
        if part.reader == "json" and src.split == "train":
            _check_reencoded(src, key, part)
        if part.reader != "text":  # a text file is always one string
            n, at = count_bad(_text_data(part.ds))
            if n and first is None:
                first = [i, at]
            bad += n
        total += len(part.ds)
    meta = {"num_records": total, "skipped_records": bad, "first_bad": first}
    if bad and (not skip or bad == total):
        raise bad_records_error(src, key, parts, meta)
    return meta


def _check_reencoded(src, key: str, part) -> None:
    """The last text as datasets read it against the file's own last lines (records.reencoded_error):
    a few lines read from the end of one file, so free."""
    from muonrun.data.records import is_string, last_text, reencoded_error

    column = _text_data(part.ds)
    if not is_string(column.type):  # datasets' Json feature (mixed types from the start) decodes right
        return
    last = last_text(part.files[-1], src.text_field) if part.files else None
    if last is None or last[0] >= len(part.ds):
        return
    got = column[len(part.ds) - 1 - last[0]].as_py()
    if got != last[1]:
        raise reencoded_error(src, key, part.files, got, last[1])


def _text_data(ds):
    """The `text` column of a map-style dataset as Arrow data, without reading it (a memory map)."""
    if getattr(ds, "_indices", None) is None:
        return ds.data.column("text")
    return ds.with_format("arrow")[:]["text"]  # a selection: materialized (never the case here)


def bad_records_error(src, key: str, parts, meta: dict) -> UserError:
    """The error for a source whose meta counts bad records: the first one, located in its file."""
    from muonrun.data.records import Where, bad_record_error, locate

    i, index = meta["first_bad"]
    part = parts[i]
    where = None
    if part.files is not None:
        where = locate(part.reader, part.files, src.text_field, index)
    if where is None:
        record = part.ds[index]
        record = {src.text_field: record["text"]} if "text" in record else record
        number = sum(len(p.ds) for p in parts[:i]) + index + 1
        where = Where(
            None, number, record=record, note=f" of {src.path} (split '{src.split}', counting from 1)"
        )
    return bad_record_error(src, key, where, meta["skipped_records"], meta["num_records"])


def _write_tokens(src, key: str, tok, data_cfg, tmp: Path, files: list[str] | None) -> dict:
    """Tokenize the source into tmp/tokens.bin; returns meta."""
    num_proc, skip = data_cfg.num_proc, data_cfg.skip_bad_records
    import pyarrow as pa

    from muonrun.data.records import good_texts

    started = time.time()
    # taken before reading, as the key's sizes and times were: what a run's data identity reuses
    prints = fingerprints(files) if files is not None else {}
    parts = load_parts(src, key, streaming=False, files=files, cache_dir=datasets_cache(data_cfg))
    if sum(len(p.ds) for p in parts) == 0:
        raise UserError(f"Source '{key}' ({src.path}, split '{src.split}') has no documents.")
    checked = _check_records(src, key, parts, skip)
    faults.during_prepare(requested)  # MUONRUN_FAULT=hang@prepare

    def tokenize(batch: pa.Table) -> pa.Table:
        check_stop()  # SIGTERM or Ctrl-C stop the preparation within a batch
        values, lens = encode_docs(tok, good_texts(batch.column("text")))  # bad records left out
        offsets = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        return pa.table({"ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})

    dtype = token_dtype(tok.vocab_size)
    num_tokens = num_docs = 0
    digest = hashlib.sha256()  # of tokens.bin, as written: the source's exact identity (identity.py)
    with open(tmp / "tokens.bin", "wb") as out:
        for i, part in enumerate(parts):
            ds = part.ds
            try:
                mapped = ds.with_format("arrow").map(
                    tokenize,
                    batched=True,
                    batch_size=1000,
                    num_proc=num_proc if num_proc > 1 and len(ds) >= 2 * num_proc else None,
                    remove_columns=ds.column_names,
                    cache_file_name=str(tmp / f"ids-{i}.arrow"),  # lives and dies with the temporary folder
                    new_fingerprint=f"{tmp.name}-{i}",
                    desc=f"Tokenizing {key}",
                )
            except UserError:
                raise
            except Exception as e:
                check_stop()  # a stop request datasets' worker processes met first
                raise read_error(e, src, key, part.files) from None
            num_docs += len(mapped)
            for table in mapped.with_format("arrow").iter(batch_size=8192):
                for chunk in table.column("ids").chunks:
                    ids = chunk.flatten().to_numpy()
                    assert ids.size == 0 or int(ids.max()) < tok.vocab_size, "token id beyond the vocabulary"
                    data = ids.astype(dtype).tobytes()
                    out.write(data)
                    digest.update(data)
                    num_tokens += ids.size
            del mapped
    for f in tmp.glob("ids*.arrow"):
        f.unlink()
    return {
        "source": src.path,
        "split": src.split,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_token_id": tok.eos_token_id,
        "dtype": dtype.name,
        "num_tokens": num_tokens,
        "num_docs": num_docs,
        "tokens_sha256": digest.hexdigest(),
        "fingerprints": prints,
        **checked,
        "build_seconds": round(time.time() - started, 3),
    }


def cached_entry(src, key: str, tok, data_cfg) -> TokenCache | None:
    """The source's finished cache entry, or None (nothing is built)."""
    files = resolve_files(src, key)
    final = entry_dir(cache_root(data_cfg), src, cache_key(src, tok, files))
    return TokenCache(final) if (final / "meta.json").is_file() else None


def check_entry(entry: TokenCache, src, key: str, data_cfg, report: bool = True) -> TokenCache:
    """An entry built with data.skip_bad_records=true serves a run only with it on too; report the count."""
    from muonrun.data.records import report_skipped, skipped_line

    skipped = entry.meta.get("skipped_records", 0)
    if skipped and not data_cfg.skip_bad_records:
        files = resolve_files(src, key)
        parts = load_parts(src, key, streaming=False, files=files, cache_dir=datasets_cache(data_cfg))
        raise bad_records_error(src, key, parts, entry.meta)
    if skipped and report:
        report_skipped(("map", str(entry.path)), skipped_line(src, key, skipped, entry.meta["num_records"]))
    return entry


def ensure_cached(src, key: str, tok, data_cfg, report: bool = True) -> TokenCache:
    """The source's cache entry, built first if missing (safe when many processes call it at once).
    With `report`, a count of skipped bad records is printed (once per process)."""
    files = resolve_files(src, key)
    ckey = cache_key(src, tok, files)
    root = cache_root(data_cfg)
    final = entry_dir(root, src, ckey)
    if (final / "meta.json").is_file():
        return check_entry(TokenCache(final), src, key, data_cfg, report)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock") as locked:
        if (final / "meta.json").is_file():  # another process built it while we waited
            return check_entry(TokenCache(final), src, key, data_cfg, report)
        if locked:  # no one else builds this entry: a temporary folder left is a killed builder's
            for stale in root.glob(f".tmp-{final.name}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            log.info(f"tokenizing {key} ({src.path}) into {final}")
            meta = _write_tokens(src, key, tok, data_cfg, tmp, files)
            meta["key"] = ckey
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return check_entry(TokenCache(final), src, key, data_cfg, report)
