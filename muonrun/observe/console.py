"""Rank 0's console: a rich live view on a terminal, plain grep-able lines elsewhere (cluster log files).

`logging.console`: `auto` picks rich when stdout is a terminal. Plain lines never contain escape codes:

    step    120/1000 loss 3.2104 lr 3.000e-04 grad_norm 0.812 tok/s 12,345 tok/s/dev 6,172 mfu 41.2% mem 12.30GiB step_time 0.530s data_wait 0.002s eta 0:07:42
    eval    100/1000 eval_loss 3.3011 eval_ppl 27.15 eval_time 4.1s

With several optimizers (`optimizer.name=muon`: Muon for the hidden matrices, AdamW for the rest) each
one's learning rate has its own field, named as in metrics.jsonl: `lr_muon 2.000e-02 lr_adamw 2.000e-04`.

The rich view's history rows keep the fields that fit the terminal (by RICH_PRIORITY; the eta always),
in columns that line up from row to row, eval rows too; its footer shows the latest row's other fields
and the progress, and, from the moment a stop is requested (Ctrl-C), what happens next. It is erased at
the end, where a short summary follows (both views): final loss, time, the checkpoint, the export.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import TextIO

LOG_WIDTH = 200  # columns for tables printed into a file or pipe
# In the launcher's control folder while rank 0's live view runs on this node's terminal: the launcher
# then leaves the stop messages to the view (a line it wrote would break the view's redrawn footer).
LIVE_VIEW_FILE = "live-view"
# muonrun.launch.worker.CONTROL_ENV, copied: importing it would be a cycle (the worker imports the trainer,
# which imports this module); tests/test_console.py checks the two are the same.
CONTROL_ENV = "MUONRUN_CONTROL_DIR"
STOPPING = (
    "Stopping: the workers save a checkpoint within two steps (once the ranks agree on one), then stop; "
    "Ctrl-C again stops at once, without saving."
)
# The fields a history row of the rich view keeps first when the terminal is too narrow for all of them
RICH_PRIORITY = ("step", "loss", "eta", "lr", "grad_norm", "tok/s", "mfu", "mem", "step_time", "aux", "load")


def print_table(table) -> None:
    """Print a rich table: at the terminal's width, or, into a log file or pipe (where rich assumes 80
    columns and cuts cells to "adamw-s…"), as wide as the table needs."""
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=LOG_WIDTH)
    console.print(table)


def format_eta(seconds: float | None) -> str:
    return "?" if seconds is None else str(datetime.timedelta(seconds=round(seconds)))


def lr_fields(row: dict) -> list[tuple[str, str]]:
    """`lr`, or each optimizer's learning rate when the row has several (`lr_muon`, `lr_adamw`, ...: every
    `lr_` key but the schedule's `lr_multiplier`), so that no optimizer's lr is hidden."""
    per_optimizer = [(k, v) for k, v in row.items() if k.startswith("lr_") and k != "lr_multiplier"]
    return [(k, f"{v:.3e}") for k, v in per_optimizer] or [("lr", f"{row['lr']:.3e}")]


def position(step: int, max_steps: int) -> str:
    """`   120/1000`: the same width on every row of a run, step rows and eval rows alike."""
    return f"{step:>{max(6, len(str(max_steps)))}}/{max_steps}"


def step_fields(row: dict, max_steps: int, eta: float | None) -> list[tuple[str, str]]:
    """(label, value) pairs of one logged step, shared by both views; missing values are left out."""
    fields = [
        ("step", position(row["step"], max_steps)),
        ("loss", f"{row['loss']:.4f}"),
        *lr_fields(row),
        ("grad_norm", f"{row['grad_norm']:.3f}"),
        ("tok/s", f"{row['tokens_per_s']:,.0f}"),
        ("tok/s/dev", f"{row['tokens_per_s_per_device']:,.0f}"),
    ]
    if row.get("aux_loss") is not None:  # mixture of experts: balance loss, busiest expert over the mean
        fields.append(("aux", f"{row['aux_loss']:.4f}"))
        if row.get("expert_load_max_mean") is not None:
            fields.append(("load", f"{row['expert_load_max_mean']:.2f}x"))
    if row.get("ep_tokens_received") is not None:  # expert parallelism: the busiest rank's tokens, a2a time
        fields.append(("ep_recv", f"{row['ep_tokens_received']:,.0f}"))
        fields.append(("a2a", f"{row['ep_all_to_all_s']:.3f}s"))
    if row.get("mfu") is not None:
        fields.append(("mfu", f"{row['mfu'] * 100:.1f}%"))
    if row.get("peak_mem_gib") is not None:
        fields.append(("mem", f"{row['peak_mem_gib']:.2f}GiB"))
    fields.append(("step_time", f"{row['step_time']:.3f}s"))
    fields.append(("data_wait", f"{row['data_wait_time']:.3f}s"))
    if row.get("optimizer_step_time") is not None:
        fields.append(("optim_time", f"{row['optimizer_step_time']:.3f}s"))
    fields.append(("eta", format_eta(eta)))
    return fields


def eval_fields(row: dict) -> list[tuple[str, str]]:
    fields = [
        (k, f"{v:.4f}" if k == "eval_loss" else f"{v:.3f}" if k.startswith("eval_acc") else f"{v:.2f}")
        for k, v in row.items()
        if k.startswith("eval_")
    ]
    return [(k, v + "s") if k == "eval_time" else (k, v) for k, v in fields]


class PlainView:
    """One line per logged step, `label value` pairs; for log files and `grep`/`awk`."""

    def __init__(self, stream: TextIO | None = None, prefix: str = ""):
        self.stream = stream
        self.prefix = prefix
        self._max_steps = 0

    def _print(self, line: str) -> None:
        print(self.prefix + line, file=self.stream or sys.stdout, flush=True)

    def banner(self, rows: list[tuple[str, str]]) -> None:
        width = max(len(k) for k, _ in rows)
        for key, value in rows:
            self._print(f"muonrun {key:<{width}}  {value}")

    def start(self, step: int, max_steps: int) -> None:
        self._max_steps = max_steps

    def advance(self, step: int) -> None:
        pass

    def step(self, row: dict, max_steps: int, eta: float | None) -> None:
        self._print(" ".join(f"{k} {v}" for k, v in step_fields(row, max_steps, eta)))

    def eval(self, row: dict) -> None:
        self._print(
            f"eval {position(row['step'], self._max_steps)} "
            + " ".join(f"{k} {v}" for k, v in eval_fields(row))
        )

    def note(self, msg: str) -> None:
        self._print(msg)

    def summary(self, rows: list[tuple[str, str]]) -> None:
        self.banner(rows)

    def close(self) -> None:
        pass


def summary_rows(
    step: int,
    max_steps: int,
    seconds: float,
    loss: float | None,
    eval_loss: float | None,
    checkpoint: str | None,
    exported: str | None,
    output_dir: str,
    name: str,
) -> list[tuple[str, str]]:
    """The run's last lines: where it ended, its final loss, its time, its checkpoint, how to export it."""
    done = step >= max_steps
    ended = f"step {step:,}/{max_steps:,} in {format_eta(seconds)}" + ("" if done else " (stopped early)")
    if loss is not None:
        ended += f", final loss {loss:.4f}"
    if eval_loss is not None:
        ended += f", eval loss {eval_loss:.4f}"
    rows = [("done" if done else "stopped", ended)]
    if checkpoint is None:
        rows.append(("checkpoint", "none saved (checkpoint.save_at_end and checkpoint.interval are off)"))
        return rows
    rows.append(("checkpoint", checkpoint + ("" if done else ": rerun the same command to resume")))
    if exported:
        rows.append(("exported", f"{exported}: AutoModelForCausalLM.from_pretrained('{exported}')"))
    else:
        rows.append(("export", f"muonrun export {output_dir} hf/{name}"))
    return rows


