"""`muonrun compare RUN_DIR [RUN_DIR ...] --out FILE.png`: loss curves of runs side by side, and a table.

Reads each run folder's metrics.jsonl (and config.yaml, saved by the launcher, for the labels), plots
the EMA-smoothed training loss against steps, tokens and wall time, prints a table and writes it as
Markdown next to the picture (FILE.md), then prints the absolute path of both files:

    muonrun compare runs/tiny-adamw runs/tiny-muon --out docs/img/compare-tiny.png

A run is labelled `optimizer (name)`; runs that share a name (one config launched several times) are
labelled by their run folder instead: its name, or as many parent folders as tell them apart.

"Target" is the worse run's final (smoothed) loss; each run's steps, tokens and time to first reach it
say how much sooner the better run got there. When every run evaluated, "eval target" is the worse
run's final eval loss and each run's tokens to it are read at its first eval at or below it (as fine
as train.eval_interval). Runs that logged telemetry (logging.max_attention_logit, train.qk_clip.tau,
logging.optimizer_telemetry) get rows for it: the largest attention logit, the heads QK-clip
rescaled, each optimizer's median update RMS.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from muonrun import log
from muonrun.errors import UserError
from muonrun.paths import unwritable
from muonrun.tools import downstream


@dataclass
class Run:
    path: Path
    name: str
    optimizer: str
    train: list[dict]
    """Training rows (with `loss`), one per logged step, in step order; rows a resume replaced are gone."""
    evals: list[dict] = field(default_factory=list)
    """Eval rows: the held-out loss, the accuracies on eval.tasks, or both."""
    harness: list[dict] = field(default_factory=list)
    """`muonrun eval`'s results (harness.jsonl), one row per task and evaluation."""
    wall: list[float] = field(default_factory=list)
    """Seconds of wall time at each training row, summed over the run's segments (resumes)."""
    shown: str = ""
    """What the table and legend call the run: `name`, or its folder when another run has the same name
    (set by `tell_apart`)."""

    @property
    def losses(self) -> list[dict]:
        """The eval rows with a held-out loss."""
        return [r for r in self.evals if "eval_loss" in r]

    @property
    def label(self) -> str:
        return f"{self.optimizer} ({self.shown or self.name})"


def folder_suffixes(paths: list[Path]) -> list[str]:
    """Each (distinct) path's shortest trailing part that no other path ends with: the folder names `a`
    and `b`, or `x/run`, `y/run` and `z` when two of the folders are named `run`."""
    parts = [path.resolve().parts for path in paths]
    suffixes = []
    for i, own in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i]
        depth = 1
        while depth < len(own) and any(p[-depth:] == own[-depth:] for p in others):
            depth += 1
        suffixes.append(str(Path(*own[-depth:])))
    return suffixes


def tell_apart(runs: list[Run]) -> None:
    """Set each run's `shown` name: its `name` when unique among `runs`, else its folder's suffix."""
    by_name: dict[str, list[Run]] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    for group in by_name.values():
        if len(group) == 1:
            group[0].shown = group[0].name
            continue
        for run, suffix in zip(group, folder_suffixes([run.path for run in group]), strict=True):
            run.shown = suffix


def _read_config(path: Path) -> dict:
    config = path / "config.yaml"
    if not config.is_file():
        return {}
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(config)) or {}
    except Exception:  # a damaged config must not stop a comparison; the start row has the labels too
        log.warning(f"'{config}' could not be read; labelling the run from metrics.jsonl.")
        return {}


_NEEDS = {
    "start": ("step", "time"),
    "training": ("step", "loss", "time"),
    "eval": ("step", "eval_loss"),
    "downstream eval": ("step", "tokens_seen"),
}
_KINDS = (
    ("start", lambda row: row.get("event") == "start"),
    ("training", lambda row: "loss" in row),
    ("eval", lambda row: "eval_loss" in row),
    ("downstream eval", lambda row: any(k.startswith(downstream.ACC) for k in row)),
)


