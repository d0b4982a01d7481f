"""A run writes, truncates and deletes only what is its own: its lock, control folder, metrics and config
are never written through a symbolic link (which could point at a user's file), a `checkpoints/` link
may lead to scratch storage but not into another run, pruning never deletes what a link points to; and
an output_dir that cannot work (a file where a folder must be, a name too long for the filesystem, a
line break) or a seed out of range exits 2 before any worker starts, with nothing written."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from muonrun.checkpoint.files import META, prune, seal, write_run_config
from muonrun.cli import app
from muonrun.errors import UserError
from muonrun.launch.lock import LOCK_FILE, RunLock
from muonrun.observe.sinks import JsonlSink
from muonrun.paths import own_folder

runner = CliRunner()


def pretrain(out: Path, *overrides: str):
    """A launch that the checks refuse before any worker starts (one in-process worker otherwise)."""
    result = runner.invoke(
        app, ["pretrain", "tiny", f"output_dir={out}", "data.seq_len=64", *overrides, "--nproc-per-node", "1"]
    )
    return result.exit_code, " ".join(result.output.split())


def refused(out: Path, says: str, *overrides: str) -> None:
    before = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    code, text = pretrain(out, *overrides)
    assert code == 2 and says in text and "Traceback" not in text, text
    assert (sorted(p.name for p in out.iterdir()) if out.is_dir() else None) == before  # nothing created


def test_muonruns_own_files_are_never_written_through_a_link(tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("precious")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "node-3" / "keep").mkdir(parents=True)
    for entry, what in ((LOCK_FILE, "the run folder's lock"), ("metrics.jsonl", "the run's metrics")):
        run = tmp_path / f"run-{what.split()[-1]}"
        run.mkdir()
        (run / entry).symlink_to(mine)
        refused(run, f"'{run / entry}' ({what}) is a symbolic link (to '{mine}')")
    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / LOCK_FILE).symlink_to(tmp_path / "created-by-nobody")
    refused(dangling, "is a symbolic link")
    control = tmp_path / "control"
    control.mkdir()
    (control / ".muonrun").symlink_to(elsewhere)  # its stale-folder clean-up would have emptied it
    refused(control, "(the launch's control folder) is a symbolic link")
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.yaml").symlink_to(mine)
    refused(config, "(the run's config) is a symbolic link")
    assert mine.read_text() == "precious" and not (tmp_path / "created-by-nobody").exists()
    assert (elsewhere / "node-3" / "keep").is_dir()

    # the writers themselves refuse a link, whoever calls them (a link made after the launcher's check)
    with pytest.raises(UserError, match="is a symbolic link"):
        RunLock(dangling).acquire()
    with pytest.raises(UserError, match="is a symbolic link"):
        JsonlSink(tmp_path / "run-metrics" / "metrics.jsonl")
    with pytest.raises(UserError, match="is a symbolic link"):
        own_folder(control / ".muonrun", "the launch's control folder")
    with pytest.raises(UserError, match="is a symbolic link"):
        write_run_config(config, "name: x\n")
    (config / "config.yaml").unlink()
    (config / ".config.yaml.tmp").symlink_to(mine)  # a leftover temporary name: removed, never followed
    write_run_config(config, "name: x\n")
    assert (config / "config.yaml").read_text() == "name: x\n" and not (config / ".config.yaml.tmp").exists()
    assert mine.read_text() == "precious"


def test_a_file_where_a_folder_belongs_and_the_reverse_exit_2_before_any_worker_starts(tmp_path):
    for entry, kind, says in (
        ("checkpoints", "file", "is a file, but a run keeps its checkpoints in a folder"),
        ("config.yaml", "folder", "(the run's config) is a folder: it must be a plain file"),
        ("metrics.jsonl", "folder", "(the run's metrics) is a folder: it must be a plain file"),
        (".muonrun", "file", "(the launch's control folder) is a file: it must be a folder"),
    ):
        run = tmp_path / entry.strip(".")
        run.mkdir()
        (run / entry).mkdir() if kind == "folder" else (run / entry).write_text("")
        refused(run, says)
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    os.mkfifo(pipe / "metrics.jsonl")  # opening it to append would wait for a reader forever
    refused(pipe, "is a named pipe (FIFO)")
    with pytest.raises(UserError, match="is a named pipe"):
        JsonlSink(pipe / "metrics.jsonl")


def test_checkpoints_may_link_to_scratch_but_not_into_another_run_or_its_scratch(tmp_path, monkeypatch):
    from muonrun.launch.run_folder import check_output_dir

    other = tmp_path / "runs" / "a"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("name: a\n")
    run = tmp_path / "runs" / "b"
    run.mkdir()
    (run / "checkpoints").symlink_to(other / "checkpoints")
    refused(run, f"is a symbolic link into the run folder '{other}'")
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(other)  # the run folder itself
    refused(run, f"is a symbolic link into the run folder '{other}'")
    (run / "checkpoints").unlink()
    (run / "checkpoints").symlink_to(tmp_path / "scratch" / "b")
    refused(run, "which does not exist: create that folder")
    (tmp_path / "scratch" / "b").mkdir(parents=True)
    check_output_dir(
        run, "b"
    )  # a plain folder elsewhere: accepted (a launch trains into it: test_train_state)
    # a second run linking to the same scratch folder: refused while the first's link points there
    from muonrun.launch.run_folder import OWNER_MARK, mark_checkpoints_owner

    (run / "config.yaml").write_text("name: b\n")
    mark_checkpoints_owner(run)  # what b's launch does under its lock
    assert (tmp_path / "scratch" / "b" / OWNER_MARK).read_text() == f"{run.resolve()}\n"
    third = tmp_path / "runs" / "c"
    third.mkdir()
    (third / "checkpoints").symlink_to(tmp_path / "scratch" / "b")
    refused(third, f"which holds the checkpoints of the run '{run.resolve()}' (its checkpoints/ links there")
    check_output_dir(run, "b")  # its owner goes on
    (run / "checkpoints").unlink()  # b's link moved away: the mark is stale, c may take the folder
    check_output_dir(third, "c")
    import muonrun.launch.run_folder as run_folder

    def unwritable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")  # a read-only scratch folder (root writes anyway)

    monkeypatch.setattr(run_folder, "open_own", unwritable)
    with pytest.raises(UserError, match=r"links to '.*scratch/b', where this run cannot write \(Permission"):
        mark_checkpoints_owner(third)
    (run / "checkpoints").symlink_to(run / "elsewhere-in-itself")
    (run / "elsewhere-in-itself").mkdir()
    check_output_dir(run, "b")


def test_pruning_removes_a_linked_checkpoint_but_never_what_it_points_to(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        path = root / f"step-{step}" if step != 2 else tmp_path / "kept-elsewhere" / "step-2"
        path.mkdir(parents=True)
        (path / "data").write_text("x")
        (path / META).write_text(
            json.dumps(seal({"step": step, "files": {"data": {"bytes": 1, "sha256": ""}}}))
        )
    (root / "step-2").symlink_to(tmp_path / "kept-elsewhere" / "step-2")
    assert [p.name for p in prune(root, keep_last=2)] == ["step-2"]
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-6"]
    assert (tmp_path / "kept-elsewhere" / "step-2" / "data").read_text() == "x"


def test_a_lock_file_that_cannot_be_opened_is_named(tmp_path, monkeypatch):
    """A read-only or immutable lock file (root passes permission checks, so the refusal is simulated)."""
    from muonrun import paths

    (tmp_path / LOCK_FILE).write_text("")
    real_open = os.open

    def refuse(path, flags, mode=0o777):
        if str(path).endswith(LOCK_FILE):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(paths.os, "open", refuse)
    with pytest.raises(UserError) as e:
        RunLock(tmp_path).acquire()
    text = str(e.value)
    assert (
        f"lock file '{tmp_path / LOCK_FILE}' cannot be opened for writing (Operation not permitted)" in text
    )
    assert "chattr -i" in text


def test_a_seed_out_of_range_a_name_too_long_and_a_line_break_exit_2_before_any_worker_starts(tmp_path):
    run = tmp_path / "run"
    for seed in ("-1", str(2**70)):
        refused(
            run, f"Config key 'train.seed' is {seed}; it must be in 0 .. 2**32 - 1.", f"train.seed={seed}"
        )
    code, text = pretrain(tmp_path / "runs" / "${name}", "name=" + "n" * 300)
    assert code == 2 and "Config key 'name' makes the folder name 'nnn" in text, text
    assert "300 bytes long, but this filesystem allows at most 255 per name" in text
    code, text = pretrain(tmp_path / ("n" * 300))
    assert code == 2 and "Config key 'output_dir' makes the folder name" in text, text
    code, text = pretrain(tmp_path / "a\nb")
    assert code == 2 and "Override 'output_dir' has a line break in its value" in text, text
    code, text = pretrain(tmp_path, r'output_dir="' + str(tmp_path) + r'/a\tb"')
    assert code == 2 and "Config key 'output_dir' holds a control character" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == []
