"""The live view as a terminal shows it: rows that fit 100 columns, in columns that line up (eval rows
too), the ETA on every row, a footer that is erased at the end, a stop request acknowledged at once with
what happens next, the checkpoint's line after its step's row, and a summary at the end. The terminal is
a small emulator of what rich's live display sends (carriage return, erase line, cursor up), fed the
view's output, or a real run's through a pseudo-terminal.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import cli_env

from muonrun.observe import console
from muonrun.observe.console import STOPPING, PlainView, RichView, summary_rows

WIDTH = 100
CSI = re.compile(r"\x1b\[([0-9;?]*)([A-Za-z])")
BAR = "━"  # rich's progress bar: only the footer draws it


def screen(data: str, width: int = WIDTH) -> tuple[list[str], list[str]]:
    """(the lines a terminal `width` columns wide is left with, scrollback included; the lines it had to
    wrap because they were written longer than `width`)."""
    lines, row, col, wrapped, i = [""], 0, 0, [], 0
    while i < len(data):
        ch = data[i]
        m = CSI.match(data, i) if ch == "\x1b" else None
        if m:
            arg, cmd = m.groups()
            n = int(arg) if arg.isdigit() else 1
            if cmd == "A":
                row = max(0, row - n)
            elif cmd == "K":
                lines[row] = "" if arg == "2" else lines[row][:col]
            i = m.end()
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":  # as a terminal shows output (a pseudo-terminal's output sends \r\n)
            row, col = row + 1, 0
        elif ch >= " ":
            if col >= width:
                wrapped.append(lines[row])
                row, col = row + 1, 0
            while len(lines) <= row:
                lines.append("")
            lines[row] = lines[row].ljust(col)[:col] + ch + lines[row][col + 1 :]
            col += 1
        while len(lines) <= row:
            lines.append("")
        i += 1
    return [line.rstrip() for line in lines], wrapped


def row(step: int, **extra) -> dict:
    return {
        "step": step,
        "loss": 2.5 / step,
        "lr": 0.02,
        "lr_muon": 0.02,
        "lr_adamw": 0.0002,
        "grad_norm": 0.7,
        "tokens_per_s": 2000.0 * step,
        "tokens_per_s_per_device": 1000.0 * step,
        "mfu": 0.42,
        "peak_mem_gib": 1.5,
        "step_time": 0.1,
        "data_wait_time": 0.0,
        **extra,
    }


def test_the_rich_view_fits_100_columns_lines_up_and_leaves_no_footer(tmp_path, monkeypatch):
    from muonrun.launch.worker import CONTROL_ENV

    assert console.CONTROL_ENV == CONTROL_ENV  # copied there (an import would be a cycle)
    monkeypatch.setenv(CONTROL_ENV, str(tmp_path))  # as under the launcher
    stopping = False
    monkeypatch.setattr(console, "stop_requested", lambda: stopping)
    buf = io.StringIO()
    view = RichView(force_terminal=True, file=buf, width=WIDTH)
    view.start(0, 1000)
    assert (tmp_path / console.LIVE_VIEW_FILE).exists()  # the launcher leaves stop messages to the view
    for step in (10, 20, 100):
        view.advance(step)
        view.step(row(step), 1000, eta=3600.0 / step)
    view.eval({"step": 100, "eval_loss": 2.4, "eval_ppl": 11.0, "eval_time": 0.2})
    footer = buf.getvalue()
    assert "tok/s/dev" in footer and BAR in footer  # the fields the rows leave out, and the progress
    stopping = True
    view.advance(101)
    view.summary(
        summary_rows(120, 1000, 75.0, 1.234, 1.5, "runs/x/checkpoints/step-120", None, "runs/x", "x")
    )
    assert not (tmp_path / console.LIVE_VIEW_FILE).exists()
    lines, wrapped = screen(buf.getvalue())
    assert not wrapped and all(len(line) <= WIDTH for line in lines), wrapped
    assert not any(BAR in line for line in lines), lines  # the footer is gone
    steps = [line for line in lines if line.startswith("step ")]
    (evals,) = [line for line in lines if line.startswith("eval ")]
    assert len(steps) == 3 and all(" eta 0:" in line for line in steps), steps
    for label in ("loss", "lr_muon", "lr_adamw", "grad_norm", "eta"):  # columns line up row after row
        assert len({line.index(f" {label} ") for line in steps}) == 1, (label, steps)
    assert evals.index("/1000") == steps[0].index("/1000"), (evals, steps[0])
    assert sum(STOPPING[:40] in line for line in lines) == 1, lines  # said once in the history
    assert lines.index(next(line for line in lines if "stopped" in line)) > lines.index(evals)
    text = " ".join(" ".join(lines).split())
    assert "step 120/1,000 in 0:01:15 (stopped early), final loss 1.2340, eval loss 1.5000" in text
    assert "runs/x/checkpoints/step-120: rerun the same command to resume" in text
    assert "export muonrun export runs/x hf/x" in text


def test_summary_rows_say_where_the_run_ended_and_what_next():
    done = dict(summary_rows(50, 50, 3.0, 2.0, None, "r/checkpoints/step-50", "r/hf", "r", "n"))
    assert done["done"] == "step 50/50 in 0:00:03, final loss 2.0000"
    assert done["exported"].startswith("r/hf: AutoModelForCausalLM.from_pretrained('r/hf')")
    assert "export" not in done and done["checkpoint"] == "r/checkpoints/step-50"
    none = dict(summary_rows(50, 50, 3.0, None, None, None, None, "r", "n"))
    assert "none saved" in none["checkpoint"] and "export" not in none
    buf = io.StringIO()
    PlainView(stream=buf).summary(list(done.items()))
    assert "muonrun done        step 50/50" in buf.getvalue()


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_run_in_a_terminal_acknowledges_ctrl_c_and_ends_with_a_summary(tmp_path):
    """Two workers with the live view in a 100-column terminal; rank 0's step 6 lasts until a stop request
    (MUONRUN_FAULT=hang@6), and Ctrl-C reaches every process of the terminal's group once step 4's
    checkpoint is saved, as a terminal sends it. What the terminal is left with: the view's word on what
    happens next (the launcher leaves it to the view), no footer, no row wider than 100 columns, step 4's
    checkpoint line after step 4's row (evaluation is not at step 4), the eval row in line with the step
    rows, and the summary."""
    import fcntl
    import select
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, WIDTH, 0, 0))
    env = cli_env("hang@6")
    env.pop("COLUMNS", None)
    env.update(TERM="xterm-256color")
    run = tmp_path / "run"
    args = [
        *("pretrain", "tiny", f"output_dir={run}", "data.seq_len=64", "train.micro_batch_size=4"),
        *("train.max_steps=12", "train.eval_interval=6", "logging.log_interval=2", "checkpoint.interval=4"),
        *("logging.console=rich", "optimizer.name=muon"),
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "muonrun", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    data, interrupted = b"", False
    deadline = time.monotonic() + 300  # a run that never ends fails here instead of hanging the suite
    try:
        while True:
            if not select.select([master], [], [], max(0.0, deadline - time.monotonic()))[0]:
                pytest.fail(f"the run did not end in 300 s: {data.decode(errors='replace')[-3000:]}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other side closed: every process of the run is gone
                break
            if not chunk:
                break
            data += chunk
            # the line may be folded where the run folder's path is long: compare without the breaks
            if not interrupted and b"checkpoints/step-4saved" in re.sub(rb"\s+", b"", data):
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's whole foreground group
                interrupted = True
        assert proc.wait(timeout=300) == 0, data.decode(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.close(master)
    lines, wrapped = screen(data.decode("utf-8", "replace"))
    shown = "\n".join(lines)
    assert not wrapped and not any(BAR in line for line in lines), shown
    assert sum(STOPPING[:40] in line for line in lines) == 1 and "the workers save" in shown, shown
    assert "Ctrl-C: the workers save" not in shown  # the launcher's own line would break the footer
    steps = {int(line.split()[1].split("/")[0]): line for line in lines if line.startswith("step ")}
    assert all(" eta " in line for line in steps.values()), shown
    (evals,) = [line for line in lines if line.startswith("eval ")]
    assert evals.index("/12") == steps[6].index("/12"), shown
    saved = next(  # the line that ends step-4's saved line (folded anywhere where the path is long)
        i
        for i in range(len(lines))
        if "checkpoints/step-4saved(written" in "".join("".join(lines[: i + 1]).split())
    )
    assert lines.index(steps[4]) < saved < lines.index(steps[6]), shown
    stopped = re.search(r"Stopped by signal after step (\d+); checkpoint saved", shown)
    assert stopped and int(stopped.group(1)) in (6, 7, 8), shown  # saved within two steps of step 6
    text = " ".join(shown.split())
    assert f"stopped step {stopped.group(1)}/12 in 0:" in text and "(stopped early), final loss" in text
    assert "…" not in shown  # nothing cut short: a path longer than a line is folded
    whole = "".join(shown.split())
    assert f"{run}/checkpoints/step-{stopped.group(1)}:rerunthesamecommandtoresume" in whole, shown
    assert f"muonrunexport{run}hf/tiny" in whole, shown
