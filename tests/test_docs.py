"""docs/performance.md stays a page of current claims anyone can rerun: its commands, run through bash with
the programs they call replaced by stubs that record their arguments, name only files that exist and
config keys the schema has (a retired `optimizer.muon` key fails, as `load_config` refuses it); every row's
id has its command; the page stays within 250 lines. No line of a doc (README, docs/, benchmarks/README.md)
is over 200 characters. benchmarks/ holds only files a row names, each listed in benchmarks/README.md. The
docs name no retired key and no missing file."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from muonrun.config.docs import field_docs
from muonrun.config.load import choices, preset_names
from muonrun.config.optimizer import RETIRED_MUON_KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PERFORMANCE = DOCS / "performance.md"
BENCHMARKS = ROOT / "benchmarks"

# a dotted config key right before its `=`, as an override, a --variant entry or a shell variable's value
KEY = re.compile(r"(?<![\w.$-])\+?([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+|\[\d+\])+)=([^,\s]*)")
PATH = re.compile(r"\b((?:benchmarks|scripts)/[\w./-]*\w)")
ROW_ID = re.compile(r"^[A-Z]\d+$")
COMMAND_ID = re.compile(r"\[([A-Z]\d+)\]")
# Every program a command in performance.md runs, replaced by a function that prints what it was given:
# one line per call, its arguments and the VARIANTS that scripts/gpu_bench.sh reads, separated by \x1f.
STUBS = "\n".join(
    f"{name}() {{ local IFS=$'\\x1f'; printf '%s\\n' \"{name}$IFS$*$IFS${{VARIANTS-}}\"; }}"
    for name in ("muonrun", "bash", "python", "python3", "torchrun", "sync")
)


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)


def table_ids(text: str) -> set[str]:
    """The ids in the last cell of each table row (`S3`, or `S3, B1`)."""
    ids = set()
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            cell = line.rstrip().rstrip("|").rsplit("|", 1)[-1]
            ids.update(part.strip() for part in cell.split(",") if ROW_ID.match(part.strip()))
    return ids


@functools.cache
def schema_keys() -> frozenset[str]:
    return frozenset(field_docs())


def schema_key(key: str) -> str | None:
    """The schema's name for an override's key (list entries as `[]`), or None if it names no setting;
    any key under `model.hf` passes (transformers' config: an open section)."""
    key = re.sub(r"\.\d+(?=\.|$)|\[\d+\]", "[]", key.removeprefix("+"))
    if key.startswith("model.hf."):
        return key
    return key if key in schema_keys() else None


def run_commands(text: str) -> list[list[str]]:
    """Each call the page's commands make, as [program, arguments..., VARIANTS], from running them in order
    (one shell: the preamble's variables reach every block) with no program on the PATH but the stubs."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    script = "\n".join(["set -euo pipefail", "PATH=/nonexistent", STUBS, *code_blocks(text)])
    done = subprocess.run([bash, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the commands of {PERFORMANCE.name} fail in bash:\n{done.stderr}"
    return [line.split("\x1f") for line in done.stdout.splitlines()]


def test_performance_commands_name_existing_files_and_config_keys():
    text = PERFORMANCE.read_text()
    calls = run_commands(text)
    assert {call[0] for call in calls} >= {"muonrun", "bash", "python", "torchrun"}, calls
    pairs = [pair for call in calls for pair in KEY.findall(" ".join(call[1:]))]
    keys = {key for key, _ in pairs}
    assert {"optimizer.name", "optimizer.muon.gram_ns", "model.hf.hidden_size", "data.sources"} <= keys
    unknown = sorted(k for k in keys if schema_key(k) is None)
    assert not unknown, f"{PERFORMANCE.name} runs keys the config does not have: {unknown}"
    allowed = choices()
    wrong = sorted(
        {f"{k}={v}" for k, v in pairs if k in allowed and not v.startswith("$") and v not in allowed[k]}
    )
    assert not wrong, f"{PERFORMANCE.name} gives keys values they do not take: {wrong}"
    # the preset each run starts from: `muonrun bench|pretrain PRESET`, `bench_power.sh OUT_DIR PRESET`
    presets = [c[2] for c in calls if c[0] == "muonrun" and c[1] in ("bench", "pretrain")]
    presets += [c[3] for c in calls if c[1] == "benchmarks/bench_power.sh"]
    assert len(presets) > 10, presets
    unknown_presets = sorted(set(presets) - set(preset_names()))
    assert not unknown_presets, (
        f"{PERFORMANCE.name} starts runs from presets that do not exist: {unknown_presets}"
    )
    files = {arg for call in calls for arg in call[1:] if PATH.fullmatch(arg)} | set(PATH.findall(text))
    assert {"scripts/gpu_bench.sh", "benchmarks/bench_power.sh"} <= files
    missing = sorted(f for f in files if not (ROOT / f).exists())
    assert not missing, f"{PERFORMANCE.name} names files that do not exist: {missing}"


def test_a_retired_muon_key_or_a_typo_names_no_setting():
    for name in RETIRED_MUON_KEYS:
        assert schema_key(f"optimizer.muon.{name}") is None
    assert schema_key("train.micro_batch_sise") is None
    assert schema_key("data.sources.0.path") == "data.sources[].path"
    assert schema_key("+model.hf.rope_theta") == "model.hf.rope_theta"
    found = KEY.findall(
        "--variant m:optimizer.name=muon,optimizer.muon.ns_steps=4 'data.sources=[{path: x}]'"
    )
    assert [k for k, _ in found] == ["optimizer.name", "optimizer.muon.ns_steps", "data.sources"]


def test_every_row_of_performance_has_its_command_and_every_command_its_row():
    text = PERFORMANCE.read_text()
    rows = table_ids(text)
    commands = {i for block in code_blocks(text) for i in COMMAND_ID.findall(block)}
    assert len(rows) > 20, rows
    assert not rows - commands, f"rows without a command: {sorted(rows - commands)}"
    assert not commands - rows, f"commands for no row: {sorted(commands - rows)}"


def test_performance_stays_short_and_no_doc_line_is_over_200_characters():
    lines = PERFORMANCE.read_text().splitlines()
    assert len(lines) <= 250, f"{PERFORMANCE.name} has {len(lines)} lines; it keeps at most 250"
    docs = [ROOT / "README.md", BENCHMARKS / "README.md", *sorted(DOCS.glob("*.md"))]
    assert PERFORMANCE in docs and len(docs) > 5, docs
    long = [
        f"{doc.relative_to(ROOT)}:{i}"
        for doc in docs
        for i, line in enumerate(doc.read_text().splitlines(), 1)
        if len(line) > 200
    ]
    assert not long, f"lines over 200 characters (a table row too: move detail below the table): {long}"


def test_benchmarks_hold_only_what_backs_a_row_and_the_index_lists_them():
    named = set(PATH.findall(PERFORMANCE.read_text()))
    files = {f"benchmarks/{p.name}" for p in BENCHMARKS.iterdir() if p.name != "README.md"}
    assert files, "benchmarks/ is empty"
    unbacked = sorted(files - named)
    assert not unbacked, f"benchmarks/ files that back no row of {PERFORMANCE.name}: {unbacked}"
    index = (BENCHMARKS / "README.md").read_text()
    unlisted = sorted(f for f in files if Path(f).name not in index)
    assert not unlisted, f"benchmarks/README.md does not list: {unlisted}"


def test_docs_name_no_retired_key_and_no_missing_file():
    retired = re.compile(rf"optimizer\.muon\.({'|'.join(RETIRED_MUON_KEYS)})\b")
    for doc in sorted(DOCS.glob("*.md")):
        text = doc.read_text()
        assert not retired.findall(text), f"{doc.name} names retired keys: {retired.findall(text)}"
        missing = sorted(f for f in set(PATH.findall(text)) if not (ROOT / f).exists())
        assert not missing, f"{doc.name} names files that do not exist: {missing}"
