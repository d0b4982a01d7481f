"""LoRA (model.lora, muonrun/features/lora.py): adapters on a pretrained model under FSDP2 with distributed Muon.

One 3-rank gloo launch (tests/dist/lora_worker.py) checks training against torch.optim.Muon, frozen
weights, the checkpoint's contents and a bitwise resume; the exports are checked against the logits it
saved; the presets train, resume bitwise and reshard its 3-rank checkpoint on one in-process worker,
and `muonrun bench` runs them; bad settings exit 2 naming the key. Every model is a tiny one saved
into tmp_path: nothing is downloaded.

Run: pytest tests/test_lora.py -q      (the quick ones alone: -m "not slow")
"""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from helpers import losses, run_workers, tiny_pretrained
from typer.testing import CliRunner

from muonrun.checkpoint import resolve_checkpoint
from muonrun.cli import app
from muonrun.config import load_config

runner = CliRunner()
WORKER = Path(__file__).parent / "dist" / "lora_worker.py"


def text_file(path: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path.write_text("".join(p.read_text() for p in sorted(stdlib.glob("json/*.py"))))
    return path


def invoke(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("lora")
    tiny_pretrained(folder / "base")
    text_file(folder / "text.txt")
    return folder


@pytest.fixture(scope="module")
def trained(folder) -> Path:
    """The 3-rank worker's run: FOLDER/run (checkpoints step-3, step-5), FOLDER/logits.pt, its log."""

    out = run_workers(WORKER, 3, str(folder), timeout=400)
    assert "LORA_WORKER_OK" in out, out
    (folder / "worker.log").write_text(out)
    return folder


# -- quick: settings, groups, plan (meta device, no process group) --------------------------------------

LORA = ["model.lora.enabled=true", "model.init=pretrained"]


def test_bad_lora_settings_exit_2_naming_the_key(folder):
    base = f"model.name_or_path={folder / 'base'}"
    for override, key, words in (
        ("model.lora.target_modules=[q_proj,qkv]", "model.lora.target_modules", "'qkv' matches no layer"),
        ("model.lora.target_modules=[input_layernorm]", "model.lora.target_modules", "cannot adapt"),
        ("model.lora.target_modules=[lm_head]", "model.lora.target_modules", "model.lora.train"),
        ("model.lora.rank=0", "model.lora.rank", "at least 1"),
        ("model.lora.train=[model.embed.weight]", "model.lora.train", "matches no parameter"),
        ("model.init=random", "model.lora.enabled", "pretrained"),
        ("parallel.float8=rowwise", "parallel.float8", "LoRA"),
    ):
        code, text = invoke("pretrain", "tiny", *LORA, base, override, "--dry-run")
        assert code == 2 and f"'{key}'" in text and words in text, (override, text)
        assert "Traceback" not in text


def test_groups_and_plan_count_only_what_trains(folder):
    """Muon takes exactly the adapters' A and B, AdamW what else trains (here the norms); with adamw
    AdamW takes all that trains; frozen parameters are in no group; the dry run plans memory without
    fp32 copies, gradients or optimizer state for frozen weights."""
    from muonrun.features import enabled
    from muonrun.features.lora import is_adapter
    from muonrun.model.build import build_hf_config, build_model
    from muonrun.optim.build import build_optimizers
    from muonrun.tools.plan import memory_per_rank, plan_summary

    over = [*LORA, f"model.name_or_path={folder / 'base'}", "model.lora.train=['*norm.weight']"]
    c = load_config("tiny", [*over, "optimizer.name=muon"])
    model = build_model(c.model, build_hf_config(c.model), enabled(c))
    named = {id(p): n for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    muon, adamw = (
        {named[id(p)] for g in o.param_groups for p in g["params"]}
        for o in build_optimizers(model, c.optimizer, "cpu")
    )
    assert muon == {n for n in trainable if is_adapter(n)} and len(muon) == 4 * 7 * 2
    assert adamw == trainable - muon and all(n.endswith("norm.weight") for n in adamw)
    (only,) = build_optimizers(model, load_config("tiny", over).optimizer, "cpu")
    assert {named[id(p)] for g in only.param_groups for p in g["params"]} == trainable

    s = plan_summary(load_config("tiny", [*over, "optimizer.name=muon", "train.device=auto"]), 2)
    p = s["parameters"]
    frozen = p["total"] - p["trainable"]
    assert 0 < p["trainable"] < p["total"] / 4
    expect = memory_per_rank(p, s["muon_parameters"], "muon", 2, frozen_bytes=2)
    assert s["memory_gib_per_rank"] == expect
    assert expect["weights"] * 2**30 * 2 == 4 * p["trainable"] + 2 * frozen  # bf16 frozen, fp32 trained
    assert expect["gradients"] * 2**30 * 2 == 4 * p["trainable"]
    muon_n = s["muon_parameters"]
    assert expect["optimizer"] * 2**30 * 2 == 4 * (muon_n + 2 * (p["trainable"] - muon_n))


def test_targets_and_base_identity(folder, tmp_path):
    """peft gets the modules' last names when they select exactly the chosen modules, else full names;
    the base's fingerprint follows its weights, not its folder."""
    from muonrun.features.lora import peft_config
    from muonrun.model.build import build_hf_config, build_model
    from muonrun.model.hf import base_identity

    c = load_config("tiny", [*LORA, f"model.name_or_path={folder / 'base'}"])
    plain = load_config("tiny", [f"model.name_or_path={folder / 'base'}"]).model
    plain = build_model(plain, build_hf_config(plain))
    assert sorted(peft_config(plain, c.model.lora).target_modules) == sorted(c.model.lora.target_modules)
    c.model.lora.target_modules = ["model.layers.1.mlp.*"]
    assert sorted(peft_config(plain, c.model.lora).target_modules) == [
        f"model.layers.1.mlp.{n}" for n in ("down_proj", "gate_proj", "up_proj")
    ]
    copy = shutil.copytree(folder / "base", tmp_path / "copy")
    assert base_identity(str(copy))["fingerprint"] == base_identity(str(folder / "base"))["fingerprint"]
    other = tiny_pretrained(tmp_path / "other", seed=2)
    assert base_identity(str(other))["fingerprint"] != base_identity(str(folder / "base"))["fingerprint"]


# -- one 3-rank launch and what it leaves ------------------------------------------------------------------


@pytest.mark.slow
def test_lora_under_fsdp2_matches_torch_muon_and_resumes_bitwise(trained):
    log = (trained / "worker.log").read_text()
    for line in (
        "groups: Muon holds the 56 adapter matrices, AdamW the embedding and norm, frozen ones none",
        "LoRA + distributed Muon == LoRA + torch.optim.Muon unsharded",
        "only the adapters, the embedding and the norm changed; the frozen base is bitwise the same",
        "checkpoint: only what trains (adapters, embedding, norm), optimizer state and the base's identity",
        "resumed from step 3: steps 4-5 repeat bitwise",
        "a checkpoint of another base model is refused, naming both",
        "param_dtype=bfloat16: frozen weights stored in bf16, adapters in fp32, two FSDP2 steps train",
    ):
        assert line in log, log


@pytest.mark.slow
def test_exports_give_the_trained_models_logits(trained, tmp_path, reseal):
    """The merged folder loads with from_pretrained, the adapter folder with peft, and both give the
    logits the sharded model computed in training."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved = torch.load(trained / "logits.pt")
    code, text = invoke("export", str(trained / "run"), str(tmp_path / "merged"))
    assert code == 0, text
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    code, text = invoke("export", str(trained / "run"), str(tmp_path / "adapter"), "--adapter-only")
    assert code == 0 and "PeftModel.from_pretrained" in text, text
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(trained / "base") and config["r"] == 1
    assert sorted(config["modules_to_save"]) == ["model.embed_tokens", "model.norm"]  # what else trained
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(trained / "base"), tmp_path / "adapter"
    )
    with torch.no_grad():
        for model in (merged, adapted):
            torch.testing.assert_close(model(saved["ids"]).logits, saved["logits"], rtol=0, atol=2e-5)
    # the base named in the checkpoint's config.yaml must still be the one the adapters were trained on
    run = shutil.copytree(trained / "run", tmp_path / "moved" / "run")
    other = tiny_pretrained(tmp_path / "other", seed=2)
    saved = resolve_checkpoint(run) / "config.yaml"
    reseal(saved.parent, saved.name, saved.read_text().replace(str(trained / "base"), str(other)))
    code, text = invoke("export", str(run), str(tmp_path / "x"))
    assert code == 2 and "trained on" in text and "fingerprint" in text and "Traceback" not in text, text


def cpu(folder: Path, out: Path) -> list[str]:
    """Small CPU overrides for the Qwen2 LoRA presets: the tiny base, local text, one worker."""
    return [
        f"model.name_or_path={folder / 'base'}",
        "data.tokenizer=byte",
        f"data.sources=[{{path: {folder / 'text.txt'}}}]",
        "data.seq_len=32",
        "train.micro_batch_size=2",
        "train.device=cpu",
        "train.loss_chunk_tokens=0",
        "parallel.compile=false",
        "parallel.compile_loss=false",
        "logging.console=plain",
        "logging.log_interval=1",
        "launch.nproc_per_node=1",
        f"output_dir={out}",
    ]


@pytest.mark.slow
def test_presets_resume_bitwise_reshard_and_bench_on_cpu(trained, tmp_path):
    ref = tmp_path / "ref"
    steps = ["train.max_steps=6", "checkpoint.interval=3", "schedule.warmup_steps=2"]
    code, text = invoke(
        "pretrain", "qwen2-muon-lora-fsdp2", *cpu(trained, ref), *steps, "checkpoint.export_at_end=true"
    )
    assert code == 0 and (ref / "hf" / "model.safetensors").is_file(), text  # merged at the end
    start = json.loads((ref / "metrics.jsonl").read_text().splitlines()[0])
    p = start["parameters"]
    assert 0 < p["trainable"] < p["total"] and f"{p['trainable']:,} trainable" in text
    # exact resume: the run is repeated from its step-3 checkpoint
    again = tmp_path / "again"
    shutil.copytree(ref, again)
    shutil.rmtree(again / "checkpoints" / "step-6")
    shutil.rmtree(again / "hf")
    code, text = invoke("pretrain", "qwen2-muon-lora-fsdp2", *cpu(trained, again), *steps)
    assert code == 0 and "step-3 at step 3" in text, text
    expect, got = losses(ref), losses(again)
    assert [got[s][-1] for s in (4, 5, 6)] == [expect[s][0] for s in (4, 5, 6)], (got, expect)
    # reshard: the 3-rank worker's checkpoint resumed on one worker
    step3 = trained / "run" / "checkpoints" / "step-3"
    code, text = invoke(
        "pretrain", str(trained / "run" / "config.yaml"), f"checkpoint.resume_from={step3}",
        f"output_dir={tmp_path / 'one'}", "train.max_steps=4", "launch.nproc_per_node=1",
    )  # fmt: skip
    assert code == 0 and "saved by 3 ranks, resharded" in text, text
    # `muonrun bench` on the presets
    out = tmp_path / "bench" / "results.json"
    code, text = invoke(
        "bench", "qwen2-adamw-lora-fsdp2", *cpu(trained, tmp_path / "unused"), "--variant", "adamw",
        "--variant", "muon:optimizer.name=muon", "--steps", "2", "--warmup", "1", "--out", str(out),
    )  # fmt: skip
    assert code == 0, text
    results = json.loads(out.read_text())
    assert set(results) == {"adamw", "muon"} and all(r["steps_measured"] == 2 for r in results.values())
