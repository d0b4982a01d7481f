"""`muonrun compare`: run loading (labels, resumes), the table's numbers, the PNG, and user errors."""

from __future__ import annotations

import json
import struct
import sys

import pytest
from typer.testing import CliRunner

from muonrun.cli import app
from muonrun.errors import UserError
from muonrun.tools.compare import (
    MARK,
    compare,
    ema,
    folder_suffixes,
    load_run,
    markdown_table,
    summarize,
    tell_apart,
)


def write_run(folder, rows, config: str | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    )
    if config is not None:
        (folder / "config.yaml").write_text(config)
    return folder


def train_row(step, loss, time, tokens_per_s=100.0, mfu=None):
    return {
        "step": step,
        "loss": loss,
        "tokens_seen": step * 100,
        "tokens_per_s": tokens_per_s,
        "mfu": mfu,
        "step_time": 1.0,
        "time": time,
    }


@pytest.fixture
def two_runs(tmp_path):
    a = write_run(
        tmp_path / "a",
        [
            {
                "event": "start",
                "step": 0,
                "tokens_seen": 0,
                "time": 1000.0,
                "name": "ignored",
                "optimizer": "x",
            },
            train_row(10, 4.0, 1010.0, 100.0, 0.1),
            train_row(20, 3.0, 1020.0, 200.0, 0.2),
            {"step": 20, "tokens_seen": 2000, "eval_loss": 3.1, "eval_ppl": 22.2, "time": 1021.0},
            train_row(30, 2.5, 1030.0, 210.0, 0.3),
            train_row(40, 2.2, 1040.0, 220.0, 0.4),
            {"step": 40, "tokens_seen": 4000, "eval_loss": 2.4, "eval_ppl": 11.0, "time": 1041.0},
        ],
        config="name: a-adamw\noptimizer:\n  name: adamw\n",
    )
    b = write_run(
        tmp_path / "b",
        [
            {
                "event": "start",
                "step": 0,
                "tokens_seen": 0,
                "time": 2000.0,
                "name": "b-muon",
                "optimizer": "muon",
            },
            train_row(10, 3.5, 2020.0, 90.0),
            train_row(20, 2.6, 2040.0, 80.0),
            train_row(30, 2.1, 2060.0, 70.0),
            train_row(40, 1.9, 2080.0, 60.0),
        ],
    )
    return a, b


def test_load_run_labels_from_config_then_start_row(two_runs):
    a, b = (load_run(p) for p in two_runs)
    assert (a.name, a.optimizer, a.label) == ("a-adamw", "adamw", "adamw (a-adamw)")
    assert (b.name, b.optimizer) == ("b-muon", "muon")  # no config.yaml: the start row
    assert [r["step"] for r in a.train] == [10, 20, 30, 40] and len(a.evals) == 2
    assert a.wall == [10.0, 20.0, 30.0, 40.0] and b.wall == [20.0, 40.0, 60.0, 80.0]


def one_config_run(folder, losses):
    """A run of the config named `tiny` (config.yaml and start row): one of several launches of a preset."""
    start = {"event": "start", "step": 0, "tokens_seen": 0, "time": 0.0, "name": "tiny", "optimizer": "muon"}
    rows = [train_row(10 * (i + 1), loss, float(i + 1)) for i, loss in enumerate(losses)]
    return write_run(folder, [start, *rows], config="name: tiny\noptimizer:\n  name: muon\n")


def test_runs_sharing_a_name_are_labelled_by_their_folder(tmp_path, two_runs, capsys):
    """Three runs of one config would be three identical `muon (tiny)` columns and legend entries: they
    are told apart by their run folder; a run whose name is its own keeps it."""
    folders = [
        one_config_run(tmp_path / "lr-0.01", [4.0, 3.0]),
        one_config_run(tmp_path / "lr-0.02", [4.0, 2.5]),
        one_config_run(tmp_path / "lr-0.04", [4.0, 2.8]),
    ]
    rows = compare([*folders, two_runs[0]], tmp_path / "cmp.png", smoothing=0.0)
    assert [r["run"] for r in rows] == ["lr-0.01", "lr-0.02", "lr-0.04", "a-adamw"]
    assert (tmp_path / "cmp.md").read_text().splitlines()[0] == "| | lr-0.01 | lr-0.02 | lr-0.04 | a-adamw |"
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("lr-0.01", "lr-0.02", "lr-0.04", "a-adamw"))

    runs = [load_run(f) for f in folders]
    tell_apart(runs)
    assert [r.label for r in runs] == ["muon (lr-0.01)", "muon (lr-0.02)", "muon (lr-0.04)"]


