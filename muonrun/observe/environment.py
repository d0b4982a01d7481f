"""Where a run ran, for its start row: library versions, the node's GPU names and the git SHA.

Each of these only reads; none of them fails a run (a missing git, a CPU machine).
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import torch


def library_versions() -> dict[str, str]:
    """muonrun, torch, transformers and python; CUDA and NCCL too when a GPU is visible."""
    import transformers

    from muonrun import __version__

    versions = {
        "muonrun": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.version.cuda and torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def gpu_names() -> list[str]:
    """The names of this node's visible GPUs (empty on a CPU machine)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def git_sha(*folders: Path | str) -> str | None:
    """HEAD of the first folder that is in a git repository (`-dirty` when it has uncommitted changes to
    tracked files); None when none is, or git is missing or slow. Never raises."""
    for folder in folders:
        try:
            sha = subprocess.run(
                ["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=2,
                check=True,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(folder), "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=2
            ).returncode
        except (OSError, subprocess.SubprocessError):
            continue
        return sha + ("-dirty" if dirty == 1 else "")
    return None
