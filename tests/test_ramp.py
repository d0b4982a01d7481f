"""The batch-size ramp (train.batch_ramp): a pure function of the tokens seen, its learning-rate rule and
the dry run's account of it; end to end, a run killed mid-ramp and restarted from its checkpoint
matches the uninterrupted run bit for bit, losses, tokens, learning rates and eval accuracies alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import SMALL, STEPS, assert_same_losses, ok, pretrain

from muonrun.config import load_config
from muonrun.config.ramp import BatchRampConfig
from muonrun.errors import UserError
from muonrun.train.ramp import accum_steps, levels, lr_scale, tokens_after
from muonrun.train.schedule import lr_multiplier


def test_the_batch_grows_linearly_in_tokens_in_whole_accumulation_steps():
    ramp = BatchRampConfig(tokens=1000, start_grad_accum_steps=2)
    assert [accum_steps(t, 8, ramp) for t in (0, 166, 167, 500, 999, 1000, 10**9)] == [2, 2, 3, 5, 7, 8, 8]
    assert accum_steps(0, 8, BatchRampConfig()) == 8  # no ramp
    assert lr_scale(2, 8) == 0.5 and lr_scale(8, 8) == 1.0
    with pytest.raises(UserError, match="start_grad_accum_steps' is 1 but train.grad_accum_steps is 1"):
        load_config("tiny", ["train.batch_ramp.tokens=1000"])


def test_the_ramps_levels_and_totals_agree_with_stepping_through_it():
    ramp = BatchRampConfig(tokens=50_000, start_grad_accum_steps=1)
    per = 1024  # tokens of one accumulation step over all ranks
    tokens, seen = 0, []
    for _ in range(40):
        accum = accum_steps(tokens, 6, ramp)
        seen.append(accum)
        tokens += accum * per
    assert tokens_after(40, 0, 6, ramp, per) == tokens
    assert tokens_after(15, tokens_after(25, 0, 6, ramp, per), 6, ramp, per) == tokens  # resumable
    found = levels(6, ramp, per, 40)
    assert [lv.accum for lv in found] == sorted(set(seen)) and sum(lv.steps for lv in found) == 40
    for lv in found:
        assert seen[lv.first_step - 1 : lv.first_step - 1 + lv.steps] == [lv.accum] * lv.steps


def test_the_dry_run_prints_the_ramp_and_the_tokens_it_trains_on():
    from typer.testing import CliRunner

    from muonrun.cli import app

    ramp = ["train.grad_accum_steps=4", "train.batch_ramp.tokens=200000", "train.max_steps=150"]
    result = CliRunner().invoke(app, ["pretrain", "tiny", "--dry-run", *ramp])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (
        "batch ramp over the first 200,000 tokens: 1 accum (4,096 tokens) at steps 1-17, 2 accum (8,192 tokens) "
        "at steps 18-25, 3 accum (12,288 tokens) at steps 26-31, 4 accum (16,384 tokens) at steps 32-150"
        in text
    )
    total = 17 * 4096 + 8 * 8192 + 6 * 12288 + 119 * 16384
    assert f"total tokens {total:,} over 150 steps" in text


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


RAMP = (
    "train.grad_accum_steps=4",
    "train.batch_ramp.tokens=5000",  # 512 tokens per accumulation step (4 x 64 x 2 ranks)
    "train.eval_interval=4",
)


@pytest.mark.slow
def test_a_run_killed_mid_ramp_resumes_bitwise(tmp_path):
    task = tmp_path / "t.jsonl"
    task.write_text(
        "".join(
            json.dumps(
                {"context": f"value = {i} +", "choices": [f"{i}", "x y z", f"{i + 1} * 2"], "label": i % 3}
            )
            + "\n"
            for i in range(12)
        )
    )
    tasks = f"eval.tasks=[{{name: t, path: {task}}}]"
    ref, run = tmp_path / "ref", tmp_path / "run"
    ok(pretrain(ref, *RAMP, tasks, "checkpoint.interval=0"))
    text = ok(
        pretrain(run, *RAMP, tasks, "checkpoint.interval=4", fault="kill@6", extra=("--max-restarts", "1"))
    )
    assert "step-4 at step 4" in text  # restarted from step 4, before the batch grows

    train = {r["step"]: r for r in rows(ref) if "loss" in r}
    # accumulation 1, 1, 1, 1, 2, 2, 3, 4 micro-batches of 512 tokens: the ramp is a function of tokens
    assert [train[s]["tokens_seen"] for s in range(1, STEPS + 1)] == [
        512,
        1024,
        1536,
        2048,
        3072,
        4096,
        5632,
        7680,
    ]
    # the learning rate: the schedule's times sqrt(accumulation / 4), for each step
    schedule = load_config("tiny", [*SMALL, *RAMP, tasks]).schedule
    for step, accum in zip(range(1, STEPS + 1), (1, 1, 1, 1, 2, 2, 3, 4), strict=True):
        expect = lr_multiplier(step, schedule, STEPS) * math.sqrt(accum / 4)
        assert math.isclose(train[step]["lr_multiplier"], expect, rel_tol=1e-12), (step, train[step])
    assert_same_losses(run, ref, first=5)
    resumed = [r for r in rows(run) if "loss" in r and r["step"] >= 5]
    for r in resumed:
        assert (r["tokens_seen"], r["lr"]) == (train[r["step"]]["tokens_seen"], train[r["step"]]["lr"])
    evals = {r["step"]: r for r in rows(ref) if "eval_time" in r}
    again = [r for r in rows(run) if "eval_time" in r and r["step"] == STEPS]
    keys = ("eval_loss", "eval_acc_t", "eval_acc_norm_t", "tokens_seen")
    assert again and all(r[k] == evals[STEPS][k] for r in again for k in keys), (again, evals)
