"""Metrics and console: rows in metrics.jsonl, plain vs rich output, the sinks, the start row and banner
of a resume on another world size. MFU's FLOPs/token and peak table: tests/test_mfu.py.

Metrics runs here against a real single-process gloo group; only the slow end-to-end test at the end
launches training.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch

from muonrun.config import load_config
from muonrun.distributed import Dist
from muonrun.observe import metrics as metrics_mod
from muonrun.observe import sinks
from muonrun.observe.console import PlainView, RichView
from muonrun.observe.environment import git_sha
from muonrun.observe.metrics import Metrics

ANSI = re.compile(r"\x1b\[")


@pytest.fixture(scope="module")
def dist1(tmp_path_factory):
    """A world of one: gloo process group and a 1-D mesh, like `muonrun pretrain --nproc-per-node 1` on CPU."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    created = not dist.is_initialized()
    if created:
        store = tmp_path_factory.mktemp("pg") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    yield Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=mesh)
    if created:
        dist.destroy_process_group()


def make_cfg(tmp_path, *overrides):
    return load_config(
        "tiny",
        [
            f"output_dir={tmp_path / 'run'}",
            "name=unit",
            "train.max_steps=4",
            "train.micro_batch_size=2",
            "train.grad_accum_steps=3",
            "data.seq_len=16",
            "logging.log_interval=2",
            "logging.console=plain",
            *overrides,
        ],
    )


def tiny_model(cfg):
    from muonrun.model.build import build_hf_config, build_model

    return build_model(cfg.model, build_hf_config(cfg.model))


class State:
    def __init__(self, step=0, tokens_seen=0):
        self.step, self.tokens_seen = step, tokens_seen


def run_steps(m: Metrics, cfg, losses, waits, optimizers, opt_times=None):
    state = State()
    m.start(state)
    tokens = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
    for i, (loss, wait) in enumerate(zip(losses, waits, strict=True)):
        state.step += 1
        state.tokens_seen += tokens
        log = state.step % cfg.logging.log_interval == 0
        m.record(
            state,
            torch.tensor(loss),
            torch.tensor(0.5 + i),
            0.25,
            wait,
            optimizers,
            log=log,
            optimizer_time=(lambda t=opt_times[i]: t) if opt_times else None,
        )
    return state


def read_rows(cfg):
    return [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]


def test_metrics_jsonl_rows(tmp_path, dist1, capsys):
    cfg = make_cfg(tmp_path, "logging.peak_tflops=0.5")
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.125)
    m = Metrics(cfg, dist1, flops_per_token=1000.0, model=tiny_model(cfg))
    state = run_steps(m, cfg, losses=[4.0, 2.0, 3.0, 1.0], waits=[0.01, 0.03, 0.0, 0.02], optimizers=[opt])
    m.log_eval(state, {"eval_loss": 1.5, "eval_ppl": math.exp(1.5)})
    m.close()

    start, r2, r4, ev = read_rows(cfg)
    assert start["event"] == "start"
    assert start["name"] == "unit" and start["optimizer"] == "adamw"
    assert start["world_size"] == 1 and start["mesh"] == {"dp_shard": 1}
    assert start["tokens_per_step"] == 2 * 3 * 16 and start["flops_per_token"] == 1000.0
    assert start["parameters"]["total"] > start["parameters"]["embedding"] > 0
    assert {"torch", "transformers", "muonrun", "python"} <= set(start["versions"])
    assert start["peak_tflops"] == 0.5 and start["precision"] == "fp32"

    required = {"step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "tokens_per_s_per_device"}
    required |= {"mfu", "step_time", "data_wait_time", "peak_mem_gib"}
    assert required <= set(r2) and required <= set(r4)
    assert (r2["step"], r4["step"]) == (2, 4)
    assert r2["loss"] == pytest.approx(3.0) and r4["loss"] == pytest.approx(2.0)  # window means
    assert r2["grad_norm"] == pytest.approx(1.5) and r4["grad_norm"] == pytest.approx(
        3.5
    )  # the logged step's
    assert r2["lr"] == 0.125 and r2["lr_multiplier"] == 0.25
    assert r4["tokens_seen"] == 4 * 96
    for r in (r2, r4):
        assert r["step_time"] > 0
        assert r["tokens_per_s_per_device"] == pytest.approx(96 / r["step_time"])
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_device"])  # world of one
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * 1000.0 / 0.5e12)
        assert r["peak_mem_gib"] > 0  # the process's peak resident set on CPU
        assert "optimizer_step_time" not in r
    assert r2["data_wait_time"] == pytest.approx(0.02) and r4["data_wait_time"] == pytest.approx(0.01)
    assert ev["step"] == 4 and ev["eval_loss"] == 1.5 and ev["eval_ppl"] == pytest.approx(math.exp(1.5))
    assert ev["eval_time"] >= 0

    out = capsys.readouterr().out
    assert not ANSI.search(out)  # console=plain
    step_lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2 and step_lines[0].startswith(
        "step      2/4 loss 3.0000 lr 1.250e-01 grad_norm 1.500"
    )
    assert "mfu " in step_lines[0] and "eta " in step_lines[0]
    assert any(line.startswith("eval      4/4 eval_loss 1.5000") for line in out.splitlines())
    assert "muonrun FLOPs/token" in out and "muonrun versions" in out


