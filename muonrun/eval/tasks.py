"""Multiple-choice task files (`eval.tasks`): read, checked record by record, kept as examples.

A record holds a context, a list of choices and the right answer (the fields the task names); a
mistake in any record stops the run before any worker starts, naming the file and its line (JSON
lines), record (a JSON list, a Hub dataset) or row (Parquet). The label is read as
lm-evaluation-harness reads a `{{label}}` target: an int, or digits as text, is the choice's index;
other text must be one of the choices.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from muonrun.config.evaluation import EvalTaskConfig
from muonrun.errors import UserError

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class Example:
    context: str
    choices: tuple[str, ...]
    label: int
    """The right choice's index."""


@dataclass(frozen=True)
class Task:
    name: str
    examples: tuple[Example, ...]
    delimiter: str
    """What goes between the context and each choice (the harness's target_delimiter)."""


def is_local(task: EvalTaskConfig) -> bool:
    """Whether `task.path` names a local file (else a Hub dataset id): an existing path, or one that looks
    like a file (a known suffix, or starting with `/`, `.` or `~`), which then must exist."""
    path = task.path
    return (
        Path(path).expanduser().exists() or path.endswith(LOCAL_SUFFIXES) or path.startswith(("/", ".", "~"))
    )


def local_path(task: EvalTaskConfig, key: str) -> Path:
    path = Path(task.path).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(
            f"Eval task '{task.name}' ({key}.path): '{path}' {what}; give a .jsonl, .json or .parquet file."
        )
    if path.suffix not in LOCAL_SUFFIXES:
        raise UserError(
            f"Eval task '{task.name}' ({key}.path): '{path}' is a {path.suffix or 'suffix-less'} file; a task file "
            "is .jsonl (one JSON object per line), .json (JSON lines or one list of objects) or .parquet."
        )
    return path


def _local_records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for each record of a local file: `line N`, `record N` or `row N`, from 1."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"row {n}", row
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            yield f"line {e.lineno}", e
            return
        for n, record in enumerate(records, 1):
            yield f"record {n}", record
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"line {n}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"line {n}", e


def _hub_records(task: EvalTaskConfig, key: str) -> Iterator[tuple[str, object]]:
    import datasets

    try:
        dataset = datasets.load_dataset(task.path, task.subset, split=task.split)
    except Exception as e:  # the Hub's and datasets' many errors: name the task, keep their first line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(
            f"Eval task '{task.name}' ({key}): datasets could not load the Hub dataset '{task.path}' "
            f"(subset {task.subset}, split '{task.split}'): {first}. Check the id, subset and split, or point "
            "the task at a local .jsonl file."
        ) from None
    for n, record in enumerate(dataset, 1):
        yield f"record {n}", record


def parse_label(value: object, choices: tuple[str, ...]) -> int | str:
    """The right choice's index, or what is wrong with `value` (a message)."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        return f"is {value!r}, neither a choice's index nor its text"
    if isinstance(value, str) and not (value.isascii() and value.isdigit()):
        if value in choices:
            return choices.index(value)
        return f"is the text {value!r}, which is none of the {len(choices)} choices"
    index = int(value)
    if not 0 <= index < len(choices):
        return f"is {value!r}, outside the {len(choices)} choices (0 to {len(choices) - 1})"
    return index


def parse_record(record: object, task: EvalTaskConfig) -> Example | str:
    """The record as an Example, or what is wrong with it (a message)."""
    if isinstance(record, json.JSONDecodeError):
        return f"is not valid JSON ({record.msg})"
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object with fields"
    fields = (task.context_field, task.choices_field, task.label_field)
    missing = [f for f in fields if f not in record]
    if missing:
        keys = ", ".join(list(record)[:8]) or "none"
        return f"has no '{missing[0]}' field (its fields: {keys})"
    context, choices = record[task.context_field], record[task.choices_field]
    if not isinstance(context, str):
        return f"has a '{task.context_field}' that is {type(context).__name__}, not text"
    if not isinstance(choices, list | tuple) or len(choices) < 2:
        return f"has a '{task.choices_field}' that is not a list of at least two choices ({choices!r:.80})"
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            return f"has choice {i} = {choice!r:.60}; every choice is non-empty text"
    choices = tuple(choices)
    label = parse_label(record[task.label_field], choices)
    if isinstance(label, str):
        return f"has a '{task.label_field}' that {label}"
    return Example(context, choices, label)


def read_task(task: EvalTaskConfig, key: str) -> Task:
    """Every record of the task checked, the first `task.limit` kept. Raises UserError naming the file
    (or Hub dataset) and the record."""
    local = is_local(task)
    where_file = str(local_path(task, key)) if local else f"Hub dataset '{task.path}'"
    records = _local_records(Path(where_file)) if local else _hub_records(task, key)
    examples = []
    for where, record in records:
        example = parse_record(record, task)
        if isinstance(example, str):
            raise UserError(
                f"Eval task '{task.name}' ({key}): '{where_file}' {where} {example}. Each record needs a "
                f"'{task.context_field}' (text), '{task.choices_field}' (a list of texts) and '{task.label_field}' "
                f"(the right choice's index or text); fix or remove that record, or name other fields with "
                f"{key}.context_field / choices_field / label_field."
            )
        examples.append(example)
    if not examples:
        raise UserError(f"Eval task '{task.name}' ({key}): '{where_file}' holds no records.")
    return Task(task.name, tuple(examples[: task.limit]), task.target_delimiter)


def read_tasks(tasks: list[EvalTaskConfig]) -> list[Task]:
    return [read_task(task, f"eval.tasks.{i}") for i, task in enumerate(tasks)]
