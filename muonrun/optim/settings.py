"""Muon's per-param-group settings, read from the groups: what batches together on an owner
(``NSSettings``, part of the exchange plan's key) and what one step applies (``StepSettings``).
Only ``muonrun.optim.muon`` uses this module."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from muonrun.optim.newton_schulz import Coefficients, Scaling, resolve_ns_coefficients


@dataclass(frozen=True)
class NSSettings:
    """How one param group's matrices are orthogonalised (and, for NorMuon, normalised on the owner);
    matrices that share it batch together."""

    per_step: tuple[Coefficients, ...]
    norm_scale: float
    eps: float
    normuon: tuple[float, float] | None  # NorMuon's (beta2, eps); None: plain Muon
    precondition: str = "frobenius"  # newton_schulz.PRECONDITIONS

    @classmethod
    def of(cls, group: dict) -> NSSettings:
        per_step, norm_scale = resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        normuon = (
            (float(group["beta2"]), float(group["normuon_eps"])) if group["variant"] == "normuon" else None
        )
        return cls(per_step, norm_scale, float(group["eps"]), normuon, group["precondition"])

    def scaling(self, fold_norm: bool, multiply: Callable[[Tensor, Tensor], None]) -> Scaling | None:
        """How the owner scales its matrices: AOL's ``Scaling``, folded into the first Gram product;
        the Frobenius norm folded the same way where ``fold_norm``; else None, a pass dividing by
        the Frobenius norm (torch's). ``multiply``: the pass that applies a folded scale."""
        if self.precondition == "frobenius" and not fold_norm:
            return None
        return Scaling(self.precondition, self.norm_scale, self.eps, multiply)


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