def test_step_time_counts_the_hosts_time_in_logging(tmp_path, dist1, monkeypatch):
    """A logged step's own work after its clock read (its reductions; on a GPU any wait for the device)
    lands in the next step's window, not in none: step times add up to the wall clock. Time that fell
    between windows would count in no step and make tokens/s look better than it is."""
    spent = 0.05
    real = metrics_mod.memory_numbers

    def slow_memory_numbers(device):
        time.sleep(spent)
        return real(device)

    monkeypatch.setattr(metrics_mod, "memory_numbers", slow_memory_numbers)
    cfg = make_cfg(tmp_path, "logging.log_interval=1")
    m = Metrics(cfg, dist1, flops_per_token=1000.0, model=tiny_model(cfg))
    run_steps(
        m, cfg, losses=[4.0, 2.0, 3.0, 1.0], waits=[0.0] * 4, optimizers=[torch.optim.SGD([torch.zeros(2)])]
    )
    m.close()
    rows = [r for r in read_rows(cfg) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for before, row in zip(rows, rows[1:], strict=False):
        assert row["step_time"] >= spent
        assert row["step_time"] == pytest.approx(row["elapsed_s"] - before["elapsed_s"], abs=1e-6)


def test_metrics_without_peak_and_two_optimizers(tmp_path, dist1):
    """CPU without logging.peak_tflops: mfu is null, not invented; Muon-style runs log each optimizer's lr;
    a timed optimizer step is averaged over the window; a resumed run appends a second start row."""
    cfg = make_cfg(tmp_path)
    opts = [
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.02),
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.003),
    ]
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    assert m.peak is None
    run_steps(m, cfg, [1.0, 1.0], [0.0, 0.0], opts, opt_times=[0.1, 0.3])
    m.close()
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    m.start(State(step=2, tokens_seen=192))
    m.close()
    start, row, resumed = read_rows(cfg)
    assert "parameters" not in start
    assert row["mfu"] is None
    assert row["lr"] == 0.02 and row["lr_sgd"] == 0.02 and row["lr_adamw"] == 0.003
    assert row["optimizer_step_time"] == pytest.approx(0.2)
    assert resumed["event"] == "start" and resumed["step"] == 2 and resumed["tokens_seen"] == 192


def test_auto_console_is_plain_when_not_a_tty(tmp_path, dist1, capsys):
    cfg = make_cfg(tmp_path, "logging.console=auto")
    m = Metrics(cfg, dist1, flops_per_token=1.0, model=tiny_model(cfg))
    assert isinstance(m.view, PlainView)
    run_steps(m, cfg, [2.0, 1.0], [0.0, 0.0], [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)])
    m.note("a note")
    m.close()
    out = capsys.readouterr().out
    assert "step      2/4 loss 1.5000" in out and "a note" in out
    assert not ANSI.search(out)


def test_rich_view_renders_a_live_view():
    buf = io.StringIO()
    view = RichView(force_terminal=True, file=buf)
    view.banner([("run", "unit -> runs/unit")])
    view.start(0, 10)
    row = {
        "step": 5,
        "loss": 2.5,
        "lr": 1e-3,
        "grad_norm": 0.7,
        "tokens_per_s": 2000.0,
        "tokens_per_s_per_device": 1000.0,
        "mfu": 0.42,
        "peak_mem_gib": 1.5,
        "step_time": 0.1,
        "data_wait_time": 0.0,
    }
    view.advance(5)
    view.step(row, 10, eta=0.5)
    view.eval({"step": 5, "eval_loss": 2.4, "eval_ppl": 11.0, "eval_time": 0.2})
    view.close()
    out = buf.getvalue()
    assert ANSI.search(out)
    assert "2.5000" in out and "42.0%" in out and "eval_loss" in out and "5/10" in out


