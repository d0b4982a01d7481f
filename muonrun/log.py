"""muonrun's one message channel: every line a user reads that is not a metrics row goes through here.

    from muonrun import log
    log.info("weights loaded from Qwen/Qwen2.5-0.5B")      # muonrun: weights loaded ...   (stdout)
    log.warning("the data changed since the checkpoint")   # muonrun: WARNING: the data ... (stderr)

Only rank 0 speaks (the `RANK` torchrun sets; a process without one is rank 0): every rank runs the same
code, so a message would otherwise appear once per worker. A message only one rank can know (its own
data shard, its own error) passes `every_rank=True`. The metrics rows have their own view
(muonrun/observe/console.py); Python warnings raised by libraries stay theirs.
"""

from __future__ import annotations

import logging
import os
import sys

_logger = logging.getLogger("muonrun")


class _Plain(logging.Handler):
    """`muonrun: message` on stdout, warnings and errors on stderr, resolved at each write (so a
    redirected or captured stream is honoured), flushed at once (cluster log files interleave ranks)."""

    def emit(self, record: logging.LogRecord) -> None:
        if os.environ.get("RANK", "0") != "0" and not getattr(record, "every_rank", False):
            return
        warning = record.levelno >= logging.WARNING
        stream = sys.stderr if warning else sys.stdout
        label = "WARNING: " if record.levelno == logging.WARNING else ""
        stream.write(f"muonrun: {label}{record.getMessage()}\n")
        stream.flush()


if not _logger.handlers:
    _logger.addHandler(_Plain())
    _logger.setLevel(logging.INFO)
    _logger.propagate = False


def info(message: str, *, every_rank: bool = False) -> None:
    _logger.info(message, extra={"every_rank": every_rank})


def warning(message: str, *, every_rank: bool = False) -> None:
    _logger.warning(message, extra={"every_rank": every_rank})


def error(message: str, *, every_rank: bool = False) -> None:
    """A failure the user must read (the paragraph that ends a run); no WARNING label."""
    _logger.error(message, extra={"every_rank": every_rank})


_said: set[str] = set()


def once(key: str, message: str, *, warn: bool = False) -> None:
    """``info`` (``warning`` with ``warn``) the first time this process says ``key``, nothing after:
    for a fact about the machine that every step would otherwise repeat."""
    if key not in _said:
        _said.add(key)
        (warning if warn else info)(message)