def _check_row(row: dict, metrics: Path, number: int) -> None:
    """A row of a kind compare reads must carry its numbers (muonrun writes them all); anything else
    in it is left alone."""
    kind = next((k for k, test in _KINDS if test(row)), None)
    for key in _NEEDS.get(kind, ()):
        value = row.get(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            what = "has no" if key not in row else f"has a non-numeric ({value!r})"
            keys = ", ".join(list(row)[:6]) + (", ..." if len(row) > 6 else "")
            raise UserError(
                f"'{metrics}' line {number} is a {kind} row that {what} '{key}' (its keys: {keys}); "
                "muonrun writes every row with it, so the line was edited or written by something else. Fix or "
                "delete that line."
            )


def load_run(path: str | Path) -> Run:
    """A run folder's rows. After a resume (a later `start` row at step S) the rows past S that the
    resume replays are dropped, and wall time continues from where the earlier segment stopped."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"Run folder '{path}' does not exist.")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file() or metrics.stat().st_size == 0:
        raise UserError(
            f"Run folder '{path}' has no metrics.jsonl (or it is empty); is it a muonrun output_dir?"
        )
    rows, bad = [], 0
    for number, line in enumerate(metrics.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None  # e.g. the last line of a run that was killed mid-write
        if isinstance(row, dict):
            _check_row(row, metrics, number)
            rows.append(row)
        else:
            bad += 1
    if bad:
        log.warning(f"'{metrics}': skipped {bad} unreadable line(s).")

    starts = [r for r in rows if r.get("event") == "start"]
    config = _read_config(path)
    name = config.get("name") or (starts[-1]["name"] if starts else path.name)
    optimizer = (config.get("optimizer") or {}).get("name") or (starts[-1]["optimizer"] if starts else "?")
    variant = ((config.get("optimizer") or {}).get("muon") or {}).get("variant")
    if optimizer == "muon" and variant not in (None, "muon"):
        optimizer = str(variant)  # e.g. normuon: the legend names the variant

    train: list[dict] = []
    evals: list[dict] = []
    wall: list[float] = []
    offset, segment_start = 0.0, None
    for row in rows:
        if row.get("event") == "start":
            keep = [i for i, r in enumerate(train) if r["step"] <= row["step"]]
            offset = wall[keep[-1]] if keep else 0.0
            train, wall = [train[i] for i in keep], [wall[i] for i in keep]
            evals = [r for r in evals if r["step"] <= row["step"]]
            segment_start = row["time"]
        elif "loss" in row:
            if segment_start is None:  # no start row (older files): the first window began one window earlier
                segment_start = row["time"] - row.get("step_time", 0.0) * row["step"]
            train.append(row)
            wall.append(offset + row["time"] - segment_start)
        elif "eval_loss" in row or any(k.startswith(downstream.ACC) for k in row):
            evals.append(row)
    if not train:
        raise UserError(f"Run folder '{path}' has no logged training steps in metrics.jsonl yet.")
    harness = downstream.read_harness(path)
    return Run(path, str(name), str(optimizer), train, evals=evals, wall=wall, harness=harness)


def ema(values: list[float], smoothing: float) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing slider); 0: unchanged."""
    out, avg = [], 0.0
    for n, v in enumerate(values, start=1):
        avg = smoothing * avg + (1 - smoothing) * v
        out.append(avg / (1 - smoothing**n))
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[Run], smoothing: float) -> tuple[list[dict], float]:
    """One dict per run (the table's rows) and the target loss: the worse run's final smoothed loss.

    tokens/s and MFU are medians over the logged rows, without the first (start-up and warm-up)."""
    smoothed = [ema([r["loss"] for r in run.train], smoothing) for run in runs]
    target = max(s[-1] for s in smoothed)
    rows = []
    for run, curve in zip(runs, smoothed, strict=True):
        steady = run.train[1:] or run.train
        hit = next(i for i, v in enumerate(curve) if v <= target)
        rows.append(
            {
                "run": run.shown or run.name,
                "optimizer": run.optimizer,
                "steps": run.train[-1]["step"],
                "tokens": run.train[-1]["tokens_seen"],
                "final_loss": run.train[-1]["loss"],
                "final_loss_smoothed": curve[-1],
                "best_eval_loss": min((r["eval_loss"] for r in run.losses), default=None),
                "tokens_per_s": _median([r.get("tokens_per_s") for r in steady]),
                "mfu": _median([r.get("mfu") for r in steady]),
                "steps_to_target": run.train[hit]["step"],
                "tokens_to_target": run.train[hit]["tokens_seen"],
                "time_to_target": run.wall[hit],
                **telemetry_summary(run),
            }
        )
    worst_tokens = max(rows, key=lambda r: r["final_loss_smoothed"])["tokens_to_target"]
    for row in rows:
        row["token_speedup"] = worst_tokens / row["tokens_to_target"] if row["tokens_to_target"] else None
    if all(run.losses for run in runs):  # the same question asked of the held-out loss
        eval_target = max(run.losses[-1]["eval_loss"] for run in runs)
        for row, run in zip(rows, runs, strict=True):
            hit = next(r for r in run.losses if r["eval_loss"] <= eval_target)
            row["eval_target"] = eval_target
            row["tokens_to_eval_target"] = hit.get("tokens_seen")
    for row, cells in zip(rows, downstream.summary(runs), strict=True):
        row.update(cells)  # accuracy on the eval tasks at equal tokens, lm-evaluation-harness results
    return rows, target


