"""Auxiliary-loss-free expert balancing (DeepSeek-V3, arXiv:2408.15437 §2.1.2): a per-expert bias on
each router's scores for choosing the top-k experts, moved after every optimizer step against the
step's load (`train.router_bias_update_rate`).

Every router (`weight` [E, H], forward returning (logits, gate weights, expert indices) from a
softmax top-k: transformers' Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) gets two buffers and a forward
hook. The hook re-chooses the experts as top-k of (softmax(logits) + bias) and gathers the gate
weights from the unbiased softmax (renormalised over the k chosen when the router does that), so the
bias decides which experts run and never how much each contributes. Which of the two gate rules a
router follows is read off the router itself, on a CPU copy, when the model is built; a router that
follows neither is refused, naming the setting.

Loads: the hook adds the chosen experts' counts to a per-router buffer in training forwards of the
decoder (a flag set around the decoder's forward, so the recompute of activation checkpointing,
which runs the layers again during backward, is not counted twice). `after_step` all-reduces the
counts of every router in one SUM (the same numbers on every rank, so every rank takes the same
bias step) and moves b_e by rate * sign(mean - load_e): an overloaded expert's bias falls, an idle
one's rises. The bias (`muonrun_expert_bias`, fp32) is a persistent buffer: it is in the model's
state dict, so checkpoints hold it and resume and reshard it exactly; the counts are not state (zero
after every step). The export leaves the bias out of the weights, which transformers would not
load, and writes it beside them (`router_expert_bias.safetensors`): the exported model routes by its
routers alone.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from muonrun import log
from muonrun.config import Config
from muonrun.errors import UserError
from muonrun.features.protocol import ExportJob, Feature
from muonrun.model.moe import backbone, is_moe, is_router_module

BIAS = "muonrun_expert_bias"
"""The router buffer holding its per-expert selection bias ([E], fp32, persistent: checkpointed)."""

COUNTS = "muonrun_expert_counts"
"""The router buffer counting this step's top-k assignments per expert ([E], fp32, not state)."""

KEY = "train.router_bias_update_rate"
EXPORT_FILE = "router_expert_bias.safetensors"


def routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers, in model (= layer) order."""
    return [m for m in model.modules() if is_router_module(m)]


def gate_rule(router: nn.Module) -> bool:
    """Whether `router` renormalises its top-k gate weights to sum to 1 (True) or gates with the plain
    softmax probabilities (False), found by running a CPU copy of it; a UserError naming the setting
    if it does neither (another scoring: sigmoid, grouped top-k, a bias of its own)."""
    weight = getattr(router, "weight", None)
    top_k = getattr(router, "top_k", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        raise _unsupported(router, "it has no `weight` [experts, hidden] and `top_k`")
    probe = copy.deepcopy(router).to_empty(device="cpu")
    for name, _ in probe.named_buffers():
        if name not in (BIAS, COUNTS):  # a buffer of the router's own, e.g. a score-correction bias
            raise _unsupported(router, f"it has a buffer `{name}` of its own")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen))
        x = torch.randn(16, weight.shape[1], generator=gen)
        out = probe(x)
    if not (isinstance(out, tuple) and len(out) == 3):
        raise _unsupported(router, "its forward does not return (logits, gate weights, expert indices)")
    logits, scores, indices = out
    probs = torch.softmax(logits.float(), dim=-1)
    if not torch.equal(indices, probs.topk(top_k, dim=-1).indices):
        raise _unsupported(router, "it does not choose the top-k experts of its softmax")
    plain = probs.gather(-1, indices)
    if torch.allclose(scores.float(), plain, atol=1e-6):
        return False
    if torch.allclose(scores.float(), plain / plain.sum(-1, keepdim=True), atol=1e-6):
        return True
    raise _unsupported(router, "its gate weights are not its softmax probabilities of the chosen experts")


def _unsupported(router: nn.Module, why: str) -> UserError:
    return UserError(
        f"Config key '{KEY}' cannot apply to this model's router ({type(router).__name__}): {why}, so a "
        "selection bias would change what it computes. Set it to 0 (off) and balance with "
        "train.router_aux_loss_coef."
    )


def biased_routing(module: nn.Module, args, output):
    """The forward hook: experts chosen by top-k of softmax + bias, gated by the unbiased softmax."""
    logits = output[0]
    probs = torch.softmax(logits.float(), dim=-1)
    bias = getattr(module, BIAS)
    indices = (probs + bias).topk(module.top_k, dim=-1).indices
    weights = probs.gather(-1, indices)
    if module.muonrun_renormalise:
        weights = weights / weights.sum(-1, keepdim=True)
    if module.muonrun_counting and torch.is_grad_enabled():
        n = bias.shape[0]
        counts = getattr(module, COUNTS)
        counts.add_(torch.histc(indices.reshape(-1).float(), bins=n, min=0, max=n))  # no host sync
    return logits, weights.to(logits.dtype), indices


def attach(model: nn.Module) -> list[nn.Module]:
    """Give every router of `model` its bias, counts and hook; the decoder sets the counting flag
    around its own forward. Returns the routers (a UserError if there are none)."""
    found = routers(model)
    if not is_moe(model.config) or not found:
        raise UserError(
            f"Config key '{KEY}' balances a mixture of experts' routers, and this model has none "
            f"({model.config.model_type}). Set it to 0."
        )
    for router in found:
        router.muonrun_renormalise = gate_rule(router)
        device = router.weight.device
        router.register_buffer(BIAS, torch.zeros(router.weight.shape[0], device=device))
        router.register_buffer(COUNTS, torch.zeros(router.weight.shape[0], device=device), persistent=False)
        router.muonrun_counting = False
        router.register_forward_hook(biased_routing)
    decoder = backbone(model)

    def counting(on: bool):
        def hook(module, *rest):
            for router in found:
                router.muonrun_counting = on and module.training

        return hook

    decoder.register_forward_pre_hook(counting(True))
    decoder.register_forward_hook(counting(False))
    return found


@torch.no_grad()
def update_biases(found: list[nn.Module], rate: float) -> Tensor:
    """One bias step from the counts of the step just taken (summed over ranks), then zero counts.
    Returns those counts, [layers, E]."""
    counts = torch.stack([getattr(r, COUNTS) for r in found])  # [layers, E]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    step = rate * torch.sign(counts.mean(dim=-1, keepdim=True) - counts)
    for router, delta in zip(found, step, strict=True):
        getattr(router, BIAS).add_(delta)
        getattr(router, COUNTS).zero_()
    return counts


class RouterBias(Feature):
    @staticmethod
    def wanted(cfg: Config) -> bool:
        return cfg.train.router_bias_update_rate > 0

    def adapt(self, model: nn.Module) -> None:
        attach(model)

    def init_parameter(self, name, shape, generator, device):
        if name.endswith(BIAS) or name.endswith(COUNTS):
            return torch.zeros(shape, device=device)
        return None

    def pretrained_name(self, name: str) -> str | None:
        return None if name.endswith(BIAS) else name

    def start(self, model: nn.Module, device: torch.device) -> None:
        self.routers = routers(model)
        self.counts = torch.zeros(len(self.routers), self.routers[0].weight.shape[0], device=device)

    def after_step(self) -> None:
        self.counts = update_biases(self.routers, self.cfg.train.router_bias_update_rate)

    def telemetry(self) -> dict[str, Tensor]:
        """The load as trained, from the last step's counts over every rank and micro-batch:
        `routed_load_max_mean_<i>` per MoE layer (busiest expert over the mean, as
        `expert_load_max_mean`, which is the router's own top-k without the bias) and the worst layer's
        unsuffixed; `router_bias_max`, the largest bias magnitude: how far balancing has had to push
        the routers' own preference."""
        ratio = self.counts.max(dim=-1).values / self.counts.mean(dim=-1).clamp(min=1e-30)
        values = {f"routed_load_max_mean_{i}": r for i, r in enumerate(ratio)}
        return {
            "routed_load_max_mean": ratio.max(),
            "router_bias_max": torch.stack([getattr(r, BIAS).abs().max() for r in self.routers]).max(),
            **values,
        }

    def plan_rows(self, model: nn.Module) -> list[tuple[str, str]]:
        rate = self.cfg.train.router_bias_update_rate
        return [("router bias", f"{len(routers(model))} routers, update rate {rate:g} per step")]

    def export(self, job: ExportJob) -> dict[str, Tensor] | Path | None:
        from safetensors.torch import save_file

        biases = {k: v for k, v in job.tensors.items() if k.endswith(BIAS)}
        if not biases:
            return None
        job.out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.float().contiguous() for k, v in biases.items()}, job.out / EXPORT_FILE)
        note = (
            f"The routers' selection biases ({KEY}) are not in the weights: transformers' "
            f"{job.hf_config.model_type} routes by its routers alone, so it can choose other experts than "
            f"training did. They are in {EXPORT_FILE} (expert index order, one per MoE layer)."
        )
        job.notes.append(note)
        log.warning(note)
        return {k: v for k, v in job.tensors.items() if not k.endswith(BIAS)}
