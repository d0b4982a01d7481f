"""The stateful parts a checkpoint holds, each with `state_dict()` / `load_state_dict()` (DCP's
Stateful protocol), so the checkpointer saves and loads whatever it is handed without knowing what
a trainer is (as torchtitan's checkpointer is built from `states={...}`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{alias: canonical name} of parameters registered twice (a tied LM head -> the input embedding)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def drop_aliases(model: nn.Module, sd: dict) -> dict:
    """Save a tied tensor once (a tied head would otherwise add a second copy of the embedding)."""
    aliases = tied_aliases(model)
    return {k: v for k, v in sd.items() if k not in aliases}


def add_aliases(model: nn.Module, sd: dict) -> dict:
    return {**sd, **{alias: sd[name] for alias, name in tied_aliases(model).items() if name in sd}}


class ModelState:
    """The model's weights (sharded DTensors: DCP saves each rank's shard and reshards on load). With
    `trainable_only` (LoRA) only the parameters that train: the frozen ones come from elsewhere at
    every start (the pretrained base's own files)."""

    def __init__(self, model: nn.Module, trainable_only: bool = False):
        self.model = model
        # the keys loaded are those state_dict() gave, so a missing frozen key is expected, never a miss
        self.options = StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)

    def state_dict(self) -> dict:
        return drop_aliases(self.model, get_model_state_dict(self.model, options=self.options))

    def load_state_dict(self, sd: dict) -> None:
        set_model_state_dict(self.model, add_aliases(self.model, sd), options=self.options)


class OptimizerState:
    """The optimizers' state, keyed by parameter name. Hyperparameters (lr, betas, decay, ...) come
    from the current config, not from the checkpoint: the groups' settings survive a load."""

    def __init__(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]):
        self.model, self.optimizers = model, optimizers

    def state_dict(self) -> dict:
        return get_optimizer_state_dict(self.model, self.optimizers)

    def load_state_dict(self, sd: dict) -> None:
        settings = [
            [{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in self.optimizers
        ]
        set_optimizer_state_dict(self.model, self.optimizers, sd)
        for opt, groups in zip(self.optimizers, settings, strict=True):
            for group, saved in zip(opt.param_groups, groups, strict=True):
                group.update(saved)


class RNGState:
    """This rank's random number generators (CPU, and the current GPU's)."""

    def __init__(self, device: torch.device):
        self.device = device

    def state_dict(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return rng

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and self.device.type == "cuda":
            torch.cuda.set_rng_state(sd["cuda"], self.device)
