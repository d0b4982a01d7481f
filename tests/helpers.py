"""Helpers the test modules share (no test module imports another): `muonrun` CLI runs in a subprocess and
what they leave (losses, checkpoints) and how two runs' losses are compared, a tiny Qwen2, and launching a script on
N gloo processes."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

from muonrun import faults
from muonrun.checkpoint import published_checkpoints

STEPS = 8  # 2N: every exact-resume comparison covers steps N+1..2N of an 8-step run
SMALL = [
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.eval_interval=0",
    "logging.log_interval=1",
    "logging.console=plain",
    f"train.max_steps={STEPS}",
]
# NorMuon: Muon's optimizer state plus a per-row second moment, so one reference run covers both
NORMUON = ("optimizer.name=muon", "optimizer.muon.variant=normuon")


def cli_env(fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop(faults.ENV, None)
    if fault:
        env[faults.ENV] = fault
    return env


def muonrun(*args: str, fault: str | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "muonrun", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=cli_env(fault),
    )


def pretrain_args(out: Path, *overrides: str, nproc: int = 2, extra=()) -> list[str]:
    return [
        "pretrain",
        "tiny",
        f"output_dir={out}",
        *SMALL,
        *overrides,
        "--nproc-per-node",
        str(nproc),
        *extra,
    ]


def pretrain(out: Path, *overrides: str, nproc: int = 2, fault: str | None = None, extra=()):
    return muonrun(*pretrain_args(out, *overrides, nproc=nproc, extra=extra), fault=fault)


def spawned_workers(pid: int) -> int:
    """How many workers launcher `pid` has spawned so far (Linux: /proc; multiprocessing's spawn_main)."""
    children = [c for f in Path(f"/proc/{pid}/task").glob("*/children") for c in f.read_text().split()]
    workers = 0
    for child in children:
        with contextlib.suppress(OSError):
            workers += b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    return workers


def step_rows(run: Path) -> dict[int, dict]:
    """Each training row of metrics.jsonl by step (the last, where a resumed run logged a step again)."""
    rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "loss" in r}


def losses(run: Path) -> dict[int, list[float]]:
    """Every logged loss by step (a resumed run appends to metrics.jsonl, so a step can repeat)."""
    out: dict[int, list[float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out.setdefault(row["step"], []).append(row["loss"])
    return out


def steps_of(run: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in published_checkpoints(run / "checkpoints")]


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout + result.stderr


def assert_same_losses(run: Path, ref: Path, first: int) -> None:
    """Bitwise: every logged loss of `run` from step `first` on equals the uninterrupted run's."""
    expect, got = losses(ref), losses(run)
    assert sorted(s for s in got if s >= first) == list(range(first, STEPS + 1)), got
    for step in range(first, STEPS + 1):
        assert got[step] == [expect[step][0]] * len(got[step]), (step, got[step], expect[step])


TINY_MOE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 5,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 48,
    "tie_word_embeddings": True,
}
"""A tiny Qwen2-MoE `model.hf`: 5 experts, top-2, a shared expert (copy it before changing a key)."""


def tiny_qwen2(tied: bool) -> nn.Module:
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


class WorkersFailed(RuntimeError):
    """The launched job exited non-zero or timed out; the message carries its combined output."""


def run_workers(
    script_path: str | os.PathLike,
    nproc: int,
    *args: str,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N script args``.

    Returns the combined stdout+stderr. Raises :class:`WorkersFailed` with that output when the job
    fails or exceeds ``timeout`` seconds. The repository root is put on ``PYTHONPATH`` and
    ``OMP_NUM_THREADS`` defaults to 1 so that several workers share a small CI machine.
    """
    repo_root = Path(__file__).resolve().parents[1]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), full_env.get("PYTHONPATH", "")]))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    # torchrun's per-worker folders go into a folder removed afterwards, not the system's temporary one
    logs = tempfile.TemporaryDirectory(prefix="muonrun-workers-")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--log-dir={logs.name}",
        str(script_path),
        *map(str, args),
    ]
    try:
        with logs:
            proc = subprocess.run(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
                env=full_env,
                cwd=repo_root,
            )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise WorkersFailed(f"{' '.join(cmd)} timed out after {timeout}s\n{out}") from None
    if proc.returncode != 0:
        raise WorkersFailed(f"{' '.join(cmd)} exited with {proc.returncode}\n{proc.stdout}")
    return proc.stdout


def tiny_pretrained(folder: Path, seed: int = 1) -> Path:
    """A randomly initialised model with the tiny preset's architecture, saved as Hugging Face does."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from muonrun.config import load_config

    torch.manual_seed(seed)
    hf_kwargs = dict(load_config("tiny").model.hf)
    AutoModelForCausalLM.from_config(Qwen2Config(**hf_kwargs)).save_pretrained(folder)
    return folder


def close(a: dict[int, list[float]], b: dict[int, list[float]], steps) -> None:
    """The same losses up to fp32 rounding (the tp all-reduce sums in another order)."""
    for s in steps:
        assert a[s][-1] == pytest.approx(b[s][-1], rel=1e-3), (s, a[s], b[s])


def same_training(a: Path, b: Path, steps) -> None:
    """The same loss, load-balancing loss, gradient norm and expert load at every step, up to fp32
    rounding (which may flip a near-tie in one token's routing: the busiest expert's load, a count, may
    move by a token or two)."""
    ra, rb = step_rows(a), step_rows(b)
    for s in steps:
        for key, rel in (
            ("loss", 1e-3),
            ("aux_loss", 1e-3),
            ("grad_norm", 1e-3),
            ("expert_load_max_mean", 0.02),
        ):
            assert ra[s][key] == pytest.approx(rb[s][key], rel=rel), (s, key, ra[s][key], rb[s][key])
