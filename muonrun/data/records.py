"""Bad records: records whose text field is missing, null or not a string.

By default the first one stops the run with a UserError that names the file, the record (its line in a
JSON-lines file) and the keys to change (`data.sources.N.text_field`, `data.skip_bad_records`). With
`data.skip_bad_records=true` they are left out, and rank 0 (or `muonrun prepare`) prints how many.

Where they are found: map-style sources are checked once per column before tokenizing. A string column
needs only its null count, which the Arrow data carries, so the usual all-good source costs nothing; a
column of mixed JSON types (datasets' `Json` feature) is checked per value, vectorized; a column of any
other type (numbers, lists, all null) is bad in every record. Streaming sources check each block of
documents as it is read. `locate` then finds the record in the files, only on the way to an error.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from dataclasses import dataclass

from muonrun import log
from muonrun.data.formats import nonempty_files, reader_for
from muonrun.errors import UserError

WHAT = "missing, null or not a string"


# -- arrow columns -----------------------------------------------------------------------------------------


def _is_json(t) -> bool:
    return getattr(t, "extension_name", None) == "arrow.json"


def is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _bad_mask(chunk):
    """Bool array (True = bad) of one Arrow chunk of the text column, or None when none is bad."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if is_string(chunk.type):
        return chunk.is_null() if chunk.null_count else None
    if _is_json(chunk.type):  # JSON text of each value: a string is exactly a value that starts with '"'
        is_str = pc.starts_with(chunk.storage, '"')
        return pc.invert(pc.fill_null(is_str, False))
    return pa.array([True] * len(chunk)) if len(chunk) else None


def count_bad(column) -> tuple[int, int | None]:
    """(number of bad records, index of the first) in an Arrow ChunkedArray of texts."""
    import pyarrow.compute as pc

    if is_string(column.type) and column.null_count == 0:  # metadata only: nothing is read
        return 0, None
    count, first, offset = 0, None, 0
    for chunk in column.chunks:
        mask = _bad_mask(chunk)
        if mask is not None:
            n = pc.sum(mask).as_py() or 0
            if n and first is None:
                first = offset + pc.index(mask, True).as_py()
            count += n
        offset += len(chunk)
    return count, first


def good_texts(column) -> list[str]:
    """The strings of a ChunkedArray of texts, bad records left out (the fast path is `to_pylist`)."""
    if is_string(column.type):
        texts = column.to_pylist()
        return texts if column.null_count == 0 else [t for t in texts if t is not None]
    if _is_json(column.type):
        return [
            json.loads(s)
            for chunk in column.chunks
            for s in chunk.storage.to_pylist()
            if s is not None and s.startswith('"')
        ]
    return []


# -- where a record is ------------------------------------------------------------------------------------


@dataclass
class Where:
    """A record: in `file` (None for a Hub dataset), its number there counting from 1, its line when the
    file has lines, and the record itself as far as it is known."""

    file: str | None
    number: int
    line: int | None = None
    record: object = None
    note: str = ""  # how the number counts when it is not the source's own order

    def place(self) -> str:
        if self.file is None:
            return f"record {self.number}{self.note}"
        if self.line is not None:
            return f"line {self.line} of '{self.file}'"
        return f"record {self.number} of '{self.file}' (counting from 1)"


class NotJson(str):
    """A line of a JSON-lines file that does not parse (the parser's complaint)."""


def is_bad(record, field: str) -> bool:
    return not (isinstance(record, dict) and isinstance(record.get(field), str))


def problem(record, field: str) -> str:
    """What is wrong with a bad record, e.g. "has no 'text' field (its fields: title)"."""
    if isinstance(record, NotJson):
        return f"is not JSON ({record})"
    if not isinstance(record, dict):
        return f"is not an object ({_short(record)}, {_kind(record)}) with a '{field}' field"
    if field not in record:
        fields = ", ".join(map(str, record)) or "none"
        return f"has no '{field}' field (its fields: {fields})"
    value = record[field]
    if value is None:
        return f"has '{field}': null"
    return f"has '{field}': {_short(value)}, {_kind(value)} where a string was expected"


