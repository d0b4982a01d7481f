"""Muon on stacked expert weights: a mixture-of-experts layer's ``[E, out, in]`` parameter is a batch of
E matrices (or 2E with a fused gate/up projection), each orthogonalised on its own.

FSDP2 shards dim 0, the expert dimension (``torch.chunk`` layout: ``ceil(E / W)`` experts per rank,
the last ranks fewer or none), so a rank's local shard is a set of whole experts and the rank that
holds an expert runs its Newton–Schulz: no exchange, unlike the row-sharded 2-D matrices
(``muonrun.optim.sharding``). ``muonrun.optim.muon.Muon`` steps these with the functions below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from muonrun.distributed import local_tensor
from muonrun.optim.newton_schulz import adjust_lr, normuon_normalize, uses_gram_form
from muonrun.optim.settings import NSSettings
from muonrun.optim.telemetry import reduce_group, sum_of_squares

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]


def is_experts_module(module: nn.Module) -> bool:
    """A module holding stacked expert weights ([E, out, in] parameters): transformers names them
    `*Experts` (`Qwen2MoeExperts`, `MixtralExperts`, ...)."""
    return type(module).__name__.endswith("Experts")


def matrices_per_expert(param_name: str) -> int:
    """How many matrices one expert's slice of a stacked parameter holds: 2 for transformers' fused
    `gate_up_proj` ([2I, H]: the gate's [I, H] rows, then the up projection's), 1 otherwise."""
    return 2 if param_name.rsplit(".", 1)[-1] == "gate_up_proj" else 1


def check_stacked(p: Tensor, matrices_per_expert: int, name: str) -> None:
    """A stacked parameter must split into equal matrices along dim 1 and be sharded on dim 0 alone."""
    if matrices_per_expert < 1 or p.shape[1] % matrices_per_expert:
        raise ValueError(
            f"Muon: stacked parameter {name} cannot be split into {matrices_per_expert} matrices per "
            "expert along dim 1"
        )
    if DTensor is not None and isinstance(p, DTensor):
        local = local_tensor(p)
        if tuple(local.shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(
                f"Muon: stacked parameter {name} is sharded inside its experts ({p.placements}); "
                "only the expert dimension (dim 0) may be sharded"
            )


def expert_rows_like(p: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Zeros ``[E, out]``: one entry per row of every expert matrix of ``p`` ``[E, out, in]``, laid out
    like ``p``'s experts (a DTensor with its mesh and placements, or a plain tensor), so DCP saves and
    reshards it like the parameter."""
    local = local_tensor(p)
    zeros = torch.zeros(local.shape[0], p.shape[1], dtype=dtype, device=local.device)
    if DTensor is None or not isinstance(p, DTensor):
        return zeros
    return DTensor.from_local(
        zeros, p.device_mesh, p.placements, shape=tuple(p.shape[:2]), stride=(p.shape[1], 1), run_check=False
    )


def orthogonalize_stacked(
    u: Tensor,
    matrices_per_expert: int,
    ns,
    ns_dtype: torch.dtype,
    newton_schulz: Callable[[Tensor, Sequence], Tensor],
    v: Tensor | None = None,
) -> tuple[Tensor, tuple[int, int]]:
    """The orthogonalised update of a local stack ``u`` ``[e, out, in]`` (this rank's experts) as
    ``[e * k, out / k, in]`` in ``ns_dtype`` (k = ``matrices_per_expert``), and one matrix's shape.

    Each matrix is scaled as ``ns`` says (its Frobenius norm times ``ns.norm_scale``, at least
    ``ns.eps``; or AOL's row scaling inside the first product) and iterated by ``newton_schulz`` in one
    batch, as the 2-D path does for the matrices a rank owns.
    NorMuon (``ns.normuon``): the rows are then normalised with ``v`` ``[e, out]`` (updated in place).
    """
    k = matrices_per_expert
    rows, cols = u.shape[1] // k, u.shape[2]
    X = u.to(ns_dtype).reshape(-1, rows, cols)
    if X.shape[0] == 0:  # a rank that holds no experts of this layer
        return X, (rows, cols)
    if X.data_ptr() == u.data_ptr():
        X = X.clone()  # never scale the momentum buffer itself
    scaling = ns.scaling()
    if scaling is None:  # Frobenius: a pass of its own; AOL is folded into the first product
        norm = torch.linalg.vector_norm(X, dim=(1, 2))
        if ns.norm_scale != 1.0:
            norm = norm * ns.norm_scale
        X.div_(norm.clamp_(min=ns.eps).view(-1, 1, 1))
    out = newton_schulz(X, ns.per_step, scaling=scaling)
    if ns.normuon:
        out, new_v = normuon_normalize(out, v.view(-1, rows), *ns.normuon)
        v.view(-1, rows).copy_(new_v)
        out = out.to(ns_dtype)
    return out, (rows, cols)


def step_stacked(opt, gi: int, p: Tensor, s) -> None:
    """`Muon.step` for one stacked expert parameter (`opt`'s param group `gi`, step settings `s`):
    momentum, then every matrix of this rank's experts orthogonalised in one batch (NorMuon:
    normalised), weight decay and the update, all local."""
    group = opt.param_groups[gi]
    ns = NSSettings.of(group)
    local, buf = local_tensor(p), local_tensor(opt._momentum_buffer(p))
    grad = p.grad
    if grad.is_sparse:
        raise RuntimeError("Muon does not support sparse gradients")
    grad = local_tensor(grad)
    buf.lerp_(grad, 1 - s.momentum)
    u = grad.lerp(buf, s.momentum) if s.nesterov else buf
    v = local_tensor(opt._second_moment(p)) if ns.normuon else None
    update, shape = orthogonalize_stacked(
        u, group["matrices_per_expert"], ns, opt.ns_dtype, opt._newton_schulz, v
    )
    opt.stats["orthogonalized"] += update.shape[0]
    opt.stats["gram"] += update.shape[0] * (opt.gram and uses_gram_form(shape, len(ns.per_step)))
    update = update.view(local.shape)
    alpha = -adjust_lr(s.lr, s.adjust_lr_fn, shape)
    if opt._sums is not None:
        pg = reduce_group(p)
        opt._sums.add(pg, "momentum", sum_of_squares([buf]))
        delta = torch.add(local * (-s.lr * s.weight_decay), update, alpha=alpha)
        opt._sums.add(pg, "update", sum_of_squares([delta]))
    if s.lr * s.weight_decay != 0.0:
        local.mul_(1 - s.lr * s.weight_decay)
    local.add_(update, alpha=alpha)
