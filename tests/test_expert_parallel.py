"""Expert parallelism (`parallel.ep`) and the mixture of experts end to end: the dispatch, AdamW and Muon
exact on expert-parallel experts, `tiny-moe` training the same at ep 1 and 2, checkpoints resumed exactly
and across ep, the export, and the mistakes refused before any worker starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import STEPS, losses, muonrun, ok, pretrain_args, run_workers, same_training, step_rows
from typer.testing import CliRunner

from muonrun.cli import app

WORKER = Path(__file__).parent / "dist" / "ep_worker.py"
EIGHT = "+model.hf.num_experts=8"  # tiny-moe's 6 experts do not split over 4 ranks


@pytest.mark.slow
def test_dispatch_and_muon_on_expert_parallel_experts_equal_the_unsplit_experts():
    """ep 2 x FSDP 2: each rank's outputs and input gradients equal the unsplit experts' on its own tokens,
    with uneven token splits and with a rank whose experts receive none; the experts' gradients are the
    mean over every rank, AdamW steps them as torch's does, and Muon each expert matrix as
    torch.optim.Muon does; a Llama4 MoE block (pre-sorted, input-scaled experts) dispatches its top-k
    pairs with the unsplit block's outputs and gradients (tests/dist/ep_worker.py)."""
    out = run_workers(WORKER, 4, timeout=600)
    assert "EP_WORKER_OK" in out and "llama4 block at ep 2 x efsdp 2: dispatch and gradients OK" in out, out
    assert "uneven splits: dispatch, gradients, AdamW and Muon OK" in out, out
    assert "every token to one ep rank's experts: dispatch, gradients, AdamW and Muon OK" in out, out


def moe_run(out: Path, *overrides: str) -> str:
    args = pretrain_args(out, "checkpoint.interval=4", "checkpoint.keep_last=4", *overrides, nproc=2)
    args[1] = "tiny-moe"
    return ok(muonrun(*args))


@pytest.mark.slow
def test_tiny_moe_trains_the_same_at_ep_1_and_2_resumes_exactly_across_ep_and_exports(tmp_path):
    """Two ranks, 6 experts, Muon, the aux-loss-free router bias on: at ep 1 (each rank holds a shard of
    every expert) and ep 2 (each holds 3 whole experts), the same losses, aux losses, expert loads and
    gradient norms, the routing statistics logged; the ep 2 run logs the tokens each rank's experts
    received. Each run's step-4 checkpoint resumes bit for bit on its own layout, router biases included;
    ep 2's resumes at ep 1 through DCP's resharding, training on as ep 2 does. The ep 1 run's export,
    its router biases in a file apart, loads in transformers alone and generates. (ep 2 x FSDP 2 on four ranks, and AdamW:
    the dispatch test above; ep 4 and AdamW end to end: tests/test_layouts.py.)"""
    from muonrun.checkpoint.safe import load_model_tensors
    from muonrun.features.router_bias import BIAS

    bias = "train.router_bias_update_rate=0.01"
    moe_run(tmp_path / "ep1", "parallel.ep=1", bias, "checkpoint.export_at_end=true")
    moe_run(tmp_path / "ep2", "parallel.ep=2", bias)
    same_training(tmp_path / "ep1", tmp_path / "ep2", range(1, STEPS + 1))
    last = step_rows(tmp_path / "ep2")[STEPS]
    assert last["ep_tokens_received"] > 0 and "ep_tokens_received" not in step_rows(tmp_path / "ep1")[STEPS]
    for key in ("aux_loss", "expert_load_max_mean", "router_entropy", "expert_load_max_mean_3"):
        assert all(isinstance(r[key], float) for r in step_rows(tmp_path / "ep2").values()), (key, last)
    for ep in (1, 2):
        saved, run = tmp_path / f"ep{ep}", tmp_path / f"resume-ep{ep}"
        shutil.copytree(saved / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
        text = moe_run(run, f"parallel.ep={ep}", bias)
        assert "resumed from" in text and "resharded" not in text
        assert losses(run) == {s: losses(saved)[s] for s in range(5, STEPS + 1)}  # bit for bit
        final = [load_model_tensors(r / "checkpoints" / f"step-{STEPS}") for r in (saved, run)]
        biases = {k: v for k, v in final[0].items() if k.endswith(BIAS)}
        assert len(biases) == 4 and all(v.abs().sum() > 0 for v in biases.values())
        assert all(torch.equal(v, final[1][k]) for k, v in biases.items())
    across = tmp_path / "ep2-at-ep1"
    shutil.copytree(tmp_path / "ep2" / "checkpoints" / "step-4", across / "checkpoints" / "step-4")
    assert "resumed from" in moe_run(across, "parallel.ep=1", bias)
    same_training(across, tmp_path / "ep2", range(5, STEPS + 1))
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "ep1" / "hf"
    assert (hf / "router_expert_bias.safetensors").exists()
    assert "router_expert_bias.safetensors" in (hf / "README.md").read_text()
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.model_type == "qwen2_moe" and model.config.num_experts == 6
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 6
    assert model.generate(torch.tensor([[10, 20, 30]]), max_new_tokens=5, do_sample=False).shape == (1, 8)


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
