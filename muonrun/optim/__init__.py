"""Muon and AdamW for FSDP2-sharded models, usable without the rest of muonrun.

- ``Muon`` (``muonrun.optim.muon``): Muon on plain tensors and FSDP2/HSDP DTensors, each matrix
  orthogonalised once per shard group; same arguments and results as ``torch.optim.Muon``;
  ``variant="normuon"`` is NorMuon (rows normalised after Newton–Schulz).
- ``AdamW`` (``muonrun.optim.adamw``): ``torch.optim.AdamW`` stepping the local shards.
- ``split_params`` (``muonrun.optim.groups``): which parameters Muon may touch (hidden matrices,
  by module and name; a mixture of experts' stacked expert weights in ``split.experts``, for a Muon
  group with ``matrices_per_expert``: ``muonrun.optim.experts``) and which go to AdamW (embeddings,
  LM head, routers, norms, biases).
- ``NewtonSchulz``, ``newton_schulz`` and friends (``muonrun.optim.newton_schulz``): the
  orthogonalisation itself; a ``NewtonSchulz`` passed as ``Muon(..., newton_schulz=...)`` replaces Muon's.

The CLI builds these from the config through ``muonrun.optim.build``; this package does not read
the config. On an FSDP2 model, under ``torchrun``::

    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from muonrun.optim import AdamW, Muon, split_params

    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("Qwen/Qwen2-0.5B")).cuda()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)  # build the optimizers after sharding: they hold the DTensor parameters

    split = split_params(model)  # hidden matrices vs the rest, checked to cover every parameter
    muon = Muon([p for _, p in split.muon], lr=0.02, weight_decay=0.01, gram=True)
    adamw = AdamW(
        [
            {"params": [p for _, p in split.adamw_decay], "weight_decay": 0.01},
            {"params": [p for _, p in split.adamw_no_decay], "weight_decay": 0.0},
        ],
        lr=2e-4,
        betas=(0.9, 0.95),
    )
    for input_ids in batches:  # your data
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()

These are the ``qwen2-muon-fsdp2`` preset's values: Muon's lr 0.02 suits its default
(KellerJordan's) shape scaling and would blow up an embedding table, hence AdamW's own lr. With
``adjust_lr_fn="match_rms_adamw"`` (Moonlight) Muon's updates have AdamW's RMS and can share its lr.
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
