"""The reference documentation of every config key, read from the schema's field docstrings.

muonrun config docs
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

from omegaconf import DictConfig, ListConfig

from muonrun.config.schema import Config, DataConfig, SourceConfig


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
    return out


def markdown_table() -> str:
    """Every key as a Markdown table row (`|` in types and text escaped, so `str | None` stays one cell)."""

    def cell(text: str) -> str:
        return " ".join(text.split()).replace("|", "\\|")

    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, (typ, default, doc) in field_docs().items():
        rows.append(f"| `{key}` | {cell(typ)} | `{cell(default)}` | {cell(doc)} |")
    return "\n".join(rows)
