"""The matrix products of one Newton–Schulz iteration, as an object the iterations call.

``newton_schulz.standard_iterations`` and ``gram_iterations`` compute every product through a
``Products``, so a faster evaluation of some products plugs in without touching the iteration.
``Products`` is torch's (``bmm``/``baddbmm``: bit for bit the iterations written with them); it also
owns the iteration's small elementwise kernels (the folded norm's scale, the split restart's splits),
compiled per shape on GPUs. Every tensor is a stack ``[k, r, c]``; "symmetric" inputs are symmetric
in exact arithmetic (Gram matrices and polynomials in one, which commute): an implementation may read
one triangle of them and must return a full, contiguous result (``ns_quack.QuackProducts`` does).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from muonrun import compat
from muonrun.optim.fused import Kernels

__all__ = ["SYMMETRIC_MIN_SIZE", "TORCH_PRODUCTS", "Products", "mm_fp32"]

SYMMETRIC_MIN_SIZE = 512
"""The smaller side of a matrix from which quack's symmetric products (``ns_quack``) run; below it
(a Gram matrix of one or two tile rows) torch's are faster on an H200 (docs/performance.md)."""


def _scale(T: Tensor, f: Tensor) -> None:
    T.mul_(f)


def _split(T: Tensor, dtype: torch.dtype) -> Tensor:
    hi = T.to(dtype)
    return torch.cat([hi, (T - hi.to(T.dtype)).to(dtype)], dim=-1)


def _split_sum(S: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    m = S.shape[-1] // 2
    T = S[..., :m] + S[..., m:]
    hi = T.to(dtype)
    return hi, (T - hi.to(T.dtype)).to(dtype)


_KERNELS = Kernels(compiled=True)


def _kernel(fn: Callable, T: Tensor, other, compiled: bool, options: Callable[[], dict] | None = None):
    """``fn(T, other)``: compiled (``_KERNELS``) for CUDA tensors where ``compiled``, else eager."""
    if not (compiled and T.is_cuda):
        return fn(T, other)
    key = (fn.__name__, tuple(T.shape), T.stride(), T.dtype, getattr(other, "shape", other))
    return _KERNELS(key, fn, T, other, options=options)


def mm_fp32(A: Tensor, B: Tensor) -> Tensor:
    """``A B`` for stacks of bf16 (or fp32, fp64) operands, with at least fp32 accumulation and an
    fp32 (fp64) result never rounded to bf16: ``bmm``'s ``out_dtype`` on CUDA, the product of the
    operands upcast elsewhere (exact products of bf16 values, the same fp32 accumulation)."""
    dtype = torch.promote_types(A.dtype, torch.float32)
    if A.is_cuda and A.dtype != dtype:
        return torch.bmm(A, B, out_dtype=dtype)
    return torch.bmm(A.to(dtype), B.to(dtype))


class Products:
    """torch's evaluation of Newton–Schulz's products (the reference every other one is held to)."""

    name = "torch's products"
    compiled = True
    """Whether the small elementwise kernels compile on GPUs (off: Muon's ``eager``)."""

    def eager(self) -> Products:
        """A copy whose elementwise kernels run as eager ops."""
        other = copy.copy(self)
        other.compiled = False
        return other

    def halves(self, shape: Sequence[int]) -> bool:
        """Whether symmetric results of ``shape`` cost half here (one triangle): ``NewtonSchulz.flops``."""
        return False

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        """``Y Y^T`` on the wide orientation, ``Y^T Y`` for a tall ``Y``: a new symmetric ``[k, m, m]``."""
        return torch.bmm(Y.mT, Y) if tall else torch.bmm(Y, Y.mT)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        """``b A + c A A`` for a symmetric ``A``: a new symmetric tensor."""
        return torch.baddbmm(A, A, A, beta=b, alpha=c)

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        """``P Q`` for symmetric ``P`` and ``Q`` that commute (so the product is symmetric): new."""
        return torch.bmm(P, Q)

    def apply(self, B: Tensor, Y: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
        """``B Y`` on the wide orientation, ``Y B^T`` for a tall ``Y`` (any square ``B``), into ``out``."""
        return torch.bmm(Y, B.mT, out=out) if tall else torch.bmm(B, Y, out=out)

    def apply_add(self, B: Tensor, Y: Tensor, a: float, tall: bool, out: Tensor | None = None) -> Tensor:
        """``a Y + B Y`` (``a Y + Y B^T`` for a tall ``Y``: torch.optim.Muon's ``baddbmm``) into ``out``."""
        return torch.baddbmm(Y, Y, B.mT, beta=a, out=out) if tall else torch.baddbmm(Y, B, Y, beta=a, out=out)

    def gram_fp32(self, Y: Tensor, tall: bool) -> Tensor:
        """``gram`` with its fp32 accumulation kept (``mm_fp32``): a new fp32 ``[k, m, m]`` for bf16
        ``Y`` (the split restart's first Gram matrix)."""
        Z = Y.mT if tall else Y
        return mm_fp32(Z, Z.mT)

    def regram(self, Q: Tensor, R0: Tensor) -> Tensor:
        """``Q R0 Q^T``, the Gram matrix of ``Q X`` for ``R0 = X X^T`` held as ``[hi | lo]`` (``split``),
        for ``gram_iterations``' split restart: a new symmetric ``[k, m, m]`` in ``Q``'s dtype. ``S = Q
        R0`` is formed in fp32 (``[Q hi | Q lo]``, one product) and split the same way, so every product
        has bf16 operands and the result keeps about 16 bits of each factor, not 8."""
        S_hi, S_lo = self.split_sum(mm_fp32(Q, R0), Q.dtype)  # Q R0 is not symmetric: a whole product
        return self.split_times(S_hi, S_lo, Q)

    def split_times(self, S_hi: Tensor, S_lo: Tensor, Q: Tensor) -> Tensor:
        """``(S_hi + S_lo) Q^T`` where that is symmetric (``regram``'s ``Q R0 Q^T``): new. ``Q^T``,
        not ``Q``: torch's product of two polynomials is symmetric only up to rounding, which is the
        precision this is for."""
        return torch.baddbmm(torch.bmm(S_lo, Q.mT), S_hi, Q.mT)

    def mm(self, A: Tensor, B: Tensor) -> Tensor:
        """``A B``, any square stacks (no symmetry assumed): new."""
        return torch.bmm(A, B)

    def scale(self, T: Tensor, f: Tensor) -> None:
        """``T *= f`` in place (``f`` broadcast), in fp32 rounded once: a folded norm on a small product."""
        _kernel(_scale, T, f, self.compiled)

    def split(self, T: Tensor, dtype: torch.dtype) -> Tensor:
        """``T`` (fp32 ``[k, m, m]``) as ``[hi | lo]`` ``[k, m, 2m]`` in ``dtype``: ``hi`` is ``T``
        rounded, ``lo`` the rounding error rounded again; together about 16 of fp32's 24 mantissa bits
        for bf16 (``T`` itself for ``T``'s own dtype, with ``lo`` zero)."""
        return _kernel(_split, T, dtype, self.compiled, compat.precise_casts)  # casts round as eagerly

    def split_sum(self, S: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``A + B`` for ``S = [A | B]`` (fp32 ``[k, m, 2m]``), as ``hi`` and ``lo`` (``split``)."""
        return _kernel(_split_sum, S, dtype, self.compiled, compat.precise_casts)


TORCH_PRODUCTS = Products()
