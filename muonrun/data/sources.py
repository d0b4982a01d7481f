"""One `SourceConfig` -> a `datasets` Dataset (or IterableDataset when streaming) with one column, `text`.

A path that exists, holds a glob character, starts with / ./ ../ ~ or ends in a known data extension
is local; anything else is a Hub dataset id. Local files are read by extension (see READERS); every
other file is one UTF-8 document. Every failure a user can cause becomes a UserError that names the
config key (`data.sources.0.path`, ...) and the file: an empty file, a file of blank lines, a column
that is not there, JSON that datasets cannot read (then the record that broke it, by records.py).
datasets' progress bars are turned off unless stderr is a terminal (`quiet_progress_bars`).
"""

from __future__ import annotations

import glob
import os
import stat
import sys
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from muonrun.checkpoint.stop import LAUNCHER_PID_ENV
from muonrun.data.formats import BINARY, COMPRESSION, READERS, nonempty_files, reader_for
from muonrun.errors import UserError

_LOCAL_HINT_EXTS = {*READERS, *COMPRESSION, ".txt", ".py", ".md"}


def _usable(path: str) -> bool:
    p = Path(path)
    return not p.name.startswith(".") and p.suffix.lower() not in BINARY and "__pycache__" not in p.parts


def _special(path: str) -> str | None:
    """What `path` is when it is not a regular file or folder (a named pipe, socket or device: opening one
    can wait forever), else None."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def _without_special(files: list[str], key: str) -> list[str]:
    """`files` less the special ones (pipes, sockets, devices), each named in one warning."""
    special = [(f, what) for f in files if (what := _special(f))]
    if special and os.environ.get(LAUNCHER_PID_ENV, str(os.getpid())) == str(os.getpid()):
        from muonrun import log  # said once, by the launcher (or the process alone), not by every worker

        shown = "; ".join(f"'{f}', {what}" for f, what in special[:3])
        more = f"; and {len(special) - 3} more" if len(special) > 3 else ""
        log.once(
            f"special:{key}",
            f"{key}.path: skipping {shown}{more}: muonrun reads regular files only (opening a pipe or a "
            "device can wait forever).",
            warn=True,
        )
    return [f for f in files if not _special(f)]


def resolve_files(src, key: str) -> list[str] | None:
    """Absolute paths of a local source's files (sorted), or None when `path` is a Hub dataset id. Named
    pipes, sockets and devices are skipped with a warning (reading one can wait forever), refused when
    named alone."""
    raw = src.path
    if not raw or raw == "???":
        raise UserError(
            f"Config key '{key}.path' is not set; give a Hub dataset id or a local file, folder or glob."
        )
    path = os.path.expanduser(raw)
    if glob.has_magic(path):
        matched = [
            f for f in glob.glob(path, recursive=True) if (os.path.isfile(f) or _special(f)) and _usable(f)
        ]
        files = _without_special(matched, key)
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
        files = _without_special(files, key)
        if not files:
            raise UserError(f"Config key '{key}.path' is the folder '{raw}', which holds no readable files.")
    elif os.path.isfile(path):
        files = [path]
    elif what := _special(path):
        raise UserError(
            f"Config key '{key}.path' is '{raw}', which is {what}, not a file muonrun can read (reading it could "
            "wait forever). Name a regular file, a folder or a glob."
        )
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
        detail += f" (caused by {type(chain[0]).__name__}: {' '.join(str(chain[0]).split())[:300]})"
    json_files = sorted(f for f in files or [] if reader_for(f) == "json")
    if json_files and any(_json_layout_error(c) for c in _cause_chain(e)):
        return _json_read_error(src, key, json_files, detail)
    return UserError(f"Source '{key}' ({src.path}) could not be read: {detail}.")


def _json_layout_error(e: BaseException) -> bool:
    """datasets' JSON reader failed on a record that does not fit the columns or types it had settled on
    (from the first 10 MB of the first file), or on a line that is not JSON or not an object (pandas'
    fallback reader then says "Trailing data")."""
    text = str(e)
    return type(e).__name__ in ("CastError", "ArrowInvalid", "ArrowTypeError", "JSONDecodeError") or any(
        s in text
        for s in ("changed from", "Expected object or value", "column names don't match", "Trailing data")
    )


def _json_read_error(src, key: str, files: list[str], detail: str) -> UserError:
    from muonrun.data.records import WHAT, NotJson, changes_type, locate, problem

    # what stops the reader: a line that is not JSON, a text of another type, a record without it
    field = src.text_field
    # a line that is valid JSON but no object (an array, a string) is as unreadable as one that is not JSON
    where = locate("json", files, field, rule=lambda r, f: isinstance(r, NotJson) or not isinstance(r, dict))
    if where is not None:
        return UserError(
            f"Source '{key}' ({src.path}): {where.place()} {problem(where.record, field)}. A JSON-lines file "
            f"holds one JSON object per line: fix or remove that line."
        )
    where = locate("json", files, field, rule=changes_type) or locate("json", files, field)
    culprit = (
        f"The first record whose '{field}' is {WHAT} is {where.place()}, which {problem(where.record, field)}. "
        if where
        else ""
    )
    return UserError(
        f"Source '{key}' ({src.path}): datasets could not read its JSON files ({detail}). {culprit}"
        "datasets settles each column's name and type from the first 10 MB it reads; a later record with "
        "other fields or another type stops the read, so data.skip_bad_records cannot skip it. Give every record "
        f"the same fields, with the text as a string in '{field}' (e.g. keep only those: jq -c "
        f"'select(.{field} | type == \"string\")' in.jsonl > out.jsonl), or set '{key}.text_field' to the "
        "field that holds the text."
    )


def hub_error(e: Exception, src, key: str) -> UserError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(
        f"Config key '{key}.path' is '{src.path}', which is not a local file, folder or glob, and loading it as a "
        f"Hugging Face Hub dataset (name={src.name!r}, split={src.split!r}) failed: {type(e).__name__}: {first}. "
        "Without network access, set HF_HUB_OFFLINE=1 and use a dataset already in the Hugging Face cache, or "
        f"download it where there is access and point '{key}.path' at the local files (jsonl, parquet, ...)."
    )


def _text_column(ds, column: str, src, key: str, what: str):
    """Keep only `column`, renamed to `text`; UserError listing the columns when it is missing. Its type
    is not checked here: records whose value is not a string are bad records (records.py)."""
    cols = ds.column_names
    if cols is None:  # streaming without known features: look at the first rows
        cols = list(dict.fromkeys(k for row in ds.take(100) for k in row))
    if column not in cols:
        raise UserError(
            f"Config key '{key}.text_field' is '{column}', but {what} has no such column; its columns are: "
            f"{', '.join(map(str, cols)) or '(none)'}. Set '{key}.text_field' to the column holding the text."
        )
    ds = ds.select_columns([column])
    return ds if column == "text" else ds.rename_column(column, "text")


def quiet_progress_bars() -> None:
    """datasets' progress bars are for a terminal: in a log file they are lines of carriage returns.
    Off when stderr (where they go) is not a terminal; left as they are on one."""
    import datasets

    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        datasets.disable_progress_bars()


@dataclass
class Part:
    """The files of one reader (json, parquet, ..., text) loaded as one dataset with the column `text`.
    `files` is None for a Hub dataset."""

    reader: str
    files: list[str] | None
    ds: object


def _no_records(src, key: str, files: list[str]) -> UserError:
    empty = [f for f in files if os.path.getsize(f) == 0]
    if len(files) == 1:
        what = f"the file '{files[0]}' is empty" if empty else f"the file '{files[0]}' holds no records"
    else:
        shown = ", ".join(f"'{f}'" for f in files[:3]) + (", ..." if len(files) > 3 else "")
        what = f"its {len(files)} files ({shown}) are empty or hold no records"
    if reader_for(files[0]) == "json":
        form = f"one JSON object per line, with the text in its field '{src.text_field}'"
    else:
        form = f"rows with the text in the column '{src.text_field}'"
    return UserError(
        f"Source '{key}' ({src.path}) has no documents: {what}. Put records in it ({form}) or point "
        f"'{key}.path' at the data."
    )


def load_parts(
    src, key: str, *, streaming: bool, files: list[str] | None = None, cache_dir: str | None = None
) -> list[Part]:
    """The source as one dataset per reader, each with the single column `text`, in reading order.
    `cache_dir`: where datasets keeps its own files for local sources (an Arrow copy, locks): under
    muonrun's cache (data.cache_dir), not in ~/.cache/huggingface; Hub datasets stay in Hugging Face's
    cache, where they are downloaded."""
    import datasets

    quiet_progress_bars()
    if files is None:
        files = resolve_files(src, key)
    if files is None:
        try:
            ds = datasets.load_dataset(src.path, src.name, split=src.split, streaming=streaming)
        except UserError:
            raise
        except Exception as e:
            raise hub_error(e, src, key) from None
        return [Part("hub", None, _text_column(ds, src.text_field, src, key, f"Hub dataset '{src.path}'"))]

    parts = []
    for reader, group in groupby(sorted(files, key=reader_for), key=reader_for):
        group = nonempty_files(reader, group)
        if not group:
            continue
        extra = {"sample_by": "document"} if reader == "text" else {}
        try:
            ds = datasets.load_dataset(
                reader, data_files=group, split=src.split, streaming=streaming, cache_dir=cache_dir, **extra
            )
        except ValueError as e:
            if "corresponds to no data" in str(e) and src.split == "train":
                continue  # files of blank lines or [] only: no records, like empty files
            if "split" in str(e).lower() or "corresponds to no data" in str(e):
                raise UserError(
                    f"Config key '{key}.split' is '{src.split}', but local files only form the split 'train' "
                    f"(slices like 'train[:90%]' work, if they select any records): "
                    f"{str(e).strip().splitlines()[0]}"
                ) from None
            raise read_error(e, src, key, group) from None
        except Exception as e:
            raise read_error(e, src, key, group) from None
        if streaming and ds.column_names == [] and next(iter(ds), None) is None:
            continue  # blank lines only: no records (map-style reading says so with the ValueError above)
        if reader != "text":
            what = f"'{group[0]}'" + (
                f" (and {len(group) - 1} more {reader} files)" if len(group) > 1 else ""
            )
            ds = _text_column(ds, src.text_field, src, key, what)
        parts.append(Part(reader, group, ds))
    if not parts:
        raise _no_records(src, key, files)
    return parts


def load_source(
    src, key: str, *, streaming: bool, files: list[str] | None = None, cache_dir: str | None = None
):
    """The source as a Dataset / IterableDataset with the single column `text`."""
    import datasets

    parts = load_parts(src, key, streaming=streaming, files=files, cache_dir=cache_dir)
    if len(parts) == 1:
        return parts[0].ds
    try:
        return datasets.concatenate_datasets([p.ds for p in parts])
    except ValueError as e:  # the text column has different types in files of different formats
        types = ", ".join(f"{p.reader} files: {p.ds.features['text']}" for p in parts if p.ds.features)
        raise UserError(
            f"Source '{key}' ({src.path}) mixes file formats whose '{src.text_field}' columns have different "
            f"types ({types or e}), which a streaming source cannot combine: give each format its own source "
            f"in data.sources, or make every '{src.text_field}' a string."
        ) from None


def check_source(src, key: str, skip_bad_records: bool = False, cache_dir: str | None = None) -> None:
    """Cheap checks before workers start: the files exist and are not all empty, the text column is there
    and the first record of each format holds a string; a Hub dataset's builder can be created (this
    needs the network or the HF cache)."""
    import datasets

    quiet_progress_bars()
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
    seen_records = False
    for reader, group in groupby(sorted(files, key=reader_for), key=reader_for):
        if reader == "text":
            seen_records = True
            continue
        group = nonempty_files(reader, group)
        if not group:
            continue
        first = group[0]
        try:  # streaming reads only the first rows of the first file
            ds = datasets.load_dataset(
                reader, data_files=[first], split="train", streaming=True, cache_dir=cache_dir
            )
            row = next(iter(ds), None)
        except Exception as e:
            raise read_error(e, src, key, [first]) from None
        if row is None:
            continue  # no records in its first file (blank lines only): the build tells if none has any
        seen_records = True
        if src.text_field not in row:
            raise UserError(
                f"Config key '{key}.text_field' is '{src.text_field}', but '{first}' has no such column; its "
                f"columns are: {', '.join(row)}. Set '{key}.text_field' to the column holding the text."
            )
        if not skip_bad_records and not isinstance(row[src.text_field], str):
            from muonrun.data.records import Where, bad_record_error, locate

            where = locate(reader, [first], src.text_field, index=0) or Where(first, 1, record=row)
            raise bad_record_error(src, key, where)
    if not seen_records and all(os.path.getsize(f) == 0 for f in files):
        raise _no_records(src, key, files)
