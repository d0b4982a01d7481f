"""The protocol every optional feature implements (muonrun/features/__init__.py lists the features and
says when the core calls each hook). Core modules use these types for annotations only: importing the
features' registry is for the modules that choose the features (trainer, launcher, plan, export).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from muonrun.config import Config
    from muonrun.distributed import Dist


@dataclass
class ExportJob:
    """What `muonrun export` hands the features: the run's config and HF config, the checkpoint and its
    trained tensors (by model name), the tokenizer, where to write and how."""

    cfg: Config
    hf_config: Any
    checkpoint: Path
    tensors: dict[str, torch.Tensor]
    out: Path
    dtype: str
    tokenizer: Any
    shown_as: Path
    """The folder's path as its README names it (it may be written elsewhere first)."""
    header: str
    """The README's sentence on where the weights come from (checkpoint, step, tokens, dtype)."""
    tokenizer_note: str
    """The README's sentence on the tokenizer."""
    options: dict[str, Any]
    """Feature-specific export options from the command line (`adapter_only`); a feature that acts on
    one removes it, and one left over is refused."""
    notes: list[str] = field(default_factory=list)
    """Sentences for the exported folder's README (e.g. "LoRA adapters merged into ...")."""


class Feature:
    """The protocol, with hooks that do nothing. `cfg` is the run's typed config; `name` its key in
    `REGISTRY` (the profiler's phase for its `after_step`)."""

    name = "feature"
    tensor_parallel = False
    """Whether the feature works on tensor-parallel layers (`parallel.tp` above 1); a run that asks for
    both is refused before any worker starts, naming the feature."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @staticmethod
    def wanted(cfg: Config) -> bool:
        """Whether `cfg` turns this feature on."""
        raise NotImplementedError

    def check(self, device_type: str) -> None:
        """Raise a UserError when this machine cannot run the feature (before any worker starts)."""

    def adapt(self, model: nn.Module) -> None:
        """Change the meta model's structure (every build of it)."""

    def convert(self, model: nn.Module) -> None:
        """Change how the worker's model computes, before compile and fully_shard."""

    def init_parameter(
        self, name: str, shape: torch.Size, generator: torch.Generator, device: torch.device
    ) -> torch.Tensor | None:
        """The initial value of a parameter or buffer this feature owns, or None (a buffer's call has
        no generator)."""
        return None

    def pretrained_name(self, name: str) -> str | None:
        """The name of a model parameter in Hugging Face weight files, or None if they lack it."""
        return name

    def flops_per_token(self, fpt: float, model: nn.Module) -> float:
        return fpt

    def identity(self, d: Dist | None) -> dict[str, dict[str, str]]:
        """{what: {"name_or_path": ..., "fingerprint": ...}} a checkpoint records and resume checks
        (`d`: the worker's process group, None in a single process)."""
        return {}

    def start(self, model: nn.Module, device: torch.device) -> None:
        """In the worker, once the model is sharded and initialised and the optimizers exist."""

    def after_step(self) -> None:
        """After every optimizer step."""

    def telemetry(self) -> dict[str, torch.Tensor]:
        """Values for the metrics row of a logged step (0-d device tensors, reduced with MAX)."""
        return {}

    def plan_rows(self, model: nn.Module) -> list[tuple[str, str]]:
        """(key, value) rows for the dry-run plan."""
        return []

    def export(self, job: ExportJob) -> dict[str, torch.Tensor] | Path | None:
        """The export's tensors with this feature applied (e.g. adapters merged), a folder it wrote
        itself (the export ends there), or None (nothing to change)."""
        return None
