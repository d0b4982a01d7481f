"""Stop requests: SIGTERM / SIGUSR1 (a scheduler's preemption), SIGHUP (a closed terminal, a dropped ssh
connection) and Ctrl-C, turned into a flag that the ranks agree on after a step, save at that step and
stop cleanly. SIGQUIT stops at once, without saving.

A handler only sets the flag: saving inside it could interrupt a collective, and a step in flight
finishes first (the save comes after it, however long it takes). A second Ctrl-C stops at once
(KeyboardInterrupt, reported in one line by the CLI), losing the steps since the last checkpoint.
In a multi-worker job the launcher handles Ctrl-C and SIGQUIT for its workers (muonrun/launch/), which
ignore them; a signal its shell or the user sets to ignored (`nohup` ignores SIGHUP) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP, signal.SIGINT)
# What a terminal sends: ignored when inherited ignored (nohup, a script's background job, or a worker,
# whose launcher handles Ctrl-C and SIGQUIT). A scheduler's SIGTERM and SIGUSR1 always count.
TERMINAL_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
LAUNCHER_PID_ENV = "MUONRUN_LAUNCHER_PID"  # the launcher's pid, in its workers' environment

_requested: int | None = None  # the last stop request of this process (and one from before its StopFlag)


class Quit(KeyboardInterrupt):
    """SIGQUIT: stop at once, without saving (the CLI says so and exits 131, as a shell reports it)."""

    signal_name = "SIGQUIT"
    exit_code = 128 + signal.SIGQUIT


def detach_from_terminal() -> None:
    """After SIGHUP: point stdout and stderr that go to a terminal at /dev/null. A hung-up terminal
    fails every write (EIO), which would turn the save that SIGHUP asks for into a crash; output that
    goes to a file or a pipe (a cluster's log) is kept."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        null_dev = os.fstat(null).st_rdev
        for fd in (1, 2):
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if stat.S_ISCHR(st.st_mode) and st.st_rdev != null_dev:
                    os.dup2(null, fd)
    finally:
        os.close(null)


def _in_charge() -> bool:
    """Whether this process speaks for itself about stop requests: no muonrun launcher above it (the
    single in-process worker, or a script under plain torchrun). Under the launcher, it speaks."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    return launcher is None or launcher == str(os.getpid())


def _say(message: str) -> None:
    from muonrun import log

    log.info(message)


def requested() -> bool:
    """Whether this process got a stop request (MUONRUN_FAULT=hang@STEP waits for one)."""
    return _requested is not None


class StoppedEarly(BaseException):  # noqa: N818 (an event, like KeyboardInterrupt; libraries pass it on)
    """A stop request during start-up work that cannot be saved and may take long (data preparation):
    the worker stops at once, with nothing trained or saved."""


PREPARING = "preparing the data"


def check_stop(what: str = PREPARING) -> None:
    """Raise `StoppedEarly` if this process got a stop request: called every few seconds at most by work
    before training (`what` it is doing, in the same words on every rank: the launcher prints it once)."""
    if _requested is None:
        return
    name = signal.Signals(_requested).name
    raise StoppedEarly(
        f"got {name} while {what}: stopped before the first step, so nothing was trained or saved. Rerun to "
        "continue: the data sources already prepared stay in the cache (MUONRUN_CACHE)."
    )


def _record_early(signum, frame) -> None:
    global _requested
    if signum == signal.SIGHUP:
        detach_from_terminal()
    _requested = signum


def record_early() -> None:
    """Record stop requests from now on, before the trainer's StopFlag exists (a worker's start-up:
    imports, model build, checkpoint load): the StopFlag starts with the request, so the run saves after
    its first step and stops, instead of dying of a signal it had no handler for yet."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT and not (sig in TERMINAL_SIGNALS and signal.getsignal(sig) is signal.SIG_IGN):
            with contextlib.suppress(ValueError):
                signal.signal(sig, _record_early)


def ignore_stop_requests() -> None:
    """Once training has ended (finished, or saved and stopped), a stop request has nothing left to ask
    for: ignored from now on. Left to their default action, which interpreter teardown restores for
    every signal a Python handler had, a repeated SIGTERM during teardown (a scheduler's, or a user's
    second kill) would turn a clean stop into a death by signal, and a launcher with restarts left
    would restart the workers."""
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT:  # Ctrl-C: a worker ignores it already; a lone process keeps it
            with contextlib.suppress(ValueError):
                signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    """Signal handlers that record a stop request. Previous handlers come back on `restore()`."""

    def __init__(self):
        self.raised: int | None = _requested
        self._previous = {}
        for sig in (*STOP_SIGNALS, signal.SIGQUIT):
            if sig in TERMINAL_SIGNALS and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # a worker's Ctrl-C and SIGQUIT (its launcher handles them), or nohup's SIGHUP
            # ValueError outside the main thread (an embedding application): no stop requests there.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            detach_from_terminal()
        if signum == signal.SIGQUIT:
            _say("got SIGQUIT: stopping now, without saving; a rerun resumes from the last checkpoint.")
            raise Quit
        if signum == signal.SIGINT:
            if self.raised == signal.SIGINT:
                raise KeyboardInterrupt
            print(flush=True)  # past the ^C the terminal echoed
            _say(
                "Ctrl-C: saving a checkpoint within two steps, then stopping "
                "(Ctrl-C again stops at once, without saving)."
            )
        elif self.raised is None and _in_charge():
            _say(
                f"got {signal.Signals(signum).name}: saving a checkpoint within two steps (once the ranks agree "
                "on one), then stopping."
            )
        global _requested
        self.raised = _requested = signum

    def restore(self) -> None:
        global _requested
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        _requested = None
