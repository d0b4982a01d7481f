"""A setting that does nothing where it is set says so: every setting whose reference mentions GPUs is
walked on a CPU plan (the tiny preset, train.device=cpu) and either warns in one line, is refused (exit 2
naming it), or works on the CPU too, as classified here; a new GPU setting must be classified. The launch
warns as the dry run does, once, and its banner says what is compiled."""

from __future__ import annotations

import re

import pytest
from helpers import SMALL, muonrun, ok
from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.config.docs import field_docs
from muonrun.config.inert import GPU_ONLY

runner = CliRunner()
GPU_WORDS = re.compile(r"GPU|CUDA|cuda|[Tt]riton|Hopper|NCCL|nccl")

# key: (what it does on a CPU plan, the overrides that set it, why)
ON_CPU = {
    "optimizer.fused": ("works", ["optimizer.fused=true"], "torch's fused AdamW has a CPU kernel"),
    "optimizer.muon.eager": ("warns", ["optimizer.name=muon", "optimizer.muon.eager=true"], ""),
    "parallel.param_dtype": ("works", ["parallel.param_dtype=bfloat16"], "bf16 matmuls run on CPUs"),
    "parallel.compile_loss": ("warns", ["parallel.compile_loss=true"], ""),
    "parallel.float8": ("refused", ["parallel.float8=rowwise"], "float8 matmuls need a GPU"),
    "train.device": ("works", ["train.device=cpu"], "the CPU plan itself"),
    "logging.peak_tflops": ("works", ["logging.peak_tflops=1.0"], "MFU against the given peak"),
    "logging.time_optimizer": ("works", ["logging.time_optimizer=true"], "wall time on a CPU"),
    "logging.profile": (
        "works",
        ["logging.profile=true", "train.max_steps=10", "schedule.warmup_steps=2"],
        "",
    ),
    "launch.nproc_per_node": ("works", ["launch.nproc_per_node=2"], "CPU workers"),
    "launch.backend": ("refused", ["launch.backend=nccl"], "nccl connects GPUs only"),
    "launch.collective_timeout_s": (
        "works",
        ["launch.collective_timeout_s=600"],
        "gloo's collectives time out too",
    ),
}


def test_every_setting_that_names_a_gpu_is_classified():
    gpu = {key for key, (_, _, doc) in field_docs().items() if GPU_WORDS.search(doc)}
    assert gpu == set(ON_CPU), (gpu - set(ON_CPU), set(ON_CPU) - gpu)
    assert {k for k, (what, _, _) in ON_CPU.items() if what == "warns"} == set(GPU_ONLY)


@pytest.mark.parametrize("key", sorted(ON_CPU))
def test_a_gpu_setting_on_a_cpu_plan_warns_is_refused_or_works(key):
    what, overrides, _ = ON_CPU[key]
    result = runner.invoke(app, ["pretrain", "tiny", "train.device=cpu", *overrides, "--dry-run"])
    text = " ".join(result.output.split())
    if what == "refused":
        assert result.exit_code == 2 and f"'{key}'" in text and "Traceback" not in text, result.output
        return
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if "WARNING" in line]
    if what == "warns":
        assert len(warnings) == 1 and f"WARNING: {key}=true does nothing on the CPU:" in warnings[0], warnings
        assert "muonrun plan" in text
    else:
        assert not warnings, warnings


def test_the_launch_warns_once_and_its_banner_says_what_is_compiled(tmp_path):
    out = ok(
        muonrun(
            "pretrain",
            "tiny",
            f"output_dir={tmp_path / 'run'}",
            *SMALL,
            "train.max_steps=1",
            "data.sources.0.path=${stdlib:}/json/*.py",
            "parallel.compile_loss=true",
            "optimizer.name=muon",
            "optimizer.muon.eager=true",
            "--nproc-per-node",
            "1",
        )
    )
    for key in GPU_ONLY:
        assert out.count(f"WARNING: {key}=true does nothing on the CPU") == 1, out
    assert "compiled layers False, compiled loss False" in " ".join(out.split()), out
