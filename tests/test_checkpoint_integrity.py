"""Nothing silent about checkpoints: damaged files are found before anything is loaded, a resume falls
back to the newest intact checkpoint with the losses an uninterrupted run has, pruning never takes the
last good one, no file of a checkpoint can run code when loaded, and Ctrl-C saves and stops.

Run: pytest tests/test_checkpoint_integrity.py -q
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import STEPS, assert_same_losses, cli_env, ok, pretrain, pretrain_args, spawned_workers, steps_of
from typer.testing import CliRunner

from muonrun.checkpoint import META, read_meta, verify
from muonrun.checkpoint.files import hash_files, prune, seal
from muonrun.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """An uninterrupted 2-worker run with checkpoints at steps 2, 4, 6 and 8: asynchronous saves, so the
    checks below also cover manifests of files hashed behind training."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    text = ok(pretrain(out, "checkpoint.interval=2", "checkpoint.keep_last=4", "checkpoint.async_save=true"))
    assert steps_of(out) == [2, 4, 6, 8]
    assert all(f"step-{s} saved (written and hashed in the background" in text for s in (2, 4, 6)), text
    assert "step-8 saved (written in" in text  # the last save is synchronous (the run ends right after)
    return out


def copy_of(ref: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(ref, out)
    return out


def zero_bytes(path: Path, count: int = 4096) -> None:
    """Overwrite `count` bytes in the middle of a file with zeros (its size stays)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + count] = bytes(min(count, len(data) - middle))
    path.write_bytes(bytes(data))


def biggest_distcp(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def reseal(checkpoint: Path) -> None:
    """Rewrite the manifest to match the folder as it is now: what someone planting a file would do."""
    meta = read_meta(checkpoint)
    meta.pop("manifest_sha256")
    meta["files"] = hash_files(p for p in checkpoint.iterdir() if p.name != META)
    (checkpoint / META).write_text(json.dumps(seal(meta)))


def cli(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, " ".join(result.output.split())


# -- finding damage ---------------------------------------------------------------------------------


def test_every_kind_of_damage_is_found_and_named(ref, tmp_path):
    run = copy_of(ref, tmp_path)
    checkpoints = {s: run / "checkpoints" / f"step-{s}" for s in (2, 4, 6, 8)}
    assert all(verify(c).ok for c in checkpoints.values())
    code, text = cli("checkpoint", "verify", str(run))
    assert code == 0 and text.count("all checksums match") == 4

    zeroed = biggest_distcp(checkpoints[8])
    zero_bytes(zeroed)
    with open(checkpoints[6] / "rank1.pt", "r+b") as f:  # truncated
        f.truncate(100)
    zero_bytes(checkpoints[4] / ".metadata", 64)
    (checkpoints[2] / "stray.bin").write_bytes(b"x")
    problems = {s: " ".join(verify(c).problems) for s, c in checkpoints.items()}
    assert f"{zeroed.name} has other contents than its save wrote" in problems[8]
    assert "rank1.pt has 100 bytes, its save wrote" in problems[6]
    assert ".metadata has other contents" in problems[4]
    assert "stray.bin is not one of the files its save wrote" in problems[2]

    code, text = cli("checkpoint", "verify", str(checkpoints[8]), str(checkpoints[6]))
    assert code == 1 and zeroed.name in text and "rank1.pt" in text and "step-8' is damaged" in text

    # the manifest itself: an edited number no longer matches the manifest's own checksum
    meta = checkpoints[8] / META
    meta.write_text(meta.read_text().replace(f'"step": {STEPS}', '"step": 7', 1))
    assert "does not match its own checksum" in " ".join(verify(checkpoints[8]).problems)

    # a step-N folder is published whole: one that lost its manifest or DCP's .metadata is damaged,
    # never passed over as if it were an interrupted save
    (checkpoints[2] / META).unlink()
    code, text = cli("checkpoint", "verify", str(run))
    assert code == 1 and "step-2' is damaged: muonrun.json cannot be trusted" in text, text


def test_pruning_never_takes_the_last_intact_checkpoint(ref, tmp_path):
    root = copy_of(ref, tmp_path) / "checkpoints"
    for step in (6, 8):  # the two newest lose a file's tail (a size the cheap pre-prune check sees)
        with open(biggest_distcp(root / f"step-{step}"), "r+b") as f:
            f.truncate(1000)
    assert prune(root, keep_last=2) == []  # only step-2 and step-4 are intact: both stay
    assert steps_of(root.parent) == [2, 4, 6, 8]
    assert [p.name for p in prune(root, keep_last=1)] == ["step-2"]  # the damaged ones are never pruned
    assert steps_of(root.parent) == [4, 6, 8]


# -- falling back ------------------------------------------------------------------------------------


def test_an_export_says_when_its_checkpoint_was_pruned_or_the_disk_ran_out(ref, tmp_path, monkeypatch):
    """A training in the run folder pruned the checkpoint export was reading (during its verification, or
    while it read the tensors): said as such, not "damaged". Out of room: one paragraph, nothing left."""
    from muonrun.checkpoint import export

    def pruning(real):
        def first_pruned(checkpoint, *args, **kwargs):
            gone = checkpoint.with_name(f"{checkpoint.name}.deleting")  # as prune() renames, then deletes
            checkpoint.rename(gone)
            shutil.rmtree(gone)
            return real(checkpoint, *args, **kwargs)

        return first_pruned

    for stage in ("verify", "load_model_tensors"):
        run = copy_of(ref, tmp_path / stage)
        with monkeypatch.context() as m:
            m.setattr(export, stage, pruning(getattr(export, stage)))
            code, text = cli("export", str(run / "checkpoints" / "step-4"), str(tmp_path / f"hf-{stage}"))
        assert code == 2 and "step-4' was deleted while export read it: a training running in its run" in text
        assert "damaged" not in text and not (tmp_path / f"hf-{stage}").exists(), text

    limited = subprocess.run(  # a file-size limit in the exporting process: safetensors' write fails
        [sys.executable, "-m", "muonrun", "export", str(ref), str(tmp_path / "hf")],
        capture_output=True, text=True, env=cli_env(), timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, resource.RLIM_INFINITY)),
    )  # fmt: skip
    text = " ".join(limited.stderr.split())
    assert (
        limited.returncode == 2 and "Exporting into" in text and "a file outgrew the file-size limit" in text
    )
    assert "the file-size limit (ulimit -f) is 256.0 KiB" in text and "Traceback" not in limited.stderr, text
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".hf", "hf"))]


@pytest.mark.slow
def test_resume_skips_damaged_checkpoints_and_matches_an_uninterrupted_run(ref, tmp_path):
    run = copy_of(ref, tmp_path)
    ck = run / "checkpoints"
    # as if the copied run had been cut short after step 4's checkpoint: its log ends there
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= 4))
    zeroed = biggest_distcp(ck / "step-8")
    zero_bytes(zeroed)  # silent damage: same size, other bytes
    with open(ck / "step-6" / "rank0.pt", "r+b") as f:
        f.truncate(10)
    text = " ".join(ok(pretrain(run, "checkpoint.interval=2", "checkpoint.keep_last=2")).split())
    assert f"step-8' is damaged: {zeroed.name} has other contents than its save wrote" in text
    assert "step-6' is damaged: rank0.pt has 10 bytes" in text
    assert "resuming from" in text and "step-4, the newest checkpoint that verifies" in text
    assert_same_losses(run, ref, first=5)
    # set aside (not deleted) when the run saved their steps again; the new ones are intact
    assert (ck / "step-6.damaged").is_dir() and (ck / "step-8.damaged").is_dir()
    assert steps_of(run) == [6, 8] and all(verify(ck / f"step-{s}").ok for s in (6, 8))


@pytest.mark.slow
def test_going_back_with_resume_from_then_a_preemption_continues_the_new_line(ref, tmp_path):
    """checkpoint.resume_from an earlier step of the run's own folder: the later checkpoints, which
    continue the training it went back from, are set aside (not deleted), so neither a plain rerun nor
    the same command after a preemption resumes them; the same command continues its own line (not
    its start again, which pruning may since have taken), with an uninterrupted run's losses."""
    run = copy_of(ref, tmp_path)
    ck = run / "checkpoints"
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r.get("step", 0) <= 2))
    back = [f"checkpoint.resume_from={ck / 'step-2'}", "checkpoint.interval=2", "checkpoint.keep_last=2"]
    text = " ".join(ok(pretrain(run, *back, fault="term@3")).split())
    assert "resumed from" in text and "step-2 at step 2" in text
    assert "step-6.abandoned, not deleted" in text and "step-8.abandoned, not deleted" in text
    assert (
        steps_of(run) == [2, 4] and (ck / "step-6.abandoned").is_dir() and (ck / "step-8.abandoned").is_dir()
    )
    (ck / "step-2").rename(ck / "step-2.gone")  # as if pruning had taken the line's start
    text = " ".join(ok(pretrain(run, *back)).split())
    assert "continues from its own latest, step-4" in text and "step-4 at step 4" in text
    assert_same_losses(run, ref, first=3)
    assert steps_of(run) == [6, 8] and all(verify(ck / f"step-{s}").ok for s in (6, 8))


