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
    except FileNotFoundError:
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
