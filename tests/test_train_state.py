"""What a resume keeps beyond weights and optimizer: the logged loss's window (a preemption between logged
steps resumes it, so the next row equals the uninterrupted run's), model state a feature holds (the
router biases: kept, or the resume refused naming the setting), and a finished run rerun changes nothing.
The checkpoints of the preempted run live on "scratch" through a `checkpoints/` link, which keeps working."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers import losses, muonrun, ok
from typer.testing import CliRunner

from muonrun.cli import app

LOGGED = [
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "logging.console=plain",
    "train.max_steps=8",
    "logging.log_interval=4",
]


def run(out: Path, *overrides: str, preset: str = "tiny", nproc: int = 2, fault: str | None = None):
    args = ["pretrain", preset, f"output_dir={out}", *LOGGED, *overrides, "--nproc-per-node", str(nproc)]
    return muonrun(*args, fault=fault)


def digest(*paths: Path) -> list[str]:
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


@pytest.mark.slow
def test_a_preemption_between_logged_steps_resumes_the_logged_loss_exactly_and_a_finished_rerun_changes_nothing(
    tmp_path,
):
    ref, out, scratch = tmp_path / "ref", tmp_path / "run", tmp_path / "scratch" / "run"
    ok(run(ref))
    scratch.mkdir(parents=True)
    out.mkdir()
    (out / "checkpoints").symlink_to(scratch)  # checkpoints on scratch storage
    # SIGTERM after step 4: the ranks agree one step late and save at step 5 or 6, between logged steps 4
    # and 8, with the loss of the steps since step 4 summed but not yet logged
    text = ok(run(out, fault="terms@4"))
    stopped = max(int(p.name.split("-")[1]) for p in scratch.glob("step-*"))
    assert stopped in (5, 6) and f"Stopped by signal after step {stopped}" in text, text[-3000:]
    assert "resumed from" in ok(run(out))
    assert losses(out) == losses(ref) == {4: losses(ref)[4], 8: losses(ref)[8]}  # row 8 averages 5..8 too
    assert sorted(p.name for p in scratch.iterdir()) == [".muonrun-owner", f"step-{stopped}", "step-8"]

    # the same command again, or with fewer steps: nothing to train, nothing in the folder rewritten
    before = digest(out / "config.yaml", out / "metrics.jsonl")
    text = ok(run(out, "train.max_steps=4"))
    assert "Nothing to train: this run is complete at step 8 (train.max_steps=4); its config" in text
    assert digest(out / "config.yaml", out / "metrics.jsonl") == before


@pytest.mark.slow
def test_router_biases_are_resumed_or_the_resume_is_refused_naming_the_setting(tmp_path):
    """train.router_bias_update_rate keeps per-expert biases in the model state: turned off on resume
    they would be dropped, turned on there they cannot be resumed; a changed rate resumes them. One
    worker, in this process (`--nproc-per-node 1` trains in the launcher's own process)."""
    moe = ("checkpoint.interval=0", "train.max_steps=2", "logging.log_interval=1", "schedule.warmup_steps=1")

    def in_process(out: Path, *overrides: str) -> tuple[int, str]:
        argv = [
            "pretrain",
            "tiny-moe",
            f"output_dir={out}",
            *LOGGED,
            *moe,
            *overrides,
            "--nproc-per-node",
            "1",
        ]
        result = CliRunner().invoke(app, argv)
        return result.exit_code, result.output

    biased, plain = tmp_path / "biased", tmp_path / "plain"
    for out, bias in ((biased, ("train.router_bias_update_rate=0.01",)), (plain, ())):
        code, text = in_process(out, *bias)
        assert code == 0, text[-3000:]
    for out, rate, says in (
        (
            biased,
            "0",
            "it holds model state this run does not have and would drop: lm.model.layers.0.mlp.gate",
        ),
        (
            plain,
            "0.01",
            "this run has model state it does not hold: lm.model.layers.0.mlp.gate.muonrun_expert",
        ),
    ):
        code, output = in_process(out, "train.max_steps=3", f"train.router_bias_update_rate={rate}")
        text = " ".join(output.split())
        assert code == 2 and says in text, output[-3000:]
        assert "train.router_bias_update_rate: " in text and "train.max_steps:" not in text
        assert "Traceback" not in output
    code, text = in_process(biased, "train.max_steps=3", "train.router_bias_update_rate=0.02")
    assert code == 0 and "resumed from" in text and 3 in losses(biased), text[-3000:]
