"""Whether muonrun can create and write a folder or file, asked before the work that would write it; and
how it writes its own files and folders in a run folder (the lock, the control folder, metrics, the
config): never through a symbolic link, which could point at a file of the user's elsewhere."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import Literal

from muonrun.errors import UserError


def unwritable(path: str | os.PathLike, kind: Literal["folder", "file"]) -> str | None:
    """Why `path` (a folder or a file, `kind`, to create or write into) cannot be written by this user,
    or None: checked on it, or on its nearest existing ancestor, without creating anything."""
    path = Path(path).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None:
        return None
    if existing == path:
        if path.is_dir() != (kind == "folder"):
            return f"it is a {'file' if kind == 'folder' else 'folder'}"
        return None if os.access(path, os.W_OK) else f"'{path}' is not writable by this user"
    if not existing.is_dir():
        return f"'{existing}' is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable by this user"
    return None


def _what(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device or special file" if not stat.S_ISREG(mode) else "a file"


def not_own(path: str | os.PathLike, kind: Literal["folder", "file"]) -> str | None:
    """Why muonrun must not write `path` as its own `kind` (a plain file, or a folder), or None (it is
    one, or does not exist yet): a symbolic link (to where), or another kind of entry. Never follows a
    link."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # not there (its folder a file: said where it is made)
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link (to '{os.readlink(path)}')"
    if stat.S_ISDIR(mode) if kind == "folder" else stat.S_ISREG(mode):
        return None
    return _what(mode)


def refuse_not_own(path: str | os.PathLike, kind: Literal["folder", "file"], what: str) -> None:
    """A UserError naming `path` (`what` it is for muonrun) when `not_own` finds it is not a plain `kind`."""
    found = not_own(path, kind)
    if found is None:
        return
    link = found.startswith("a symbolic link")
    fix = (
        "muonrun writes its own files in a run folder only as plain files and folders, never through a "
        "link, which could point at something of yours. Remove the link (muonrun creates what it needs)"
        if link
        else f"it must be a {'folder' if kind == 'folder' else 'plain file'}. Move it away"
    )
    raise UserError(f"'{path}' ({what}) is {found}: {fix}, or set output_dir to another folder.")


def open_own(path: str | os.PathLike, flags: int, what: str, mode: int = 0o644) -> int:
    """`os.open` for one of muonrun's own files in a run folder: a symbolic link there (dangling or not)
    is never followed, and a folder, pipe or device in its place is refused: a UserError naming `path`
    (`what` it is for muonrun)."""
    refuse_not_own(path, "file", what)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):  # made since the look above
            refuse_not_own(path, "file", what)
        raise


def own_folder(path: str | os.PathLike, what: str) -> Path:
    """Create (with its parents) one of muonrun's own folders in a run folder; a symbolic link or a file
    in its place is refused (a UserError naming `path`, `what` it is for muonrun)."""
    path = Path(path)
    refuse_not_own(path, "folder", what)
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_own(path: str | os.PathLike) -> None:
    """Remove one of muonrun's own entries (a leftover folder or file), never what a link points to: a
    link is unlinked itself; best effort (what cannot be removed stays)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # rmtree unlinks the links inside, never follows them
    else:
        with contextlib.suppress(OSError):
            path.unlink()


# What a write that ran out of room raises: errno, or the words of libraries that hide it (safetensors'
# SafetensorError carries Rust's io error kind; torch's stream writer its own RuntimeError).
_NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is used up"}
_NO_ROOM[errno.EFBIG] = "a file outgrew the file-size limit"
_NO_ROOM_WORDS = {
    "StorageFull": errno.ENOSPC,
    "No space left on device": errno.ENOSPC,
    "QuotaExceeded": errno.EDQUOT,
    "Disk quota exceeded": errno.EDQUOT,
    "FileTooLarge": errno.EFBIG,
    "File too large": errno.EFBIG,
}


def out_of_room(errors) -> int | None:
    """The errno (ENOSPC, EDQUOT or EFBIG) behind any of `errors` (exceptions, their causes and contexts
    followed), or None when none of them ran out of room."""
    seen, todo = set(), list(errors)
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_ROOM:
            return e.errno
        for words, number in _NO_ROOM_WORDS.items():
            if words in str(e):
                return number
        todo += [e.__cause__, e.__context__, *(getattr(e, "failures", None) or {}).values()]
        todo += [x for x in (e.args if isinstance(e, BaseException) else ()) if isinstance(x, BaseException)]
        if isinstance(e, tuple):
            todo += [x for x in e if isinstance(x, BaseException)]
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1024
    return ""


def out_of_room_message(number: int, what: str, where: Path, needed: int | None) -> str:
    """One paragraph for a write (`what`, into `where`) that ran out of room (`number`, from `out_of_room`):
    what it needed (`needed` bytes: in all, or for its largest file when a file-size limit stopped it),
    what was free or allowed, and what to do."""
    import resource

    if number == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "unlimited" if limit == resource.RLIM_INFINITY else _size(limit)
        have = f"the file-size limit (ulimit -f) is {shown}"
        fix = "Raise the limit (ulimit -f unlimited, or the scheduler's file-size setting)"
    else:
        try:
            free = shutil.disk_usage(where if where.exists() else where.parent).free
            have = f"the filesystem has {_size(free)} free"
        except OSError:
            have = "the filesystem's free space is unknown"
        fix = "Free space there, or point it at a larger filesystem"
    needs = "Its largest file needs about" if number == errno.EFBIG else "It needs about"
    need = f"{needs} {_size(needed)}; {have}" if needed else have[0].upper() + have[1:]
    return f"{what} into '{where}' failed: {_NO_ROOM[number]}. {need}. {fix}."


def room_left_in(folder: Path) -> int | None:
    """ENOSPC or EFBIG when `folder` shows that a write into it ran out of room (its filesystem nearly
    full, or a file in it as large as the file-size limit), else None: for errors that lost their errno
    on the way (a library's own exception, a peer rank's)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    try:
        if limit != resource.RLIM_INFINITY and any(p.stat().st_size >= limit for p in folder.iterdir()):
            return errno.EFBIG
        if shutil.disk_usage(folder).free < 1 << 20:
            return errno.ENOSPC
    except OSError:
        return None
    return None
