"""`muonrun bench` helpers: variant parsing and the medians it reports."""

import pytest

from muonrun.bench import parse_variant, summarize
from muonrun.errors import UserError


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
    with pytest.raises(UserError, match="warm-up"):
        summarize(rows, warmup=5)