def test_folders_with_one_name_are_labelled_with_their_parent(tmp_path):
    runs = [
        load_run(one_config_run(tmp_path / "node-a" / "run", [4.0, 3.0])),
        load_run(one_config_run(tmp_path / "node-b" / "run", [4.0, 2.0])),
        load_run(one_config_run(tmp_path / "node-b" / "other", [4.0, 2.0])),
    ]
    tell_apart(runs)
    assert [r.label for r in runs] == ["muon (node-a/run)", "muon (node-b/run)", "muon (other)"]
    # One path ends the other: the shorter needs its parent's parent to differ.
    suffixes = folder_suffixes([tmp_path / "x" / "a", tmp_path / "y" / "x" / "a"])
    assert suffixes == [f"{tmp_path.name}/x/a", "y/x/a"]


def test_summary_numbers(two_runs):
    rows, target = summarize([load_run(p) for p in two_runs], smoothing=0.0)
    a, b = rows
    assert target == 2.2  # the worse run's final loss
    assert (a["final_loss"], b["final_loss"]) == (2.2, 1.9)
    assert a["best_eval_loss"] == 2.4 and b["best_eval_loss"] is None
    assert a["tokens_per_s"] == 210.0 and b["tokens_per_s"] == 70.0  # medians without the first row
    assert a["mfu"] == pytest.approx(0.3) and b["mfu"] is None
    assert (a["steps_to_target"], a["tokens_to_target"], a["time_to_target"]) == (40, 4000, 40.0)
    assert (b["steps_to_target"], b["tokens_to_target"], b["time_to_target"]) == (30, 3000, 60.0)
    assert a["token_speedup"] == 1.0 and b["token_speedup"] == pytest.approx(4 / 3)
    md = markdown_table(rows, target, 0.0).splitlines()
    assert md[:2] == ["| | a-adamw | b-muon |", "|---|---:|---:|"]
    expected = {
        "optimizer": "adamw | muon",
        "final loss": "2.2000 | 1.9000",
        "best eval loss": "2.4000 | -",
        "tokens/s": "210 | 70",
        "MFU": "30.0% | -",
        "steps to target": "40 | 30",
        "tokens to target": "4,000 | 3,000",
        "time to target (s)": "40.0 | 60.0",
        "token speed-up": "1.00x | 1.33x",
    }
    for title, cells in expected.items():
        assert f"| {title} | {cells} |" in md


def test_smoothed_target_uses_the_ema(two_runs):
    runs = [load_run(p) for p in two_runs]
    rows, target = summarize(runs, smoothing=0.5)
    assert target == pytest.approx(ema([4.0, 3.0, 2.5, 2.2], 0.5)[-1])
    assert rows[0]["final_loss"] == 2.2 and rows[0]["final_loss_smoothed"] == pytest.approx(target)


def test_ema_is_bias_corrected():
    assert ema([1.0, 1.0, 1.0], 0.9) == pytest.approx([1.0, 1.0, 1.0])
    assert ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 5.0 / 0.75])
    assert ema([3.0, 1.0], 0.0) == [3.0, 1.0]


def test_resumed_run_drops_replayed_rows_and_continues_wall_time(tmp_path, capsys):
    folder = write_run(
        tmp_path / "r",
        [
            {"event": "start", "step": 0, "time": 0.0, "name": "r", "optimizer": "adamw"},
            train_row(1, 4.0, 1.0),
            train_row(2, 3.0, 2.0),
            train_row(3, 9.9, 3.0),  # logged, then the job died before the next checkpoint
            {"step": 3, "eval_loss": 9.0, "time": 3.5},
            "not json: the last line of a killed writer",
            {"event": "start", "step": 2, "time": 100.0, "name": "r", "optimizer": "adamw"},
            train_row(3, 2.5, 101.0),
            train_row(4, 2.0, 103.0),
        ],
    )
    run = load_run(folder)
    assert "skipped 1 unreadable line" in capsys.readouterr().err
    assert [(r["step"], r["loss"]) for r in run.train] == [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]
    assert run.evals == [] and run.wall == [1.0, 2.0, 3.0, 5.0]


def test_compare_writes_png_and_markdown(two_runs, tmp_path, capsys):
    out = tmp_path / "fig" / "cmp.png"
    rows = compare(list(two_runs), out, smoothing=0.0)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1800, 552) and len(data) > 20_000
    md = (tmp_path / "fig" / "cmp.md").read_text()
    assert md == markdown_table(rows, 2.2, 0.0) + MARK  # marked as compare's own, which a rerun replaces
    printed = capsys.readouterr().out
    assert "a-adamw" in printed and "b-muon" in printed and "1.33x" in printed
    assert f"Wrote {out} (the plot)\n" in printed
    assert f"Wrote {out.with_suffix('.md')} (the table as Markdown)\n" in printed

    compare(list(two_runs), out, smoothing=0.0)
    printed = capsys.readouterr().out
    assert f"Wrote {out} (the plot, replacing the earlier file)\n" in printed
    assert f"Wrote {out.with_suffix('.md')} (the table as Markdown, replacing the earlier file)\n" in printed