class Muon(torch.optim.SGD):
    """Stands in for muonrun's Muon: the row key comes from the optimizer's class name."""


def muon_and_adamw():
    return [
        Muon([torch.zeros(1, requires_grad=True)], lr=0.02),
        torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.0002),
    ]


def test_plain_lines_show_each_optimizers_lr(tmp_path, dist1, capsys):
    """With Muon + AdamW the plain line carries both learning rates under their metrics.jsonl names,
    not only the first optimizer's under `lr`; a single optimizer keeps the one `lr` field."""
    cfg = make_cfg(tmp_path)
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    run_steps(m, cfg, [2.0, 1.0], [0.0, 0.0], muon_and_adamw())
    m.close()
    row = [r for r in read_rows(cfg) if "loss" in r][0]
    assert (row["lr"], row["lr_muon"], row["lr_adamw"]) == (0.02, 0.02, 0.0002)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert line.startswith("step      2/4 loss 1.5000 lr_muon 2.000e-02 lr_adamw 2.000e-04 grad_norm 1.500")
    assert " lr " not in line

    buf = io.StringIO()
    single = {k: v for k, v in row.items() if k not in ("lr_muon", "lr_adamw")}  # one optimizer's row
    PlainView(stream=buf).step(single, 4, None)
    assert " lr 2.000e-02 grad_norm" in buf.getvalue() and "lr_" not in buf.getvalue()


def test_rich_view_shows_each_optimizers_lr():
    """The rich view's scrolling history carries Muon's and AdamW's lr (its footer, the fields left out)."""
    buf = io.StringIO()
    view = RichView(force_terminal=True, file=buf, width=100)
    view.start(0, 10)
    row = {
        "step": 5,
        "loss": 2.5,
        "lr": 0.02,
        "lr_muon": 0.02,
        "lr_adamw": 0.0002,
        "lr_multiplier": 1.0,
        "grad_norm": 0.7,
        "tokens_per_s": 2000.0,
        "tokens_per_s_per_device": 1000.0,
        "step_time": 0.1,
        "data_wait_time": 0.0,
    }
    view.step(row, 10, eta=0.5)
    footer = dict(view.rest)
    view.close()
    history = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())  # without colours and cursor moves
    assert "step      5/10  loss 2.5000  lr_muon 2.000e-02  lr_adamw 2.000e-04  grad_norm 0.700" in history
    assert "tok/s/dev" in footer and "lr_multiplier" not in footer and "lr_multiplier" not in history


def test_resume_on_another_world_size_counts_tokens_of_both_launches(tmp_path, dist1, capsys):
    """Steps 1-6 on 2 ranks, resumed at step 6 on 3 ranks up to step 9 (as `--nproc-per-node 2`, then 3):
    the second banner's total and the start row's tokens_at_max_steps are the tokens of the first
    launch (restored with the step) plus the second's, not max_steps x the new tokens per step."""
    per_rank = 2 * 3 * 16  # make_cfg: micro-batch 2 x accumulation 3 x seq 16

    def launch(world, state, max_steps):
        cfg = make_cfg(tmp_path, f"train.max_steps={max_steps}")
        m = Metrics(cfg, dataclasses.replace(dist1, world_size=world), flops_per_token=1.0)
        m.start(state)
        while state.step < max_steps:
            state.step += 1
            state.tokens_seen += per_rank * world  # as the trainer counts them
            m.record(state, torch.tensor(1.0), torch.tensor(1.0), 1.0, 0.0, muon_and_adamw(), log=True)
        m.close()
        return cfg

    state = State()
    launch(2, state, 6)
    first = capsys.readouterr().out
    assert state.tokens_seen == 6 * 2 * per_rank
    cfg = launch(3, State(state.step, state.tokens_seen), 9)
    second = capsys.readouterr().out

    both = 6 * 2 * per_rank + 3 * 3 * per_rank  # 1152 + 864
    starts = [r for r in read_rows(cfg) if r.get("event") == "start"]
    last = [r for r in read_rows(cfg) if "loss" in r][-1]
    assert last["tokens_seen"] == both
    assert [r["tokens_at_max_steps"] for r in starts] == [6 * 2 * per_rank, both]
    assert starts[1]["tokens_seen"] == 6 * 2 * per_rank and starts[1]["world_size"] == 3
    assert "x 2 ranks = 192 tokens/step; 6 steps = 1,152 tokens\n" in first
    assert (
        "x 3 ranks = 288 tokens/step; 9 steps = 2,016 tokens (1,152 seen by step 6 + 3 steps x 288)" in second
    )
    assert "2,592" not in second  # 9 steps x 288: the count that forgets the first launch ran on 2 ranks


