"""End-to-end runs of `muonrun pretrain` on CPU: 2 gloo workers under FSDP2 (the in-process path, with
Muon, runs in tests/test_metrics.py).

Process start-up dominates on a 2-core machine, so each launch serves several assertions.
"""

import json
from pathlib import Path

import pytest
from helpers import muonrun

pytestmark = pytest.mark.slow


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


def test_a_mistake_found_by_one_worker_alone_exits_2_with_its_message(tmp_path):
    """A bad record that only rank 1 reads (a streaming source is split record by record across ranks):
    rank 1 stops with a UserError while rank 0 trains on; the job must not hang waiting for rank 1, nor
    restart into the same record, and the launcher prints rank 1's one paragraph, exit 2, no traceback."""
    corpus = tmp_path / "c.jsonl"
    records = [{"text": f"document {i} " * 40} for i in range(200)]
    records[1] = {"title": "rank 1's first record has no text"}
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = muonrun(
        "pretrain",
        "tiny",
        f"output_dir={tmp_path / 'run'}",
        f"data.sources=[{{path: {corpus}, streaming: true}}]",
        "data.eval_sources=[]",
        "train.eval_interval=0",
        "data.shuffle_buffer=50",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        timeout=180,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    text = " ".join(result.stderr.split())
    assert "c.jsonl" in text and "has no 'text' field" in text and "data.skip_bad_records" in text, text
    assert text.count("has no 'text' field") == 1 and "restarting" not in text  # reported once, not restarted
    # the launcher stops both workers at once: no traceback from rank 0, no abort, no leak warnings
    assert "Traceback" not in result.stderr and "terminate called" not in text and "leaked" not in text