def _kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


def _short(value, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _open_binary(path: str):
    name = path.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".bz2"):
        return bz2.open(path, "rb")
    if name.endswith(".xz"):
        return lzma.open(path, "rb")
    if name.endswith(".zst"):
        import zstandard  # datasets needs it for .zst too

        return zstandard.open(path, "rb")
    return open(path, "rb")  # noqa: SIM115 (the caller closes it)


def _is_array(path: str) -> bool:
    """A .json file holding one JSON array (datasets reads its elements as the records)."""
    with _open_binary(path) as f:
        return f.read(1 << 16).lstrip().startswith(b"[")


def _json_records(path: str):
    """(line, record) of a JSON-lines file, or (None, element) of a file holding one JSON array; a line
    that is not JSON gives a NotJson record."""
    if _is_array(path):
        with _open_binary(path) as f:
            try:
                data = json.loads(f.read().decode("utf-8"))
            except ValueError:  # lines that start with "[": JSON lines holding arrays, read line by line
                data = None
        if data is not None:
            for item in data if isinstance(data, list) else [data]:
                yield None, item
            return
    with _open_binary(path) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except ValueError as e:
                    yield line_no, NotJson(str(e))


def _json_count(path: str) -> int | None:
    """Records of a JSON-lines file: its non-blank lines (None for a file holding one array)."""
    if _is_array(path):
        return None
    with _open_binary(path) as f:
        return sum(1 for line in f if line.strip())


def _table_records(reader: str, path: str, field: str):
    """(None, {field: value}) of each row of a parquet, arrow or csv file."""
    import pyarrow as pa

    if reader == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if field not in pf.schema_arrow.names:
            for _ in range(pf.metadata.num_rows):
                yield None, {}
            return
        batches = pf.iter_batches(columns=[field])
    elif reader == "arrow":
        try:
            batches = iter(pa.ipc.open_stream(pa.memory_map(path)))
        except pa.ArrowInvalid:
            f = pa.ipc.open_file(pa.memory_map(path))
            batches = (f.get_batch(i) for i in range(f.num_record_batches))
    else:  # csv, read as datasets reads it (pandas)
        import pandas as pd

        for df in pd.read_csv(path, chunksize=1 << 16):
            if field not in df.columns:
                for _ in range(len(df)):
                    yield None, {}
                continue
            for value in df[field].tolist():
                yield None, {field: None if isinstance(value, float) and value != value else value}
        return
    for batch in batches:
        if field not in batch.schema.names:
            for _ in range(batch.num_rows):
                yield None, {}
            continue
        for value in batch.column(field).to_pylist():
            yield None, {field: value}


def _table_count(reader: str, path: str) -> int | None:
    if reader == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    return None


def _records(reader: str, path: str, field: str):
    return _json_records(path) if reader == "json" else _table_records(reader, path, field)


def _count(reader: str, path: str) -> int | None:
    return _json_count(path) if reader == "json" else _table_count(reader, path)


def locate(reader: str, files: list[str], field: str, index: int | None = None, rule=None) -> Where | None:
    """The bad record at `index` (counting from 0 over `files`, read in order by `reader`) or, with no
    index or when the record there is not bad by this module's rule, the first bad record of the files.
    Reads the files (only on the way to an error); None when none is found or they cannot be read.
    `rule(record, field)` picks other records than bad ones."""
    if reader == "text":
        return None
    rule = rule or is_bad
    try:
        if index is not None:
            base = 0
            for path in files:
                count = _count(reader, path)
                if count is not None and base + count <= index:
                    base += count
                    continue
                for number, (line, record) in enumerate(_records(reader, path, field), 1):
                    if base + number - 1 == index:
                        if rule(record, field):
                            return Where(path, number, line, record)
                        break
                break
        for path in files:
            for number, (line, record) in enumerate(_records(reader, path, field), 1):
                if rule(record, field):
                    return Where(path, number, line, record)
    except Exception:  # noqa: BLE001 (only ever on the way to an error: say less rather than fail)
        return None
    return None