def test_git_sha_never_fails(tmp_path):
    assert git_sha(tmp_path / "missing", tmp_path) is None
    sha = git_sha(metrics_mod.__file__.rsplit("/", 1)[0])
    assert sha is None or re.fullmatch(r"[0-9a-f]{12}(-dirty)?", sha)


def test_tensorboard_sink(tmp_path, dist1):
    pytest.importorskip("tensorboard")
    cfg = make_cfg(tmp_path, "logging.tensorboard=true")
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    run_steps(m, cfg, [2.0, 1.0], [0.0, 0.0], [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)])
    m.close()
    assert list((Path(cfg.output_dir) / "tensorboard").glob("events.out.tfevents.*"))


def test_wandb_sink_logs_the_same_rows(tmp_path, dist1, monkeypatch):
    import sys
    import types

    logged = []

    class FakeRun:
        summary: dict = {}

        def define_metric(self, *args, **kwargs):
            pass

        def log(self, values):
            logged.append(values)

        def finish(self):
            logged.append("finished")

    init_kwargs = {}

    def init(**kwargs):
        init_kwargs.update(kwargs)
        return FakeRun()

    fake = types.SimpleNamespace(init=init, util=types.SimpleNamespace(generate_id=lambda: "abc123"))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(sinks, "_wandb_installed", lambda: True)
    cfg = make_cfg(tmp_path, "logging.wandb_project=proj")
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    state = run_steps(
        m, cfg, [2.0, 1.0], [0.0, 0.0], [torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)]
    )
    m.log_eval(state, {"eval_loss": 1.0, "eval_ppl": math.e})
    m.close()
    assert (
        init_kwargs["project"] == "proj" and init_kwargs["name"] == "unit" and init_kwargs["id"] == "abc123"
    )
    assert (Path(cfg.output_dir) / "wandb_id").read_text() == "abc123"
    assert logged[0]["step"] == 2 and logged[0]["train/loss"] == pytest.approx(1.5)
    assert logged[1]["eval/loss"] == 1.0 and logged[-1] == "finished"


def test_wandb_missing_warns(tmp_path, dist1, monkeypatch, capsys):
    monkeypatch.setattr(sinks, "_wandb_installed", lambda: False)
    cfg = make_cfg(tmp_path, "logging.wandb_project=proj")
    m = Metrics(cfg, dist1, flops_per_token=1.0)
    m.close()
    assert (
        "muonrun: WARNING: logging.wandb_project is 'proj' but wandb is not installed"
        in capsys.readouterr().err
    )


@pytest.mark.slow
def test_pretrain_run_writes_metrics(tmp_path):
    """The one real run here: 1 in-process worker with Muon (+ AdamW for the rest), 3 steps of a smaller
    tiny model, stdout not a terminal."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    args = [
        f"output_dir={out}",
        "name=e2e",
        "model.hf.hidden_size=64",
        "model.hf.intermediate_size=128",
        "model.hf.num_hidden_layers=2",
        "data.seq_len=64",
        "train.micro_batch_size=2",
        "train.max_steps=3",
        "optimizer.name=muon",
        "train.eval_interval=3",
        "train.eval_steps=1",
        "logging.log_interval=1",
        "logging.peak_tflops=1.0",
        "checkpoint.save_at_end=false",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "muonrun", "pretrain", "tiny", *args, "--nproc-per-node", "1"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_rows(load_config("tiny", args))
    start, train, evals = rows[0], [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]
    assert start["event"] == "start" and start["name"] == "e2e" and start["optimizer"] == "muon"
    assert start["flops_per_token"] > 0 and start["peak_tflops"] == 1.0 and start["git_sha"] != ""
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        assert r["tokens_seen"] == r["step"] * 2 * 64
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["tokens_per_s"] == pytest.approx(2 * 64 / r["step_time"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_device"] * start["flops_per_token"] / 1e12)
        assert r["data_wait_time"] >= 0 and r["peak_mem_gib"] > 0
        assert r["lr_muon"] > 0 and r["lr_adamw"] > 0  # each optimizer's own learning rate
    assert train[-1]["loss"] < train[0]["loss"]
    assert not (out / "checkpoints").exists()  # checkpoint.save_at_end=false
    assert len(evals) == 1 and evals[0]["eval_ppl"] == pytest.approx(
        math.exp(evals[0]["eval_loss"]), rel=1e-5
    )
    assert not ANSI.search(result.stdout)
    assert "muonrun FLOPs/token" in result.stdout and "step      3/3 loss" in result.stdout
