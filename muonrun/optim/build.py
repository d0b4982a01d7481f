"""Optimizer registry: `optimizer.name` -> a builder that returns the list of torch optimizers.

Built after `fully_shard`, so every parameter is already a DTensor shard. Each param group
carries `peak_lr`; the trainer sets `lr = peak_lr * schedule(step)` before every step. This is the
only optim module that reads the config; `muonrun.optim` itself does not import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from muonrun.config import OptimizerConfig
from muonrun.optim.adamw import AdamW
from muonrun.optim.groups import split_params
from muonrun.optim.muon import Muon
from muonrun.optim.newton_schulz import NewtonSchulz
from muonrun.optim.ns_quack import default_products


def _adamw(params: list[dict], o: OptimizerConfig, device_type: str) -> AdamW:
    """torch's AdamW, stepped on the local shards (muonrun/optim/adamw.py: same results, less host time)."""
    fused = o.fused if o.fused is not None else device_type == "cuda"
    return AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused)


def _adamw_groups(decay, no_decay, o: OptimizerConfig) -> list[dict]:
    """Weight decay on matrices (embeddings and LM head included), never on norms and biases."""
    groups = [
        {"params": [p for _, p in decay], "weight_decay": o.weight_decay, "peak_lr": o.lr},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0, "peak_lr": o.lr},
    ]
    return [g for g in groups if g["params"]]


def build_adamw(model: nn.Module, o: OptimizerConfig, device_type: str) -> list[torch.optim.Optimizer]:
    split = split_params(model)
    decay = split.muon + split.experts + split.adamw_decay
    return [_adamw(_adamw_groups(decay, split.adamw_no_decay, o), o, device_type)]


def build_muon(model: nn.Module, o: OptimizerConfig, device_type: str) -> list[torch.optim.Optimizer]:
    """Muon for the hidden matrices; AdamW, with optimizer.lr/betas/eps/weight_decay, for the rest."""
    m = o.muon
    split = split_params(model, muon_patterns=m.muon_patterns, adamw_patterns=m.adamw_patterns)
    weight_decay = m.weight_decay if m.weight_decay is not None else o.weight_decay
    groups = [{"params": [p for _, p in split.muon], "peak_lr": m.lr}]
    groups += [{**group, "peak_lr": m.lr} for group in split.expert_groups()]
    muon = Muon(
        [g for g in groups if g["params"]] or groups[:1],
        lr=m.lr,
        weight_decay=weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        adjust_lr_fn=m.adjust_lr_fn,
        variant=m.variant,
        beta2=m.beta2,
        newton_schulz=muon_iteration(o, device_type),
        eager=m.eager,
    )
    adamw_groups = _adamw_groups(split.adamw_decay, split.adamw_no_decay, o)
    # LoRA: when only the adapters train, all that trains is Muon's (their A and B) and no AdamW is needed.
    return [muon, _adamw(adamw_groups, o, device_type)] if adamw_groups else [muon]


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimizerConfig, str], list[torch.optim.Optimizer]]] = {
    "adamw": build_adamw,
    "muon": build_muon,
}


def muon_iteration(o: OptimizerConfig, device_type: str) -> NewtonSchulz:
    """The iteration ``build_muon``'s Muon runs on ``device_type``; the dry run counts it (``tools.plan``)."""
    return NewtonSchulz(gram=o.muon.gram_ns, products=default_products(device_type))


def build_optimizers(model: nn.Module, o: OptimizerConfig, device_type: str) -> list[torch.optim.Optimizer]:
    return OPTIMIZERS[o.name](model, o, device_type)
