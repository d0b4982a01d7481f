"""Muon and AdamW for FSDP2-sharded models, usable without the rest of muonrun.

- ``Muon``: ``torch.optim.Muon``'s arguments and results on plain tensors, FSDP2/HSDP DTensors and
  stacked experts, each matrix orthogonalised once per shard group; ``variant="normuon"`` is NorMuon.
- ``AdamW``: ``torch.optim.AdamW`` stepping the local shards.
- ``split_params``: which parameters Muon may touch (hidden matrices and stacked experts, by module
  and name) and which go to AdamW (embeddings, LM head, routers, norms, biases).
- ``NewtonSchulz``, ``newton_schulz``: the orthogonalisation; a ``NewtonSchulz`` passed as
  ``Muon(..., newton_schulz=...)`` replaces Muon's (how a study tries another iteration).

The CLI builds these from the config (``muonrun.optim.build``); this package does not read it. On an
FSDP2 model, under ``torchrun``, after ``fully_shard`` (the optimizers hold the DTensor parameters)::

    from muonrun.optim import AdamW, Muon, split_params

    split = split_params(model)  # hidden matrices vs the rest, checked to cover every parameter
    groups = [{"params": [p for _, p in split.muon]}, *split.expert_groups()]  # experts: one group per layout
    muon = Muon(groups, lr=0.02, weight_decay=0.01, gram=True)
    decay, no_decay = [p for _, p in split.adamw_decay], [p for _, p in split.adamw_no_decay]
    adamw = AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                  lr=2e-4, betas=(0.9, 0.95))
    # each step: loss.backward(); muon.step(); adamw.step(); zero_grad() on both

These are the ``qwen2-muon-fsdp2`` preset's values: Muon's lr 0.02 suits its default (KellerJordan's)
shape scaling; with ``adjust_lr_fn="match_rms_adamw"`` (Moonlight) Muon can share AdamW's lr.
"""

from muonrun.optim.adamw import AdamW
from muonrun.optim.groups import ParamSplit, split_params
from muonrun.optim.muon import Muon
from muonrun.optim.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    NewtonSchulz,
    adjust_lr,
    newton_schulz,
    newton_schulz_flops,
)

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "AdamW",
    "Muon",
    "NewtonSchulz",
    "ParamSplit",
    "adjust_lr",
    "newton_schulz",
    "newton_schulz_flops",
    "split_params",
]
