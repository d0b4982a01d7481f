"""Rank 0's console: a rich live view on a terminal, plain grep-able lines elsewhere (cluster log files).

`logging.console`: `auto` picks rich when stdout is a terminal. Plain lines never contain escape codes:

    step    120/1000 loss 3.2104 lr 3.000e-04 grad_norm 0.812 tok/s 12,345 tok/s/dev 6,172 mfu 41.2% mem 12.30GiB step_time 0.530s data_wait 0.002s eta 0:07:42
    eval    100/1000 eval_loss 3.3011 eval_ppl 27.15 eval_time 4.1s

With several optimizers (`optimizer.name=muon`: Muon for the hidden matrices, AdamW for the rest) each
one's learning rate has its own field, named as in metrics.jsonl: `lr_muon 2.000e-02 lr_adamw 2.000e-04`.
"""

from __future__ import annotations

import datetime
import sys
from typing import TextIO

LOG_WIDTH = 200  # columns for tables printed into a file or pipe


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


def step_fields(row: dict, max_steps: int, eta: float | None) -> list[tuple[str, str]]:
    """(label, value) pairs of one logged step, shared by both views; missing values are left out."""
    fields = [
        ("step", f"{row['step']:>6}/{max_steps}"),
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
            f"eval {row['step']:>6}/{self._max_steps} " + " ".join(f"{k} {v}" for k, v in eval_fields(row))
        )

    def note(self, msg: str) -> None:
        self._print(msg)

    def close(self) -> None:
        pass


class RichView:
    """A live footer (the latest logged metrics, a progress bar, elapsed time and ETA) under a scrolling
    history of logged steps, eval results and notes."""

    def __init__(self, force_terminal: bool | None = None, file: TextIO | None = None):
        from rich.console import Console

        self.console = Console(force_terminal=force_terminal, file=file, highlight=False)
        self.live = None
        self._max_steps = 0

    def banner(self, rows: list[tuple[str, str]]) -> None:
        from rich.table import Table

        table = Table(
            title="[bold]muonrun[/]", show_header=False, title_justify="left", box=None, padding=(0, 2)
        )
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
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
        self.latest = None
        self.live = Live(self._render(), console=self.console, refresh_per_second=2)
        self.live.start()

    def _render(self):
        from rich.console import Group

        return Group(self.latest, self.progress) if self.latest is not None else self.progress

    def advance(self, step: int) -> None:
        self.progress.update(self.task, completed=step)

    def step(self, row: dict, max_steps: int, eta: float | None) -> None:
        from rich.text import Text

        fields = step_fields(row, max_steps, eta)
        self.console.print(" ".join(f"[dim]{k}[/] {v}" for k, v in fields[:-1]))  # the scrolling history
        self.latest = Text.assemble(
            *[part for k, v in fields[1:-1] for part in ((f"{k} ", "bold cyan"), f"{v}  ")], no_wrap=False
        )
        self.progress.update(self.task, completed=row["step"], eta=format_eta(eta))
        self.live.update(self._render())

    def eval(self, row: dict) -> None:
        self.console.print(
            f"[bold magenta]eval[/] {row['step']}/{self._max_steps} "
            + " ".join(f"[dim]{k}[/] {v}" for k, v in eval_fields(row))
        )

    def note(self, msg: str) -> None:
        self.console.print(msg, markup=False)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def make_view(mode: str, prefix: str = "") -> PlainView | RichView:
    """`plain`, `rich` (even when stdout is not a terminal) or `auto` (rich on a terminal)."""
    if mode == "rich" or (mode == "auto" and sys.stdout.isatty()):
        return RichView(force_terminal=True if mode == "rich" else None)
    return PlainView(prefix=prefix)
