"""Fault injection for tests and drills, read from ONE environment variable: MUONRUN_FAULT.

    MUONRUN_FAULT=nan@7            rank 0's loss becomes NaN at step 7 (the run must stop and save nothing of it)
    MUONRUN_FAULT=kill@7           rank 0 SIGKILLs itself after step 7's optimizer step (a crashed worker)
    MUONRUN_FAULT=kill@save:8      rank 0 SIGKILLs itself in the middle of step 8's checkpoint save
    MUONRUN_FAULT=term@6           rank 0 sends SIGTERM to the launcher after step 6 (like a scheduler
                                   preempting the job: the launcher forwards it to every worker)
    MUONRUN_FAULT=terms@6          the same, then again every 20 ms until rank 0 exits (a scheduler or a
                                   user that repeats it, into the save and the workers' exit)
    MUONRUN_FAULT=int@6            rank 0 sends SIGINT to the launcher after step 6 (Ctrl-C); int2@6 twice
    MUONRUN_FAULT=hang@6           rank 0's step 6 lasts until a stop request reaches it (10 minutes at
                                   most): a very long step, for stop requests, kills and a second launch
    MUONRUN_FAULT=hang@prepare     the rank that tokenizes a source waits there until a stop request
                                   reaches it (10 minutes at most): a long data preparation

Append `:rN` to pick another rank (`nan@7:r1`). A fault fires only in the first attempt of a job
(TORCHELASTIC_RESTART_COUNT unset or 0), so `--max-restarts` can show the recovery.
Example:  MUONRUN_FAULT=kill@save:8 muonrun pretrain tiny checkpoint.interval=4 --max-restarts 1
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import torch

ENV = "MUONRUN_FAULT"
# muonrun.checkpoint.stop.LAUNCHER_PID_ENV, copied: importing it would be a cycle (muonrun.checkpoint
# imports this module); tests/test_checkpoint.py checks the two are the same.
LAUNCHER_PID_ENV = "MUONRUN_LAUNCHER_PID"
_SPEC = re.compile(r"^(nan|kill|terms|term|int|int2|hang)@(save:)?(\d+)(?::r(\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str  # nan | kill | term | terms | int | int2 | hang
    step: int
    at_save: bool = False
    rank: int = 0
    at_prepare: bool = False


def parse(spec: str | None) -> Fault | None:
    if not spec:
        return None
    if spec.strip() == "hang@prepare":
        return Fault("hang", 0, at_prepare=True)
    m = _SPEC.match(spec.strip())
    if not m or (m.group(2) and m.group(1) != "kill"):
        raise ValueError(
            f"{ENV}='{spec}' is not one of nan@STEP, kill@STEP, kill@save:STEP, term@STEP, terms@STEP, int@STEP, "
            "int2@STEP, hang@STEP (+ :rRANK), hang@prepare"
        )
    return Fault(m.group(1), int(m.group(3)), bool(m.group(2)), int(m.group(4) or 0))


def _active(rank: int) -> Fault | None:
    fault = parse(os.environ.get(ENV))
    if fault is None or fault.rank != rank or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    return fault


def _fires(kind: str, step: int, rank: int, at_save: bool = False) -> bool:
    f = _active(rank)
    return f is not None and f.kind == kind and f.step == step and f.at_save == at_save


def corrupt_loss(loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """`nan@STEP`: the loss of step STEP (1-based, the step being computed) becomes NaN."""
    return loss * float("nan") if _fires("nan", step, rank) else loss


def after_step(step: int, rank: int, stop_requested=lambda: False) -> None:
    """`kill@STEP`, `term@STEP`, `terms@STEP`, `int@STEP`, `int2@STEP` and `hang@STEP`, checked after step
    STEP's update.
    `hang` waits (10 minutes at most) until `stop_requested()`: a step that takes long."""
    if _fires("kill", step, rank):
        os.kill(os.getpid(), signal.SIGKILL)
    if _fires("hang", step, rank):
        deadline = time.monotonic() + 600
        while not stop_requested() and time.monotonic() < deadline:
            time.sleep(0.05)
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, os.getpid()))
    if _fires("term", step, rank):
        os.kill(launcher, signal.SIGTERM)
    if _fires("terms", step, rank):
        threading.Thread(target=_repeat_term, args=(launcher,), daemon=True, name="muonrun-terms").start()
    for i in range(_fires("int", step, rank) + 2 * _fires("int2", step, rank)):
        if i:
            time.sleep(1.0)  # a signal sent while the same one is pending is merged into it
        os.kill(launcher, signal.SIGINT)


def _repeat_term(launcher: int) -> None:
    """SIGTERM to the launcher every 20 ms, until this process exits (a daemon thread)."""
    while True:
        os.kill(launcher, signal.SIGTERM)
        time.sleep(0.02)


def during_prepare(stop_requested) -> None:
    """`hang@prepare`: called as a source's tokenization starts, on whichever rank builds it; waits (10
    minutes at most) until `stop_requested()`."""
    fault = parse(os.environ.get(ENV))
    if fault is None or not fault.at_prepare or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return
    deadline = time.monotonic() + 600
    while not stop_requested() and time.monotonic() < deadline:
        time.sleep(0.05)


def during_save(step: int, rank: int) -> None:
    """`kill@save:STEP`: called after this rank wrote its part of step STEP's checkpoint, before it
    is published."""
    if _fires("kill", step, rank, at_save=True):
        os.kill(os.getpid(), signal.SIGKILL)
