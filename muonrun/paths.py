"""Whether muonrun can create and write a folder or file, asked before the work that would write it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal


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