def test_compare_never_replaces_a_file_it_did_not_write_unless_forced(two_runs, tmp_path):
    notes, elsewhere = tmp_path / "notes.md", tmp_path / "elsewhere.png"
    notes.write_text("my notes\n")
    elsewhere.write_bytes(b"not a plot")
    (tmp_path / "plot.png").symlink_to(elsewhere)
    for out, foreign in ((tmp_path / "notes.png", notes), (tmp_path / "plot.png", tmp_path / "plot.png")):
        result = CliRunner().invoke(app, ["compare", *map(str, two_runs), "--out", str(out)])
        text = " ".join(result.output.split())
        assert (
            result.exit_code == 2
            and f"would replace '{foreign}', which `muonrun compare` did not write" in text
        )
        assert "--force" in text and not out.with_suffix(".md" if out.name == "plot.png" else ".png").exists()
    assert notes.read_text() == "my notes\n" and elsewhere.read_bytes() == b"not a plot"
    result = CliRunner().invoke(
        app, ["compare", *map(str, two_runs), "--out", str(tmp_path / "plot.png"), "--force"]
    )
    assert (
        result.exit_code == 0 and elsewhere.read_bytes() == b"not a plot"
    )  # the link replaced, not followed
    assert not (tmp_path / "plot.png").is_symlink()
    compare(list(two_runs), tmp_path / "notes.png", force=True)
    assert notes.read_text().startswith("| |")
    compare(list(two_runs), tmp_path / "notes.png")  # its own files now: replaced without --force


def test_cli_compare(two_runs, tmp_path, monkeypatch):
    out = tmp_path / "c.png"
    result = CliRunner().invoke(
        app, ["compare", *map(str, two_runs), "--out", str(out), "--smoothing", "0.5"]
    )
    assert result.exit_code == 0, result.output
    assert out.is_file() and out.with_suffix(".md").is_file()

    # Without --out: compare.png in the current folder, and the output says which folder that is.
    monkeypatch.chdir(tmp_path / "a")
    result = CliRunner().invoke(app, ["compare", *map(str, two_runs)])
    assert result.exit_code == 0, result.output
    assert f"Wrote {tmp_path / 'a' / 'compare.png'} (the plot)" in result.output
    assert f"Wrote {tmp_path / 'a' / 'compare.md'} (the table as Markdown)" in result.output
    assert (tmp_path / "a" / "compare.png").is_file()


def test_user_errors(tmp_path, two_runs):
    with pytest.raises(UserError, match="'.*missing' does not exist"):
        compare([tmp_path / "missing"], tmp_path / "x.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="'.*empty' has no metrics.jsonl"):
        compare([tmp_path / "empty"], tmp_path / "x.png")
    write_run(
        tmp_path / "started", [{"event": "start", "step": 0, "time": 0.0, "name": "s", "optimizer": "adamw"}]
    )
    with pytest.raises(UserError, match="'.*started' has no logged training steps"):
        compare([tmp_path / "started"], tmp_path / "x.png")
    with pytest.raises(UserError, match="smoothing"):
        compare(list(two_runs), tmp_path / "x.png", smoothing=1.0)
    with pytest.raises(UserError, match=r"\.png"):
        compare(list(two_runs), tmp_path / "x.pdf")
    (tmp_path / "afile").write_text("")
    with pytest.raises(UserError, match=r"cannot be written: '.*afile' is a file"):
        compare(list(two_runs), tmp_path / "afile" / "x.png")
    with pytest.raises(UserError, match=r"'.*a/' is given twice \(also as '.*a'\)"):
        compare([two_runs[0], two_runs[1], f"{two_runs[0]}/"], tmp_path / "x.png")
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "missing")])
    assert result.exit_code == 2 and "does not exist" in result.output
    timeless = {k: v for k, v in train_row(2, 3.0, 5.0).items() if k != "time"}
    write_run(tmp_path / "edited", [train_row(1, 4.0, 4.0), timeless])
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "edited"), "-o", str(tmp_path / "e.png")])
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "metrics.jsonl' line 2 is a training row that has no 'time'" in text


