"""Checkpoints end to end on CPU (gloo): exact resume, crash mid-save, preemption, NaN, resharding,
pretrained init, init_from and the Hugging Face export. Faults are injected with MUONRUN_FAULT
(muonrun/faults.py). Two reference runs (AdamW and NorMuon, module fixtures) serve several tests.

Run: pytest tests/test_checkpoint.py -q     (the unit tests alone: -m "not slow")
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    NORMUON,
    STEPS,
    assert_same_losses,
    cli_env,
    losses,
    muonrun,
    ok,
    pretrain,
    pretrain_args,
    steps_of,
    tree,
)
from typer.testing import CliRunner

from muonrun import faults
from muonrun.checkpoint import (
    META,
    WRITER_THREADS,
    StopFlag,
    load_model_tensors,
    published_checkpoints,
    rank_state_file,
    read_meta,
    resolve_checkpoint,
    verify,
)
from muonrun.checkpoint.files import seal
from muonrun.checkpoint.resume import load_order
from muonrun.cli import app
from muonrun.errors import UserError

runner = CliRunner()

# -- unit tests (no process group) ----------------------------------------------------------------------


def test_fault_specs():
    assert faults.parse("nan@7") == faults.Fault("nan", 7)
    assert faults.parse("kill@save:8:r1") == faults.Fault("kill", 8, at_save=True, rank=1)
    assert faults.parse("term@6") == faults.Fault("term", 6)
    assert faults.parse("terms@6:r1") == faults.Fault("terms", 6, rank=1)
    assert faults.parse(None) is None
    for bad in ("nan@save:3", "boom@1", "kill@x"):
        with pytest.raises(ValueError, match="MUONRUN_FAULT"):
            faults.parse(bad)
    from muonrun.checkpoint.stop import LAUNCHER_PID_ENV

    assert faults.LAUNCHER_PID_ENV == LAUNCHER_PID_ENV  # faults' copy (an import would be a cycle)


def test_a_fault_spec_that_does_not_parse_exits_2_before_any_worker_starts(tmp_path):
    result = runner.invoke(
        app, ["pretrain", "tiny", f"output_dir={tmp_path / 'run'}"], env={faults.ENV: "nan@x"}
    )
    assert result.exit_code == 2 and "MUONRUN_FAULT='nan@x' is not one of" in result.output, result.output
    assert not (tmp_path / "run").exists()


def _fake_checkpoint(path: Path, world_size: int = 2, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    if complete:
        (path / META).write_text(json.dumps(seal({"step": 1, "world_size": world_size, "files": {}})))
    return path


def test_only_published_checkpoints_count_and_a_published_one_missing_files_is_damaged(tmp_path):
    """A save renames step-N.tmp to step-N once its manifest is written: a step-N folder without one lost
    it afterwards, so it counts (and verifies as damaged) rather than being passed over in silence."""
    root = tmp_path / "run" / "checkpoints"
    _fake_checkpoint(root / "step-10")
    _fake_checkpoint(root / "step-9")
    _fake_checkpoint(root / "step-20.tmp")  # an interrupted save
    _fake_checkpoint(root / "step-30", complete=False)  # its muonrun.json deleted after the save
    (root / "step-40").mkdir()  # emptied
    (root / "step-50").write_text("")  # a file, not a checkpoint
    published = published_checkpoints(root)
    assert [p.name for p in published] == ["step-9", "step-10", "step-30", "step-40"]  # numeric order
    for damaged in ("step-30", "step-40"):
        assert verify(root / damaged).problems[0].startswith("muonrun.json cannot be trusted")
    assert resolve_checkpoint(tmp_path / "run").name == "step-40"
    with pytest.raises(UserError, match="incomplete"):
        resolve_checkpoint(root / "step-20.tmp")
    with pytest.raises(UserError, match="'.*nowhere' does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    with pytest.raises(UserError, match="not a muonrun checkpoint"):
        resolve_checkpoint(tmp_path / "other")
    # set aside, complete: never counted, but named it is a checkpoint (resume_from goes back to its line)
    for aside in ("step-60.abandoned", "step-60.abandoned-2", "step-70.damaged"):
        _fake_checkpoint(root / aside)
        assert resolve_checkpoint(root / aside) == root / aside
        assert load_order(str(root / aside), None, root)[-1] == ("resume", str(root / aside), True)
    assert [p.name for p in published_checkpoints(root)][-1] == "step-40"


def test_loader_state_follows_the_data_rule(tmp_path):
    """Same world size: each rank its own file; a new one: rank 0's, which a map-style loader can use
    (its cursor is global) and a streaming loader refuses with a clear message."""
    from muonrun.config import Config, DataConfig, SourceConfig, TrainConfig
    from muonrun.data import build_loader, build_tokenizer

    ck = _fake_checkpoint(tmp_path / "step-5", world_size=2)
    assert rank_state_file(ck, 1, 2).name == "rank1.pt"
    assert rank_state_file(ck, 2, 3).name == "rank0.pt"
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    cfg = Config(
        data=DataConfig(
            sources=[SourceConfig(path=str(corpus), streaming=True)], seq_len=16, shuffle_buffer=8
        ),
        train=TrainConfig(micro_batch_size=2),
    )
    tok = build_tokenizer("byte")
    old = build_loader(cfg, tok, dp_rank=0, dp_size=2)
    next(old)
    with pytest.raises(UserError, match="2 data-parallel ranks, this run has 3"):
        build_loader(cfg, tok, dp_rank=2, dp_size=3).load_state_dict(old.state_dict())


def test_stop_flag_only_records_the_signal_and_the_process_in_charge_says_a_save_follows(capsys, monkeypatch):
    """The single worker (no launcher above it) says at once what a stop request does; a worker under the
    launcher stays quiet (its launcher says it, once for the job)."""
    from muonrun.checkpoint.stop import LAUNCHER_PID_ENV

    for launcher, says in ((None, True), ("1", False)):
        if launcher is None:
            monkeypatch.delenv(LAUNCHER_PID_ENV, raising=False)
        else:
            monkeypatch.setenv(LAUNCHER_PID_ENV, launcher)
        flag = StopFlag()
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGTERM)  # a second request: nothing more to say
            assert flag.raised == signal.SIGTERM
        finally:
            flag.restore()
        out = capsys.readouterr()
        text = out.out + out.err
        assert text.count("got SIGUSR1: saving a checkpoint within two steps") == int(says), text
        assert text.count("muonrun:") == int(says), text
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# -- end to end -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adamw_ref(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("adamw") / "run"
    ok(pretrain(out, "checkpoint.interval=4"))
    assert steps_of(out) == [4, STEPS]
    # each of the 2 ranks wrote its share with WRITER_THREADS threads, one file each (every test below
    # resumes, reshards or exports from such checkpoints)
    files = sorted(p.name for p in (out / "checkpoints" / f"step-{STEPS}").glob("*.distcp"))
    assert files == [f"__{r}_{t}.distcp" for r in range(2) for t in range(WRITER_THREADS)], files
    return out


@pytest.fixture(scope="module")
def normuon_ref(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("normuon") / "run"
    ok(pretrain(out, *NORMUON, "checkpoint.interval=0"))
    return out


@pytest.mark.slow
def test_crash_mid_save_then_preemption_then_exact_resume(adamw_ref, tmp_path):
    out = tmp_path / "run"
    ckpt = ["checkpoint.interval=2", "checkpoint.keep_last=2"]
    # 1. Rank 1 is SIGKILLed in the middle of step 4's save: step-2 stays the latest complete checkpoint.
    #    Without restarts, rank 0 then fails in a collective with it ("Connection reset by peer") and
    #    may exit first; the launcher names rank 1 and how it died, in one line.
    crashed = pretrain(out, *ckpt, fault="kill@save:4:r1")
    text = crashed.stdout + crashed.stderr
    assert crashed.returncode == 1, text[-3000:]
    assert "worker rank 1 failed (killed by SIGKILL); the other workers stopped with it." in text
    assert "Connection reset" not in text and "worker rank 0" not in text and "Traceback" not in text
    assert steps_of(out) == [2] and (out / "checkpoints" / "step-4.tmp").is_dir()
    # 2. The next run deletes the partial save, resumes from step-2 and is preempted: the launcher gets
    #    SIGTERM after step 5, and again every 20 ms until the end; it forwards it once, and the workers
    #    save at the step they agree on and exit 0, neither killed by a repeat nor restarted.
    text = ok(pretrain(out, *ckpt, fault="terms@5", extra=("--max-restarts", "1")))
    assert "resumed from" in text and "step-2 at step 2" in text and "restarting" not in text
    stopped = max(losses(out))
    assert stopped >= 5 and f"Stopped by signal after step {stopped}" in text
    assert steps_of(out) == [4, stopped]
    assert not list((out / "checkpoints").glob("*.tmp"))
    # 3. A plain rerun (async saves, a stale init_from that must be ignored loudly) finishes the job.
    text = ok(pretrain(out, *ckpt, "checkpoint.async_save=true", f"checkpoint.init_from={adamw_ref}"))
    assert "init_from" in text and "IGNORED" in text
    assert steps_of(out) == [6, 8]  # keep_last=2, the async step-6 published too
    assert_same_losses(out, adamw_ref, first=3)


@pytest.mark.slow
def test_muon_worker_crash_restarts_from_the_checkpoint_exactly(normuon_ref, tmp_path):
    out = tmp_path / "run"
    text = ok(pretrain(out, *NORMUON, "checkpoint.interval=4", fault="kill@6", extra=("--max-restarts", "1")))
    # the launcher says who failed and where the restart resumes; the restarted workers resumed there
    # (NorMuon's momentum buffers and second moments included)
    assert "worker rank 0 failed (killed by SIGKILL); restarting the workers (restart 1 of 1)" in text
    assert "resuming from" in text and "step-4 at step 4" in text
    assert_same_losses(out, normuon_ref, first=5)


STILL = 1 - 2**-30
"""A momentum and beta2 that hold Muon's EMAs still: each step moves an entry by 2**-30 of its gap to
the new value, which fp32 rounds away or nearly."""


@pytest.mark.slow
def test_a_save_out_of_room_is_one_paragraph_and_the_last_checkpoint_resumes_exactly(adamw_ref, tmp_path):
    """A file-size limit (as a full disk or quota would) stops the step-8 save of a run resumed from
    step 4: one paragraph naming the folder, the limit and what the save needed, the half-written
    step-8.tmp removed, the earlier checkpoint kept; with room again the run resumes from it exactly."""
    out, ckpt = tmp_path / "run", "checkpoint.interval=4"
    shutil.copytree(adamw_ref / "checkpoints" / "step-4", out / "checkpoints" / "step-4")
    limited = subprocess.run(
        [sys.executable, "-m", "muonrun", *pretrain_args(out, ckpt)],
        capture_output=True, text=True, env=cli_env(), timeout=400,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY)),
    )  # fmt: skip
    text = " ".join(limited.stderr.split())
    assert limited.returncode == 2, limited.stdout[-2000:] + limited.stderr[-3000:]
    assert (
        f"Saving checkpoint step-{STEPS} into '{out / 'checkpoints' / f'step-{STEPS}.tmp'}' failed: a file"
        in text
    )
    assert "outgrew the file-size limit. Its largest file needs about" in text
    assert "the file-size limit (ulimit -f) is 1.0 MiB" in text
    assert f"The half-written step-{STEPS}.tmp was removed; step-4, the latest checkpoint, is kept" in text
    assert text.count("Saving checkpoint") == 1 and "Traceback" not in limited.stdout + limited.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-4"]
    ok(pretrain(out, ckpt))
    assert steps_of(out) == [4, STEPS]
    assert_same_losses(out, adamw_ref, first=5)


def optimizer_state(checkpoint: Path, scratch: Path) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's optimizer state as full tensors, by parameter name (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, scratch)
    return torch.load(scratch, weights_only=True)["optim"]["state"]


@pytest.mark.slow
def test_resharded_resume_two_to_three_workers(normuon_ref, tmp_path):
    """NorMuon saved by 2 workers, resumed by 3. Hyperparameters come from the config, not the
    checkpoint: the resumed run's Muon momentum and beta2 are STILL, so its two steps leave the momentum
    buffers and second moments as the load restored them, and the step-10 checkpoint its 3 ranks write
    holds the step-8 one's, row for row. A state restarted from zeros would hold about 2**-29 of them."""
    out = tmp_path / "run"
    text = ok(
        pretrain(
            out,
            *NORMUON,
            f"checkpoint.resume_from={normuon_ref}",
            "train.max_steps=10",
            f"optimizer.muon.momentum={STILL!r}",
            f"optimizer.muon.beta2={STILL!r}",
            nproc=3,
        )
    )
    assert "resharded" in text
    got, ref = losses(out), losses(normuon_ref)
    assert sorted(got) == [9, 10]
    for step in (9, 10):
        loss = got[step][0]
        assert math.isfinite(loss) and abs(loss - ref[STEPS][0]) < 0.5, (loss, ref)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["tokens_seen"] for r in rows if "loss" in r][-1] == STEPS * 2 * 4 * 64 + 2 * 3 * 4 * 64
    saved = optimizer_state(normuon_ref / "checkpoints" / f"step-{STEPS}", tmp_path / "saved.pt")
    resumed = optimizer_state(out / "checkpoints" / "step-10", tmp_path / "resumed.pt")
    muon = sorted(name for name, state in saved.items() if "second_moment" in state)
    assert len(muon) == 4 * 7, sorted(saved)  # the tiny preset's hidden matrices: 7 in each of 4 layers
    for name in muon:
        v, v_saved = resumed[name]["second_moment"], saved[name]["second_moment"]
        assert v_saved.min() > 0, name  # every row has a second moment that zeros would not match
        torch.testing.assert_close(v, v_saved, rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        buf, buf_saved = resumed[name]["momentum_buffer"], saved[name]["momentum_buffer"]
        atol = 1e-6 * buf_saved.abs().max().item()
        torch.testing.assert_close(buf, buf_saved, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_nan_stops_before_the_update_and_keeps_the_checkpoint_and_another_seq_len_is_said_once(
    adamw_ref, tmp_path
):
    out = tmp_path / "run"
    shutil.copytree(adamw_ref, out)
    before = {k: v for k, v in tree(out / "checkpoints").items() if k.startswith("step-8")}
    # NaN on rank 1 only, the step after an async save (step 9's, possibly still being written when
    # step 10's NaN is agreed: it is of a finite step, so it is published, not left as .tmp). Not
    # restarted: a restart would resume exactly and meet it again (the fault fires in the first
    # attempt only, so a restart would pass here and exit 0). The resume also changes data.seq_len
    # (64 -> 32): one line says so across both ranks, and the run's config.yaml records the new value.
    async_at_9 = ("checkpoint.async_save=true", "checkpoint.interval=9")
    result = pretrain(
        out,
        "train.max_steps=12",
        "data.seq_len=32",
        *async_at_9,
        fault="nan@10:r1",
        extra=("--max-restarts", "1"),
    )
    assert result.returncode == 3, result.stdout[-2000:] + result.stderr[-3000:]
    text = result.stdout + result.stderr
    assert text.count("data.seq_len is 32, the checkpoint was saved with 64") == 1, text[-3000:]
    assert "UserWarning" not in text and "data changed" not in text
    assert "  seq_len: 32\n" in (out / "config.yaml").read_text()  # the resumed run's config, now
    assert "restarting" not in result.stderr
    # one report, the same on both ranks, naming the rank and the checkpoint a rerun resumes from
    assert result.stderr.count("not finite at step 10") == 1, result.stderr
    assert "loss not finite on rank 1 (the lowest such rank)" in result.stderr
    assert (
        "nothing from that step on was saved" in result.stderr and "step-9, which is intact" in result.stderr
    )
    after = tree(out / "checkpoints")
    assert {k: v for k, v in after.items() if k.startswith("step-8")} == before  # untouched
    assert steps_of(out) == [8, 9] and not list((out / "checkpoints").glob("*.tmp"))
    assert muonrun("checkpoint", "verify", str(out / "checkpoints" / "step-9")).returncode == 0
    # The agreement is read one step late: step 10's row (its loss is the ranks' mean, NaN) is the last.
    assert max(losses(out)) == 10 and math.isnan(losses(out)[10][-1])
    assert math.isfinite(losses(out)[9][-1])  # the resumed run trains on 32-token sequences


def test_the_launcher_exits_by_what_workers_reported_not_by_their_exit_status(tmp_path, capsys):
    """A rank that reported a non-finite step may still die in interpreter teardown (-6), its peers in a
    collective with it: the reports alone give the exit code, and each distinct message is printed once."""
    from muonrun.launch.launcher import NON_FINITE_EXIT, USER_ERROR_EXIT, report_worker_errors

    assert report_worker_errors(tmp_path) is None  # a plain crash: the launcher reports the first failure
    for rank in (0, 1):
        (tmp_path / f"exit{NON_FINITE_EXIT}-rank{rank}.txt").write_text("Loss is not finite at step 10.")
    assert report_worker_errors(tmp_path) == NON_FINITE_EXIT
    assert capsys.readouterr().err == "muonrun: Loss is not finite at step 10.\n"
    (tmp_path / f"exit{USER_ERROR_EXIT}-rank1.txt").write_text("data.path 'x' does not exist.")
    assert report_worker_errors(tmp_path) == USER_ERROR_EXIT
    assert capsys.readouterr().err.count("muonrun: ") == 2


def test_a_checkpoint_records_its_architecture_resume_refuses_another_and_export_rebuilds_it(adamw_ref):
    """Every checkpoint's manifest records the resolved transformers config (`architecture_of`). A
    config that resolves differently under the same settings (model.name_or_path's config.json edited,
    other transformers defaults) is refused at resume; checkpoint.init_from refuses another layout but
    may reach further positions; export rebuilds the trained architecture and says which keys differ."""
    from dataclasses import replace

    from muonrun.checkpoint.export import as_trained, read_run_config
    from muonrun.checkpoint.resume import check_architecture
    from muonrun.model.build import architecture_of, build_hf_config

    step = adamw_ref / "checkpoints" / f"step-{STEPS}"
    model = read_run_config(step).model
    saved = read_meta(step)["architecture"]
    assert saved == architecture_of(build_hf_config(model)) and saved["num_hidden_layers"] == 4
    edited = build_hf_config(replace(model, hf={**model.hf, "hidden_act": "gelu", "rms_norm_eps": 0.1}))
    with pytest.raises(UserError, match=r"hidden_act: 'silu' -> 'gelu'; rms_norm_eps: 1e-06 -> 0.1"):
        check_architecture(step, architecture_of(edited), "resume")
    rebuilt, differing = as_trained(edited, step)
    assert differing == ["hidden_act", "rms_norm_eps"] and architecture_of(rebuilt) == saved
    assert as_trained(build_hf_config(model), step)[1] == []
    with pytest.raises(UserError, match="num_hidden_layers: 4 -> 3.*checkpoint.init_from"):
        check_architecture(step, {**saved, "num_hidden_layers": 3}, "init")
    further = {**saved, "max_position_embeddings": 4 * saved["max_position_embeddings"]}
    check_architecture(step, further, "init")  # a warm start may reach further positions
    with pytest.raises(UserError, match="max_position_embeddings"):
        check_architecture(step, further, "resume")
    check_architecture(step, {**saved, "a_key_of_another_transformers": 1}, "resume")  # shared keys only
    check_architecture(step, None, "resume")  # nothing recorded on one side: nothing to compare


@pytest.mark.slow
def test_export_round_trip_matches_logits(adamw_ref, tmp_path, reseal):
    from transformers import AutoModelForCausalLM

    from muonrun.checkpoint.export import read_run_config
    from muonrun.model.build import build_hf_config

    step = adamw_ref / "checkpoints" / f"step-{STEPS}"
    hf = tmp_path / "hf"
    result = runner.invoke(app, ["export", str(step), str(hf)])  # in-process: no interpreter start-up
    assert result.exit_code == 0, result.output
    assert (hf / "config.json").is_file() and "byte-level tokenizer" in (hf / "README.md").read_text()
    model, info = AutoModelForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # The reference: DCP's own converter to a torch.save file, loaded into a model built from config.yaml.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(step, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    ref = AutoModelForCausalLM.from_config(build_hf_config(read_run_config(step).model, 257))
    missing, unexpected = ref.load_state_dict(
        {k.removeprefix("lm."): v for k, v in full.items()}, strict=False
    )
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding: saved once
    ids = torch.randint(0, 257, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref.eval()(ids).logits, rtol=0, atol=0)
    # With a Hugging Face tokenizer its files and its EOS id go into the export (generation stops there).
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"], show_progress=False)
    raw.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>", unk_token="<unk>")
    tok.save_pretrained(tmp_path / "tok")
    run = tmp_path / "run-hf-tok"
    shutil.copytree(adamw_ref, run)
    saved = run / "checkpoints" / f"step-{STEPS}" / "config.yaml"  # what export reads
    reseal(
        saved.parent,
        saved.name,
        saved.read_text().replace("tokenizer: byte", f"tokenizer: {tmp_path / 'tok'}"),
    )
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "hf-tok")])
    assert result.exit_code == 0, result.output
    exported = json.loads((tmp_path / "hf-tok" / "config.json").read_text())
    assert exported["eos_token_id"] == tok.eos_token_id is not None
    assert (tmp_path / "hf-tok" / "tokenizer.json").is_file()
    # Mistakes are one paragraph and exit code 2.
    partial = adamw_ref / "checkpoints" / "step-99.tmp"
    shutil.copytree(step, partial, ignore=shutil.ignore_patterns(META))
    try:
        for args, message in (
            ((str(partial), str(tmp_path / "x")), "incomplete"),
            ((str(tmp_path / "nowhere"), str(tmp_path / "y")), "does not exist"),
            ((str(step), str(hf)), "not empty"),
            ((str(step), str(hf / "config.json")), "is a file"),
            (
                (str(step), str(hf / "config.json" / "sub")),
                f"cannot be written: '{hf / 'config.json'}' is a file",
            ),
            ((str(step), str(adamw_ref / "checkpoints" / "step-100")), "is the checkpoint"),  # a run's own
        ):
            result = runner.invoke(app, ["export", *args])
            assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
            assert "Traceback" not in result.output
    finally:
        shutil.rmtree(partial)
    # a symlink to an empty folder: the export goes where it points, and the link still names it
    (tmp_path / "empty").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "empty")
    result = runner.invoke(app, ["export", str(step), str(tmp_path / "link")])
    assert result.exit_code == 0 and (tmp_path / "link").is_symlink(), result.output
    assert (tmp_path / "empty" / "config.json").is_file()


