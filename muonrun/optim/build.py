"""Optimizer registry: `optimizer.name` -> a builder that returns the list of torch optimizers.

Built after `fully_shard`, so every parameter is already a DTensor shard. Each param group
carries `peak_lr`; the trainer sets `lr = peak_lr * schedule(step)` before every step. This is the
only optim module that reads the config; `muonrun.optim` itself does not import it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from muonrun.config import OptimizerConfig
from muonrun.errors import UserError
from muonrun.optim.adamw import AdamW
from muonrun.optim.groups import split_params
from muonrun.optim.muon import Muon
from muonrun.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, ns_dtype_for
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products, quack_chosen, quack_installed


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


def products_for(name: str, device_type: str) -> Products:
    """The evaluation named by ``optimizer.muon.ns_products``: ``"torch"``; ``"quack"``
    (``ns_quack.QuackProducts``; raises ImportError without quack-kernels); ``"auto"``: quack where
    ``quack_pays``, else torch's (``quack_chosen``; an installed quack that fails to import is warned
    about, not fatal)."""
    if name not in ("auto", "torch", "quack"):
        raise ValueError(f"unknown ns_products {name!r}; expected auto, torch or quack")
    if not quack_chosen(name, device_type):
        return TORCH_PRODUCTS
    from muonrun.optim.ns_quack import QuackProducts

    try:
        return QuackProducts()
    except Exception as e:
        if name == "quack":
            raise
        warnings.warn(  # a broken optional install must not stop a run that did not ask for it
            f"optimizer.muon.ns_products=auto: quack is installed but does not import ({type(e).__name__}: {e}); "
            "Newton-Schulz uses torch's products. Set optimizer.muon.ns_products=torch to silence this.",
            stacklevel=2,
        )
        return TORCH_PRODUCTS


def build_muon(model: nn.Module, o: OptimizerConfig, device_type: str) -> list[torch.optim.Optimizer]:
    """Muon for the hidden matrices; AdamW, with optimizer.lr/betas/eps/weight_decay, for the rest."""
    m = o.muon
    split = split_params(model, muon_patterns=m.muon_patterns, adamw_patterns=m.adamw_patterns)
    weight_decay = m.weight_decay if m.weight_decay is not None else o.weight_decay
    # Stacked experts: one group per layout (matrices per expert slice, 2 for a fused gate_up_proj; stored
    # [E, out, in] or [E, in, out]; gate and up apart or interleaved).
    groups = [{"params": [p for _, p in split.muon], "peak_lr": m.lr}]
    groups += [{**group, "peak_lr": m.lr} for group in split.expert_groups()]
    muon = Muon(
        [g for g in groups if g["params"]] or groups[:1],
        lr=m.lr,
        weight_decay=weight_decay,
        momentum=m.momentum,
        nesterov=m.nesterov,
        ns_coefficients=m.ns_coefficients if m.ns_coefficients != "default" else DEFAULT_NS_COEFFICIENTS,
        eps=m.eps,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr_fn,
        gram=m.gram_ns,
        variant=m.variant,
        beta2=m.beta2,
        ns_dtype=ns_dtype_for(m.ns_dtype, device_type),
        precondition=m.ns_precondition,
        fused=m.fused if m.fused is not None else device_type == "cuda",
        products=products_for(m.ns_products, device_type),
        fold_norm=m.ns_fold_norm,
        split_restart=m.ns_split_restart,
        cuda_graph=m.cuda_graph if m.cuda_graph is not None else device_type == "cuda",
        ns_streams=m.ns_streams,
    )
    adamw_groups = _adamw_groups(split.adamw_decay, split.adamw_no_decay, o)
    # LoRA: when only the adapters train, all that trains is Muon's (their A and B) and no AdamW is needed.
    return [muon, _adamw(adamw_groups, o, device_type)] if adamw_groups else [muon]


def check_optimizer(o: OptimizerConfig, device_type: str) -> None:
    """What the optimizer settings need from this machine, checked before any worker starts."""
    if o.name != "muon" or o.muon.ns_products != "quack":
        return
    if device_type != "cuda":
        raise UserError(
            "Config key 'optimizer.muon.ns_products' is 'quack', but this run has no GPU: quack's symmetric "
            "GEMM needs an NVIDIA GPU. Set optimizer.muon.ns_products=auto (torch's products on CPU)."
        )
    if not quack_installed():
        raise UserError(
            "Config key 'optimizer.muon.ns_products' is 'quack', but quack-kernels is not installed: "
            "pip install 'muonrun[quack]', or set optimizer.muon.ns_products=auto (quack where installed, "
            "else torch's products)."
        )


OPTIMIZERS: dict[str, Callable[[nn.Module, OptimizerConfig, str], list[torch.optim.Optimizer]]] = {
    "adamw": build_adamw,
    "muon": build_muon,
}


def build_optimizers(model: nn.Module, o: OptimizerConfig, device_type: str) -> list[torch.optim.Optimizer]:
    return OPTIMIZERS[o.name](model, o, device_type)
