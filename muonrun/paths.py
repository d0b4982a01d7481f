"""Whether muonrun can create and write a folder or file, asked before the work that would write it."""

from __future__ import annotations

import os
from pathlib import Path


def unwritable(path: str | os.PathLike) -> str | None:
    """Why `path` (a folder or file to create or write into) cannot be written by this user, or None:
    checked on its nearest existing ancestor, without creating anything."""
    path = Path(path).expanduser().absolute()
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is None or existing == path:
        if existing is not None and not os.access(existing, os.W_OK):
            return f"'{existing}' is not writable by this user"
        return None
    if not existing.is_dir():
        return f"'{existing}' is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable by this user"
    return None
