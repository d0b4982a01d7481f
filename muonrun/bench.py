"""`muonrun bench CONFIG [OVERRIDES] --variant NAME:key=v,key=v ...`: variants side by side, one call.

Each variant is a real, short `pretrain` run (same launcher, same trainer) with per-step logging and
the optimizer step timed with CUDA events (no sync); the first `--warmup` steps are dropped and the
medians of the rest are reported. Example (2 x H200):

    muonrun bench qwen2-adamw-fsdp2 --steps 10 --warmup 5 \
        --variant adamw --variant muon:optimizer.name=muon --out bench.json
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from muonrun.errors import UserError

BENCH_OVERRIDES = [
    "logging.log_interval=1",
    "logging.time_optimizer=true",
    "logging.console=plain",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "train.eval_interval=0",
]
REPORTED = (
    "tokens_per_s_per_device",
    "mfu",
    "step_time",
    "optimizer_step_time",
    "data_wait_time",
    "peak_mem_gib",
)


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """`name` or `name:key=value,key=value`."""
    name, _, rest = spec.partition(":")
    if not name or any(not part or "=" not in part for part in rest.split(",") if rest):
        raise UserError(f"--variant '{spec}' is malformed: write NAME or NAME:key=value,key=value.")
    return name, [part for part in rest.split(",") if part]


def summarize(rows: list[dict], warmup: int) -> dict:
    steady = [r for r in rows if "loss" in r and r["step"] > warmup]
    if not steady:
        raise UserError(f"No steps after the {warmup} warm-up steps were logged; raise --steps.")
    summary = {"steps_measured": len(steady), "final_loss": steady[-1]["loss"]}
    for key in REPORTED:
        values = [r[key] for r in steady if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    return summary


def run_bench(
    preset: str, overrides: list[str], variants: list[str], steps: int, warmup: int, out_dir: Path
) -> dict:
    from muonrun.config import load_config
    from muonrun.launch import launch

    results = {}
    for spec in variants or ["default"]:
        name, extra = parse_variant(spec)
        run_dir = out_dir / name
        metrics = run_dir / "metrics.jsonl"
        metrics.unlink(missing_ok=True)
        cfg = load_config(
            preset,
            [
                *overrides,
                *extra,
                *BENCH_OVERRIDES,
                f"train.max_steps={warmup + steps}",
                f"output_dir={run_dir}",
                f"name={name}",
            ],
        )
        code = launch(cfg)
        if code:
            results[name] = {"error": f"exit code {code}"}
            continue
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        results[name] = {"overrides": extra, **summarize(rows, warmup)}
    return results


def print_results(results: dict) -> None:
    table = Table(title="muonrun bench (medians after warm-up)")
    for col in ("variant", "tokens/s/dev", "MFU", "step ms", "optim ms", "data wait ms", "peak GiB", "loss"):
        table.add_column(col, justify="right")

    def fmt(v, scale=1.0, spec=",.0f"):
        return "-" if v is None else format(v * scale, spec)

    for name, r in results.items():
        if "error" in r:
            table.add_row(name, r["error"], *["-"] * 6)
            continue
        table.add_row(
            name,
            fmt(r["tokens_per_s_per_device"]),
            fmt(r["mfu"], 100, ".1f") + ("%" if r["mfu"] is not None else ""),
            fmt(r["step_time"], 1000, ".1f"),
            fmt(r["optimizer_step_time"], 1000, ".1f"),
            fmt(r["data_wait_time"], 1000, ".2f"),
            fmt(r["peak_mem_gib"], 1, ".1f"),
            fmt(r["final_loss"], 1, ".3f"),
        )
    Console().print(table)