# -- messages -----------------------------------------------------------------------------------------------


def bad_record_error(
    src, key: str, where: Where, bad: int | None = None, total: int | None = None
) -> UserError:
    """One paragraph: the first bad record, how many there are (when known) and the three ways out."""
    field = src.text_field
    if bad is not None and total is not None and bad == total:
        return UserError(
            f"Source '{key}' ({src.path}): none of its {total} records has a string in '{field}', the field "
            f"that '{key}.text_field' names; the first, {where.place()}, {problem(where.record, field)}. "
            f"Set '{key}.text_field' to the field that holds the text."
        )
    if bad is not None and total is not None:
        count = f"{bad} of its {total} records {'has' if bad == 1 else 'have'} a '{field}' that is {WHAT}"
    else:
        count = f"it is the first record whose '{field}' is {WHAT}"
    return UserError(
        f"Source '{key}' ({src.path}): {where.place()} {problem(where.record, field)}; {count}. Every record "
        f"needs its text as a string in the field that '{key}.text_field' names ('{field}'): fix or remove "
        f"such records, set '{key}.text_field' to the field that holds the text, or set "
        "data.skip_bad_records=true to skip them (the run then reports how many it skipped)."
    )


_reported: set = set()


def report_skipped(ident, line: str) -> None:
    """Print `muonrun: <line>` once per process for `ident` (rank 0 and `muonrun prepare` call this)."""
    if ident in _reported:
        return
    _reported.add(ident)
    log.info(line, every_rank=True)


def skipped_line(src, key: str, skipped: int, total: int, where: str = "") -> str:
    return (
        f"skipped {skipped} of {total} records of {key} ({src.path}){where} whose '{src.text_field}' is "
        f"{WHAT} (data.skip_bad_records=true)"
    )


def locate_first(src, files: list[str] | None, rule=None) -> Where | None:
    """The first bad record of a local source, its files read in the order the source reads them."""
    from itertools import groupby

    if files is None:
        return None
    for reader, group in groupby(sorted(files, key=reader_for), key=reader_for):
        where = locate(reader, nonempty_files(reader, group), src.text_field, rule=rule)
        if where is not None:
            return where
    return None


