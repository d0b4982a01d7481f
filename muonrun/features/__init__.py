"""Optional features, plugged into the core through one protocol.

A feature is one module here with one class deriving from `Feature`, and one line in `REGISTRY`. The core
asks `enabled(cfg)` for the features a config turns on and calls each at the points below, in the order
of the data flow; it never imports a feature module or branches on one. Every hook has a default that
does nothing, so a feature overrides only what it changes:

    check(device_type)                 before any worker starts: a missing package, an unsupported device
    adapt(model)                       on the meta model, right after it is built (every build: the dry
                                       run, the launcher's check, the worker, the export), e.g. LoRA adapters
    convert(model)                     in the worker, before compile and fully_shard, e.g. float8 matmuls
    init_parameter(name, shape, ...)   its own parameters' and buffers' initial values
    pretrained_name(name)              a parameter's name in Hugging Face weight files (None: not there)
    flops_per_token(fpt, model)        the training FLOPs per token with the feature on
    identity(d)                        what a checkpoint only makes sense on top of (refused otherwise)
    start(model, device)               in the worker, after the optimizers exist; then per step:
    after_step()                       after each optimizer step (e.g. QK-clip's rescale)
    telemetry()                        device tensors for the metrics row of a logged step
    plan_rows(model)                   rows of the dry-run plan
    export(job)                        the Hugging Face export: return tensors to write, or write it all

Adding another feature touches only its module, its `REGISTRY` line and, if it has settings, its
section of muonrun/config/schema.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from muonrun.features.protocol import ExportJob, Feature

if TYPE_CHECKING:
    from muonrun.config import Config

__all__ = ["REGISTRY", "ExportJob", "Feature", "enabled", "flops_per_token", "pretrained_name"]


def _registry() -> dict[str, type[Feature]]:
    from muonrun.features.float8 import Float8
    from muonrun.features.lora import LoRA
    from muonrun.features.qkclip import MaxLogit
    from muonrun.features.router_bias import RouterBias

    return {"lora": LoRA, "float8": Float8, "qk_clip": MaxLogit, "router_bias": RouterBias}


REGISTRY: dict[str, type[Feature]] = _registry()
"""Every feature, by name: one line each."""


def enabled(cfg: Config) -> list[Feature]:
    """The features `cfg` turns on, in registry order."""
    on = []
    for name, feature in REGISTRY.items():
        if feature.wanted(cfg):
            on.append(feature(cfg))
            on[-1].name = name
    return on


def flops_per_token(features: list[Feature], fpt: float, model: nn.Module) -> float:
    """The model's training FLOPs per token with every feature's adjustment (muonrun/model/build.py
    counts the plain model)."""
    for f in features:
        fpt = f.flops_per_token(fpt, model)
    return fpt


def pretrained_name(features: list[Feature], name: str) -> str | None:
    """A parameter's name in a pretrained model's weight files after every feature's say (None: not in
    them, as LoRA's adapters are)."""
    for feature in features:
        name = feature.pretrained_name(name)
        if name is None:
            return None
    return name
