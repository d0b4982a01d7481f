"""Mixture-of-experts models (transformers' Qwen2-MoE and its kin): which parameters are stacked
experts and routers, the router's load-balancing and z losses, expert-load statistics and active parameters.

transformers keeps every layer's experts as stacked parameters of one `*Experts` module:
`gate_up_proj` [E, 2I, H] (gate and up fused along dim 1, split by `chunk(2, dim=-1)` of the output)
and `down_proj` [E, H, I]; the router (`*Router`, `mlp.gate.weight` [E, H]) is a classifier. Dense
models have none of these, and nothing here runs for them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def backbone(lm: nn.Module) -> nn.Module:
    """The decoder stack under a causal LM's head: its `base_model`, or where the family's
    `base_model_prefix` names no attribute of it (Llama4ForCausalLM's is "language_model", its stack
    `model`) and `base_model` is the LM itself, its `model`."""
    base = lm.base_model
    return lm.model if base is lm and isinstance(getattr(lm, "model", None), nn.Module) else base


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (0 for a dense model)."""
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None) or 0)


def experts_per_token(hf_config) -> int:
    return int(getattr(hf_config, "num_experts_per_tok", None) or 0)


def is_moe(hf_config) -> bool:
    return num_experts(hf_config) > 0 and experts_per_token(hf_config) > 0


def is_router_module(module: nn.Module) -> bool:
    """A router: a raw `weight` [E, H] scoring the experts for each token, e.g. `Qwen2MoeTopKRouter`."""
    return type(module).__name__.endswith("Router")


LOGITS = "muonrun_router_logits"
"""The attribute where our hook leaves a router module's logits of its last forward."""


def _record_router_logits(module: nn.Module, args, output) -> None:
    """The forward hook: the module's logits stay on it until `RouterLogits.take` collects them (an
    attribute, not a shared list: dynamo guards on a list's length, so every layer would compile anew)."""
    setattr(module, LOGITS, output[module.muonrun_logits_index] if isinstance(output, tuple) else output)


