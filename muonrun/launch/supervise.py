"""The launcher's side while torch's elastic agent runs the workers (in this process's main thread):
signals, reports, and the restart message. Public API only: torch's agent is started by
`elastic_launch` and never patched.

- SIGTERM, SIGUSR1 (a scheduler's preemption) and SIGHUP (a closed terminal) are passed on to the
  workers, once (repeats change nothing; workers a restart starts after it get it too), which save a
  checkpoint within two steps and exit 0. Ctrl-C: the first does the
  same, the second stops at once. SIGQUIT stops at once, without saving. The workers are this
  process's children (`multiprocessing.active_children()`), since the agent runs in this process.
- A worker that reports a user mistake or a non-finite step (muonrun/launch/worker.py) sends SIGUSR2:
  the handler stops every worker and raises `WorkersReported` out of the agent, which shuts down
  without restarting them. A report of an early stop (a stop request during data preparation) first
  gives the other workers, which got the same request, a few seconds to report too: the one that
  tokenizes removes its half-built cache folder before it does.
- Restarts (`--max-restarts`): a thread per worker waits for it to exit, without reaping it
  (`os.waitid(..., WNOWAIT)`; the agent reaps its own children); one that exits with an error is
  announced: which rank failed, how, and which checkpoint the restart resumes from. The agent's own log says it at INFO level only,
  without the reason, and muonrun silences the agent's logging.
- A woken waiter can still lose its worker's status: the kernel wakes it when the worker exits, but if
  the agent reaps the worker before the waiter thread runs (a loaded machine), its `waitid` finds no
  child. So a SIGCHLD handler also peeks at every registered worker (`WNOHANG | WNOWAIT`) and keeps
  the statuses: it runs in the main thread, where the agent reaps, before the agent's next step, and a
  waiter that finds its worker gone reads the status from there.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import threading
import time
from multiprocessing import resource_tracker
from pathlib import Path

from muonrun import log
from muonrun.checkpoint.stop import TERMINAL_SIGNALS, Quit, detach_from_terminal
from muonrun.errors import UserError
from muonrun.launch.lock import pid_exists
from muonrun.launch.worker import REPORTED, REPORTS, STOPPED_EXIT
from muonrun.observe.console import LIVE_VIEW_FILE


class WorkersReported(Exception):  # noqa: N818 (an event, not an error of the launcher's)
    """A worker reported a user mistake or a non-finite step: the agent must stop, not restart."""


LEAK_WARNING_FILTER = "ignore:resource_tracker:UserWarning"


def quiet_leak_warnings() -> None:
    """A worker the launcher stops at once (SIGKILL) leaves the semaphores it made (tqdm's write lock,
    made by datasets) registered with the resource tracker it shares with the launcher: the tracker
    unlinks them when the launcher exits, and warns of each. Expected here, so not shown: the filter
    travels in PYTHONWARNINGS to the tracker (started later, by the first semaphore) and the workers."""
    current = os.environ.get("PYTHONWARNINGS", "")
    if LEAK_WARNING_FILTER not in current.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [current, LEAK_WARNING_FILTER]))


def stop_workers_now() -> None:
    """SIGKILL every worker (the agent's children in this process)."""
    for child in multiprocessing.active_children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)


def start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the workers' semaphores) now, with the terminal's signals
    ignored, which it keeps. It handles neither Ctrl-\\ nor a hangup, and a terminal sends them to every
    process of its foreground group: killed by one, it is started again by the next worker that
    registers a semaphore, and that one's cleanup prints a KeyError traceback. Started by the agent with
    the first worker instead, it would also unblock SIGINT in the agent's thread (see `__enter__`)."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in TERMINAL_SIGNALS}
    try:
        resource_tracker.ensure_running()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# How long a worker that exited with an error waits before it is named as the failure: a peer killed by a
# signal at the same moment is the likelier cause, and its waiter speaks first in that time.
PEER_GRACE_S = 0.5
# How long an early stop's report waits for the other workers to report or exit before they are killed:
# they got the same stop request and stop within a batch of their work (checkpoint/stop.py: check_stop).
EARLY_STOP_GRACE_S = 20.0


