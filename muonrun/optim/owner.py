"""The owner's side of Muon's step for one stack of same-shape matrices, wherever the stack came from: a
bucket its rank holds whole or one reassembled from an all-to-all. ``Muon._orthogonalize`` runs one per
stack, side by side on the CUDA graph's lanes where there are (``muonrun.optim.graphed.Lanes``). Only
``muonrun.optim.muon`` uses it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from muonrun.optim.fused import frobenius_divisors
from muonrun.optim.newton_schulz import normuon_row_scale, orthogonality_residual, uses_gram_form
from muonrun.optim.settings import NSSettings
from muonrun.optim.sharding import Item, Owned, Partition, scatter_rows


def orthogonalize_stack(opt, part: Partition, own: Owned, grid: Tensor, sample: Item | None) -> None:
    """The owner's work on one stack of same-shape matrices of ``opt`` (a ``Muon``): normalise it (or fold
    the norm), Newton–Schulz, NorMuon's row factors, and on several ranks the rows back into ``grid``
    (``recv`` as ``[world, per_source]``); ``sample``: the item whose orthogonality residual telemetry
    reports."""
    W = part.shard.world
    ns: NSSettings = part.ns  # type: ignore[assignment]
    k, R, C, c = own.count, own.rows, own.cols, own.chunk
    run = grid[:, own.offset : own.offset + k * own.slab].view(W, k, own.slab)
    slabs = run[..., : c * C].view(W, k, c, C)
    # Frobenius: a pass of its own (padding rows are zero, so the norm over whole slabs is the
    # matrix's; compiled where fused) or, held whole, folded (``fold_norm``); AOL: folded
    if W == 1:  # the buffer is ours: normalised in place, the result written back into it
        X = slabs[0]
        scaling = ns.scaling(opt._passes.scale, X.shape if opt.fold_norm else None)
        if scaling is None:
            opt._passes.normalize(run[0], c, C, ns.norm_scale, ns.eps)
        out = opt._newton_schulz(X, ns.per_step, scaling=scaling, out=X)
    else:
        full = torch.empty(k, W * c, C, dtype=grid.dtype, device=grid.device)
        scaling = ns.scaling(opt._passes.scale)
        if scaling is None:  # reassembled and normalised in one pass
            norm = frobenius_divisors(slabs, (0, 2, 3), ns.norm_scale, ns.eps).view(k, 1, 1, 1)
            torch.div(slabs.transpose(0, 1), norm, out=full.view(k, W, c, C))
        else:
            full.view(k, W, c, C).copy_(slabs.transpose(0, 1))
        X = full[:, :R]
        out = opt._newton_schulz(X, ns.per_step, scaling=scaling)
    if own.first is sample:  # reported by its owner, summed with the others' zeros
        opt._sums.add(part.shard.group, "ortho_residual", orthogonality_residual(out[0]))
    if ns.normuon:
        states = run[..., own.state_at : own.state_at + c * own.first.row_state]
        states = states.view(torch.float32).view(W, k, 2, c)  # v, then the factor, of every row
        v = states[:, :, 0].transpose(0, 1).reshape(k, W * c)[:, :R]
        factor, v = normuon_row_scale(out, v, *ns.normuon)
        scatter_rows(states[:, :, 0], v, c)
        scatter_rows(states[:, :, 1], factor, c)  # applied with the update (``_apply``)
    if W > 1:
        scatter_rows(slabs, out, c)
    opt.stats["orthogonalized"] += k
    opt.stats["gram"] += k * (opt.gram and uses_gram_form(X.shape, len(ns.per_step)))
