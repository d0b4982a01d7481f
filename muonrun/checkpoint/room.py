"""A save that runs out of room (a full disk or quota, a file-size limit) as one paragraph, not a crash.

    ulimit -f 1024; muonrun pretrain tiny checkpoint.interval=10   # its first save stops here, exit 2

The paragraph is the same on every rank (the launcher prints it once): the save and its folder, what
ran out and what it needed (the newest checkpoint's size, from its manifest), what to do. The
half-written `step-N.tmp` is removed and the checkpoints before it are untouched, so a rerun with room
resumes exactly from the latest one.
"""

from __future__ import annotations

import contextlib
import errno
import threading
from pathlib import Path

from muonrun import compat
from muonrun.checkpoint.files import published_checkpoints, read_meta
from muonrun.errors import UserError
from muonrun.paths import out_of_room, out_of_room_message, remove_own, room_left_in


@contextlib.contextmanager
def save_room(step: int, tmp: Path, root: Path, published: int | None):
    """Around the save of `step` into `tmp` (in `root`; `published`: the newest checkpoint's step, which
    stays): running out of room raises the paragraph as a UserError, with `tmp` removed. DCP's writer
    threads die of it with tracebacks of their own: kept here, and shown only if the save fails for
    another reason."""
    died = []
    before = set(threading.enumerate())
    previous, threading.excepthook = threading.excepthook, died.append
    try:
        yield
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        number = None
        if not isinstance(e, KeyboardInterrupt | SystemExit):
            # DCP raises from its own writer at once, while its other writers may still be writing into
            # `tmp` (and dying of the same lack of room): they end before `tmp` goes and the hook returns
            for thread in compat.dcp_writer_threads(before):
                thread.join(timeout=120)
            number = out_of_room([e, *(d.exc_value for d in died)]) or room_left_in(tmp)
        if number is None:
            for d in died:
                previous(d)
            raise
        remove_own(tmp)
        kept = (
            f"step-{published}, the latest checkpoint, is kept: a rerun resumes from it."
            if published is not None
            else "no earlier checkpoint exists."
        )
        raise UserError(
            out_of_room_message(number, f"Saving checkpoint step-{step}", tmp, last_size(root, number))
            + f" The half-written {tmp.name} was removed; {kept}"
        ) from None
    finally:
        threading.excepthook = previous


def last_size(root: Path, number: int) -> int | None:
    """Bytes of the newest published checkpoint in `root` (what the next one needs, about), from its
    manifest; of its largest file when a file-size limit (`number` EFBIG) stopped the save."""
    found = published_checkpoints(root)
    try:
        sizes = [entry["bytes"] for entry in read_meta(found[-1])["files"].values()] if found else []
    except (UserError, KeyError, TypeError):
        return None
    return (max if number == errno.EFBIG else sum)(sizes) if sizes else None
