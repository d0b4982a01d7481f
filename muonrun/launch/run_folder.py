"""What the launcher checks in output_dir before it touches anything there (exit 2, one paragraph): that
the folder's name fits the filesystem, and that the entries muonrun writes are what it writes them as.

muonrun writes its own entries in a run folder (the lock, the control folder, metrics.jsonl,
config.yaml, wandb_id) only as plain files and folders, never through a symbolic link: a link there
could point at a file of the user's, which a launch would truncate, append to or delete. The writers
refuse one themselves (muonrun/paths.py); this check finds it before any worker starts. `checkpoints/`
may be a link to a folder, the usual way to put checkpoints on scratch storage, but not into another
run's folder: it would resume that run's checkpoints, write its own among them and prune them. Nor into
a folder another run's `checkpoints/` links to: the launch marks a linked folder with its run folder's
path (`.muonrun-owner`), and a second run linking there is refused while that run's link still does.
"""

from __future__ import annotations

import os
from pathlib import Path

from muonrun.checkpoint.files import CONFIG, check_run_folder
from muonrun.errors import UserError
from muonrun.launch.lock import LOCK_FILE, lock_file
from muonrun.paths import open_own, refuse_not_own

CONTROL_DIR = ".muonrun"  # in output_dir: one control folder per node while a launch runs
METRICS = "metrics.jsonl"
OWNER_MARK = ".muonrun-owner"  # in a folder `checkpoints/` links to: the run folder whose it is
# muonrun's own entries in a run folder: (name, kind, what it is)
OWN = (
    (LOCK_FILE, "file", "the run folder's lock"),
    (CONTROL_DIR, "folder", "the launch's control folder"),
    (METRICS, "file", "the run's metrics"),
    (CONFIG, "file", "the run's config"),
    ("wandb_id", "file", "the run's Weights & Biases id"),
)


def is_run_folder(path: Path) -> bool:
    """Whether `path` holds a muonrun run: its config, metrics or lock."""
    return (path / CONFIG).is_file() or (path / METRICS).is_file() or os.path.lexists(path / LOCK_FILE)


def check_output_dir(out: Path, name: str, node_rank: int = 0) -> None:
    """Every check of output_dir a launch makes before it creates anything there (a UserError)."""
    check_name_lengths(out, name)
    check_run_folder(out)  # not inside a checkpoint or another run's checkpoints/
    entries = [*OWN]
    if node_rank:
        entries.append((lock_file(node_rank), "file", f"node rank {node_rank}'s lock"))
    for entry, kind, what in entries:
        refuse_not_own(out / entry, kind, what)
    check_checkpoints_folder(out)


def _name_max(path: Path) -> int:
    existing = next((p for p in (path, *path.parents) if os.path.isdir(p)), Path("/"))
    try:
        return os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_name_lengths(out: Path, name: str) -> None:
    """Each part of output_dir must fit the filesystem's longest file name (255 bytes on most); and a
    control character in it (a line break) is refused: a folder named so is hard to find and to type."""
    limit = _name_max(out.absolute())
    for part in out.parts:
        if any(ord(c) < 32 or ord(c) == 127 for c in part):
            key = "name" if part == name else "output_dir"
            raise UserError(
                f"Config key '{key}' holds a control character (a line break or tab: {part!r}); a run folder "
                "named so is hard to find and to type. Use a name without one."
            )
        size = len(os.fsencode(part))
        if size > limit:
            key = "name" if part == name else "output_dir"
            shown = part[:40] + "..."
            raise UserError(
                f"Config key '{key}' makes the folder name '{shown}' {size} bytes long, but this filesystem "
                f"allows at most {limit} per name{' (output_dir is runs/${name})' if key == 'name' else ''}. "
                "Shorten it."
            )


def check_checkpoints_folder(out: Path) -> None:
    """OUTPUT_DIR/checkpoints: a folder, or a link to one outside any other run's folder."""
    folder = out / "checkpoints"
    if not os.path.lexists(folder):
        return
    if folder.is_symlink():
        target = folder.resolve()
        if not target.exists():
            raise UserError(
                f"'{folder}' is a symbolic link to '{os.readlink(folder)}', which does not exist: create that "
                "folder (checkpoints go there) or remove the link."
            )
        home = out.resolve()
        for p in (target, *target.parents):
            if p == home:
                break
            if is_run_folder(p):
                raise UserError(
                    f"'{folder}' is a symbolic link into the run folder '{p}' (to '{target}'): this run would "
                    "resume that run's checkpoints, save among them and prune them. Point the link at a folder "
                    "of this run's own (on scratch storage, say), or remove it."
                )
        owner = linked_owner(target)
        if owner is not None and owner != home:
            raise UserError(
                f"'{folder}' is a symbolic link to '{target}', which holds the checkpoints of the run "
                f"'{owner}' (its checkpoints/ links there too): the two runs would resume, overwrite and prune "
                "each other's checkpoints. Point this link at a folder of this run's own, or remove it."
            )
    if not folder.is_dir():
        raise UserError(
            f"'{folder}' is a file, but a run keeps its checkpoints in a folder of that name. Move the file "
            "away, or set output_dir to another folder."
        )


def linked_owner(target: Path) -> Path | None:
    """The run folder whose `checkpoints/` links to `target`, as `target`'s mark names it, while that run
    still exists and its link still points there (a run moved or deleted leaves a stale mark)."""
    try:
        owner = Path((target / OWNER_MARK).read_text().strip())
    except (OSError, UnicodeDecodeError):
        return None
    link = owner / "checkpoints"
    if not owner.is_absolute() or not link.is_symlink() or not is_run_folder(owner):
        return None
    return owner if link.resolve() == target else None


def mark_checkpoints_owner(out: Path) -> None:
    """When OUTPUT_DIR/checkpoints links elsewhere, name this run in the linked folder (OWNER_MARK), so
    that a second run linking there is refused (`check_checkpoints_folder`). Node 0, under the lock."""
    folder = out / "checkpoints"
    if not folder.is_symlink():
        return
    mark = folder.resolve() / OWNER_MARK
    try:
        fd = open_own(
            mark, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "the mark naming the run its checkpoints are"
        )
        with os.fdopen(fd, "w") as f:
            f.write(f"{out.resolve()}\n")
    except OSError as e:  # checkpoints are saved there: say so now rather than at the first save
        raise UserError(
            f"'{folder}' links to '{mark.parent}', where this run cannot write ({e.strerror}): its checkpoints "
            "are saved there. Make that folder writable, or point the link at one that is."
        ) from None
