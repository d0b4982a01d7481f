"""One live writer per run folder: the launcher on node 0 (or the single in-process worker) holds an
exclusive lock on `<output_dir>/.muonrun.lock` from before it touches anything in the folder until the
run ends, restarts included. The file names its holder (host, pid, since when) for whoever finds it
taken. The launcher of every other node rank r holds `<output_dir>/.muonrun.node-r.lock` the same way:
a second launcher of one node rank (two srun tasks on one node, a relaunch while the first runs) would
otherwise wait in torch's rendezvous, silently, until the job ends.

The lock is `flock(2)`: the kernel releases it when its holder dies, however it dies (kill -9, a crashed
node's NFS lease expiring), so a lock left behind is taken over, with a message saying whose it was.
Across machines it holds where the filesystem implements flock for all its clients: local disks, NFSv4
(and NFSv3 with lockd), Lustre mounted with `-o flock` (not `localflock`, whose locks each client keeps
to itself), GPFS / Spectrum Scale, BeeGFS with global file locks, CephFS. Where the filesystem refuses
locks (NFS mounted `nolock`, some FUSE filesystems), muonrun says so and runs with a weaker check: it
refuses only a holder that the lock file names on this same machine and that is still alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from muonrun import log
from muonrun.errors import UserError
from muonrun.paths import open_own

LOCK_FILE = ".muonrun.lock"


def lock_file(node_rank: int = 0) -> str:
    """The lock file of a node rank's launcher: node 0's is the run folder's (`LOCK_FILE`)."""
    return LOCK_FILE if node_rank == 0 else f".muonrun.node-{node_rank}.lock"


# flock's answers where the filesystem cannot lock (rather than "someone else holds it")
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    since: str

    @classmethod
    def me(cls) -> Holder:
        return cls(
            socket.gethostname(), os.getpid(), datetime.now().astimezone().isoformat(timespec="seconds")
        )

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            d = json.loads(text)
            return cls(str(d["host"]), int(d["pid"]), str(d["since"]))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, since {self.since}"

    def alive_here(self) -> bool:
        """On this machine and its process still running (False where that cannot be told)."""
        return self.host == socket.gethostname() and pid_exists(self.pid)


def pid_exists(pid: int) -> bool:
    """Whether process `pid` exists on this machine (another user's, or a zombie, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """`with RunLock(output_dir):` (or `acquire()` ... `release()`): the run folder's lock (``node_rank``
    above 0: that node rank's launcher lock); acquiring raises a UserError (exit 2) naming the holder
    when another live launch has it."""

    def __init__(self, output_dir: Path, node_rank: int = 0):
        self.path = Path(output_dir) / lock_file(node_rank)
        self.node_rank = node_rank
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        """Take the lock now (held until `release`, or the end of a `with` on this object)."""
        if self._fd is not None:
            return self
        try:
            fd = open_own(self.path, os.O_RDWR | os.O_CREAT, "the run folder's lock")
        except OSError as e:
            if not os.access(self.path.parent, os.W_OK | os.X_OK) and not os.path.lexists(self.path):
                raise UserError(
                    f"output_dir '{self.path.parent}' cannot be written ({e.strerror or type(e).__name__}); "
                    "set output_dir to a folder you can write, on a filesystem every node shares."
                ) from None
            raise UserError(
                f"The run folder's lock file '{self.path}' cannot be opened for writing "
                f"({e.strerror or type(e).__name__}): muonrun writes its holder into it. Make it writable "
                "(chmod u+w; `lsattr` shows an immutable flag, `chattr -i` clears it) or delete it (muonrun "
                "creates it again)."
            ) from None
        try:
            self._take(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:  # a launch that failed between acquire() and its `with`
        with contextlib.suppress(Exception):
            self.release()

    def _take(self, fd: int) -> None:
        left = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(self._busy(left)) from None
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            log.warning(
                f"the filesystem of output_dir '{self.path.parent}' does not support file locks "
                f"({e.strerror}): muonrun cannot keep a second launch on another machine out of this run "
                "folder. Make sure only one training writes it (docs/clusters.md lists filesystems that lock)."
            )
            if left is not None and left.alive_here() and left.pid != os.getpid():
                raise UserError(
                    self._busy(left) + " If that process is not a muonrun launch, delete the lock file."
                ) from None
        else:
            if left is not None:
                log.warning(
                    f"the run folder's lock was left by a launch that is gone ({left.describe()}); taking it over."
                )
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(Holder.me().__dict__).encode(), 0)
        os.fsync(fd)

    def _busy(self, holder: Holder | None) -> str:
        who = holder.describe() if holder is not None else "a process that has not written its name yet"
        if holder is not None and holder.host == socket.gethostname() and not holder.alive_here():
            who += f"; that process is gone, one that inherited its lock holds it: `fuser -v {self.path}`"
        if self.node_rank:
            return (
                f"node rank {self.node_rank} of the run in output_dir '{self.path.parent}' is already launched "
                f"({who}): each node rank has one launcher, and a second one would wait in the rendezvous "
                "until the job ends (two srun tasks on one node, or a relaunch while the first still runs). "
                "Stop one of them, or check --node-rank (SLURM_NODEID under srun: one task per node). "
                f"(The lock is {self.path}; the kernel releases it when its holder exits.)"
            )
        return (
            f"output_dir '{self.path.parent}' is in use by another muonrun launch ({who}): a run folder has "
            "one live training. Wait for it to end or stop it, or set output_dir (or name) to another "
            f"folder. (The lock is {self.path}; the kernel releases it when its holder exits.)"
        )

    def release(self) -> None:
        if self._fd is None:
            return
        # Emptied before unlocking: a next launch that finds a name in it knows the holder did not end
        # cleanly and says so as it takes the lock over.
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
