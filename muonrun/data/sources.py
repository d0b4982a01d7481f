"""One `SourceConfig` -> a `datasets` Dataset (or IterableDataset when streaming) with one column, `text`.

A path that exists, holds a glob character, starts with / ./ ../ ~ or ends in a known data extension
is local; anything else is a Hub dataset id. Local files are read by extension (see READERS); every
other file is one UTF-8 document. Every failure a user can cause becomes a UserError that names the
config key (`data.sources[0].path`, ...) and the file.
"""

from __future__ import annotations

import glob
import os
from itertools import groupby
from pathlib import Path

from muonrun.errors import UserError

# extension -> datasets builder; every other file goes to the `text` builder, one document per file
READERS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
# never text: skipped when a folder or glob is expanded (an explicitly named file is always read)
_BINARY_EXTS = """.pyc .pyo .so .dll .dylib .exe .o .a .lib .class .jar .png .jpg .jpeg .gif .bmp .ico .webp
.pdf .zip .tar .tgz .whl .egg .bin .pt .pth .safetensors .npy .npz .pkl .pickle .wav .mp3 .mp4 .db .sqlite .lock"""
BINARY = frozenset(_BINARY_EXTS.split())
_LOCAL_HINT_EXTS = {*READERS, *COMPRESSION, ".txt", ".py", ".md"}


def reader_for(path: str) -> str:
    """The datasets builder for a file, by extension (compression suffixes look through)."""
    name = path.lower()
    for suffix in COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return READERS.get(Path(name).suffix, "text")


def _usable(path: str) -> bool:
    p = Path(path)
    return not p.name.startswith(".") and p.suffix.lower() not in BINARY and "__pycache__" not in p.parts


def resolve_files(src, key: str) -> list[str] | None:
    """Absolute paths of a local source's files (sorted), or None when `path` is a Hub dataset id."""
    raw = src.path
    if not raw or raw == "???":
        raise UserError(
            f"Config key '{key}.path' is not set; give a Hub dataset id or a local file, folder or glob."
        )
    path = os.path.expanduser(raw)
    if glob.has_magic(path):
        files = [f for f in glob.glob(path, recursive=True) if os.path.isfile(f) and _usable(f)]
        if not files:
            raise UserError(
                f"Config key '{key}.path' is the glob '{raw}', which matches no readable files "
                f"(searched from {os.getcwd()}; hidden files and binaries are skipped)."
            )
    elif os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
            files += [os.path.join(root, n) for n in names if _usable(os.path.join(root, n))]
        if not files:
            raise UserError(f"Config key '{key}.path' is the folder '{raw}', which holds no readable files.")
    elif os.path.isfile(path):
        files = [path]
    elif raw.startswith(("/", "./", "../", "~")) or Path(raw.lower()).suffix in _LOCAL_HINT_EXTS:
        raise UserError(
            f"Config key '{key}.path' is '{raw}', which does not exist (relative paths start at {os.getcwd()})."
        )
    else:
        return None
    return sorted(os.path.abspath(f) for f in files)


def _cause_chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def undecodable_file(files: list[str]) -> tuple[str, UnicodeDecodeError] | None:
    """The first text file that is not valid UTF-8 (only called after a read failed, so speed is moot)."""
    for f in files:
        if reader_for(f) != "text":
            continue
        try:
            with open(f, encoding="utf-8") as fh:
                while fh.read(1 << 24):
                    pass
        except UnicodeDecodeError as e:
            return f, e
    return None


def read_error(e: Exception, src, key: str, files: list[str] | None) -> UserError:
    """Turn an exception raised while reading a source into a UserError that names the file."""
    if any(isinstance(c, UnicodeDecodeError) for c in _cause_chain(e)):
        bad = undecodable_file(files or [])
        where = (
            f"file '{bad[0]}' is not valid UTF-8 ({bad[1].reason} at byte {bad[1].start})" if bad else str(e)
        )
        return UserError(
            f"Source '{key}' ({src.path}): {where}. Text files are read as UTF-8: convert or remove the file, "
            f"or narrow '{key}.path' so it no longer matches it."
        )
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
    chain = [c for c in _cause_chain(e) if c is not e]
    if chain:
        detail += f" (caused by {type(chain[0]).__name__}: {str(chain[0]).strip()[:300]})"
    return UserError(f"Source '{key}' ({src.path}) could not be read: {detail}.")


