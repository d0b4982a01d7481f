"""File formats of local sources: which `datasets` builder reads a file (by extension, through
compression suffixes) and which files are never text. Shared by sources.py and records.py."""

from __future__ import annotations

import os
from pathlib import Path

# extension -> datasets builder; every other file goes to the `text` builder, one document per file
READERS = {
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".csv": "csv",
}
COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
# never text: skipped when a folder or glob is expanded (an explicitly named file is always read)
_BINARY_EXTS = """.pyc .pyo .so .dll .dylib .exe .o .a .lib .class .jar .png .jpg .jpeg .gif .bmp .ico .webp
.pdf .zip .tar .tgz .whl .egg .bin .pt .pth .safetensors .npy .npz .pkl .pickle .wav .mp3 .mp4 .db .sqlite .lock"""
BINARY = frozenset(_BINARY_EXTS.split())


def reader_for(path: str) -> str:
    """The datasets builder for a file, by extension (compression suffixes look through)."""
    name = path.lower()
    for suffix in COMPRESSION:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    return READERS.get(Path(name).suffix, "text")


def nonempty_files(reader: str, files) -> list[str]:
    # an empty .py is an (empty) document; an empty table file is nothing, and datasets chokes on it
    return sorted(f for f in files if reader == "text" or os.path.getsize(f) > 0)