class Supervisor:
    """`with Supervisor(control, output_dir, max_restarts): elastic_launch(...)(...)`; `resume_from` and
    `init_from`: the run's checkpoint settings, for the restart message."""

    def __init__(
        self,
        control: Path,
        output_dir: Path,
        max_restarts: int,
        resume_from: str | None = None,
        init_from: str | None = None,
    ):
        self.control, self.output_dir, self.max_restarts = control, output_dir, max_restarts
        self.resume_from, self.init_from = resume_from, init_from
        self.stopping = False  # the launcher stops the workers itself: their exits are not failures
        self._interrupts = 0
        self._stop_signal: int | None = None  # the stop request passed on to the workers, once
        self._previous: dict[int, object] = {}
        self._done = threading.Event()
        self._watch = threading.Thread(target=self._watch_exits, daemon=True, name="muonrun-watch")
        self._announced: set[int] = set()  # attempts whose failure was announced
        self._lock = threading.Lock()  # the waiters of one attempt's workers may fire together
        self._exits: dict[int, tuple[int, int]] = {}  # pid: (si_code, si_status), kept by _child_exited
        self._seen: dict[int, tuple[float, bool, int]] = {}  # pid: (when its exit was seen, killed, status)
        self._mask: set[signal.Signals] | None = None  # this thread's signal mask before __enter__

    def __enter__(self) -> Supervisor:
        start_resource_tracker()
        handlers = {
            signal.SIGTERM: self._stop_request,
            signal.SIGUSR1: self._stop_request,
            signal.SIGHUP: self._stop_request,
            signal.SIGINT: self._interrupt,
            signal.SIGQUIT: self._quit,
            REPORTED: self._reported,
        }
        for sig, handler in handlers.items():
            if sig in TERMINAL_SIGNALS and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # ignored by whoever started muonrun (nohup, a script's `&`): the workers inherit it
            self._previous[sig] = signal.signal(sig, handler)
        if hasattr(os, "waitid"):
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._child_exited)
            self._watch.start()
            # A terminal sends Ctrl-C, Ctrl-\ and its hangup to every process of its foreground group,
            # the workers too, which die of them while they still import (a crash report instead of a
            # save). Blocked in this thread, the agent's, they are blocked in every worker it spawns (a
            # signal mask survives fork and exec) until `worker_entry` has its handlers and unblocks them.
            # This process still gets them, through the watcher thread (started before, so not blocked),
            # and Python runs the handlers above in this thread as before, when the agent next wakes.
            # (The resource tracker, started above, would unblock SIGINT here if it started with a worker.)
            self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
        return self

    def __exit__(self, *exc) -> None:
        if self._mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        self._done.set()
        if self._watch.is_alive():
            self._watch.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    # -- signals (run in the main thread, between the agent's own steps)

    def _stop_request(self, signum, frame) -> None:
        """Passed on once: the workers need one request, and a repeat that reached a worker already
        past its save would only disturb its exit."""
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if self._stop_signal is not None:
            return
        self._stop_signal = signum
        if not self._view_speaks():
            log.info(
                f"got {signal.Signals(signum).name}: the workers save a checkpoint within two steps (the "
                "ranks agree on one first), then stop."
            )
        self._forward(signum)

    def _view_speaks(self) -> bool:
        """Whether rank 0's live view runs on this terminal, and says what a stop request does: a line
        written here would break its redrawn footer (muonrun/observe/console.py)."""
        return (self.control / LIVE_VIEW_FILE).exists()

    def _forward(self, signum: int) -> None:
        """To the workers (this process's children) that registered, whose handlers record it. One still
        starting (importing) would die of it, a crash instead of a save: the watcher sends it the request
        once it registers."""
        registered = set(self._registered())
        for child in multiprocessing.active_children():
            if child.pid in registered:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signum)

    def _interrupt(self, signum, frame) -> None:
        """Ctrl-C, which the workers ignore: they get it only through here."""
        self._interrupts += 1
        if self._interrupts == 1:
            if not self._view_speaks():
                print(flush=True)  # past the ^C the terminal echoed
                log.info(
                    "Ctrl-C: the workers save a checkpoint within two steps, then stop "
                    "(Ctrl-C again stops at once, without saving)."
                )
            if self._stop_signal is None:
                self._stop_signal = signal.SIGTERM
                self._forward(signal.SIGTERM)
            return
        self._stop_now()
        raise KeyboardInterrupt

    def _quit(self, signum, frame) -> None:
        log.info(
            "got SIGQUIT: stopping the workers now, without saving; a rerun resumes from the last checkpoint."
        )
        self._stop_now()
        raise Quit

    def _reported(self, signum, frame) -> None:
        if self.stopping:
            return  # another worker's report, while the first one's is being acted on
        if not self._reports():  # a worker writes its report first
            log.warning("got SIGUSR2 from outside the job (its workers use it to report a failure): ignored.")
            return
        if self._early_stop_reported():
            self._wait_for_reports(EARLY_STOP_GRACE_S)
        self._stop_now()
        raise WorkersReported

    def _reports(self) -> list[Path]:
        return sorted((self.control / "reports").glob(REPORTS))

    def _early_stop_reported(self) -> bool:
        return all(p.name.startswith(f"exit{STOPPED_EXIT}-") for p in self._reports())

    def _wait_for_reports(self, timeout_s: float) -> None:
        """Until every registered worker has reported or exited, `timeout_s` at most."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reported = {p.stem.rpartition("-pid")[2] for p in self._reports()}
            if all(
                str(pid) in reported or pid in self._seen or not pid_exists(pid) for pid in self._registered()
            ):
                return
            time.sleep(0.1)

    def _stop_now(self) -> None:
        self.stopping = True
        stop_workers_now()

    # -- restarts

    def _child_exited(self, signum, frame) -> None:
        """SIGCHLD: keep how each registered worker that has exited ended, before the agent reaps it."""
        with contextlib.suppress(OSError):
            for pid in self._registered():
                if pid in self._exits:
                    continue
                try:
                    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:  # reaped already, or not this process's child
                    continue
                if info is not None:
                    self._exits[pid] = (info.si_code, info.si_status)
                    self._saw(pid, info.si_code, info.si_status)

    def _watch_exits(self) -> None:
        """Start a waiter for each worker as it registers."""
        watched: set[int] = set()
        while not self._done.wait(0.2):
            for pid in self._registered():
                if pid not in watched:
                    watched.add(pid)
                    threading.Thread(target=self._wait_for, args=(pid,), daemon=True).start()
                    if self._stop_signal is not None:  # started (restarted) after the stop request
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, self._stop_signal)

    def _registered(self) -> list[int]:
        """The pids of the workers that registered in the control folder (`workers/<pid>`), any attempt."""
        with contextlib.suppress(OSError):
            return [int(p.name) for p in (self.control / "workers").iterdir() if p.name.isdigit()]
        return []

    def _wait_for(self, pid: int) -> None:
        """Block until worker `pid` exits and read how, leaving it for the agent to reap (WNOWAIT). The
        kernel wakes this waiter the moment the worker exits; the agent looks every monitor interval."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            code, status = info.si_code, info.si_status
        except ChildProcessError:  # reaped already (the SIGCHLD handler saw how), or not this process's child
            if pid not in self._exits:
                return
            code, status = self._exits[pid]
        killed = self._saw(pid, code, status)
        if killed or status:
            self._failed(self._entry(pid), status, killed)

    def _saw(self, pid: int, code: int, status: int) -> bool:
        """Note when worker `pid`'s exit was first seen (for `cause`); whether a signal killed it."""
        killed = code in (os.CLD_KILLED, os.CLD_DUMPED)
        self._seen.setdefault(pid, (time.monotonic(), killed, status))
        return killed

    def cause(self) -> tuple[int, str] | None:
        """(rank, signal name) of the worker whose death by a signal ended the job, or None: the first
        worker seen to exit, or one killed within PEER_GRACE_S of it (its peers then fail in a
        collective with it, "Connection reset by peer", and may exit first)."""
        if not self._seen:
            return None
        first = min(when for when, _, _ in self._seen.values())
        killed = sorted((when, pid, status) for pid, (when, k, status) in self._seen.items() if k)
        for when, pid, status in killed:
            entry = self._entry(pid)
            if when - first <= PEER_GRACE_S and "rank" in entry:
                return entry["rank"], _signal_name(status)
        return None

    def _entry(self, pid: int) -> dict:
        with contextlib.suppress(OSError, ValueError):
            return json.loads((self.control / "workers" / str(pid)).read_text())
        return {}

    def _failed(self, entry: dict, status: int, killed: bool) -> None:
        """A worker exited with an error: announce the restart the agent makes of it, once per attempt."""
        attempt = entry.get("attempt", 0)
        if not killed:  # often a peer's consequence (its collective lost a killed rank): let that one speak
            time.sleep(PEER_GRACE_S)
        with self._lock:
            if self.stopping or any((self.control / "reports").glob(REPORTS)) or attempt in self._announced:
                return  # the launcher stops the workers itself, or a report ends the job
            self._announced.add(attempt)
        if attempt >= self.max_restarts:
            return  # the agent gives up: the launcher reports the failure when it returns
        how = f"killed by {_signal_name(status)}" if killed else f"exit code {status}"
        if entry.get("failure") and not killed:
            how += f": {entry['failure']}"
        who = f"worker rank {entry['rank']}" if "rank" in entry else "a worker"
        log.warning(
            f"{who} failed ({how}); restarting the workers (restart {attempt + 1} of {self.max_restarts}), "
            f"{self._restart_point()}."
        )

    def _restart_point(self) -> str:
        """What the restarted workers load first, by the checkpointer's own rule (`resume.load_order`): with
        `resume_from`, its line's latest or itself, not the folder's newest checkpoint."""
        from muonrun.checkpoint.resume import load_order

        try:
            order = load_order(self.resume_from, self.init_from, self.output_dir / "checkpoints")
        except UserError:  # the restarted workers say why
            order = []
        if not order:
            return "resuming from the start (no checkpoint yet)"
        kind, path, _ = order[0]
        return (
            f"resuming from {path}"
            if kind == "resume"
            else f"starting from the weights of {path} (checkpoint.init_from)"
        )
