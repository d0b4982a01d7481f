"""Metrics, console and MFU: rows in metrics.jsonl, FLOPs/token, the peak table, plain vs rich output.

Metrics runs here against a real single-process gloo group; no training is launched.
"""

from __future__ import annotations

import io
import json
import math
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from muonrun import metrics as metrics_mod
from muonrun.config import load_config, to_object
from muonrun.console import PlainView, RichView
from muonrun.distributed import Dist
from muonrun.metrics import Metrics, git_sha, lookup_peak_tflops, matmul_precision

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
    return to_object(
        load_config(
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
    )


def tiny_model(cfg):
    from muonrun.model import build_hf_config, build_model

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
    lands in the next step's window, not in none: step times add up to the wall clock. Until run 18 it
    fell between windows, and a wait there made tokens/s look up to 16% better than they were."""
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


def test_flops_per_token_hand_count():
    from transformers import Qwen2Config

    from muonrun.model import flops_per_token

    h, layers, heads, kv, inter, vocab, seq = 64, 2, 4, 2, 160, 96, 32
    hf = Qwen2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )
    head_dim = h // heads  # 16
    q_o = 2 * h * h  # 8192
    k_v = 2 * h * kv * head_dim  # 4096
    mlp = 3 * h * inter  # 30720
    matmul_params = layers * (q_o + k_v + mlp) + h * vocab  # 86016 + 6144 = 92160
    assert matmul_params == 92160
    # Forward: 2 FLOPs per weight per token, plus scores (QK^T) and values (AV), 2*seq*h each per layer,
    # halved by the causal mask; training is forward + backward = 3x forward.
    attention = layers * 2 * (2 * seq * h) / 2
    expected = 3 * (2 * matmul_params + attention)
    assert expected == 3 * (184320 + 8192) == 577536
    assert flops_per_token(hf, seq) == expected


def test_flops_per_token_matches_torch_flop_counter():
    """torch's FlopCounterMode on one forward + backward of the real model (eager attention, which counts
    the full seq x seq scores): equal to ours once the causal half of the attention FLOPs is added back."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, Qwen2Config

    from muonrun.model import flops_per_token

    seq = 32
    hf = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 96, (1, seq))).logits.float().sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention_full = counts["aten.bmm"]
    assert flops_per_token(hf, seq) * seq == counter.get_total_flops() - attention_full / 2


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L40", "bf16", 181.05),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_peak_table_lookup(name, precision, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup_peak_tflops(name, precision) == expected


def test_unknown_device_warns_once(monkeypatch):
    monkeypatch.setattr(metrics_mod, "_warned_devices", set())
    with pytest.warns(UserWarning, match="Unknown device 'NVIDIA Quantum Q9'.*logging.peak_tflops"):
        assert lookup_peak_tflops("NVIDIA Quantum Q9", "bf16") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup_peak_tflops("NVIDIA Quantum Q9", "bf16") is None


def test_matmul_precision_follows_param_dtype():
    assert matmul_precision("auto", "cuda") == "bf16"
    assert matmul_precision("bfloat16", "cuda") == "bf16"
    assert matmul_precision("float32", "cuda") == "fp32"  # torch's default: no TF32
    assert matmul_precision("auto", "cpu") == "fp32"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("float32", "cuda") == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)


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
    monkeypatch.setattr(metrics_mod, "_wandb_installed", lambda: True)
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


def test_wandb_missing_warns(tmp_path, dist1, monkeypatch):
    monkeypatch.setattr(metrics_mod, "_wandb_installed", lambda: False)
    cfg = make_cfg(tmp_path, "logging.wandb_project=proj")
    with pytest.warns(UserWarning, match="wandb is not installed"):
        m = Metrics(cfg, dist1, flops_per_token=1.0)
    m.close()


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
    rows = read_rows(to_object(load_config("tiny", args)))
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
