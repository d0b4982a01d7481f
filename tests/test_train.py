"""End-to-end runs of `muonrun pretrain` on CPU: 2 gloo workers under FSDP2 (the in-process path, with
Muon, runs in tests/test_metrics.py; the tiny preset learning on 2 workers, in tests/test_eval.py).

Process start-up dominates on a 2-core machine, so each launch serves several assertions.
"""

import json

import pytest
from helpers import muonrun

pytestmark = pytest.mark.slow


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
