"""Tokenize a map-style source once into `<cache_dir>/<name>-<hash>/{tokens.bin,meta.json}`.

tokens.bin is the source's whole token stream (every document followed by EOS), uint16 when the
vocabulary fits, else uint32, read back as a numpy memmap. Windows of seq_len+1 tokens are a reshape
of that stream, so the cache does not depend on seq_len and changing it does not retokenize. The key
hashes the source (path, name, split, text field, and for local files each file's size and mtime), the
tokenizer's fingerprint (vocabulary and EOS) and CACHE_VERSION.

Several ranks may build the same entry at once: an advisory lock lets one build while the others wait,
and the build goes to a private temporary folder renamed into place, so a reader only ever sees a
complete entry even where the lock does not work (the first rename wins, later ones are discarded).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import numpy as np

from muonrun.data.sources import load_source, read_error, resolve_files
from muonrun.data.tokenizer import encode_docs
from muonrun.errors import UserError

log = logging.getLogger(__name__)

CACHE_VERSION = 1
"""Bump when the layout of tokens.bin or the tokenization rule changes: old entries are then ignored."""


def cache_root(data_cfg) -> Path:
    root = data_cfg.cache_dir or os.environ.get("MUONRUN_CACHE") or "~/.cache/muonrun"
    return Path(root).expanduser()


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
        yield  # no locking here: the atomic rename alone keeps it correct
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield
    finally:
        fh.close()


def _write_tokens(src, key: str, tok, num_proc: int, tmp: Path, files: list[str] | None) -> dict:
    """Tokenize the source into tmp/tokens.bin; returns meta."""
    import pyarrow as pa

    started = time.time()
    ds = load_source(src, key, streaming=False, files=files)
    if len(ds) == 0:
        raise UserError(f"Source '{key}' ({src.path}, split '{src.split}') has no documents.")

    def tokenize(batch: pa.Table) -> pa.Table:
        texts = [t or "" for t in batch.column("text").to_pylist()]
        values, lens = encode_docs(tok, texts)
        offsets = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=offsets[1:])
        return pa.table({"ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})

    try:
        mapped = ds.with_format("arrow").map(
            tokenize,
            batched=True,
            batch_size=1000,
            num_proc=num_proc if num_proc > 1 and len(ds) >= 2 * num_proc else None,
            remove_columns=ds.column_names,
            cache_file_name=str(tmp / "ids.arrow"),  # lives and dies with the temporary folder
            new_fingerprint=tmp.name,
            desc=f"Tokenizing {key}",
        )
    except UserError:
        raise
    except Exception as e:
        raise read_error(e, src, key, files) from None
    dtype = token_dtype(tok.vocab_size)
    num_tokens = 0
    with open(tmp / "tokens.bin", "wb") as out:
        for table in mapped.with_format("arrow").iter(batch_size=8192):
            for chunk in table.column("ids").chunks:
                ids = chunk.flatten().to_numpy()
                assert ids.size == 0 or int(ids.max()) < tok.vocab_size, "token id beyond the vocabulary"
                out.write(ids.astype(dtype).tobytes())
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
        "num_docs": len(ds),
        "build_seconds": round(time.time() - started, 3),
    }


def ensure_cached(src, key: str, tok, data_cfg) -> TokenCache:
    """The source's cache entry, built first if missing (safe when many processes call it at once)."""
    files = resolve_files(src, key)
    ckey = cache_key(src, tok, files)
    root = cache_root(data_cfg)
    final = entry_dir(root, src, ckey)
    if (final / "meta.json").is_file():
        return TokenCache(final)
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{final.name}.lock"):
        if (final / "meta.json").is_file():  # another process built it while we waited
            return TokenCache(final)
        tmp = root / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            log.info("tokenizing %s (%s) into %s", key, src.path, final)
            meta = _write_tokens(src, key, tok, data_cfg.num_proc, tmp, files)
            meta["key"] = ckey
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, final)
            except OSError:
                if not (final / "meta.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return TokenCache(final)
