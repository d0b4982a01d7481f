"""Downstream accuracy in `muonrun compare`: the tasks scored in the loop (`eval.tasks`: eval rows'
`eval_acc_NAME`, `eval_acc_norm_NAME`) and lm-evaluation-harness results (`muonrun eval`: the run
folder's harness.jsonl).

The table gives each task's accuracy at equal tokens: at the largest token count every run evaluated
the task at, each run's last evaluation at or before it. The picture gets a panel per task: accuracy
against tokens, acc solid and acc_norm dashed, harness results as stars.
"""

from __future__ import annotations

import json
from pathlib import Path

from muonrun import log

RESULTS = "harness.jsonl"  # muonrun/eval/harness.py writes it (not imported: compare needs no harness)
ACC, NORM = "eval_acc_", "eval_acc_norm_"
FOOTNOTE = (
    " Accuracy at N tokens: each run's last evaluation of the task at or before N, the largest token count "
    "every run evaluated it at (acc_norm divides each choice's log-likelihood by its length in characters, as "
    "lm-evaluation-harness does)."
)
KEY = "downstream:"
"""The table rows' keys: KEY + the row's title."""


def read_harness(folder: Path) -> list[dict]:
    """The rows `muonrun eval` appended to a run folder's harness.jsonl (none when it has none)."""
    path = folder / RESULTS
    if not path.is_file():
        return []
    rows, bad = [], 0
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and isinstance(row.get("task"), str):
            rows.append(row)
        else:
            bad += 1
    if bad:
        log.warning(f"'{path}': skipped {bad} unreadable line(s).")
    return rows


def task_names(runs) -> list[str]:
    """Tasks some run scored in the loop (`mean` last, when there are several), then harness-only ones."""
    loop = {
        k.removeprefix(ACC)
        for run in runs
        for r in run.evals
        for k in r
        if k.startswith(ACC) and not k.startswith(NORM)
    }
    names = sorted(loop - {"mean"}) + (["mean"] if len(loop) > 2 else [])
    harness = sorted({r["task"] for run in runs for r in run.harness} - set(names))
    return names + harness


def curve(run, name: str, prefix: str) -> tuple[list[int], list[float]]:
    rows = [r for r in run.evals if r.get(prefix + name) is not None and r.get("tokens_seen") is not None]
    return [r["tokens_seen"] for r in rows], [r[prefix + name] for r in rows]


def summary(runs) -> list[dict]:
    """Per run, the table's downstream values, keyed `downstream:TITLE` in the table's order: each task's
    acc and acc_norm at equal tokens, then its latest lm-evaluation-harness results."""
    cells: list[dict] = [{} for _ in runs]
    for name in task_names(runs):
        for prefix, what in ((ACC, "acc"), (NORM, "acc_norm")):
            curves = [curve(run, name, prefix) for run in runs]
            if not all(tokens for tokens, _ in curves):
                continue
            common = min(tokens[-1] for tokens, _ in curves)
            for row, (tokens, values) in zip(cells, curves, strict=True):
                at = [v for t, v in zip(tokens, values, strict=True) if t <= common]
                row[f"{KEY}{name} {what} at {common:,} tokens"] = at[-1] if at else None
        for what in ("acc", "acc_norm"):
            for row, run in zip(cells, runs, strict=True):
                found = [r for r in run.harness if r["task"] == name and isinstance(r.get(what), int | float)]
                if found:
                    last = max(found, key=lambda r: (r.get("step") or 0, r.get("time") or 0))
                    step = f" (step {last['step']:,})" if last.get("step") is not None else ""
                    row[f"{KEY}{name} {what}, lm-evaluation-harness"] = f"{last[what]:.3f}{step}"
    return cells


def table_metrics(rows: list[dict]) -> list[tuple[str, str, str]]:
    """The table rows (key, title, format) of the downstream values in `rows`, in their order."""
    keys = list(dict.fromkeys(k for row in rows for k in row if k.startswith(KEY)))
    return [
        (k, k.removeprefix(KEY), "{}" if any(isinstance(row.get(k), str) for row in rows) else "{:.3f}")
        for k in keys
    ]


def plot(fig, runs) -> None:
    """A row of panels in `fig` (a subfigure), one per task: accuracy against tokens."""
    from matplotlib.ticker import EngFormatter

    names = task_names(runs)
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    for ax, name in zip(axes, names, strict=True):
        for i, run in enumerate(runs):
            color = f"C{i}"
            for prefix, style in ((ACC, "-"), (NORM, "--")):
                tokens, values = curve(run, name, prefix)
                if tokens:
                    ax.plot(tokens, values, style, color=color, marker="o", markersize=3, linewidth=1.4)
            for what, marker in (("acc", "*"), ("acc_norm", "P")):
                done = [r for r in run.harness if r["task"] == name and r.get("tokens_seen") is not None]
                done = [r for r in done if isinstance(r.get(what), int | float)]
                if done:
                    ax.plot(
                        [r["tokens_seen"] for r in done],
                        [r[what] for r in done],
                        marker,
                        color=color,
                        markersize=9,
                    )
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("tokens")
        ax.xaxis.set_major_formatter(EngFormatter())
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (acc solid, acc_norm dashed;\nharness: * acc, + acc_norm)")
