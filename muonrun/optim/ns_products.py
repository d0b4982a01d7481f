"""The matrix products of one Newton–Schulz iteration, as an object the iterations call.

``newton_schulz.standard_iterations`` and ``gram_iterations`` compute every product through a
``Products`` per iteration, so a faster evaluation of some products (a kernel that writes only one
triangle of a symmetric result, lower-precision operands for the early iterations) plugs in without
touching the iteration itself. ``Products`` is torch's evaluation (cuBLAS/CPU ``bmm``): the results
are bit for bit those of the iterations written with ``torch.bmm``/``baddbmm`` directly.

Every tensor is a stack ``[k, r, c]``. "Symmetric" inputs are symmetric in exact arithmetic (Gram
matrices and polynomials in one Gram matrix, which also commute with each other); an implementation
may read only one triangle of them and must return a full (both triangles), contiguous result.

Muon uses torch's, or ``ns_quack.QuackProducts`` (quack's symmetric GEMM: the symmetric results at
half their FLOPs) where ``optim.build.products_for`` picks it. benchmarks/ns_triton.py (upper-triangle Triton
kernels), benchmarks/ns_float8.py (e4m3 operands) and benchmarks/ns_blocked.py (the upper blocks as
cuBLAS products) are evaluations studied the same way (benchmarks/bench_ns_products.py); on an H200
they lose to cuBLAS's bf16 products at the presets' shapes (docs/performance.md), so none is part of Muon.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import Tensor

from muonrun import compat, log
from muonrun.optim.fused import fresh_code

__all__ = [
    "SYMMETRIC_MIN_SIZE",
    "Products",
    "TORCH_PRODUCTS",
    "quack_chosen",
    "quack_installed",
    "quack_pays",
    "mm_fp32",
    "runs_symmetric",
    "split_bf16",
    "split_sum_bf16",
]

SYMMETRIC_MIN_SIZE = 512
"""The smaller side of a matrix from which quack's symmetric products (``ns_quack``) run; below it
(a Gram matrix of one or two tile rows) torch's are faster on an H200 (docs/performance.md, [w2])."""


class Products:
    """torch's evaluation of Newton–Schulz's products (the reference every other one is held to)."""

    halves_symmetric: bool = False
    """Whether the symmetric results of matrices ``runs_symmetric`` names cost half their FLOPs here
    (one triangle computed): what Muon balances its owners on and the dry-run counts."""

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
        """``B Y`` on the wide orientation, ``Y B^T`` for a tall ``Y`` (``B`` square, any), into
        ``out`` when given."""
        return torch.bmm(Y, B.mT, out=out) if tall else torch.bmm(B, Y, out=out)

    def apply_add(self, B: Tensor, Y: Tensor, a: float, tall: bool, out: Tensor | None = None) -> Tensor:
        """``a Y + B Y`` on the wide orientation, ``a Y + Y B^T`` for a tall ``Y``, into ``out`` when
        given (torch.optim.Muon's ``baddbmm``)."""
        return torch.baddbmm(Y, Y, B.mT, beta=a, out=out) if tall else torch.baddbmm(Y, B, Y, beta=a, out=out)

    def gram_fp32(self, Y: Tensor, tall: bool) -> Tensor:
        """``gram`` with its fp32 accumulation kept (``mm_fp32``): a new fp32 ``[k, m, m]`` for bf16
        ``Y`` (the split restart's first Gram matrix)."""
        Z = Y.mT if tall else Y
        return mm_fp32(Z, Z.mT)

    def regram(self, Q: Tensor, R0: Tensor) -> Tensor:
        """``Q R0 Q^T``, the Gram matrix of ``Q X`` for ``R0 = X X^T`` held in fp32 as two bf16
        halves side by side, ``[hi | lo]`` ``[k, m, 2m]`` (``split_bf16``): a new symmetric
        ``[k, m, m]`` in ``Q``'s dtype. ``S = Q R0`` is formed in fp32 (``[Q hi | Q lo]``, one
        product) and split the same way, so every product has bf16 operands and the result keeps
        about 16 bits of each factor, not 8 (``gram_iterations``' split restart)."""
        S_hi, S_lo = split_sum_bf16(mm_fp32(Q, R0), Q.dtype)  # Q R0 is not symmetric: a whole product
        return self.split_times(S_hi, S_lo, Q)

    def split_times(self, S_hi: Tensor, S_lo: Tensor, Q: Tensor) -> Tensor:
        """``(S_hi + S_lo) Q^T`` where that is symmetric (``regram``'s ``Q R0 Q^T``): new. ``Q^T``,
        not ``Q``: torch's product of two polynomials is symmetric only up to rounding, which is the
        precision this is for."""
        return torch.baddbmm(torch.bmm(S_lo, Q.mT), S_hi, Q.mT)

    def mm(self, A: Tensor, B: Tensor) -> Tensor:
        """``A B``, any square stacks (no symmetry assumed): new."""
        return torch.bmm(A, B)


