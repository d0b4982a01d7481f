"""A checkpoint on disk: where checkpoints are, which are complete, and whether their bytes are intact.

A checkpoint is a folder OUTPUT_DIR/checkpoints/step-N holding DCP's `.metadata` and `__R_T.distcp`
files, one `rankR.pt` per rank (data-loader position and RNG states), `config.yaml` (the resolved config
it was saved with, which resume, export and verify read) and `muonrun.json`, written last by rank 0
before the folder is renamed from `step-N.tmp` into place. `muonrun.json` carries the
manifest: the size and SHA-256 of every other file, each hashed by the rank that wrote it, plus a
checksum of the manifest itself. `verify` compares a folder with its manifest, so a checkpoint
damaged after it was written (a bad disk, a partial copy, a flaky network filesystem) is found
before any byte of it is loaded.

    muonrun checkpoint verify runs/tiny            # every complete checkpoint of a run
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from muonrun.errors import UserError
from muonrun.paths import open_own, refuse_not_own, remove_own

STEP_DIR = re.compile(r"^step-(\d+)$")
# A checkpoint set aside (`step-N.abandoned` by a resume_from that went back, `step-N.damaged` by a save of
# its step): never resumed from or pruned unless named (checkpoint.resume_from, export, verify).
SET_ASIDE = re.compile(r"^step-(\d+)\.(abandoned(-\d+)?|damaged)$")
META = "muonrun.json"
CONFIG = "config.yaml"  # in a checkpoint: the config it was saved with; in a run folder: its current one
# Files hashed at once per rank: hashlib releases the GIL on large buffers, so a rank's few files
# hash in parallel (each thread reads a file the save has just written, mostly from the page cache).
HASH_THREADS = 4
_CHUNK = 16 << 20


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(path.name).group(1))


def is_published(path: Path) -> bool:
    """A `step-N` folder in a `checkpoints` folder (or elsewhere, with a checkpoint's files): published by
    rank 0, which renames `step-N.tmp` only once every file and the manifest are written. Whether its
    files are all still there and intact is for `verify` to say (a published checkpoint with a file
    missing is damaged, never skipped in silence)."""
    if not (STEP_DIR.match(path.name) and path.is_dir()):
        return False
    return path.parent.name == "checkpoints" or (path / META).exists() or (path / ".metadata").exists()


def published_checkpoints(root: Path) -> list[Path]:
    """The published checkpoints under OUTPUT_DIR/checkpoints, oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if is_published(p)), key=step_of)


def checkpoints_of(path: str | os.PathLike) -> list[Path]:
    """Every published checkpoint a path names, oldest first: itself (a step-N folder), or all those of
    a run folder or its checkpoints folder. Raises a UserError saying what the path is instead."""
    path = Path(path)
    if is_published(path) or (SET_ASIDE.match(path.name) and (path / META).is_file()):
        return [path]
    for root in (path / "checkpoints", path):
        found = published_checkpoints(root)
        if found:
            return found
    if not path.exists():
        raise UserError(
            f"'{path}' does not exist: give a run folder or one of its checkpoints/step-N folders."
        )
    if path.name.endswith(".tmp"):
        raise UserError(
            f"Checkpoint '{path}' is incomplete (its save was interrupted); use an earlier step-N folder."
        )
    raise UserError(
        f"'{path}' is not a muonrun checkpoint: give a complete OUTPUT_DIR/checkpoints/step-N folder "
        "(with .metadata and muonrun.json inside), or a run folder that holds one."
    )


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete step-N folder, or a run folder / its checkpoints folder (-> the latest complete one)."""
    return checkpoints_of(path)[-1]


def check_run_folder(out: Path, key: str = "output_dir") -> None:
    """A run's output_dir (or an export's folder, `key`) must not lie inside a checkpoint or another run's
    `checkpoints/` folder: it would write into what that run verifies, prunes and resumes from (which
    then calls its checkpoint damaged, or replaces what was written). Checked before any worker starts;
    raises UserError."""
    out = Path(out).resolve()
    for p in (out, *out.parents):
        if is_published(p) or (p.parent.name == "checkpoints" and STEP_DIR.match(p.name.split(".")[0])):
            raise UserError(
                f"{key} '{out}' {'is' if p == out else 'is inside'} the checkpoint '{p}': writing there would "
                "go into that checkpoint, which its own run then finds damaged. Set "
                f"{key} to a folder of its own (beside that run, not in it)."
            )
        run = p.parent
        if p.name == "checkpoints" and (
            (run / CONFIG).is_file() or (run / "metrics.jsonl").is_file() or published_checkpoints(p)
        ):
            where = "is" if p == out else "is inside"
            raise UserError(
                f"{key} '{out}' {where} the checkpoints folder of the run in '{run}': writing there would mix "
                f"its files with that run's checkpoints (which it prunes and replaces). Set {key} to a folder of "
                "its own (beside that run, not in it)."
            )


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(paths: Iterable[Path]) -> dict[str, dict]:
    """{file name: {"bytes": size, "sha256": hex}} of files in one folder, HASH_THREADS at a time."""
    paths = list(paths)
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digests = list(pool.map(sha256_file, paths))
    return {p.name: {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(paths, digests, strict=True)}


def _manifest_checksum(meta: dict) -> str:
    body = {k: v for k, v in meta.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(meta: dict) -> dict:
    """`meta` with the checksum of its own contents added (so a damaged manifest is found too)."""
    return {**meta, "manifest_sha256": _manifest_checksum(meta)}


class DamagedCheckpoint(UserError):
    """A checkpoint whose files do not match what its save wrote."""


def read_meta(checkpoint: Path) -> dict:
    """The checkpoint's `muonrun.json`, checked against its own checksum."""
    path = checkpoint / META
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("not a muonrun.json object with a step")
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(
            f"Checkpoint '{checkpoint}' is damaged: its {META} cannot be read ({str(e).splitlines()[0]})."
        ) from None
    if meta.get("manifest_sha256") != _manifest_checksum(meta):
        raise DamagedCheckpoint(
            f"Checkpoint '{checkpoint}' is damaged: its {META} does not match its own checksum (its bytes "
            "changed after the save)."
        )
    return meta