def test_damaged_explicit_checkpoints_and_no_intact_one_exit_2(ref, tmp_path):
    run = copy_of(ref, tmp_path)
    ck = run / "checkpoints"
    for step in (2, 4, 6, 8):
        zero_bytes(biggest_distcp(ck / f"step-{step}"))
    name = biggest_distcp(ck / "step-8").name
    base = ["pretrain", "tiny", "--nproc-per-node", "1", "data.seq_len=64", "train.eval_interval=0"]
    code, text = cli(*base, f"output_dir={tmp_path / 'b'}", f"checkpoint.resume_from={ck / 'step-8'}")
    assert code == 2 and "step-8' is damaged" in text and name in text
    code, text = cli(*base, f"output_dir={tmp_path / 'c'}", f"checkpoint.init_from={ck / 'step-8'}")
    assert code == 2 and "step-8' is damaged" in text and name in text
    code, text = cli("export", str(ck / "step-8"), str(tmp_path / "hf"))
    assert code == 2 and "step-8' is damaged" in text and name in text and not (tmp_path / "hf").exists()
    code, text = cli(*base, f"output_dir={run}")  # every checkpoint damaged: never a silent fresh start
    assert code == 2 and "No checkpoint in" in text and "step-2, step-4, step-6, step-8" not in text
    assert "cannot resume" in text and not list((run / "checkpoints").glob("*.damaged"))


