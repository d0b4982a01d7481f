"""End-to-end runs of `muonrun pretrain` on CPU: 2 gloo workers under FSDP2 (the in-process path, with
Muon, runs in tests/test_metrics.py).

Process start-up dominates on a 2-core machine, so each launch serves several assertions.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def muonrun(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "muonrun", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_worker_fsdp2_run_learns(tmp_path):
    out = tmp_path / "run"
    result = muonrun(
        "pretrain",
        "tiny",
        f"output_dir={out}",
        "train.max_steps=40",
        "logging.log_interval=5",
        "train.eval_interval=20",
        "checkpoint.interval=0",
        "--nproc-per-node",
        "2",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    train = [r for r in rows(out) if "loss" in r]
    evals = [r for r in rows(out) if "eval_loss" in r]
    assert [r["step"] for r in train] == list(range(5, 41, 5))
    assert train[-1]["loss"] < train[0]["loss"] - 1.0, [r["loss"] for r in train]  # clearly learning
    assert train[-1]["tokens_seen"] == 40 * 2 * 8 * 256  # steps x workers x micro-batch x seq_len
    assert len(evals) == 2 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    saved = (out / "config.yaml").read_text()
    assert "max_steps: 40" in saved and "nproc_per_node: 2" in saved
    assert (out / "checkpoints" / "step-40" / ".metadata").is_file()  # saved at the end
    assert "step     40/40" in result.stdout


def test_worker_user_error_exits_2(tmp_path):
    # The attention kernel is only resolved inside the workers: the message must still be one paragraph.
    result = muonrun(
        "pretrain",
        "tiny",
        f"output_dir={tmp_path}",
        "model.attn_implementation=no_such_kernel",
        "--nproc-per-node",
        "2",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.attn_implementation" in result.stderr
    assert "Traceback" not in result.stderr
