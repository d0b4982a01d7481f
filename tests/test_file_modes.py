"""What muonrun writes, teammates can read: a run's checkpoint, its export at the end and `muonrun export`
get the modes the user's umask gives any new file (0644 and folders 0755 under umask 022), never a
temporary file's 0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from helpers import ok, pretrain

from muonrun.checkpoint.export import current_umask, export_hf


def modes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.rglob("*")]}


def wrong_modes(folder: Path, mask: int) -> dict[str, str]:
    found = modes(folder)
    want = {name: (0o777 if (folder / name).is_dir() else 0o666) & ~mask for name in found}
    return {
        name: f"{oct(found[name])} (want {oct(want[name])})" for name in found if found[name] != want[name]
    }


def test_checkpoints_and_exports_take_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        assert current_umask() == 0o022
        run = tmp_path / "run"
        ok(
            pretrain(
                run,
                "train.max_steps=2",
                "data.sources.0.path=${stdlib:}/json/*.py",
                "checkpoint.export_at_end=true",
                nproc=1,
            )
        )
        step = run / "checkpoints" / "step-2"
        assert (run / "hf" / "model.safetensors").is_file() and any(step.glob("*.distcp"))
        for folder in (step, run / "hf"):
            assert not wrong_modes(folder, 0o022), (folder, wrong_modes(folder, 0o022))
        os.umask(0o027)  # a stricter umask is kept too: the group reads, others nothing
        assert current_umask() == 0o027
        out = export_hf(step, tmp_path / "hf-027")
        assert (out / "model.safetensors").is_file() and not wrong_modes(out, 0o027), wrong_modes(out, 0o027)
    finally:
        os.umask(old)
