"""One Muon param group's settings as the step reads them: how its matrices are orthogonalised
(`NSSettings`, shared by the matrices that batch together) and its hyperparameters (`StepSettings`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from muonrun.optim.newton_schulz import Coefficients, resolve_ns_coefficients

VARIANTS = ("muon", "normuon")
NS_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class NSSettings:
    """How one param group's matrices are orthogonalised (and, for NorMuon, normalised on the owner);
    matrices that share it batch together."""

    per_step: tuple[Coefficients, ...]
    norm_scale: float
    eps: float
    normuon: tuple[float, float] | None  # NorMuon's (beta2, eps); None: plain Muon

    @classmethod
    def of(cls, group: dict) -> NSSettings:
        per_step, norm_scale = resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        normuon = (float(group["beta2"]), float(group["normuon_eps"]))
        return cls(
            per_step, norm_scale, float(group["eps"]), normuon if group["variant"] == "normuon" else None
        )


@dataclass(frozen=True)
class StepSettings:
    """One param group's hyperparameters, read once per step (the schedule may change ``lr``)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None

    @classmethod
    def of(cls, group: dict) -> StepSettings:
        return cls(
            lr=to_float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            nesterov=bool(group["nesterov"]),
            adjust_lr_fn=group["adjust_lr_fn"],
        )


def to_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)
