"""`muonrun bench` helpers: variant parsing and the medians it reports."""

import pytest

from muonrun.errors import UserError
from muonrun.tools.bench import parse_variant, summarize


def test_parse_variant():
    assert parse_variant("adamw") == ("adamw", [])
    assert parse_variant("m:optimizer.name=muon,parallel.compile=true") == (
        "m",
        ["optimizer.name=muon", "parallel.compile=true"],
    )
    for bad in (":x=1", "m:optimizer.name", "m:a=1,,b=2"):
        with pytest.raises(UserError, match="malformed"):
            parse_variant(bad)


def test_summarize_drops_warmup_and_takes_medians():
    rows = [{"event": "start"}] + [
        {"step": s, "loss": 10.0 - s, "step_time": t, "tokens_per_s_per_device": 1000 / t, "mfu": None}
        for s, t in [(1, 9.0), (2, 0.3), (3, 0.1), (4, 0.2), (5, 0.5)]
    ]
    out = summarize(rows, warmup=1)
    assert out["steps_measured"] == 4 and out["final_loss"] == 5.0
    assert out["step_time"] == pytest.approx(
        0.25
    )  # median of 0.3, 0.1, 0.2, 0.5: the 9 s warm-up step is gone
    assert out["mfu"] is None and out["optimizer_step_time"] is None
    assert out["alloc_retries"] is None  # CPU rows have no allocator
    with pytest.raises(UserError, match="warm-up"):
        summarize(rows, warmup=5)


def test_summarize_counts_allocator_retries_of_the_measured_steps_only():
    rows = [
        {"step": s, "loss": 1.0, "step_time": 0.1, "tokens_per_s_per_device": 1.0, "alloc_retries": n}
        for s, n in [(1, 4), (2, 4), (3, 6), (4, 9)]
    ]
    assert summarize(rows, warmup=2)["alloc_retries"] == 5  # 9 at the end, 4 when the warm-up ended
    assert summarize(rows, warmup=0)["alloc_retries"] == 9


def test_repeats_run_round_robin_and_report_median_and_range(tmp_path, monkeypatch):
    """The orchestration, with `launch` replaced by one that logs a known step time per run."""
    import json
    from pathlib import Path

    import muonrun.launch.launcher
    from muonrun.tools.bench import run_bench

    launched = []
    step_times = iter([0.5, 1.0, 0.4, 2.0, 0.6, 1.5])  # a, b, a, b, a, b

    def fake_launch(cfg):
        launched.append(cfg.output_dir)
        t = next(step_times)
        rows = [{"event": "start"}] + [
            {"step": s, "loss": 1.0, "step_time": t, "tokens_per_s_per_device": 1 / t} for s in (1, 2, 3)
        ]
        run_dir = Path(cfg.output_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
        return 0

    monkeypatch.setattr(muonrun.launch.launcher, "launch", fake_launch)
    out = run_bench("tiny", [], ["a", "b:optimizer.name=muon"], 2, 1, tmp_path, 3)
    assert [Path(p).name for p in launched] == ["a-1", "b-1", "a-2", "b-2", "a-3", "b-3"]
    assert out["a"]["step_time"] == 0.5 and out["b"]["step_time"] == 1.5  # median of the three runs
    assert out["a"]["tokens_per_s_per_device_range"] == [1 / 0.6, 1 / 0.4]
    assert out["b"]["repeats"] == 3 and out["b"]["steps_measured"] == 6
    assert out["b"]["overrides"] == ["optimizer.name=muon"]
    with pytest.raises(UserError, match="must differ"):
        run_bench("tiny", [], ["a", "a:optimizer.name=muon"], 2, 1, tmp_path)
    # a later variant's mistake is found before the first variant runs; so are impossible step counts
    launched.clear()
    with pytest.raises(UserError, match="Unknown config key 'optimizer.nmae'"):
        run_bench("tiny", [], ["a", "b:optimizer.nmae=muon"], 2, 1, tmp_path)
    with pytest.raises(UserError, match="--steps is 0"):
        run_bench("tiny", [], ["a"], 0, 1, tmp_path)
    assert launched == []


def test_results_table_keeps_whole_names_in_a_log_file(capsys):
    """Printed into a pipe (a cluster log), rich would assume 80 columns and cut cells to 'adamw-s…'."""
    from muonrun.tools.bench import print_results

    row = {
        "tokens_per_s_per_device": 10262.4,
        "mfu": 0.453,
        "step_time": 1.5966,
        "optimizer_step_time": 0.0366,
    }
    row |= {"data_wait_time": 0.00061, "peak_mem_gib": 87.0, "alloc_retries": 5321, "final_loss": 6.077}
    results = {
        "adamw-selective-mb8-keep-gathered": {**row, "tokens_per_s_per_device_range": [10001.0, 10511.0]},
        "muon-selective-mb8-keep-gathered": {"error": "exit code 1"},
        "muon-gram": {**row, "tokens_per_s_per_device": 9852.0},
    }
    print_results(results)
    out = capsys.readouterr().out
    assert "adamw-selective-mb8-keep-gathered" in out and "muon-selective-mb8-keep-gathered" in out
    assert "10,001-10,511" in out and "45.3%" in out and "5,321" in out and "exit code 1" in out
    assert "1.000x" in out and "0.960x" in out  # tokens/s against the first variant that ran
    assert "…" not in out