def test_a_checkpoint_without_a_manifest_is_damaged(ref, tmp_path):
    """A muonrun.json without its file list and checksum: nothing vouches for the files, so nothing loads it."""
    run = copy_of(ref, tmp_path)
    step = run / "checkpoints" / f"step-{STEPS}"
    meta = json.loads((step / META).read_text())
    (step / META).write_text(
        json.dumps({k: v for k, v in meta.items() if k not in ("files", "manifest_sha256")})
    )
    assert not verify(step).ok
    code, text = cli("checkpoint", "verify", str(step))
    assert code == 1 and "damaged" in text and META in text
    code, text = cli("export", str(step), str(tmp_path / "hf"))
    assert code == 2 and "damaged" in text and not (tmp_path / "hf").exists()


# -- loading never runs code ---------------------------------------------------------------------------


class PlantedPayload:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_file_never_runs_code(ref, tmp_path):
    """Each door a checkpoint is read through, with the planted file's checksum written into the
    manifest (so the refusal comes from the safe loading, not from verification)."""
    marker = tmp_path / "marker"
    payload = pickle.dumps(PlantedPayload(marker))
    base = ["pretrain", "tiny", "--nproc-per-node", "1", "data.seq_len=64", "train.eval_interval=0"]

    # 1. DCP's .metadata: resume, init_from and export all read it
    run = copy_of(ref, tmp_path / "meta")
    step = run / "checkpoints" / f"step-{STEPS}"
    (step / ".metadata").write_bytes(payload)
    reseal(step)
    for args in (
        [*base, f"output_dir={run}"],
        [*base, f"output_dir={tmp_path / 'init'}", f"checkpoint.init_from={step}"],
        ["export", str(step), str(tmp_path / "hf")],
    ):
        code, text = cli(*args)
        assert code == 2 and ".metadata' was refused" in text and "posix.system" in text, (args, text)
        assert not marker.exists()
    # two workers: the refusal alone, without DCP's tracebacks as it looks for per-rank metadata first
    result = pretrain(run)
    assert result.returncode == 2 and ".metadata' was refused" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr and not marker.exists()

    # 2. a rank's data-loader/RNG file
    run = copy_of(ref, tmp_path / "rank")
    step = run / "checkpoints" / f"step-{STEPS}"
    (step / "rank0.pt").write_bytes(payload)
    reseal(step)
    code, text = cli(*base, f"output_dir={run}")
    assert code == 2 and "rank0.pt' was refused" in text and not marker.exists()

    # 3. one of DCP's non-tensor items (the step count), pointed at a planted file
    run = copy_of(ref, tmp_path / "item")
    step = run / "checkpoints" / f"step-{STEPS}"
    with open(step / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own, trusted file
    buffer = step / "planted.distcp"
    torch.save(PlantedPayload(marker), buffer)
    index = next(i for i in metadata.storage_data if i.fqn == "train.step")
    info = metadata.storage_data[index]
    metadata.storage_data[index] = type(info)(
        relative_path="planted.distcp", offset=0, length=buffer.stat().st_size
    )
    with open(step / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    reseal(step)
    code, text = cli(*base, f"output_dir={run}")
    assert code == 2 and "planted.distcp' was refused" in text and "'train.step'" in text, text
    assert not marker.exists()


# -- Ctrl-C -------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_saves_and_stops_and_twice_stops_at_once(tmp_path):
    """Ctrl-C in a terminal reaches every process of the job, the workers too, and here while they still
    import, before they can ignore it (they start with it blocked): it is still one stop request, saved
    after the first step or two. Twice (MUONRUN_FAULT=int2@3: rank 0 sends two after step 3) stops at once."""
    once = subprocess.Popen(  # its own process group, as a terminal's foreground job
        [sys.executable, "-m", "muonrun", *pretrain_args(tmp_path / "once")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(), start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + (240 if Path("/proc/self/task").is_dir() else 3)  # Linux: as they spawn
        while spawned_workers(once.pid) < 2 and once.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(once.pid, signal.SIGINT)
        text, _ = once.communicate(timeout=300)
    finally:
        if once.poll() is None:
            once.kill()
    assert once.returncode == 0, text[-3000:]
    assert "Ctrl-C: the workers save a checkpoint within two steps" in text, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text and "failed" not in text, text[-3000:]
    stopped = steps_of(tmp_path / "once")
    assert stopped in ([1], [2]) and f"Stopped by signal after step {stopped[0]}" in text, text[-3000:]
    result = pretrain(tmp_path / "twice", fault="int2@3", nproc=1)
    assert result.returncode == 130, result.stderr[-2000:]
    assert "stopped by Ctrl-C" in result.stderr and "Traceback" not in result.stdout + result.stderr