def mm_fp32(A: Tensor, B: Tensor) -> Tensor:
    """``A B`` for stacks of bf16 (or fp32, fp64) operands, with at least fp32 accumulation and an
    fp32 (fp64) result never rounded to bf16: ``bmm``'s ``out_dtype`` on CUDA, the product of the
    operands upcast elsewhere (exact products of bf16 values, the same fp32 accumulation)."""
    dtype = torch.promote_types(A.dtype, torch.float32)
    if A.is_cuda and A.dtype != dtype:
        return torch.bmm(A, B, out_dtype=dtype)
    return torch.bmm(A.to(dtype), B.to(dtype))


def _split(T: Tensor, dtype: torch.dtype) -> Tensor:
    hi = T.to(dtype)
    return torch.cat([hi, (T - hi.to(T.dtype)).to(dtype)], dim=-1)


def _split_sum(S: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    m = S.shape[-1] // 2
    T = S[..., :m] + S[..., m:]
    hi = T.to(dtype)
    return hi, (T - hi.to(T.dtype)).to(dtype)


def _compiled_on_gpu(fn):
    """``fn`` compiled (one fused kernel, instead of eager's four passes) for CUDA tensors, eager
    elsewhere; compiled per shape at its first CUDA call, which Muon makes before it captures a CUDA
    graph. Each cast rounds as it does eagerly (``compat.precise_casts``): the low half is that
    rounding's error. Where compiling fails, the eager ops run instead, with one warning."""
    compiled: dict[tuple, Callable] = {}
    failed = False

    def run(T: Tensor, dtype: torch.dtype):
        nonlocal failed
        if not T.is_cuda or failed:
            return fn(T, dtype)
        key = (tuple(T.shape), dtype)
        if key not in compiled:  # a code object of its own per shape: no recompile limit to reach
            compiled[key] = torch.compile(fresh_code(fn), dynamic=False, options=compat.precise_casts())
        try:
            return compiled[key](T, dtype)
        except compat.compile_error() as e:  # compiling failed before anything ran
            log.once(
                "split-compile-failed",
                f"the split restart's kernels could not be compiled ({type(e).__name__}); they run as "
                "eager ops instead",
                warn=True,
            )
            failed = True
            return fn(T, dtype)

    return run


split_bf16 = _compiled_on_gpu(_split)
split_bf16.__doc__ = """``T`` (fp32 ``[k, m, m]``) as ``[hi | lo]`` ``[k, m, 2m]`` in ``dtype``: ``hi``
is ``T`` rounded, ``lo`` the rounding error rounded again; together about 16 of fp32's 24 mantissa bits
for bf16 (``T`` itself for ``T``'s own dtype, with ``lo`` zero)."""
split_sum_bf16 = _compiled_on_gpu(_split_sum)
split_sum_bf16.__doc__ = """``A + B`` for ``S = [A | B]`` (fp32 ``[k, m, 2m]``), as ``hi`` and ``lo``
(``split_bf16``) in two ``[k, m, m]`` tensors."""


TORCH_PRODUCTS = Products()


def quack_installed() -> bool:
    """Whether quack-kernels (``pip install 'muonrun[quack]'``) can be imported, without importing it."""
    return importlib.util.find_spec("quack") is not None


def quack_pays(device_type: str) -> bool:
    """Where ``"auto"`` takes quack's symmetric products: an installed quack and a Hopper GPU (compute
    capability 9.x), where they are measured faster than cuBLAS's whole products (docs/performance.md).
    quack also runs on other NVIDIA GPUs (8.x-12.x); ``"quack"`` chooses it there."""
    if device_type != "cuda" or not torch.cuda.is_available() or not quack_installed():
        return False
    return torch.cuda.get_device_capability()[0] == 9


def quack_chosen(name: str, device_type: str) -> bool:
    """Whether ``optimizer.muon.ns_products=name`` (``auto``, ``torch`` or ``quack``) takes quack's
    products on this machine: Muon's products (``optim.build.products_for``) and the dry-run's FLOP
    count (``tools.plan``) both resolve it here."""
    return name == "quack" or (name == "auto" and quack_pays(device_type))


def runs_symmetric(shape, symmetric: bool) -> bool:
    """Whether a matrix of ``shape`` has its symmetric products run on one triangle, when the chosen
    products are quack's (``symmetric``): the rule ``ns_quack.QuackProducts`` applies, for FLOP counts."""
    return symmetric and min(shape[-2:]) >= SYMMETRIC_MIN_SIZE
