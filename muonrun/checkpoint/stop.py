"""Stop requests: SIGTERM / SIGUSR1 (a scheduler's preemption) and Ctrl-C, turned into a flag that the
ranks agree on after a step, save at that step and stop cleanly.

A handler only sets the flag: saving inside it could interrupt a collective. A second Ctrl-C stops at
once (KeyboardInterrupt, reported in one line by the CLI), losing the steps since the last checkpoint.
In a multi-worker job the launcher handles Ctrl-C for its workers (muonrun/launch/launcher.py), which ignore it.
"""

from __future__ import annotations

import contextlib
import signal

from muonrun import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopFlag:
    """Signal handlers that record a stop request. Previous handlers come back on `restore()`."""

    def __init__(self):
        self.raised: int | None = None
        self._previous = {}
        for sig in STOP_SIGNALS:
            if sig == signal.SIGINT and signal.getsignal(sig) is signal.SIG_IGN:
                continue  # a worker of a multi-worker job: its launcher turns Ctrl-C into SIGTERM
            # ValueError outside the main thread (an embedding application): no stop requests there.
            with contextlib.suppress(ValueError):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.raised == signal.SIGINT:
                raise KeyboardInterrupt
            log.warning(
                "Ctrl-C: saving a checkpoint after this step, then stopping "
                "(Ctrl-C again stops at once, without saving)."
            )
        elif self.raised is None:
            # A step can take minutes: say at once that the request was heard and what happens next
            # (muonrun.log's handler lock is re-entrant, so interrupting a logging call is safe).
            log.warning(
                f"{signal.Signals(signum).name} received: the step in progress finishes, then a "
                "checkpoint is saved and training stops."
            )
        self.raised = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