class RouterLogits:
    """Each router's logits of a forward, recorded by a forward hook of ours instead of transformers'
    `output_router_logits=True`.

    transformers records them with hooks that read a `ContextVar`, which torch.compile cannot trace: a
    graph break in every compiled MoE layer (the layer runs as several graphs with eager Python between
    them, on every forward and its backward). Our hook sets an attribute of the module, which dynamo
    traces, so each decoder layer stays one graph. It records what transformers'
    `_can_record_outputs["router_logits"]` names (the module class and the output index), in layer
    order: the very tensors transformers would return. `attach` returns None where that spec is not a
    plain class and index (a name match): the caller then asks transformers for them."""

    def __init__(self, modules: list[nn.Module], index: int):
        self.modules = modules
        for module in modules:
            module.muonrun_logits_index = index
            setattr(module, LOGITS, None)
            module.register_forward_hook(_record_router_logits)

    def take(self) -> tuple[Tensor, ...]:
        """The logits of the last forward, layer by layer (none where a layer did not run); they are
        then forgotten. A recompute of activation checkpointing in backward records them again: the
        caller takes (and drops) those before its next forward."""
        out = tuple(t for m in self.modules if (t := getattr(m, LOGITS)) is not None)
        for m in self.modules:
            setattr(m, LOGITS, None)
        return out

    @staticmethod
    def attach(lm: nn.Module) -> RouterLogits | None:
        """Hooks on the modules whose output transformers records as `router_logits`; None when the
        model's `_can_record_outputs` names them another way (by class name) or not at all."""
        spec = (getattr(type(backbone(lm)), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is None or isinstance(spec, list | str):
            return None
        if isinstance(spec, type):
            target, index, layer_name = spec, 1, None  # transformers' default index for a bare class
        else:
            target, index = getattr(spec, "target_class", None), getattr(spec, "index", None)
            layer_name = getattr(spec, "layer_name", None)
            if (
                not isinstance(target, type)
                or not isinstance(index, int)
                or getattr(spec, "class_name", None)
            ):
                return None
        found = [
            m
            for name, m in backbone(lm).named_modules()
            if isinstance(m, target) and (layer_name is None or f".{layer_name.strip('.')}." in f".{name}.")
        ]
        return RouterLogits(found, index) if found else None


def router_aux_loss_coef(cfg, hf_config) -> float | None:
    """The load-balancing loss weight for this run: `train.router_aux_loss_coef`, else the model
    config's; None for a dense model."""
    if not is_moe(hf_config):
        return None
    if cfg.train.router_aux_loss_coef is not None:
        return float(cfg.train.router_aux_loss_coef)
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(router_logits: tuple[Tensor, ...], hf_config) -> Tensor:
    """The Switch-Transformer load-balancing loss of each MoE layer, averaged over layers:
    E * sum_e f_e * P_e, with f_e the share of the layer's tokens whose top k holds expert e (summing
    to k) and P_e its mean router probability; k when balanced. Per layer, as in the Switch
    Transformer: transformers' `load_balancing_loss_func` pools the counts and probabilities of all
    layers first, so layers that crowd onto different experts look balanced together."""
    e, k = num_experts(hf_config), experts_per_token(hf_config)
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        chosen = probs.topk(k, dim=-1).indices.reshape(-1).float()
        share = torch.histc(chosen, bins=e, min=0, max=e) / probs.shape[0]  # no host sync
        losses.append(e * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def router_z_loss(router_logits: tuple[Tensor, ...]) -> Tensor:
    """ST-MoE's router z-loss (arXiv:2202.08906, eq. 5) averaged over MoE layers: the mean over tokens
    of logsumexp(router logits)^2. It keeps the router logits small, where softmax stays sensitive."""
    return torch.stack([torch.logsumexp(x.float(), dim=-1).square().mean() for x in router_logits]).mean()


@torch.no_grad()
def expert_load(router_logits: tuple[Tensor, ...], top_k: int) -> dict[str, Tensor]:
    """Per MoE layer i, from its router logits [tokens, E] (0-d device tensors, no host sync):
    `expert_load_max_mean_<i>`, the busiest expert's share of the top-k assignments over the mean
    share (1 = perfectly even, E / top_k = one expert in every token's top k), and
    `router_entropy_<i>`, the mean entropy (nats) of the router's softmax per token (log E =
    undecided). The unsuffixed keys are the largest load ratio and the mean entropy over layers."""
    values: dict[str, Tensor] = {}
    loads, entropies = [], []
    for i, logits in enumerate(router_logits):
        logp = torch.log_softmax(logits.float(), dim=-1)
        n = logp.shape[-1]
        chosen = logp.topk(top_k, dim=-1).indices.reshape(-1).float()
        counts = torch.histc(chosen, bins=n, min=0, max=n)  # no host sync, unlike bincount
        loads.append(counts.max() / counts.mean().clamp(min=1e-30))
        entropies.append(-(logp.exp() * logp).sum(-1).mean())
        values[f"expert_load_max_mean_{i}"] = loads[-1]
        values[f"router_entropy_{i}"] = entropies[-1]
    if loads:
        values = {
            "expert_load_max_mean": torch.stack(loads).max(),
            "router_entropy": torch.stack(entropies).mean(),
            **values,
        }
    return values


def expert_width(hf_config) -> int:
    """One routed expert's intermediate size: ``moe_intermediate_size`` where the family has it (Qwen2-MoE,
    DeepSeek), else ``intermediate_size`` (Mixtral, GPT-OSS)."""
    return getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size


def active_matmul_params(hf_config) -> int | None:
    """Matmul weights one token passes through in the MLPs of all layers (top-k routed experts, the
    shared expert and its gate, the router; dense MLPs in layers that have no experts), or None for a
    dense model."""
    if not is_moe(hf_config):
        return None
    h = hf_config.hidden_size
    layers = hf_config.num_hidden_layers
    moe_inter = expert_width(hf_config)
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or 0
    step = getattr(hf_config, "decoder_sparse_step", None) or 1
    dense_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    total = 0
    for i in range(layers):
        if i not in dense_only and (i + 1) % step == 0:
            total += experts_per_token(hf_config) * 3 * h * moe_inter + num_experts(hf_config) * h
            if shared:
                total += 3 * h * shared + h
        else:
            total += 3 * h * hf_config.intermediate_size
    return total
