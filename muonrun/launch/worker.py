"""What each worker process runs under the launcher (muonrun/launch/launcher.py), and how it talks to it.

- It dies with its launcher: a parent-death signal (Linux; elsewhere a thread watching its parent) kills
  it the moment the launcher dies, `kill -9` included, so no orphan trains on into a run folder whose lock
  is free again.
- It leaves Ctrl-C and SIGQUIT to the launcher, which forwards a stop request or stops it; stop signals
  that arrive during start-up are kept for the trainer (muonrun/checkpoint/stop.py).
- It registers in the launcher's control folder (`workers/<pid>`: its rank and attempt, and later the
  error that ended it), so the launcher can say which rank failed and how.
- A user mistake (exit code 2) or a non-finite step (3) is reported, not raised: one paragraph in
  `reports/`, then SIGUSR2 to the launcher, which stops every worker at once and exits with that code
  without restarting (resuming is exact, so a restart would meet the same failure at the same step). So is
  a stop request during data preparation (exit code 0: nothing was trained, so nothing is lost), and a
  collective that timed out with no restart left (exit code 1, naming the rank that stalled).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from muonrun import log
from muonrun.checkpoint.stop import (
    LAUNCHER_PID_ENV,
    TERMINAL_SIGNALS,
    StoppedEarly,
    ignore_stop_requests,
    record_early,
)
from muonrun.errors import UserError

USER_ERROR_EXIT = 2
NON_FINITE_EXIT = 3
STOPPED_EXIT = 0  # stopped on request before training (data preparation): nothing lost, nothing saved
STALLED_EXIT = 1  # a collective timed out: a rank stalled (launch/stall.py)
CONTROL_ENV = "MUONRUN_CONTROL_DIR"  # the launcher's control folder on this node
REPORTED = signal.SIGUSR2  # a worker's "I reported; stop us all" to its launcher
REPORTS = "exit*-rank*.txt"  # a report's name: the exit code it calls for, the reporting rank and pid
REPORT_GRACE_S = 60.0  # how long a reporting worker waits for its launcher to stop it


def worker_entry(config_yaml: str) -> None:
    """What each spawned worker runs."""
    die_with_launcher()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the workers through the launcher only
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # so does SIGQUIT (Ctrl-\ in a terminal hits them all)
    record_early()
    # Blocked since the spawn (launch/supervise.py): a terminal's Ctrl-C or Ctrl-\ during the imports is
    # dropped now, its hangup recorded as a stop request.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, TERMINAL_SIGNALS)
    register()

    from torch.distributed.elastic.multiprocessing.errors import record

    from muonrun.config import from_yaml
    from muonrun.distributed import release_process_groups
    from muonrun.launch.stall import is_timeout, restarts_left, stall_message, stalled_ranks
    from muonrun.train.trainer import NonFiniteError, run_worker

    code, message = 0, ""
    try:
        record(run_worker)(config_yaml)
        ignore_stop_requests()
    except (UserError, NonFiniteError) as e:
        code, message = (USER_ERROR_EXIT if isinstance(e, UserError) else NON_FINITE_EXIT), str(e)
    except StoppedEarly as e:  # a stop request before training: nothing to save, every rank stops now
        code, message = STOPPED_EXIT, str(e)
    except BaseException as e:
        if is_timeout(e) and not restarts_left():  # a rank stalled: say which, once, without tracebacks
            timeout_s = from_yaml(config_yaml).launch.collective_timeout_s
            code, message = STALLED_EXIT, stall_message(stalled_ranks(min(timeout_s, 60.0)), timeout_s)
        else:
            lines = str(e).strip().splitlines()
            register(failure=f"{type(e).__name__}: {lines[0] if lines else ''}")  # for the restart message
            raise
    if message:  # outside the except block: the error's traceback (and the trainer its frames hold) is gone
        report(code, message)
    release_process_groups()
    # The exit frees everything at once: collecting the objects torch and transformers made first costs
    # seconds of interpreter teardown per process. Frozen, the final collections skip them.
    gc.freeze()


def die_with_launcher() -> None:
    """Die the moment the launcher does (a no-op in the launcher's own process)."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or int(launcher) == os.getpid():
        return
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(
            target=_watch_parent, args=(int(launcher),), daemon=True, name="muonrun-parent"
        ).start()
    if os.getppid() != int(launcher):  # it died before the signal was armed
        os._exit(1)


def _parent_death_signal(sig: int) -> bool:
    """Linux's PR_SET_PDEATHSIG: the kernel sends `sig` when the parent (the launcher, whose main thread
    runs the elastic agent that started this process) exits. False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(0.5)
    os._exit(1)


def _control() -> Path | None:
    folder = os.environ.get(CONTROL_ENV)
    return Path(folder) if folder else None


def register(failure: str | None = None) -> None:
    """This worker's entry in the control folder: rank, local rank, attempt, and what ended it."""
    control = _control()
    if control is None:
        return
    entry = {
        "rank": int(os.environ.get("RANK", "0")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }
    if failure:
        entry["failure"] = failure[:300]
    with contextlib.suppress(OSError):
        (control / "workers").mkdir(parents=True, exist_ok=True)
        own = control / "workers" / str(os.getpid())
        tmp = own.with_name(f".{own.name}.tmp")  # renamed into place: the launcher never reads half of it
        tmp.write_text(json.dumps(entry))
        tmp.replace(own)


def report(code: int, message: str) -> None:
    """Leave the paragraph for the launcher and have it stop every worker now; never returns.

    The launcher prints each distinct report once and exits with its code. This worker waits for the
    launcher's SIGKILL rather than exiting: exiting first would let a peer fail in a collective with it
    and print a traceback before the launcher stops it. Nothing is torn down either way (os._exit): gloo's
    threads, freed in interpreter teardown under a peer's traffic, can abort the process with "terminate
    called without an active exception"."""
    rank = os.environ.get("RANK", "0")
    control, launcher = _control(), os.environ.get(LAUNCHER_PID_ENV)
    if control is not None and launcher is not None:
        with contextlib.suppress(OSError):
            (control / "reports").mkdir(parents=True, exist_ok=True)
            (control / "reports" / f"exit{code}-rank{rank}-pid{os.getpid()}.txt").write_text(message)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(launcher), REPORTED)
            _flush()
            time.sleep(REPORT_GRACE_S)
    else:
        log.error(message)  # no launcher to print it: rank 0 does
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