@pytest.mark.slow
def test_a_refused_resume_changes_nothing_and_export_reads_the_checkpoints_own_config(
    adamw_ref, tmp_path, reseal
):
    """A rerun with another architecture is refused (exit 2, naming the settings) and leaves the run's
    config.yaml, metrics and checkpoints as they were; export rebuilds the model from the config the
    checkpoint carries, so neither that rerun nor a hand edit of the run's config.yaml changes what it
    writes; a checkpoint without its own config whose run config no longer fits is refused, naming the
    first tensor that differs, and nothing is written."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    shutil.copytree(adamw_ref, run)
    step = run / "checkpoints" / f"step-{STEPS}"
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl")}
    checkpoints = tree(run / "checkpoints")
    # fewer layers (a load would read a subset of the tensors) and another split into heads (it would
    # read them all): neither fails a load, both are refused before it
    # one worker, in this process (`--nproc-per-node 1` runs it in the launcher's own)
    other = ("model.hf.num_hidden_layers=2", "model.hf.num_attention_heads=8")
    refused = runner.invoke(app, pretrain_args(run, *other, nproc=1))
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "saved by another model or optimizer" in text, refused.output[-3000:]
    assert "model.hf.num_hidden_layers: 4 -> 2; model.hf.num_attention_heads: 4 -> 8" in text, text
    assert "Traceback" not in refused.output
    assert {name: (run / name).read_bytes() for name in before} == before
    assert tree(run / "checkpoints") == checkpoints
    # a hand edit of the run's config.yaml: export reads the checkpoint's own copy
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("hidden_size: 128", "hidden_size: 64"))
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.hidden_size == 128
    # a checkpoint without its own config (an older muonrun's): the edited run config does not fit
    reseal(step, "config.yaml", None)
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "hf2")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "does not fit the qwen2 model its config describes" in text, text
    assert "'model.embed_tokens.weight' is (320, 128) in the checkpoint but (320, 64) in that model" in text
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # nothing written, no leftovers
    config.write_text("model: [unclosed\n")
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "hf3")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"Config file '{config}' is not valid YAML" in text, text
    assert "Traceback" not in result.output


def test_an_output_dir_inside_a_checkpoint_or_a_runs_checkpoints_exits_2_and_creates_nothing(tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step-20"
    _fake_checkpoint(step)
    (run / "config.yaml").write_text("name: run\n")
    for out, says in (
        (step, f"is the checkpoint '{step}'"),
        (step / "inner", f"is inside the checkpoint '{step}'"),
        (run / "checkpoints", f"is the checkpoints folder of the run in '{run}'"),
        (run / "checkpoints" / "new", f"is inside the checkpoints folder of the run in '{run}'"),
    ):
        before = tree(run)
        result = runner.invoke(app, ["pretrain", "tiny", f"output_dir={out}", "train.max_steps=1"])
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and says in text and "Traceback" not in result.output, result.output
        assert tree(run) == before  # nothing created, nothing touched


def _tiny_hf_model(folder: Path):
    """A randomly initialised transformers model with the tiny preset's architecture, saved as HF does."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from muonrun.config import load_config

    torch.manual_seed(1)
    hf_kwargs = dict(load_config("tiny").model.hf)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**hf_kwargs))
    model.save_pretrained(folder)
    return model.state_dict()


