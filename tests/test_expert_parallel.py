"""Expert parallelism (`parallel.ep`): the dispatch and Muon exact on expert-parallel experts, `tiny-moe`
training the same at ep 1 and 2, checkpoints across ep, export, and the mistakes refused before any
worker starts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import STEPS, losses, muonrun, ok, pretrain_args, run_workers
from typer.testing import CliRunner

from muonrun.cli import app

WORKER = Path(__file__).parent / "dist" / "ep_worker.py"
EIGHT = "+model.hf.num_experts=8"  # tiny-moe's 6 experts do not split over 4 ranks


@pytest.mark.slow
def test_dispatch_and_muon_on_expert_parallel_experts_equal_the_unsplit_experts():
    """ep 2 x FSDP 2: each rank's outputs and input gradients equal the unsplit experts' on its own tokens,
    with uneven token splits and with a rank whose experts receive none; the experts' gradients are the
    mean over every rank, AdamW steps them as torch's does, and Muon each expert matrix as
    torch.optim.Muon does
    (tests/dist/ep_worker.py)."""
    out = run_workers(WORKER, 4, timeout=600)
    assert "EP_WORKER_OK" in out, out
    assert "uneven splits: dispatch, gradients, AdamW and Muon OK" in out, out
    assert "every token to one ep rank's experts: dispatch, gradients, AdamW and Muon OK" in out, out


def rows(run: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r
    }


def moe_run(out: Path, *overrides: str):
    args = pretrain_args(out, "checkpoint.interval=4", "checkpoint.keep_last=4", *overrides, nproc=2)
    args[1] = "tiny-moe"
    return ok(muonrun(*args))


def same_training(a: Path, b: Path, steps) -> None:
    """The same loss, load-balancing loss, gradient norm and expert load at every step, up to fp32
    rounding (which may flip a near-tie in one token's routing: the busiest expert's load, a count, may
    move by a token or two)."""
    ra, rb = rows(a), rows(b)
    for s in steps:
        for key, rel in (
            ("loss", 1e-3),
            ("aux_loss", 1e-3),
            ("grad_norm", 1e-3),
            ("expert_load_max_mean", 0.02),
        ):
            assert ra[s][key] == pytest.approx(rb[s][key], rel=rel), (s, key, ra[s][key], rb[s][key])


@pytest.mark.slow
def test_tiny_moe_trains_the_same_at_ep_1_and_2_and_resumes_across_ep(tmp_path):
    """Two ranks, 6 experts, Muon: at ep 1 (each rank holds a shard of every expert) and ep 2 (each holds
    3 whole experts), the same losses, aux losses, expert loads and gradient norms; the expert-parallel
    run logs the tokens each rank's experts received. Its step-4 checkpoint resumes bit for bit at ep 2
    and through DCP's resharding at ep 1; its export loads in transformers with every expert. (ep 2 x
    FSDP 2 on four ranks, and AdamW: the dispatch test above.)"""
    for ep in (1, 2):
        moe_run(tmp_path / f"muon-ep{ep}", f"parallel.ep={ep}")
    same_training(tmp_path / "muon-ep1", tmp_path / "muon-ep2", range(1, STEPS + 1))
    assert rows(tmp_path / "muon-ep2")[STEPS]["ep_tokens_received"] > 0
    assert "ep_tokens_received" not in rows(tmp_path / "muon-ep1")[STEPS]
    saved = tmp_path / "muon-ep2"
    for ep in (2, 1):
        run = tmp_path / f"resume-ep{ep}"
        shutil.copytree(saved / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
        assert "resumed from" in moe_run(run, f"parallel.ep={ep}")
        if ep == 2:
            assert losses(run) == {s: losses(saved)[s] for s in range(5, STEPS + 1)}
        same_training(run, saved, range(5, STEPS + 1))
    ok(muonrun("export", str(saved), str(tmp_path / "hf")))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
    ids = torch.arange(1, 33).view(1, -1)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


@pytest.mark.slow
def test_expert_parallel_mistakes_exit_2_before_any_worker_starts(tmp_path):
    """Experts that do not divide over ep, an ep that does not divide the shard group, a dense model, and
    ep beside tp: one paragraph naming parallel.ep, exit 2, in the dry run and the launch alike (both run
    `check_expert_parallel` before any worker starts)."""
    cases = [
        (("tiny-moe", "parallel.ep=4"), "6 experts"),
        (("tiny-moe", EIGHT, "parallel.ep=8"), "dp_shard=4"),
        (("tiny", "parallel.ep=2"), "no experts"),
        (("tiny-moe", "parallel.ep=2", "parallel.tp=2"), "parallel.tp"),
    ]
    for args, says in cases:  # the dry run, in this process
        result = CliRunner().invoke(app, ["pretrain", *args, "--dry-run", "--world-size", "4"])
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "parallel.ep" in text and says in text, (args, result.output)
    # the launch runs the same checks (check_expert_parallel) before any worker starts
    run = tmp_path / "run"
    result = muonrun("pretrain", *cases[0][0], f"output_dir={run}", "--nproc-per-node", "4")
    assert result.returncode == 2 and "parallel.ep" in result.stderr and "6 experts" in result.stderr
    assert "Traceback" not in result.stderr and not (run / "metrics.jsonl").exists()