@dataclass
class Verdict:
    """What `verify` found: problems (empty when intact)."""

    checkpoint: Path
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def error(self) -> DamagedCheckpoint:
        shown = "; ".join(self.problems[:3]) + (
            f"; and {len(self.problems) - 3} more" if len(self.problems) > 3 else ""
        )
        return DamagedCheckpoint(
            f"Checkpoint '{self.checkpoint}' is damaged: {shown}. Its files no longer match the checksums "
            "written when it was saved (a bad disk, an incomplete copy, a flaky filesystem). Copy it again "
            "from a good source, or use an earlier checkpoint."
        )


def verify(checkpoint: Path, share: tuple[int, int] = (0, 1), hash_contents: bool = True) -> Verdict:
    """Compare a checkpoint folder with its manifest. With `share=(r, n)` only every n-th file from
    the r-th is hashed (ranks split the reading); the file list is always checked whole.
    `hash_contents=False` checks names and sizes only (cheap)."""
    verdict = Verdict(checkpoint)
    try:
        meta = read_meta(checkpoint)
    except DamagedCheckpoint as e:
        verdict.problems.append(f"{META} cannot be trusted ({str(e).split(': ', 1)[-1]})")
        return verdict
    expected: dict[str, dict] | None = meta.get("files")
    if not isinstance(expected, dict):
        verdict.problems.append(f"{META} lists no files to check")
        return verdict
    present = {p.name for p in checkpoint.iterdir() if p.name != META}
    for name in sorted(set(expected) - present):
        verdict.problems.append(f"{name} is missing")
    for name in sorted(present - set(expected)):
        verdict.problems.append(f"{name} is not one of the files its save wrote")
    mine = sorted(set(expected) & present)[share[0] :: share[1]]
    sized = []
    for name in mine:
        size = (checkpoint / name).stat().st_size
        if size != expected[name]["bytes"]:
            verdict.problems.append(f"{name} has {size:,} bytes, its save wrote {expected[name]['bytes']:,}")
        else:
            sized.append(checkpoint / name)
    if hash_contents and sized:
        for name, found in hash_files(sized).items():
            if found["sha256"] != expected[name]["sha256"]:
                verdict.problems.append(f"{name} has other contents than its save wrote (SHA-256 differs)")
    return verdict


def prune(root: Path, keep_last: int, damaged: Iterable[Path] = ()) -> list[Path]:
    """Delete the complete checkpoints older than the `keep_last` newest intact ones (names and sizes
    as their manifests say; `damaged` ones never count), so pruning never takes the last good
    checkpoint; damaged ones are left alone. Returns what was deleted."""
    damaged = set(damaged)
    intact = [
        p for p in published_checkpoints(root) if p not in damaged and verify(p, hash_contents=False).ok
    ]
    if len(intact) <= keep_last:
        return []
    oldest_kept = step_of(intact[-keep_last])
    deleted = []
    for old in intact:
        if step_of(old) < oldest_kept:
            doomed = old.with_name(f"{old.name}.deleting")  # never a half-deleted step-N folder
            old.rename(doomed)
            remove_own(doomed)  # a step-N that is a link: the link goes, never what it points to
            deleted.append(old)
    return deleted


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_run_config(output_dir: Path, text: str) -> None:
    """OUTPUT_DIR/config.yaml: the config of the training that runs in the folder, written (atomically) by
    rank 0 once its checkpoint is loaded, so a command refused before that leaves the file as it was."""
    output_dir.mkdir(parents=True, exist_ok=True)
    refuse_not_own(output_dir / CONFIG, "file", "the run's config")  # a link there: refused, not replaced
    tmp = output_dir / f".{CONFIG}.tmp"
    remove_own(tmp)  # a leftover, or a link someone left there: never written through
    fd = open_own(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "the run's config, being written")
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(output_dir / CONFIG)


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