@pytest.mark.slow
def test_pretrained_init_is_loaded_into_the_shards(tmp_path):
    """model.init=pretrained on 2 workers (each reads its rows of the safetensors), one step with lr=0,
    export_at_end: the exported weights are the pretrained ones, bit for bit."""
    from safetensors.torch import load_file

    original = _tiny_hf_model(tmp_path / "pretrained")
    out = tmp_path / "run"
    text = ok(
        pretrain(
            out,
            "model.init=pretrained",
            f"model.name_or_path={tmp_path / 'pretrained'}",
            "optimizer.lr=0",
            "train.max_steps=1",
            "checkpoint.export_at_end=true",
        )
    )
    assert "model.init=pretrained" in text
    exported = load_file(out / "hf" / "model.safetensors")
    assert exported.keys() == {k for k in original if k != "lm_head.weight"}  # tied: saved once
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name


@pytest.mark.slow
def test_init_from_takes_weights_only(adamw_ref, tmp_path):
    out = tmp_path / "run"
    step = adamw_ref / "checkpoints" / f"step-{STEPS}"

    def in_process(*overrides: str) -> str:  # one worker, in this process (`--nproc-per-node 1`)
        result = runner.invoke(app, pretrain_args(out, *overrides, nproc=1))
        assert result.exit_code == 0, result.output[-3000:]
        return result.output

    text = in_process(
        f"checkpoint.init_from={step}", "optimizer.lr=0", "train.max_steps=1", "checkpoint.export_at_end=true"
    )
    assert "checkpoint.init_from" in text and sorted(losses(out)) == [1]  # step 1: a fresh optimizer and data
    from safetensors.torch import load_file

    exported = load_file(out / "hf" / "model.safetensors")
    trained = load_model_tensors(step)
    for name, tensor in exported.items():
        assert torch.equal(tensor, trained[name]), name
    # Rerunning the finished run trains nothing, says so, and exports again over its own export.
    (out / "hf" / "stale.txt").write_text("from the first export")
    again = [f"checkpoint.init_from={step}", "train.max_steps=1", "checkpoint.export_at_end=true"]
    text = in_process(*again)
    assert "Nothing to train: this run is complete at step 1" in text
    assert f"{out / 'hf'}: AutoModelForCausalLM.from_pretrained" in text  # the summary's export line
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("hf")) == ["hf"]
    assert not (out / "hf" / "stale.txt").exists() and (out / "hf" / "model.safetensors").exists()
    assert f'from_pretrained("{out / "hf"}")' in (out / "hf" / "README.md").read_text()  # not hf.new
