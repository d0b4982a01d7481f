"""The root module the trainer runs: a transformers causal LM's backbone, then its LM head and
cross-entropy fused over chunks of tokens (muonrun/model/loss.py), with a mixture of experts' router
losses and load statistics.
"""

from __future__ import annotations

import torch
from torch import nn

from muonrun.model.loss import linear_cross_entropy_sum, token_log_likelihoods
from muonrun.model.moe import (
    RouterLogits,
    backbone,
    expert_load,
    experts_per_token,
    is_moe,
    load_balancing_loss,
    router_z_loss,
)


class CausalLMWithLoss(nn.Module):
    """The root FSDP unit: backbone, then LM head + cross-entropy fused over chunks of tokens
    (muonrun/model/loss.py), so the full [tokens x vocab] fp32 logits never exist (151,936-way vocab for
    Qwen2). `loss_chunk_tokens=0` computes all logits at once.

    A mixture-of-experts model (`router_aux_loss_coef` not None) also adds the router's
    load-balancing loss times the coefficient to what backward sees; the value returned stays the LM
    loss (the aux term enters as `c * aux - (c * aux).detach()`, exactly 0 in value), so the logged and
    evaluated loss is comparable with a dense model's. The aux loss itself is summed on the device
    for logging (`moe_telemetry`); likewise the router z-loss times `router_z_loss_coef` when that is
    positive (logged as `z_loss`). While `watch_experts` is set each forward keeps the expert
    load statistics of its router logits. A dense model runs the plain path."""

    def __init__(
        self,
        lm: nn.Module,
        loss_chunk_tokens: int = 4096,
        compile_loss: bool = False,
        router_aux_loss_coef: float | None = None,
        router_z_loss_coef: float = 0.0,
    ):
        super().__init__()
        self.lm = lm
        self.loss_chunk_tokens = loss_chunk_tokens
        self.compile_loss = compile_loss
        self.router_aux_loss_coef = router_aux_loss_coef if is_moe(lm.config) else None
        self.router_z_loss_coef = router_z_loss_coef
        self.watch_experts = False
        self._aux_sum: torch.Tensor | None = None
        self._z_sum: torch.Tensor | None = None
        self._aux_count = 0
        self._expert_load: dict[str, torch.Tensor] = {}
        # Router logits through our own hooks where the model allows: transformers' way breaks the
        # compiled graph of every MoE layer (muonrun/model/moe.py RouterLogits).
        self._router_logits = RouterLogits.attach(lm) if self.router_aux_loss_coef is not None else None
        head = lm.get_output_embeddings()
        assert isinstance(head, nn.Linear) and head.bias is None, (
            "the fused loss expects a bias-free Linear LM head"
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        # use_cache=False: training needs no KV cache, and a cache object in the call makes every
        # compiled decoder layer guard on its own cache slot, so each layer recompiles and all past
        # torch._dynamo's recompile limit (8) silently run eager.
        if self.router_aux_loss_coef is None or per_token:
            hidden = backbone(self.lm)(input_ids=input_ids, use_cache=False).last_hidden_state
            return self._lm_loss(hidden, labels, per_token)
        if self._router_logits is None:
            out = backbone(self.lm)(input_ids=input_ids, use_cache=False, output_router_logits=True)
            router_logits = out.router_logits
        else:
            self._router_logits.take()  # what a recompute in the last backward recorded
            out = backbone(self.lm)(input_ids=input_ids, use_cache=False)
            router_logits = self._router_logits.take()
        loss = self._lm_loss(out.last_hidden_state, labels)
        if not torch.is_grad_enabled():  # evaluation: the LM loss alone
            return loss
        aux = load_balancing_loss(router_logits, self.lm.config)
        detached = aux.detach()
        self._aux_sum = detached if self._aux_sum is None else self._aux_sum + detached
        self._aux_count += 1
        if self.watch_experts:
            self._expert_load = expert_load(router_logits, experts_per_token(self.lm.config))
        scaled = self.router_aux_loss_coef * aux
        if self.router_z_loss_coef > 0:
            z = router_z_loss(router_logits)
            self._z_sum = z.detach() if self._z_sum is None else self._z_sum + z.detach()
            scaled = scaled + self.router_z_loss_coef * z
        return loss + (scaled - scaled.detach())

    def _lm_loss(self, hidden: torch.Tensor, labels: torch.Tensor, per_token: bool = False) -> torch.Tensor:
        weight = self.lm.get_output_embeddings().weight
        if per_token:  # each label's log-probability [B, T], for downstream evals (muonrun/eval/)
            return token_log_likelihoods(hidden, weight, labels, self.loss_chunk_tokens)
        total = linear_cross_entropy_sum(
            hidden.flatten(0, 1), weight, labels.flatten(), self.loss_chunk_tokens, self.compile_loss
        )
        return total / labels.numel()

    def moe_telemetry(self) -> dict[str, torch.Tensor]:
        """Since the last call (0-d device tensors, per rank): `aux_loss`, the mean load-balancing loss
        of the training forwards (and `z_loss`, the mean router z-loss, when it trains), and the expert
        load of the last watched one (`expert_load`); then a new window. Empty for a dense model."""
        if self.router_aux_loss_coef is None or self._aux_sum is None:
            return {}
        values = {"aux_loss": self._aux_sum / self._aux_count, **self._expert_load}
        if self._z_sum is not None:
            values["z_loss"] = self._z_sum / self._aux_count
        self._aux_sum, self._z_sum, self._aux_count, self._expert_load = None, None, 0, {}
        return values
