"""How Newton–Schulz scales an un-normalised input without a pass over it: the scale is read off the
first Gram product ``A = X X^T`` and applied to the small ``m x m`` products the iteration forms
(``newton_schulz.standard_iterations`` and ``gram_iterations`` take a ``Scaling``). Imports only torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DEFAULT_EPS", "PRECONDITIONS", "Scaling", "gram_scale", "multiply_", "scale_gram_", "scale_input"]

DEFAULT_EPS = 1e-7
PRECONDITIONS = ("frobenius", "aol")


def multiply_(T: Tensor, f: Tensor) -> None:
    """``T *= f`` in place (``f`` broadcast over ``T``), computed in fp32 and rounded once into ``T``'s
    dtype: how a folded scale is applied (``Scaling.multiply``; Muon compiles it, ``fused.Passes.scale``)."""
    T.mul_(f)


@dataclass(frozen=True)
class Scaling:
    """How an un-normalised input is scaled, from its first Gram product ``A`` (``X X^T`` on the wide
    orientation, ``m x m``), instead of by a separate pass over ``X``:

    - ``"frobenius"``: ``X / max(norm_scale * ||X||_F, eps)``, with ``||X||_F^2 = trace(A)``: torch's
      normalisation, folded (it differs from dividing first by where the bf16 roundings fall). The
      scale stays fp32 and every product it scales is computed in fp32 and rounded once: a scale
      rounded to bf16 would move every singular value by the same factor, up to 0.2%. ``A``'s
      entries are the input's squares: inputs whose entries pass about 1e17 overflow bf16's range
      (the result is then not finite, as a NaN step is);
    - ``"aol"`` (Turbo-Muon's AOL preconditioning, arXiv:2512.04632): ``D X`` with
      ``D_ii = (sum_j |A_ij|)^(-1/2)``, the diagonal rescaling that bounds the spectral norm by 1
      (Prach and Lampert's almost-orthogonal layers, arXiv:2208.03160). It brings the singular values
      of gradient-like matrices 1.2-3x closer to 1 than the Frobenius norm does, so a shorter
      coefficient table (``TURBO_COEFFICIENTS``) can reach the same distance to the polar factor. A
      row scaling changes the polar factor itself a little (it is not a scalar): the distance to
      the polar factor of the input is what benchmarks/ns_levers_numerics.py measures.

    ``multiply(T, f)``: ``multiply_``, eager, unless the caller has a faster pass of it (Muon's
    compiled one, ``fused.Passes.scale``).
    """

    kind: str = "frobenius"
    norm_scale: float = 1.0
    eps: float = DEFAULT_EPS
    multiply: Callable[[Tensor, Tensor], None] = multiply_


def gram_scale(A: Tensor, scaling: Scaling) -> Tensor:
    """The scale for the first Gram product ``A`` ``[k, m, m]``, in fp32: AOL, the diagonal of ``D``
    ``[k, m]``; Frobenius, one number per matrix ``[k, 1, 1]``."""
    if scaling.kind == "aol":  # row sums of |A|, read once (fp32 accumulation)
        dtype = torch.promote_types(A.dtype, torch.float32)
        return torch.linalg.vector_norm(A, ord=1, dim=-1, dtype=dtype).clamp_(min=scaling.eps**2).rsqrt_()
    if scaling.kind != "frobenius":
        raise ValueError(f"unknown scaling {scaling.kind!r}; expected one of {PRECONDITIONS}")
    trace = A.diagonal(dim1=-2, dim2=-1).float().sum(-1).view(-1, 1, 1)
    return (trace.sqrt() * scaling.norm_scale).clamp_(min=scaling.eps).reciprocal_()


def scale_gram_(A: Tensor, scaling: Scaling) -> Tensor:
    """``A <- D A D`` in place, the Gram product of the scaled input, and the factor ``f`` that a
    product ``B`` on ``D``'s right takes (``scaling.multiply(B, f)`` is ``B D``): AOL, ``D``'s diagonal
    in ``A``'s dtype (one ``D`` for ``A`` and ``X``: same-dtype passes are eager's fast ones) as a row
    ``[k, 1, m]``; Frobenius, the fp32 scale ``[k, 1, 1]``."""
    d = gram_scale(A, scaling)
    if scaling.kind == "aol":
        d = d.to(A.dtype)
        scaling.multiply(A, d.unsqueeze(-1))
        scaling.multiply(A, d.unsqueeze(-2))
        return d.unsqueeze(-2)
    scaling.multiply(A, d.square())
    return d


def scale_input(X: Tensor, scaling: Scaling) -> Tensor:
    """``D X`` on its own (the zero-iteration case): a new tensor."""
    tall = X.shape[-2] > X.shape[-1]
    d = gram_scale(torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT), scaling)
    if scaling.kind == "aol":
        d = d.to(X.dtype).unsqueeze(-2 if tall else -1)
    return (X * d).to(X.dtype)