METRICS = [
    ("optimizer", "optimizer", "{}"),
    ("steps", "steps", "{:,}"),
    ("tokens", "tokens", "{:,}"),
    ("final_loss", "final loss", "{:.4f}"),
    ("final_loss_smoothed", "final loss (EMA)", "{:.4f}"),
    ("best_eval_loss", "best eval loss", "{:.4f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("steps_to_target", "steps to target", "{:,}"),
    ("tokens_to_target", "tokens to target", "{:,}"),
    ("time_to_target", "time to target (s)", "{:,.1f}"),
    ("token_speedup", "token speed-up", "{:.2f}x"),
]
"""The table's rows (one column per run, so that a few runs fit a terminal): key, title, format."""


def telemetry_summary(run: Run) -> dict:
    """The telemetry a run logged, over the whole run: the largest `max_attention_logit`, the sum of
    `qk_clipped_heads`, the last `aux_loss`, `expert_load_max_mean` and `router_entropy` (MoE), the
    median of each `update_rms_<optimizer>`. Keys it did not log are absent."""
    out: dict = {}
    logits = [r["max_attention_logit"] for r in run.train if r.get("max_attention_logit") is not None]
    if logits:
        out["max_attention_logit"] = max(logits)
    if any("qk_clipped_heads" in r for r in run.train):
        out["qk_clipped_heads"] = sum(r.get("qk_clipped_heads") or 0 for r in run.train)
    for key in ("aux_loss", "expert_load_max_mean", "router_entropy"):  # mixture of experts: the last logged
        last = [r[key] for r in run.train if r.get(key) is not None]
        if last:
            out[key] = last[-1]
    for key in sorted({k for r in run.train for k in r if k.startswith("update_rms_")}):
        out[key] = _median([r.get(key) for r in run.train])
    return out


def table_metrics(rows: list[dict]) -> list[tuple[str, str, str]]:
    """METRICS, then a row for each telemetry value that some run has."""
    present = {k for row in rows for k in row}
    extra = [
        (k, title, fmt)
        for k, title, fmt in [
            ("max_attention_logit", "max attention logit", "{:.1f}"),
            ("qk_clipped_heads", "heads QK-clipped", "{:,.0f}"),
            ("aux_loss", "router balance loss (last)", "{:.4f}"),
            ("expert_load_max_mean", "busiest expert / mean (last)", "{:.2f}x"),
            ("router_entropy", "router entropy, nats (last)", "{:.3f}"),
            ("eval_target", "eval target", "{:.4f}"),
            ("tokens_to_eval_target", "tokens to eval target", "{:,}"),
        ]
        if k in present
    ]
    extra += [
        (k, f"update RMS, {k.removeprefix('update_rms_')} (median)", "{:.3g}")
        for k in sorted(present)
        if k.startswith("update_rms_")
    ]
    return METRICS + extra + downstream.table_metrics(rows)


def _cells(rows: list[dict], key: str, fmt: str) -> list[str]:
    return ["-" if row.get(key) is None else fmt.format(row[key]) for row in rows]


def markdown_table(rows: list[dict], target: float, smoothing: float) -> str:
    lines = [
        "| | " + " | ".join(row["run"] for row in rows) + " |",
        "|---|" + "---:|" * len(rows),
        *(
            f"| {title} | " + " | ".join(_cells(rows, key, fmt)) + " |"
            for key, title, fmt in table_metrics(rows)
        ),
        "",
        f"Target loss {target:.4f}: the worse run's final training loss, EMA-smoothed ({smoothing:g} per logged "
        "row). tokens/s and MFU: medians over the logged steps after the first. Token speed-up: the worse "
        "run's tokens to target / this run's."
        + (downstream.FOOTNOTE if downstream.table_metrics(rows) else ""),
    ]
    return "\n".join(lines) + "\n"


def print_comparison(rows: list[dict], target: float) -> None:
    from rich.table import Table

    from muonrun.observe.console import print_table

    table = Table(title=f"muonrun compare (target loss {target:.4f})")
    table.add_column("")
    for row in rows:
        table.add_column(row["run"], justify="right")
    for key, title, fmt in table_metrics(rows):
        table.add_row(title, *_cells(rows, key, fmt))
    print_table(table)


def plot(runs: list[Run], out: Path, smoothing: float, target: float, title: str | None = None) -> None:
    """Loss vs step, tokens and wall time: faint raw curves, solid smoothed ones, eval losses as dots."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import EngFormatter
    except ImportError:
        raise UserError(
            "`muonrun compare` draws with matplotlib, which is not installed: pip install 'muonrun[plot]'"
        ) from None

    minutes = max(run.wall[-1] for run in runs) > 300
    axes_spec = [
        (
            "step",
            "step",
            lambda run: [r["step"] for r in run.train],
            lambda run: [r["step"] for r in run.losses],
        ),
        (
            "tokens",
            "tokens",
            lambda run: [r["tokens_seen"] for r in run.train],
            lambda run: [r["tokens_seen"] for r in run.losses],
        ),
        ("wall", "wall time (min)" if minutes else "wall time (s)", lambda run: run.wall, None),
    ]
    tasks = downstream.task_names(runs)  # a second row: a panel per task
    fig = Figure(figsize=(15, 8.8 if tasks else 4.6), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 0.9]) if tasks else (fig, None)
    axes = top.subplots(1, 3, sharey=True)
    smoothed = {id(run): ema([r["loss"] for r in run.train], smoothing) for run in runs}
    all_smoothed = sorted(v for s in smoothed.values() for v in s)
    low, high = all_smoothed[0], all_smoothed[int(0.95 * (len(all_smoothed) - 1))]
    pad = 0.08 * (high - low or 1.0)
    for ax, (key, xlabel, xs, eval_xs) in zip(axes, axes_spec, strict=True):
        for i, run in enumerate(runs):
            color = f"C{i}"
            x = xs(run)
            if key == "wall" and minutes:
                x = [t / 60 for t in x]
            if smoothing > 0:
                ax.plot(x, [r["loss"] for r in run.train], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(x, smoothed[id(run)], color=color, linewidth=1.8, label=run.label)
            if eval_xs is not None and run.losses:
                ax.plot(eval_xs(run), [r["eval_loss"] for r in run.losses], "o", color=color, markersize=4)
        ax.axhline(target, color="0.5", linestyle="--", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if key == "tokens":
            ax.xaxis.set_major_formatter(EngFormatter())
    axes[0].set_ylim(low - pad, high + pad)
    axes[0].set_ylabel("training loss" + (f" (EMA {smoothing:g})" if smoothing > 0 else ""))
    handles, labels = axes[0].get_legend_handles_labels()
    if any(run.losses for run in runs):
        handles.append(Line2D([], [], marker="o", color="0.3", linestyle="none", markersize=4))
        labels.append("eval loss")
    handles.append(Line2D([], [], color="0.5", linestyle="--", linewidth=0.8))
    labels.append(f"target {target:.3f} (worse run's final)")
    axes[0].legend(handles, labels, fontsize=9)
    if bottom is not None:
        downstream.plot(bottom, runs)
    fig.suptitle(title or "muonrun compare: " + " vs ".join(run.label for run in runs))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, metadata={"Software": WRITER})


WRITER = "muonrun compare"
"""How compare marks the files it writes: the PNG's `Software` text chunk, the Markdown's last line."""
MARK = f"<!-- written by {WRITER} -->\n"


def _png_software(path: Path) -> str | None:
    """A PNG's `Software` text chunk (read from the chunks before the image data), or None."""
    with open(path, "rb") as f:
        data = f.read(1 << 16)
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return None
    pos = 8
    while pos + 8 <= len(data):
        length, kind = int.from_bytes(data[pos : pos + 4], "big"), data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            return None
        if kind == b"tEXt":
            key, _, value = data[pos + 8 : pos + 8 + length].partition(b"\0")
            if key == b"Software":
                return value.decode("latin-1")
        pos += 12 + length
    return None


def written_by_compare(path: Path) -> bool:
    """Whether `path` (the plot or its table) is a file an earlier `muonrun compare` wrote."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".png":
        return _png_software(path) == WRITER
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - len(MARK)))
        return f.read() == MARK.encode()


def compare(
    run_dirs: list[str | Path],
    out: str | Path,
    smoothing: float = 0.6,
    title: str | None = None,
    force: bool = False,
) -> list[dict]:
    """Load, summarize, plot to `out` (PNG), write `out` with .md, print the table and where both files
    went (absolute paths: `out` may be the CLI's default in the current folder); returns the table rows.
    A file there that an earlier compare did not write is refused, not replaced, unless `force`."""
    if not run_dirs:
        raise UserError("Give at least one run folder to compare.")
    if not 0.0 <= smoothing < 1.0:
        raise UserError(f"--smoothing is {smoothing}; it must be in [0, 1) (0: no smoothing).")
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise UserError(f"--out '{out}' must be a .png file (the table is written next to it as .md).")
    problem = unwritable(out, "file")
    if problem:
        raise UserError(f"--out '{out}' cannot be written: {problem}. Give a file in a folder you can write.")
    md = out.with_suffix(".md")
    foreign = [f for f in (out, md) if os.path.lexists(f) and not written_by_compare(f)]
    folders = [f for f in foreign if f.is_dir() and not f.is_symlink()]
    if folders:
        raise UserError(f"--out '{out}': '{folders[0]}' is a folder; give another --out.")
    if foreign and not force:
        raise UserError(
            f"--out '{out}' would replace {' and '.join(repr(str(f)) for f in foreign)}, which `muonrun compare` "
            "did not write (it writes the plot and the table beside it, FILE.md). Give another --out, or pass "
            "--force to replace them."
        )
    seen: dict[Path, str | Path] = {}
    for path in run_dirs:
        if (resolved := Path(path).resolve()) in seen:
            raise UserError(
                f"Run folder '{path}' is given twice (also as '{seen[resolved]}'); give each run once."
            )
        seen[resolved] = path
    runs = [load_run(path) for path in run_dirs]
    tell_apart(runs)
    rows, target = summarize(runs, smoothing)
    replaced = [f for f in (out, md) if os.path.lexists(f)]
    for f in foreign:
        f.unlink()  # --force: a link is replaced, never written through
    plot(runs, out, smoothing, target, title)
    md.write_text(markdown_table(rows, target, smoothing) + MARK)
    print_comparison(rows, target)
    for written, what in ((out, "the plot"), (md, "the table as Markdown")):
        if written in replaced:
            what += ", replacing the earlier file"
        print(f"Wrote {written.resolve()} ({what})")
    return rows