def test_missing_matplotlib_is_a_user_error(two_runs, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    with pytest.raises(UserError, match=r"pip install 'muonrun\[plot\]'"):
        compare(list(two_runs), tmp_path / "x.png")


def test_eval_target_when_every_run_evaluated(tmp_path, two_runs):
    """With evals in every run, the worse final eval loss is a second target, read at the evals; a
    NorMuon run is labelled by its variant."""
    evals = [
        {"step": 20, "tokens_seen": 2000, "eval_loss": 2.9, "time": 2041.0},
        {"step": 40, "tokens_seen": 4000, "eval_loss": 2.0, "time": 2081.0},
    ]
    rows = [json.loads(line) for line in (two_runs[1] / "metrics.jsonl").read_text().splitlines()]
    nor = write_run(
        tmp_path / "nor",
        rows + evals,
        config="name: nor\noptimizer:\n  name: muon\n  muon:\n    variant: normuon\n",
    )
    assert load_run(nor).label == "normuon (nor)"
    (a, b), _ = summarize([load_run(two_runs[0]), load_run(nor)], smoothing=0.0)
    assert a["eval_target"] == b["eval_target"] == 2.4  # a's final eval loss is the worse one
    assert (a["tokens_to_eval_target"], b["tokens_to_eval_target"]) == (4000, 4000)  # b: 2.9 > 2.4 at 2000
    nor_early = write_run(tmp_path / "early", rows + [{**evals[0], "eval_loss": 2.3}, evals[1]])
    (_, early), _ = summarize([load_run(two_runs[0]), load_run(nor_early)], smoothing=0.0)
    assert early["tokens_to_eval_target"] == 2000
    md = markdown_table(*summarize([load_run(two_runs[0]), load_run(nor_early)], 0.0), 0.0)
    assert "| tokens to eval target | 4,000 | 2,000 |" in md
    rows_without, _ = summarize([load_run(p) for p in two_runs], smoothing=0.0)
    assert all("eval_target" not in row for row in rows_without)  # b never evaluated


def test_downstream_accuracy_at_equal_tokens_and_harness_results_get_rows_and_a_panel_each(tmp_path):
    def acc_row(step, tokens, rev, last, loss=None):
        row = {"step": step, "tokens_seen": tokens, "eval_time": 1.0, "time": 1.0 + step}
        row.update({"eval_acc_rev": rev, "eval_acc_norm_rev": rev, "eval_acc_last": last})
        row.update({"eval_acc_norm_last": last / 2, "eval_acc_mean": (rev + last) / 2})
        row["eval_acc_norm_mean"] = (rev + last / 2) / 2
        return row if loss is None else {**row, "eval_loss": loss}

    start = {"event": "start", "step": 0, "tokens_seen": 0, "time": 0.0, "name": "x", "optimizer": "adamw"}
    a = write_run(
        tmp_path / "a",
        [
            start,
            train_row(10, 3.0, 10.0),
            acc_row(10, 1000, 0.6, 0.2),
            train_row(20, 2.0, 20.0),
            acc_row(20, 2000, 0.8, 0.3),
        ],
        config="name: a\noptimizer:\n  name: adamw\n",
    )
    # b evaluated at other token counts (a larger batch), its eval loss beside the accuracies
    b = write_run(
        tmp_path / "b",
        [
            start,
            train_row(10, 2.5, 10.0),
            acc_row(10, 1500, 0.7, 0.25, loss=2.6),
            train_row(20, 1.5, 20.0),
            acc_row(20, 3000, 0.9, 0.4, loss=1.6),
        ],
        config="name: b\noptimizer:\n  name: muon\n",
    )
    harness = {
        "event": "harness",
        "task": "rev",
        "step": 20,
        "tokens_seen": 2000,
        "acc": 0.75,
        "acc_norm": 0.7,
    }
    (a / "harness.jsonl").write_text(
        json.dumps(harness) + "\n" + json.dumps({**harness, "task": "arc_easy"}) + "\n"
    )
    out = tmp_path / "c.png"
    rows = compare([a, b], out, smoothing=0.0)
    # the largest token count both evaluated at is 2,000: a's eval there, b's last at or before it (1,500)
    assert (
        rows[0]["downstream:rev acc at 2,000 tokens"] == 0.8
        and rows[1]["downstream:rev acc at 2,000 tokens"] == 0.7
    )
    assert rows[1]["downstream:last acc_norm at 2,000 tokens"] == 0.125
    assert rows[0]["downstream:rev acc, lm-evaluation-harness"] == "0.750 (step 20)"
    assert "downstream:rev acc, lm-evaluation-harness" not in rows[1]
    assert rows[0]["downstream:arc_easy acc_norm, lm-evaluation-harness"] == "0.700 (step 20)"
    assert rows[0]["best_eval_loss"] is None and rows[1]["best_eval_loss"] == 1.6  # loss rows only
    md = out.with_suffix(".md").read_text()
    assert "| mean acc at 2,000 tokens | 0.550 | 0.475 |" in md and "Accuracy at N tokens" in md
    width, height = struct.unpack(">II", out.read_bytes()[16:24])
    assert (width, height) == (1800, 1056)  # a second row: panels for last, rev, mean and arc_easy
