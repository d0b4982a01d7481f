"""A collective that timed out (launch.collective_timeout_s): which rank stalled, in one paragraph.

    MUONRUN_FAULT=hang@3:r1 muonrun pretrain tiny launch.collective_timeout_s=5   # rank 1 stalls: named

Every rank whose collective timed out marks itself in the job's store (the c10d store the workers
rendezvoused through, which a stalled rank's process still serves) and waits a while for the others to
do the same; the ranks that never mark are the ones that stalled, since a stalled rank is not waiting in
a collective. Each waiting rank then reports the same paragraph (muonrun/launch/worker.py), which the
launcher prints once before it stops every worker. On gloo the timeout is an exception in the waiting
ranks; NCCL's watchdog instead ends each process that timed out (SIGABRT, torch's own message naming the
collective), so there the stalled rank is not named (docs/clusters.md, "A rank that stalls").
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

# How a timed-out collective reads: gloo's "Timed out waiting 5000ms for recv operation to complete" (and
# the pair it then closes), NCCL's watchdog "Watchdog caught collective operation timeout".
_TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure", "collective operation timeout")


def is_timeout(e: BaseException) -> bool:
    """Whether `e` (or what it was raised from) is a collective that timed out."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if any(words in str(e) for words in _TIMED_OUT):
            return True
        e = e.__cause__ or e.__context__
    return False


def stalled_ranks(wait_s: float) -> list[int] | None:
    """The ranks that did not time out themselves within `wait_s` of this one (the stalled ones), from the
    job's store; None when the store cannot be reached."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:
        store = dist.PrefixStore(
            f"muonrun-stall-{attempt}",
            dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=timedelta(seconds=30),
                wait_for_workers=False,
            ),
        )
        store.set(str(rank), "timed out")
        deadline = time.monotonic() + wait_s
        while True:
            waiting = [r for r in range(world) if store.check([str(r)])]
            if len(waiting) == world or time.monotonic() > deadline:
                return [r for r in range(world) if r not in waiting]
            time.sleep(0.2)
    except (RuntimeError, KeyError, ValueError, OSError):
        return None


def stall_message(stalled: list[int] | None, timeout_s: float) -> str:
    """The paragraph every waiting rank reports (the same words on each: the launcher prints it once)."""
    if stalled:
        who = f"rank {stalled[0]}" if len(stalled) == 1 else f"ranks {', '.join(map(str, stalled))}"
        what = (
            f"{who} never joined it: {'it' if len(stalled) == 1 else 'they'} stalled (a hung filesystem, a stuck "
            "GPU, a lost node, or a step far slower there than on the others), while every other rank waited"
        )
    elif stalled is None:
        what = "the job's store could not be reached to tell which rank stalled"
    else:
        what = "every rank timed out waiting (the network between them, or a rank that stalled only briefly)"
    return (
        f"A collective waited launch.collective_timeout_s={timeout_s:g} s for every rank and timed out: {what}. "
        "The job stopped; nothing of the step it stalled in was saved, and a rerun resumes from the latest "
        "checkpoint. If a healthy step can wait that long (a large save, a download on one rank, the first "
        "compilation), raise launch.collective_timeout_s."
    )


def restarts_left() -> bool:
    """Whether the elastic agent restarts the workers after this failure (then it is raised, not reported)."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return attempt < int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
