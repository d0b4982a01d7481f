"""The reference documentation of every config key, read from the schema's field docstrings.

muonrun config docs                      # every key, wrapped to the terminal
muonrun config docs data train.seed      # a section's keys, one key
muonrun config docs --markdown           # one Markdown table, for docs pages
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import shutil
import textwrap
import typing

from omegaconf import DictConfig, ListConfig

from muonrun.config.evaluation import EvalConfig, EvalTaskConfig
from muonrun.config.schema import Config, DataConfig, SourceConfig
from muonrun.errors import UserError


def _docstrings(cls: type) -> dict[str, str]:
    """{field name: the string literal right under it} from the class source."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def field_docs(cls: type = Config, prefix: str = "") -> dict[str, tuple[str, str, str]]:
    """{dotted key: (type, default, docstring)}; a closed set of values is part of the type."""
    docs = _docstrings(cls)
    out: dict[str, tuple[str, str, str]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            out.update(field_docs(type(sub), f"{key}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else sub
        if (
            isinstance(default, list | ListConfig | DictConfig)
            and default
            and dataclasses.is_dataclass(default[0] if isinstance(default, list) else None)
        ):
            default = "[...]"
        allowed = typing.get_args(hints[f.name]) if typing.get_origin(hints[f.name]) is typing.Literal else ()
        typ = " / ".join(allowed) if allowed else str(f.type)
        out[key] = (typ, repr(default), docs.get(f.name, ""))
    if cls is DataConfig:
        out.update(field_docs(SourceConfig, f"{prefix}sources[]."))
    if cls is EvalConfig:
        out.update(field_docs(EvalTaskConfig, f"{prefix}tasks[]."))
    return out


def markdown_table(docs: dict[str, tuple[str, str, str]] | None = None) -> str:
    """Every key (or those of `docs`) as a Markdown table row (`|` in types and text escaped, so
    `str | None` stays one cell)."""

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, (typ, default, doc) in (field_docs() if docs is None else docs).items():
        rows.append(f"| `{key}` | {cell(typ)} | `{cell(default)}` | {cell(doc)} |")
    return "\n".join(rows)


def selected(queries: list[str] | None = None) -> dict[str, tuple[str, str, str]]:
    """The keys of `field_docs` that the queries name: a section (`data`, `optimizer.muon`) gives all its
    keys, a key itself; a list element's index reads as its entry (`data.sources.0.path`). No query: every
    key. A query that names nothing is the user's mistake, answered with the closest keys and sections."""
    docs = field_docs()
    if not queries:
        return docs
    out: dict[str, tuple[str, str, str]] = {}
    for query in queries:
        q = re.sub(r"\.(\d+)(?=\.|$)|\[\d*\]", "[]", query.strip().strip("."))
        found = {k: v for k, v in docs.items() if k == q or k.startswith((f"{q}.", f"{q}[]."))}
        if not found:
            sections = {k.rsplit(".", i)[0] for k in docs for i in range(1, k.count(".") + 1)}
            close = difflib.get_close_matches(q, [*sections, *docs], n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
            top = sorted({k.split(".")[0].split("[")[0] for k in docs})
            raise UserError(
                f"'{query}' is neither a config key nor a section.{hint} At the top: {', '.join(top)}; "
                "`muonrun config docs` lists every key."
            )
        out.update(found)
    return out


def text_reference(docs: dict[str, tuple[str, str, str]], width: int | None = None) -> str:
    """The keys as text for a terminal: `key: type = default` on one line, the meaning wrapped to `width`
    (the terminal's) under it, a blank line between sections."""
    width = max(40, (width or shutil.get_terminal_size((100, 24)).columns) - 1)
    lines: list[str] = []
    section = None
    for key, (typ, default, doc) in docs.items():
        top = key.split(".")[0]
        if section is not None and top != section:
            lines.append("")
        section = top
        lines += textwrap.wrap(
            f"{key}: {' '.join(typ.split())} = {default}",
            width,
            subsequent_indent="      ",
            break_long_words=False,
            break_on_hyphens=False,
        )
        lines += textwrap.wrap(
            " ".join(doc.split()),
            width,
            initial_indent="    ",
            subsequent_indent="    ",
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines)
