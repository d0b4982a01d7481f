"""Reported vs wall-clock step time of every bench run kept under docs/bench-data (run 18's correction).

Wall clock: the median difference of consecutive logged rows' `elapsed_s` (each row's clock read, taken
before the row's own work), over the steps after warm-up. Before commit ff8995b a logged step's work
after that read fell outside every step-time window, so a wait for the GPU there went uncounted.
    python3 docs/bench-data/run18/scripts/wall_clock.py docs/bench-data > docs/bench-data/run18/wall-clock.txt
"""

import glob
import json
import os
import statistics
import sys

root = sys.argv[1]
print(
    f"{'run folder (metrics.jsonl)':62s} {'warmup':>6s} {'reported ms':>12s} {'wall ms':>9s} {'hidden':>7s}"
)
for path in sorted(glob.glob(f"{root}/**/metrics.jsonl", recursive=True)):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    start = next((r for r in rows if r.get("event") == "start"), {})
    rows = [r for r in rows if "loss" in r and "elapsed_s" in r and "step_time" in r]
    at = {r["step"]: r["elapsed_s"] for r in rows}
    for warmup in (
        5,
        4,
        1,
    ):  # the bench's --warmup of that run is not in the rows; the largest that leaves steps
        steady = [r for r in rows if r["step"] > warmup and r["step"] - 1 in at]
        if len(steady) >= 2:
            break
    if len(steady) < 2 or start.get("config", {}).get("logging", {}).get("log_interval", 1) not in (1, None):
        continue
    reported = statistics.median(r["step_time"] for r in steady) * 1000
    wall = statistics.median(r["elapsed_s"] - at[r["step"] - 1] for r in steady) * 1000
    name = os.path.relpath(os.path.dirname(path), root)
    print(f"{name:62s} {warmup:6d} {reported:12.1f} {wall:9.1f} {(wall - reported) / wall:7.1%}")
