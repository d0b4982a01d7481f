"""Launch a script on N local processes (gloo, CPU) with torch.distributed.run, for tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


class WorkersFailed(RuntimeError):
    """The launched job exited non-zero or timed out; the message carries its combined output."""


def run_workers(
    script_path: str | os.PathLike,
    nproc: int,
    *args: str,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> str:
    """Run ``python -m torch.distributed.run --standalone --nproc-per-node N script args``.

    Returns the combined stdout+stderr. Raises :class:`WorkersFailed` with that output when the job
    fails or exceeds ``timeout`` seconds. The repository root is put on ``PYTHONPATH`` and
    ``OMP_NUM_THREADS`` defaults to 1 so that several workers share a small CI machine.
    """
    repo_root = Path(__file__).resolve().parents[2]
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root), full_env.get("PYTHONPATH", "")]))
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script_path),
        *map(str, args),
    ]
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=repo_root,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise WorkersFailed(f"{' '.join(cmd)} timed out after {timeout}s\n{out}") from None
    if proc.returncode != 0:
        raise WorkersFailed(f"{' '.join(cmd)} exited with {proc.returncode}\n{proc.stdout}")
    return proc.stdout
