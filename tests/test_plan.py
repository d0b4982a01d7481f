"""The dry run tells the truth about the run it plans: what the command line changed in the file, the device
it plans for and whether a micro-batch fits it, HSDP where there are nodes, small figures with their
digits, rows wrapped to the terminal and never cut, and offline one look at the Hub instead of retries.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.tools.figures import figure, flop, gib

runner = CliRunner()
COLUMNS = 100


def plan(*args: str, env: dict | None = None) -> tuple[str, str]:
    """(the plan as printed, its words joined by single spaces)."""
    result = runner.invoke(
        app, ["pretrain", *args, "--dry-run"], env={"COLUMNS": str(COLUMNS), **(env or {})}
    )
    assert result.exit_code == 0, result.output
    return result.output, " ".join(result.output.split())


def test_figures_keep_three_significant_digits_in_the_unit_that_shows_them():
    assert [figure(x) for x in (57.17, 1.844, 0.04241, 1234.4, 0.0)] == [
        "57.2",
        "1.84",
        "0.0424",
        "1,234",
        "0",
    ]
    assert [gib(x) for x in (6.03, 0.0942, 2e-4)] == ["6.03 GiB", "96.5 MiB", "210 KiB"]
    assert [flop(x) for x in (1.058e14, 4.3e10, 2.5e6)] == ["106 TFLOP", "43.0 GFLOP", "2.50 MFLOP"]
    raw, _ = plan("tiny", "optimizer.name=muon")  # a 1M-parameter model: every figure is small
    assert not re.search(r"(?<![\d.])0\.0+ (GiB|MiB|TFLOP|GFLOP)|\b0\.0%", raw), raw
    assert re.search(r"weights \d+(\.\d+)? (KiB|MiB)", raw) and "GFLOP per rank per optimizer step" in raw, (
        raw
    )


def test_the_plan_names_what_the_command_line_changed_and_what_it_plans_for():
    """The tiny preset's file says 2 workers per node and train.device cpu; a command line asking for 64
    workers on 8 nodes gets both said, and the HSDP hint, which goes once HSDP is on."""
    raw, text = plan(
        "tiny", "train.max_steps=10", "train.micro_batch_size=8", "--world-size", "64", "--nnodes", "8"
    )
    assert (
        "command line train.max_steps 150 -> 10; train.micro_batch_size 8 (as in the file); launch.nnodes 1 -> 8; "
        "--world-size 64 over 8 node(s) is 8 workers per node, in place of launch.nproc_per_node 2" in text
    ), raw
    assert "device CPU (train.device=cpu), fp32: planned as 64 CPU workers; train.device=cuda plans" in text
    assert "world size 64 (mesh dp_replicate=1 x dp_shard=64), 8 nodes x 8" in text
    assert "HSDP (parallel.dp_replicate=-1) shards within each node's 8 workers" in text, raw
    _, hsdp = plan("tiny", "parallel.dp_replicate=-1", "--world-size", "64", "--nnodes", "8")
    assert "dp_replicate=8 x dp_shard=8" in hsdp and "HSDP" not in hsdp
    _, plain = plan("tiny")
    assert "command line" not in plain and "HSDP" not in plain and "Hugging Face Hub" not in plain
    assert "micro-batch fits? " in plain and "fits this machine's memory" in plain, plain


def test_rows_wrap_to_the_terminal_and_none_is_cut_short(tmp_path):
    """A tokenizer folder that does not load: the row carries the whole reason, wrapped to the terminal."""
    raw, text = plan("tiny", f"data.tokenizer={tmp_path}", "--world-size", "8")
    long_words = [w for line in raw.splitlines() for w in line.split() if len(w) > 40]
    assert max(map(len, raw.splitlines())) <= COLUMNS + max(map(len, long_words), default=0), raw
    if not long_words:
        assert all(len(line) <= COLUMNS for line in raw.splitlines()), raw
    assert "not loadable here, so the vocabulary is not checked" in text, raw
    assert "as written by `tokenizer.save_pretrained(folder)`. data not checked" in text, raw
    _, offline = plan("tiny", "data.tokenizer=no-such-org/no-such-tokenizer", env={"HF_HUB_OFFLINE": "1"})
    assert "it is not in the local Hugging Face cache and the Hub is offline here data not checked" in offline


@pytest.mark.skipif(torch.cuda.is_available(), reason="judges against assumed GPUs only without one")
def test_a_micro_batch_is_judged_against_the_gpu_the_plan_assumes():
    """A GPU preset planned on a machine without GPUs is judged against an H100 80 GB, and where it does
    not fit that, an H200 141 GB; each verdict gives the largest micro-batch that fits."""
    _, text = plan("qwen2-muon-fsdp2", "--world-size", "8")
    assert "this machine has no GPU, so memory is judged against an H100 80 GB, then an H200 141 GB" in text
    fits = re.search(
        r"activations for 16 x 2048\): fits an H100 80 GB \(79\.1 GiB; up to micro-batch (\d+) fits\)", text
    )
    assert fits and "H200" not in text.split("micro-batch fits?")[1].split("Muon")[0], text
    largest = int(fits.group(1))
    _, big = plan("qwen2-muon-fsdp2", f"train.micro_batch_size={largest + 1}", "--world-size", "8")
    assert (
        f"does NOT fit an H100 80 GB (79.1 GiB; up to micro-batch {largest} fits); fits an H200 141 GB" in big
    )


def test_a_plan_that_needs_more_memory_than_a_worker_here_has_is_warned_about(monkeypatch):
    from muonrun.tools import plan as plan_module

    monkeypatch.setattr(
        plan_module, "memory_targets", lambda c, workers: ([("a 1 GiB test device", 1.0)], True)
    )
    _, text = plan("tiny", "train.micro_batch_size=512")
    assert "does NOT fit a 1 GiB test device (1.00 GiB; up to micro-batch" in text, text
    assert (
        "WARNING: this plan needs about" in text
        and "(a 1 GiB test device, 1.00 GiB): it will run out" in text
    )
    raw, _ = plan("tiny")
    assert "WARNING" not in raw


def test_offline_the_dry_run_asks_the_hub_once_and_plans_from_the_cache():
    """A Hub tokenizer, no HF_HUB_OFFLINE and a Hub that refuses connections: the plan says so in one line and
    reads the cache alone, without the Hub clients' retries; with HF_HUB_OFFLINE set, it says that."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") and "proxy" not in k.lower()
    }
    env.update(HF_ENDPOINT="http://127.0.0.1:9", COLUMNS=str(COLUMNS), PYTHONUNBUFFERED="1")
    args = [
        "pretrain",
        "tiny",
        "data.tokenizer=no-such-org/no-such-tokenizer",
        "--dry-run",
        "--world-size",
        "8",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "muonrun", *args], capture_output=True, text=True, env=env, timeout=300
    )
    out = done.stdout + done.stderr
    text = " ".join(out.split())
    assert done.returncode == 0, out
    assert (
        "Hugging Face Hub not reachable from here (127.0.0.1:9: Connection refused): planned from the" in text
    )
    assert "Retry" not in out and "HF_HUB_OFFLINE=1 is set" not in out, out
    _, offline = plan(*args[1:-3], "--world-size", "8", env={"HF_HUB_OFFLINE": "1"})
    assert (
        "Hugging Face Hub offline (HF_HUB_OFFLINE is set): only the local Hugging Face cache is read"
        in offline
    )
