"""Distributed checkpoints: OUTPUT_DIR/checkpoints/step-N/, complete or absent.

All ranks write a DCP checkpoint (model, optimizers, train state) plus one small file per rank
(data-loader and RNG state) into `step-N.tmp/`; after a barrier rank 0 renames it to `step-N/`.
A rename is atomic, so a crash mid-save leaves only a `.tmp` folder, which loading ignores.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from muonrun.config import Config
from muonrun.distributed import Dist
from muonrun.errors import UserError

if TYPE_CHECKING:
    from muonrun.trainer import Trainer

STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(root: Path) -> list[Path]:
    """Published checkpoints, oldest first. A folder counts only once DCP's metadata is in it."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
    return [p for _, p in sorted(found)]


class Checkpointer:
    def __init__(self, cfg: Config, d: Dist):
        self.cfg = cfg
        self.dist = d
        self.root = Path(cfg.output_dir) / "checkpoints"

    def due(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and step % interval == 0

    def stop_requested(self) -> bool:
        return False

    def has(self, step: int) -> bool:
        return (self.root / f"step-{step}").is_dir()

    def _app_state(self, trainer: Trainer) -> dict:
        model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizers)
        return {"model": model_sd, "optim": optim_sd, "train": trainer.state.state_dict()}

    def save(self, trainer: Trainer) -> Path:
        step = trainer.state.step
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        if self.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        dcp.save(self._app_state(trainer), checkpoint_id=tmp)
        torch.save(
            {"loader": trainer.loader.state_dict(), "rng": torch.get_rng_state()}, tmp / f"rank{self.dist.rank}.pt"
        )
        dist.barrier()
        if self.dist.is_main:
            tmp.rename(final)
            for old in complete_checkpoints(self.root)[: -self.cfg.checkpoint.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def load(self, trainer: Trainer) -> Path | None:
        """Restore from checkpoint.resume_from, else the latest complete checkpoint, else start fresh."""
        explicit = self.cfg.checkpoint.resume_from
        if explicit:
            path = Path(explicit)
            if not (path / ".metadata").is_file():
                raise UserError(f"checkpoint.resume_from '{path}' is not a complete muonrun checkpoint folder.")
        else:
            found = complete_checkpoints(self.root)
            if not found:
                return None
            path = found[-1]
        state = self._app_state(trainer)
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            trainer.model, trainer.optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        trainer.state.load_state_dict(state["train"])
        own = path / f"rank{self.dist.rank}.pt"
        extra = torch.load(own if own.is_file() else path / "rank0.pt", weights_only=False)
        trainer.loader.load_state_dict(extra["loader"])
        torch.set_rng_state(extra["rng"])
        return path

    def close(self) -> None:
        pass