class StreamChecks:
    """Bad records of one streaming source on one data-parallel rank: the error for the first one, the
    error when skipping leaves nothing, and (with `report`, rank 0) the line saying how many were skipped."""

    def __init__(
        self, src, key: str, files: list[str] | None, skip: bool, rank: int, world: int, report: bool
    ):
        self.src, self.key, self.files, self.skip = src, key, files, skip
        self.rank, self.world, self.report = rank, world, report
        self.text_is_json = False  # the stream's text column is datasets' Json feature (set on opening)
        self._reencoding_checked = files is None

    def reencoded(self, docs: list[str]) -> UserError | None:
        """The error when datasets turned the texts into JSON text (see reencoded_error). It does so from
        some record to the end, so the last texts of a block (in reading order) tell: one wrapped in double
        quotes is the hint, and the files are then searched once for its cause."""
        if self._reencoding_checked or self.text_is_json:
            return None
        quoted = next((d for d in docs[-3:] if len(d) > 1 and d[0] == '"' and d[-1] == '"'), None)
        if quoted is None:
            return None
        self._reencoding_checked = True
        if locate_first(self.src, self.files, changes_type) is None:
            return None  # texts that really are quoted
        return reencoded_error(self.src, self.key, self.files, quoted)

    def _on_rank(self) -> str:
        return f" on data-parallel rank {self.rank} of {self.world}" if self.world > 1 else ""

    def error(self, number: int, value) -> UserError:
        """`number`: the record's place in this rank's pass over the stream (from 1); `value`: its text."""
        where = locate_first(self.src, self.files)
        if where is None:
            where = Where(
                None,
                number,
                record={self.src.text_field: value},
                note=f" of {self.src.path} (split '{self.src.split}') as read{self._on_rank()}, counting from 1",
            )
        return bad_record_error(self.src, self.key, where)

    def nothing_left(self, read: int) -> UserError:
        where = locate_first(self.src, self.files)
        first = f"; the first, {where.place()}, {problem(where.record, self.src.text_field)}" if where else ""
        return UserError(
            f"Source '{self.key}' ({self.src.path}): all {read} records read{self._on_rank()} have a "
            f"'{self.src.text_field}' that is {WHAT}{first}, so data.skip_bad_records=true leaves nothing to "
            f"train on. Set '{self.key}.text_field' to the field that holds the text."
        )

    def count(self, read: int, skipped: int, complete: bool) -> None:
        """Called as blocks are served: `read` and `skipped` so far in this pass; `complete`: pass over."""
        if not (self.report and skipped):
            return
        ident = (self.key, self.src.path)
        if complete:
            report_skipped((*ident, "pass"), skipped_line(self.src, self.key, skipped, read, self._on_rank()))
        else:
            report_skipped(
                (*ident, "partial"),
                f"skipping records of {self.key} ({self.src.path}) whose '{self.src.text_field}' is {WHAT} "
                f"(data.skip_bad_records=true): {skipped} of the first {read} read{self._on_rank()}; the count "
                "of a whole pass follows when it ends",
            )


def last_text(path: str, field: str, limit: int = 100) -> tuple[int, str] | None:
    """(records after it, text) of the last of the final `limit` records of an uncompressed JSON-lines
    file whose `field` is a string, read from the file's end; None when there is none or the file is
    compressed or one JSON array."""
    if not path.lower().endswith((".jsonl", ".json", ".ndjson")):
        return None
    with open(path, "rb") as f:
        pos = f.seek(0, 2)
        tail, lines = b"", []
        while pos > 0:
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
            lines = [line for line in tail.splitlines() if line.strip()]
            if len(lines) > limit:
                break
    lines = lines[1:] if pos > 0 else lines  # the first may be cut
    if pos == 0 and lines and lines[0].lstrip().startswith(b"["):
        return None
    for after, line in enumerate(reversed(lines[-limit:])):
        try:
            record = json.loads(line)
        except ValueError:
            return None
        if isinstance(record, dict) and isinstance(record.get(field), str):
            return after, record[field]
    return None


def changes_type(record, field: str) -> bool:
    """A text that is neither a string nor null: what makes datasets' JSON reader change the column."""
    return isinstance(record, dict) and record.get(field) is not None and not isinstance(record[field], str)


def reencoded_error(src, key: str, files: list[str], got: str, want: str | None = None) -> UserError:
    """datasets' JSON reader, once a record's text has another type (a list, a number) after its first
    10 MB or in a later file, writes the texts from there on as JSON: "abc" becomes '"abc"'."""
    field = src.text_field
    where = locate_first(src, files, changes_type)
    seen = f"came out as {_short(got)}" + (
        f" where the file holds {_short(want)}" if want is not None else ""
    )
    cause = f" The likely cause is {where.place()}, which {problem(where.record, field)}." if where else ""
    return UserError(
        f"Source '{key}' ({src.path}): datasets read its JSON files wrongly: a '{field}' {seen}.{cause} When "
        f"a record's '{field}' is not a string after the first 10 MB datasets reads (or in a later file), "
        f"datasets turns every '{field}' from there on into JSON text, so data.skip_bad_records cannot skip it. "
        f"Give every record its text as a string in '{field}' (e.g. keep only those: jq -c "
        f"'select(.{field} | type == \"string\")' in.jsonl > out.jsonl)."
    )