def fit_fields(
    fields: list[tuple[str, str]], width: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(the fields a history row of `width` columns shows, in their order; the rest): by RICH_PRIORITY
    (`lr_muon` counts as `lr`), as many as fit with two spaces between fields."""

    def rank(label: str) -> int:
        base = "lr" if label.startswith("lr") else label
        return RICH_PRIORITY.index(base) if base in RICH_PRIORITY else len(RICH_PRIORITY)

    kept: set[int] = set()
    used = -2
    for i in sorted(range(len(fields)), key=lambda i: rank(fields[i][0])):
        need = len(fields[i][0]) + 1 + len(fields[i][1]) + 2
        if used + need <= width or not kept:
            kept.add(i)
            used += need
    return [f for i, f in enumerate(fields) if i in kept], [f for i, f in enumerate(fields) if i not in kept]


class RichView:
    """A scrolling history of logged steps, eval results and notes, in columns that fit the terminal, over a
    live footer: the latest row's other fields, what a stop request does (once there is one) and the
    progress (step / max steps, elapsed time, ETA). The footer is erased at the end."""

    def __init__(
        self, force_terminal: bool | None = None, file: TextIO | None = None, width: int | None = None
    ):
        from rich.console import Console

        self.console = Console(force_terminal=force_terminal, file=file, highlight=False, width=width)
        self.live = None
        self._max_steps = 0
        self._widths: dict[str, int] = {}  # each field's widest value so far: the columns line up
        self.rest: list[tuple[str, str]] = []  # the latest step row's fields its history row left out
        self._mark: Path | None = None
        self._stop_said = False

    def banner(self, rows: list[tuple[str, str]]) -> None:
        from rich.table import Table

        table = Table(
            title="[bold]muonrun[/]", show_header=False, title_justify="left", box=None, padding=(0, 2)
        )
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column(overflow="fold")  # a path longer than the line is folded, never cut short
        for key, value in rows:
            table.add_row(key, value)
        self.console.print(table)

    def start(self, step: int, max_steps: int) -> None:
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._max_steps = max_steps
        self.progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta {task.fields[eta]}"),
            console=self.console,
        )
        self.task = self.progress.add_task("train", total=max_steps, completed=step, eta="?")
        self.live = Live(_Footer(self), console=self.console, refresh_per_second=2, transient=True)
        self.live.start()
        self._mark_live(True)

    def _mark_live(self, on: bool) -> None:
        """Tell this node's launcher (if any) that the view speaks for stop requests on this terminal."""
        control = os.environ.get(CONTROL_ENV)
        if on and control and self.console.is_terminal:
            self._mark = Path(control) / LIVE_VIEW_FILE
            try:
                self._mark.touch()
            except OSError:
                self._mark = None
        elif not on and self._mark is not None:
            self._mark.unlink(missing_ok=True)
            self._mark = None

    def advance(self, step: int) -> None:
        self.progress.update(self.task, completed=step)
        # The footer said it at once; the history keeps it (a lone worker's own handler prints it already)
        if self._mark is not None and not self._stop_said and stop_requested():
            self._stop_said = True
            self.console.print(STOPPING, style="bold yellow")

    def _padded(self, fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Each value right-aligned to the widest this field has had: the columns line up row after row."""
        out = []
        for k, v in fields:
            self._widths[k] = max(self._widths.get(k, 0), len(v))
            out.append((k, v.rjust(self._widths[k])))
        return out

    def _print_row(self, label: str, where: str, fields: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """`label where  k v  k v ...` with the fields that fit the terminal; returns those left out."""
        shown, rest = fit_fields(self._padded(fields), self.console.width - len(label) - len(where) - 3)
        self.console.print("  ".join([f"[bold]{label}[/] {where}", *(f"[dim]{k}[/] {v}" for k, v in shown)]))
        return rest

    def step(self, row: dict, max_steps: int, eta: float | None) -> None:
        fields = step_fields(row, max_steps, eta)
        self.rest = self._print_row("step", fields[0][1], fields[1:])
        self.progress.update(self.task, completed=row["step"], eta=format_eta(eta))

    def eval(self, row: dict) -> None:
        self._print_row("eval", position(row["step"], self._max_steps), eval_fields(row))

    def note(self, msg: str) -> None:
        self.console.print(msg, markup=False)

    def summary(self, rows: list[tuple[str, str]]) -> None:
        self.close()  # the footer goes first: the summary is the last thing on the screen
        self.banner(rows)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        self._mark_live(False)


class _Footer:
    """The live view's footer, rendered anew at each refresh (so a stop request shows within one)."""

    def __init__(self, view: RichView):
        self.view = view

    def __rich_console__(self, console, options):
        from rich.console import Group
        from rich.text import Text

        parts = []
        if self.view.rest:
            parts.append(
                Text("  ").join(Text.assemble((f"{k} ", "bold cyan"), v.strip()) for k, v in self.view.rest)
            )
        if stop_requested():
            parts.append(Text(STOPPING, style="bold yellow"))
        parts.append(self.view.progress)
        yield Group(*parts)


def stop_requested() -> bool:
    """Whether this process got a stop request (Ctrl-C through the launcher, a scheduler's SIGTERM)."""
    from muonrun.checkpoint.stop import requested

    return requested()


def make_view(mode: str, prefix: str = "") -> PlainView | RichView:
    """`plain`, `rich` (even when stdout is not a terminal) or `auto` (rich on a terminal)."""
    if mode == "rich" or (mode == "auto" and sys.stdout.isatty()):
        return RichView(force_terminal=True if mode == "rich" else None)
    return PlainView(prefix=prefix)
