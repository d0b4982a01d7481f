"""The config reference reads in a terminal and narrows to a section or a key; docs/configs.md's configs,
written from scratch and by `defaults:` path, pass the dry run as the page shows them."""

from __future__ import annotations

import re
from pathlib import Path

from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.config.docs import field_docs

runner = CliRunner()
PAGE = Path(__file__).resolve().parents[1] / "docs" / "configs.md"


def docs(*args: str, columns: int = 80):
    return runner.invoke(app, ["config", "docs", *args], env={"COLUMNS": str(columns)})


def test_config_docs_is_wrapped_text_for_a_terminal_with_every_key():
    result = docs()
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    # wrapped to the terminal: only a word longer than a line (none today) may stick out
    assert all(len(line) <= 80 or " " not in line.strip() for line in lines), max(lines, key=len)
    assert not any(line.startswith("|") for line in lines)  # not Markdown table rows
    keys = {line.split(":")[0] for line in lines if line and not line.startswith(" ")}
    assert keys == set(field_docs())
    at = lines.index("train.seed: int = 42")
    assert lines[at + 1].startswith("    Seed for weights, data order"), lines[at : at + 3]
    table = docs("--markdown")
    assert table.exit_code == 0 and table.output.startswith("| key | type | default | meaning |")


def test_config_docs_narrows_to_sections_and_keys():
    data = docs("data")
    assert data.exit_code == 0, data.output
    keys = [line.split(":")[0] for line in data.output.splitlines() if line and not line.startswith(" ")]
    assert keys == [k for k in field_docs() if k.startswith("data.")] and "data.sources[].path" in keys
    both = docs("train.max_steps", "data.sources.0.path", "optimizer.muon")
    keys = [line.split(":")[0] for line in both.output.splitlines() if line and not line.startswith(" ")]
    assert keys[:2] == ["train.max_steps", "data.sources[].path"] and len(keys) > 3, both.output
    assert all(k.startswith("optimizer.muon.") for k in keys[2:])
    for query, says in (("trian", "Did you mean 'train'?"), ("train.max_step", "'train.max_steps'")):
        wrong = docs(query)
        text = " ".join(wrong.output.split())
        assert wrong.exit_code == 2 and f"'{query}' is neither a config key nor a section" in text, text
        assert says in text and "Traceback" not in text


def test_the_configs_page_runs_as_written(tmp_path, monkeypatch):
    """Each YAML block of docs/configs.md, saved under the name its first line gives, passes the dry run
    with the corpus paths pointed at a small local corpus; the second starts from the first by path."""
    text = PAGE.read_text()
    names = []
    for block in re.findall(r"^```yaml\n(.*?)^```", text, flags=re.M | re.S):
        name = re.match(r"# ([\w.-]+\.yaml):", block).group(1)
        (tmp_path / name).write_text(block)
        names.append(name)
    assert names == ["my-llama.yaml", "my-llama-adamw.yaml"]
    assert "defaults: [my-llama.yaml]" in (tmp_path / names[1]).read_text()
    for folder in ("corpus", "heldout"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    monkeypatch.chdir(tmp_path)
    paths = [
        f"data.sources.0.path={tmp_path}/corpus/*.txt",
        f"data.eval_sources.0.path={tmp_path}/heldout/*.txt",
    ]
    for name, optimizer in zip(names, ("muon", "adamw"), strict=True):
        result = runner.invoke(app, ["pretrain", name, *paths, "--dry-run"])
        out = " ".join(result.output.split())
        assert result.exit_code == 0, result.output
        assert (
            "model llama (inline config)" in out and "byte (257 tokens, fits the model's vocabulary)" in out
        )
        assert f"optimizer {optimizer}" in out and "checked as the launch checks them" in out, out
    # the page's claims about the byte tokenizer are the tokenizer's
    from muonrun.data import build_tokenizer

    assert build_tokenizer("byte").vocab_size == 257 and "vocabulary is **257**" in text
