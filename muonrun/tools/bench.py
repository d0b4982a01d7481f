"""`muonrun bench CONFIG [OVERRIDES] --variant NAME:key=v,key=v ...`: variants side by side, one call.

Each variant is a real, short `pretrain` run (same launcher, same trainer) with per-step logging and
the optimizer step timed with CUDA events (no sync); the first `--warmup` steps are dropped and the
medians of the rest are reported. Example (2 x H200):

    muonrun bench qwen2-adamw-fsdp2 --steps 10 --warmup 5 \
        --variant adamw --variant muon:optimizer.name=muon --out bench.json

`--repeat N` runs the variants N times round-robin and reports the median of the runs' medians
with the tokens/s range: same-variant runs in one call can differ by several percent on a GPU.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from rich.table import Table

from muonrun.errors import UserError
from muonrun.observe.console import print_table

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
    "peak_reserved_gib",
    "alloc_retries",
)


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """`name` or `name:key=value,key=value`."""
    name, _, rest = spec.partition(":")
    if not name or any(not part or "=" not in part for part in rest.split(",") if rest):
        raise UserError(
            f"--variant '{spec}' is malformed: write NAME or NAME:key=value,key=value (commas separate the "
            "overrides, so a value cannot hold one: give a list such as optimizer.betas as a common override "
            "after the preset)."
        )
    return name, [part for part in rest.split(",") if part]


def summarize(rows: list[dict], warmup: int) -> dict:
    steady = [r for r in rows if "loss" in r and r["step"] > warmup]
    if not steady:
        raise UserError(f"No steps after the {warmup} warm-up steps were logged; raise --steps.")
    summary = {"steps_measured": len(steady), "final_loss": steady[-1]["loss"]}
    for key in REPORTED:
        values = [r[key] for r in steady if r.get(key) is not None]
        summary[key] = statistics.median(values) if values else None
    if summary["alloc_retries"] is not None:  # cumulative: count only the measured steps' retries
        before = [r["alloc_retries"] for r in rows if "loss" in r and r["step"] <= warmup]
        summary["alloc_retries"] = steady[-1]["alloc_retries"] - (before[-1] if before else 0)
    return summary


def combine(runs: list[dict]) -> dict:
    """One variant's repeated runs: the median of each run's medians, and the tokens/s range."""
    if len(runs) == 1:
        return runs[0]
    out = {"repeats": len(runs), "steps_measured": sum(r["steps_measured"] for r in runs)}
    out["final_loss"] = runs[-1]["final_loss"]
    for key in REPORTED:
        values = [r[key] for r in runs if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    tps = [r["tokens_per_s_per_device"] for r in runs]
    out["tokens_per_s_per_device_range"] = [min(tps), max(tps)]
    return out


def run_bench(
    preset: str,
    overrides: list[str],
    variants: list[str],
    steps: int,
    warmup: int,
    out_dir: Path,
    repeat: int = 1,
) -> dict:
    from muonrun.config import load_config
    from muonrun.launch.launcher import launch

    specs = [parse_variant(spec) for spec in variants or ["default"]]
    names = [name for name, _ in specs]
    if len(set(names)) < len(names):
        raise UserError(f"Variant names must differ (got {', '.join(names)}): each names its own run folder.")
    if repeat < 1:
        raise UserError(f"--repeat is {repeat}; it must be at least 1.")
    if steps < 1 or warmup < 0:
        raise UserError(f"--steps is {steps} and --warmup {warmup}: measure at least 1 step after 0 or more.")

    # every run's config, so a variant's mistake is found before the first one runs
    configs = {
        (name, r): load_config(
            preset,
            [
                *overrides,
                *extra,
                *BENCH_OVERRIDES,
                f"train.max_steps={warmup + steps}",
                f"output_dir={out_dir / (name if repeat == 1 else f'{name}-{r + 1}')}",
                f"name={name}",
            ],
        )
        for r in range(repeat)
        for name, extra in specs
    }
    runs: dict[str, list[dict]] = {name: [] for name in names}
    failed: dict[str, dict] = {}
    # Round-robin, not variant after variant: a machine that drifts during the call (two runs of one
    # variant can differ by several percent) then biases no variant.
    for r in range(repeat):
        for name, _ in specs:
            if name in failed:
                continue
            cfg = configs[name, r]
            metrics = Path(cfg.output_dir) / "metrics.jsonl"
            metrics.unlink(missing_ok=True)
            code = launch(cfg)
            if code:
                failed[name] = {"error": f"exit code {code}"}
                continue
            rows = [json.loads(line) for line in metrics.read_text().splitlines()]
            runs[name].append(summarize(rows, warmup))
    return {name: failed.get(name) or {"overrides": extra, **combine(runs[name])} for name, extra in specs}


def print_results(results: dict) -> None:
    repeated = any("tokens_per_s_per_device_range" in r for r in results.values())
    # tokens/s against the first variant that ran (e.g. Muon against AdamW), read off the table
    first = next((r["tokens_per_s_per_device"] for r in results.values() if "error" not in r), None)
    table = Table(title="muonrun bench (medians after warm-up" + (", over repeats)" if repeated else ")"))
    cols = ["variant", "tokens/s/dev"] + (["range"] if repeated else []) + ["vs first"]
    cols += ["MFU", "step ms", "optim ms", "data wait ms", "peak GiB", "retries", "loss"]
    for col in cols:
        table.add_column(col, justify="right")

    def fmt(v, scale=1.0, spec=",.0f"):
        return "-" if v is None else format(v * scale, spec)

    for name, r in results.items():
        if "error" in r:
            table.add_row(name, r["error"], *["-"] * (len(cols) - 2))
            continue
        lo_hi = r.get("tokens_per_s_per_device_range")
        table.add_row(
            name,
            fmt(r["tokens_per_s_per_device"]),
            *([f"{fmt(lo_hi[0])}-{fmt(lo_hi[1])}" if lo_hi else "-"] if repeated else []),
            f"{r['tokens_per_s_per_device'] / first:.3f}x",
            fmt(r["mfu"], 100, ".1f") + ("%" if r["mfu"] is not None else ""),
            fmt(r["step_time"], 1000, ".1f"),
            fmt(r["optimizer_step_time"], 1000, ".1f"),
            fmt(r["data_wait_time"], 1000, ".2f"),
            fmt(r["peak_mem_gib"], 1, ".1f"),
            fmt(r.get("alloc_retries")),
            fmt(r["final_loss"], 1, ".3f"),
        )
    print_table(table)
