"""Tensor parallelism (`parallel.tp`): Muon exact on tensor-parallel shards, the tiny preset training the
same with and without tensor parallelism, checkpoints across layouts, export, and the mistakes refused before any
worker starts."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import STEPS, close, losses, muonrun, ok, pretrain, run_workers, step_rows, tiny_pretrained
from typer.testing import CliRunner

from muonrun.cli import app

WORKER = Path(__file__).parent / "dist" / "tp_worker.py"


@pytest.mark.slow
def test_muon_on_tensor_parallel_shards_equals_torch_muon():
    """Column-wise and row-wise layers split over tp with FSDP2 over the data-parallel axes (tp 2 x dp 2,
    tp 4, tp 2 with HSDP; uneven splits, an empty shard): Muon and NorMuon step each rank's part as
    torch.optim.Muon (the paper's NorMuon) steps the whole matrix, each matrix orthogonalised once,
    AdamW, clipping and telemetry equal torch's on the full tensors; a tiny Qwen3 split by muonrun's
    parallelize has the unsplit model's gradients, q_norm/k_norm's summed over tp (tests/dist/tp_worker.py)."""
    out = run_workers(WORKER, 4, timeout=600)
    assert "TP_WORKER_OK" in out and "qwen3 at tp 2 x dp 2: gradients OK" in out, out
    for tag in ("tp 2 x dp 2", "tp 4", "tp 2 hsdp 2x1"):
        assert f"{tag}: 3 combinations, AdamW and clip OK" in out, out


@pytest.mark.slow
def test_the_tiny_preset_trains_the_same_with_and_without_tp_and_resumes_across_layouts(tmp_path):
    """Four ranks, the same global batch: dp 4 with one sequence each, or dp 2 x tp 2 with two (the tp
    ranks of a data-parallel rank share it): the same losses and gradient norms with Muon (AdamW steps
    the embeddings and norms), and QK-clip measuring the same largest logits and clipping the same
    heads (each tp rank measures and rescales its own heads' rows). The dp 2 x tp 2 run saves at step 4; that checkpoint resumes at
    dp 2 x tp 2 bit for bit, and on two ranks without tensor parallelism through DCP's resharding,
    training on as the uninterrupted run does. Its export loads in transformers."""
    # tau below the tiny model's largest logits (about 0.25): some heads are clipped at every step
    common = (
        "optimizer.name=muon",
        "checkpoint.interval=4",
        "checkpoint.keep_last=4",
        "train.qk_clip.tau=0.2",
    )
    runs = {
        "muon-dp4": ("train.micro_batch_size=1",),
        "muon-tp2": ("train.micro_batch_size=2", "parallel.tp=2"),
    }
    for name, layout in runs.items():
        ok(pretrain(tmp_path / name, *common, *layout, nproc=4))
    close(losses(tmp_path / "muon-dp4"), losses(tmp_path / "muon-tp2"), range(1, STEPS + 1))
    norms = [step_rows(tmp_path / name) for name in runs]
    for s in range(1, STEPS + 1):
        assert norms[0][s]["grad_norm"] == pytest.approx(norms[1][s]["grad_norm"], rel=1e-3), s
        logit = [n[s]["max_attention_logit"] for n in norms]
        assert logit[0] == pytest.approx(logit[1], rel=1e-3), (s, logit)
        assert norms[0][s]["qk_clipped_heads"] == norms[1][s]["qk_clipped_heads"], s
    assert sum(norms[1][s]["qk_clipped_heads"] for s in range(1, STEPS + 1)) >= STEPS
    saved = tmp_path / "muon-tp2"
    resumes = {"tp2": (4, runs["muon-tp2"]), "dp2": (2, ("train.micro_batch_size=2",))}
    for name, (nproc, layout) in resumes.items():
        run = tmp_path / f"resume-{name}"
        shutil.copytree(saved / "checkpoints" / "step-4", run / "checkpoints" / "step-4")
        out = ok(pretrain(run, *common, *layout, nproc=nproc))
        assert "resumed from" in out and "step-4" in out, out
        if name == "tp2":  # the same layout: bit for bit
            assert losses(run) == {s: losses(saved)[s] for s in range(5, STEPS + 1)}
        close(losses(run), losses(saved), range(5, STEPS + 1))
    exported = CliRunner().invoke(app, ["export", str(saved), str(tmp_path / "hf")])  # in-process
    assert exported.exit_code == 0, exported.output
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    q = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q.shape) == (128, 128) and torch.isfinite(q).all()
    ids = torch.arange(1, 33).view(1, -1)
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_tensor_parallel_mistakes_exit_2_before_any_worker_starts(tmp_path):
    """A tp that does not divide the key-value heads or the workers per node, a model with experts, and a
    feature that does not run on tensor-parallel layers: one paragraph naming parallel.tp, exit 2, no
    worker started (no run folder). One launch as a process, the rest in this one (the same checks)."""
    base = tiny_pretrained(tmp_path / "base")
    lora = ("model.lora.enabled=true", "model.init=pretrained", f"model.name_or_path={base}")
    cases = [
        (("tiny", "parallel.tp=4"), 4, "model.hf.num_key_value_heads=2"),
        (("tiny", "parallel.tp=2"), 3, "does not"),
        (("tiny", "parallel.tp=2", *lora), 4, "lora"),
        (("tiny-moe", "parallel.tp=2"), 2, "experts"),
    ]
    for i, (args, nproc, says) in enumerate(cases):
        run = tmp_path / f"r{i}"
        argv = ["pretrain", *args, f"output_dir={run}", "--nproc-per-node", str(nproc)]
        if i == 0:
            result = muonrun(*argv)
            code, text = result.returncode, result.stderr
            assert "Traceback" not in text, text
        else:
            result = CliRunner().invoke(app, argv)
            code, text = result.exit_code, result.output
        assert code == 2 and "parallel.tp" in text and says in " ".join(text.split()), text
        assert not (run / "metrics.jsonl").exists()


def test_the_dry_run_plans_tensor_parallelism_and_refuses_what_the_launch_refuses():
    """`--dry-run --world-size 16 parallel.tp=2`: the mesh with its tp axis, what tensor parallelism
    sends, and Muon's Newton–Schulz over the tp x dp_shard ranks; a tp the key-value heads cannot
    split, or one that does not divide the workers per node, exits 2 as the launch does."""
    plan = CliRunner().invoke(
        app, ["pretrain", "tiny", "--dry-run", "--world-size", "16", "parallel.tp=2", "optimizer.name=muon"]
    )
    text = " ".join(plan.output.split())
    assert plan.exit_code == 0, plan.output
    assert "dp_shard=8 x tp=2" in text and "tensor parallel" in text and "Muon Newton–Schulz" in text, text
    for overrides, says in (
        (("parallel.tp=4",), "num_key_value_heads"),
        (("parallel.tp=3",), "workers per node"),
    ):
        argv = ["pretrain", "tiny", "--dry-run", "--world-size", "12", "--nnodes", "3", *overrides]
        bad = CliRunner().invoke(app, argv)
        assert bad.exit_code == 2 and says in bad.output, bad.output


def test_a_layer_part_that_would_see_a_share_of_the_sequence_is_refused():
    """Sequence parallelism hands a layer's parts between the blocks the rank's share of the tokens: a
    part with weights there that is neither a norm nor a block the plan splits (a convolution, a
    recurrent mixer) is refused naming it, and the tiny preset's layers pass."""
    from torch import nn

    from muonrun.config import load_config
    from muonrun.errors import UserError
    from muonrun.model.build import check_model, decoder_layers
    from muonrun.model.tensor_parallel import check_tensor_parallel

    cfg = load_config("tiny", ["parallel.tp=2"])
    model = check_model(cfg.model, 320)
    check_tensor_parallel(cfg, model, [])
    for layer in decoder_layers(model):
        layer.mixer = nn.Conv1d(8, 8, 3)
    with pytest.raises(UserError, match=r"parallel\.tp.*\['mixer'\]"):
        check_tensor_parallel(cfg, model, [])