def hub_error(e: Exception, src, key: str) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(
        f"Config key '{key}.path' is '{src.path}', which is not a local file, folder or glob, and loading it as a "
        f"Hugging Face Hub dataset (name={src.name!r}, split={src.split!r}) failed: {type(e).__name__}: {first}. "
        "Without network access, set HF_HUB_OFFLINE=1 and use a dataset already in the Hugging Face cache, or "
        f"download it where there is access and point '{key}.path' at the local files (jsonl, parquet, ...)."
    )


def _text_column(ds, column: str, src, key: str, what: str):
    """Keep only `column`, renamed to `text`; UserError listing the columns when it is missing."""
    cols = ds.column_names
    if cols is None:  # streaming without known features: look at the first row
        first = next(iter(ds.take(1)), None)
        cols = list(first) if first is not None else []
    if column not in cols:
        raise UserError(
            f"Config key '{key}.text_field' is '{column}', but {what} has no such column; its columns are: "
            f"{', '.join(map(str, cols)) or '(none)'}. Set '{key}.text_field' to the column holding the text."
        )
    feature = (ds.features or {}).get(column)
    dtype = getattr(feature, "dtype", None)
    if feature is not None and dtype not in ("string", "large_string"):
        raise UserError(
            f"Config key '{key}.text_field' is '{column}', but that column of {what} holds {feature}, not text."
        )
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def load_source(src, key: str, *, streaming: bool, files: list[str] | None = None):
    """The source as a Dataset / IterableDataset with the single column `text`."""
    import datasets

    if files is None:
        files = resolve_files(src, key)
    if files is None:
        try:
            ds = datasets.load_dataset(src.path, src.name, split=src.split, streaming=streaming)
        except UserError:
            raise
        except Exception as e:
            raise hub_error(e, src, key) from None
        return _text_column(ds, src.text_field, src, key, f"Hub dataset '{src.path}'")

    parts = []
    for reader, group in groupby(sorted(files, key=reader_for), key=reader_for):
        # an empty .py is an (empty) document; an empty table file is nothing, and datasets chokes on it
        group = sorted(f for f in group if reader == "text" or os.path.getsize(f) > 0)
        if not group:
            continue
        extra = {"sample_by": "document"} if reader == "text" else {}
        try:
            ds = datasets.load_dataset(
                reader, data_files=group, split=src.split, streaming=streaming, **extra
            )
        except ValueError as e:
            if "split" in str(e).lower():
                raise UserError(
                    f"Config key '{key}.split' is '{src.split}', but local files only form the split 'train' "
                    f"(slices like 'train[:90%]' work): {str(e).strip().splitlines()[0]}"
                ) from None
            raise read_error(e, src, key, group) from None
        except Exception as e:
            raise read_error(e, src, key, group) from None
        if reader == "text":
            parts.append(ds)
        else:
            what = f"'{group[0]}'" + (
                f" (and {len(group) - 1} more {reader} files)" if len(group) > 1 else ""
            )
            parts.append(_text_column(ds, src.text_field, src, key, what))
    if not parts:
        raise UserError(f"Source '{key}' ({src.path}) has no documents: its files are empty.")
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def check_source(src, key: str) -> None:
    """Cheap checks before workers start: the files exist and the text column is there; a Hub dataset's
    builder can be created (this needs the network or the HF cache)."""
    import datasets

    if not src.weight > 0:
        raise UserError(f"Config key '{key}.weight' is {src.weight}; mixture weights must be positive.")
    files = resolve_files(src, key)
    if files is None:
        try:
            builder = datasets.load_dataset_builder(src.path, src.name)
        except Exception as e:
            raise hub_error(e, src, key) from None
        features = builder.info.features
        if features is not None and src.text_field not in features:
            raise UserError(
                f"Config key '{key}.text_field' is '{src.text_field}', but Hub dataset '{src.path}' has no such "
                f"column; its columns are: {', '.join(features)}. Set '{key}.text_field' to the text column."
            )
        return
    for reader, group in groupby(sorted(files, key=reader_for), key=reader_for):
        if reader == "text":
            continue
        first = sorted(group)[0]
        try:  # streaming reads only the first rows of the first file
            ds = datasets.load_dataset(reader, data_files=[first], split="train", streaming=True)
            row = next(iter(ds), None)
        except Exception as e:
            raise read_error(e, src, key, [first]) from None
        if row is None:
            continue  # an empty file; the build reports an empty source as a whole
        if src.text_field not in row:
            raise UserError(
                f"Config key '{key}.text_field' is '{src.text_field}', but '{first}' has no such column; its "
                f"columns are: {', '.join(row)}. Set '{key}.text_field' to the column holding the text."
            )
