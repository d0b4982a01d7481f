"""Triton kernels for Newton–Schulz's symmetric products: only the upper triangle is computed.

Three of the four products of a Newton–Schulz iteration (``ns_products.Products``) have symmetric
results: the Gram matrix ``Y Y^T``, the polynomial ``b A + c A A`` of a symmetric ``A`` and the
product ``P Q`` of two commuting symmetric matrices. All three are ``alpha * L R^T + beta * C`` with
``L``, ``R`` of shape ``[k, M, K]`` (``A A = A A^T`` and ``P Q = P Q^T`` for symmetric ``A``, ``Q``),
so one kernel serves them: it runs an output tile only where the tile holds an entry on or above the
diagonal (row <= column), stores those entries and writes the transposed tile below the diagonal
from the same registers. Each output entry is stored exactly once, so the result is exactly
symmetric and deterministic, and about half the tiles' FLOPs are skipped: ~35% of the Gram form's
Newton–Schulz FLOPs, ~33% of the standard form's (``newton_schulz_flops(..., symmetric=True)``).

bf16 operands, fp32 accumulation, bf16 result (fp32 operands also run, in full fp32 precision: the
CPU interpreter tests use them, ``TRITON_INTERPRET=1``). Operands are any strided views: the Gram
matrix ``Y^T Y`` of a tall ``Y`` reads ``Y`` through ``Y.mT`` with no transposed copy.

The kernel is adapted from microsoft/dion's ``dion/newton_schulz_triton.py`` (``ns_line_1``,
``ns_line_2``; MIT License, Copyright (c) Microsoft Corporation), which computes the lower-triangle
tiles of ``A A^T`` and ``alpha A A^T + beta A``. It is vendored because no pip package ships these
kernels (dion is installed from source). Changes: one kernel for two operands (``P Q^T``) as well as
one (``A A^T``), batch as the second grid axis, per-entry triangle masks so no entry is stored twice
(dion's diagonal tiles store each entry twice, from two threads), and a small autotune set for
Hopper keyed on the sizes and layouts.

Importing this module needs triton; the benchmark imports it only when asked for
``triton`` products and falls back to torch's where it cannot.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from muonrun.optim.ns_products import Products

TRITON_MIN_SIZE = 256
"""Smallest side ``m`` of a symmetric result the kernel computes by its upper triangle: below it a
matrix is one or two 128-tiles per side, so skipping the lower ones saves little."""

__all__ = ["TritonProducts", "sym_gram", "sym_matmul", "sym_poly"]


def _configs() -> list:
    """Hopper-sensible tiles: 128x128 (8 or 4 warps) for large matrices, 64x64 where 128 tiles would
    leave SMs idle (few tiles per matrix, small stacks); 3-4 pipeline stages."""
    tiles = [
        (128, 128, 64, 3, 8),
        (128, 128, 64, 4, 8),
        (128, 128, 64, 3, 4),
        (64, 64, 64, 3, 4),
        (64, 64, 64, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_stages=s, num_warps=w)
        for bm, bn, bk, s, w in tiles
    ]


@triton.jit
def _sym_kernel(
    L,
    R,
    C,
    Out,
    M,
    K,
    l_sb,
    l_sr,
    l_sc,
    r_sb,
    r_sr,
    r_sc,
    c_sb,
    c_sr,
    c_sc,
    o_sb,
    o_sr,
    o_sc,
    alpha,
    beta,
    HAS_C: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``Out = alpha * L R^T (+ beta * C)`` for ``[M, K]`` operands whose product is symmetric; one
    program per output tile (axis 0) and matrix of the stack (axis 1)."""
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(M, BLOCK_N)
    pid_m, pid_n = tl.swizzle2d(pid // num_n, pid % num_n, num_m, num_n, GROUP_M)
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    if m0 >= n0 + BLOCK_N:  # every row below every column: the mirror of a tile that runs
        return
    L += batch * l_sb
    R += batch * r_sb
    Out += batch * o_sb
    # rows past M wrap around (in bounds, never stored): no masks in the inner loop but K's
    rows = (m0 + tl.arange(0, BLOCK_M)) % M
    cols = (n0 + tl.arange(0, BLOCK_N)) % M
    ks = tl.arange(0, BLOCK_K)
    l_ptrs = L + rows[:, None] * l_sr + ks[None, :] * l_sc
    r_ptrs = R + ks[:, None] * r_sc + cols[None, :] * r_sr  # R^T's tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(l_ptrs, mask=ks[None, :] < left, other=0.0)
        b = tl.load(r_ptrs, mask=ks[:, None] < left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        l_ptrs += BLOCK_K * l_sc
        r_ptrs += BLOCK_K * r_sc
    acc = acc * alpha
    om = m0 + tl.arange(0, BLOCK_M)
    on = n0 + tl.arange(0, BLOCK_N)
    inside = (om[:, None] < M) & (on[None, :] < M)
    if HAS_C:
        C += batch * c_sb
        c = tl.load(C + om[:, None] * c_sr + on[None, :] * c_sc, mask=inside, other=0.0)
        acc += beta * c.to(tl.float32)
    result = acc.to(Out.dtype.element_ty)
    upper = inside & (om[:, None] <= on[None, :])
    tl.store(Out + om[:, None] * o_sr + on[None, :] * o_sc, result, mask=upper)
    strictly = inside & (om[:, None] < on[None, :])  # the diagonal is stored once, above
    tl.store(Out + on[None, :] * o_sr + om[:, None] * o_sc, result, mask=strictly)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
"""Under triton's CPU interpreter (the tests') there is no benchmarker to autotune with: one fixed
config, with uneven tiles so that the triangle logic is exercised where tiles are not square."""
INTERPRETER_CONFIG = {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 2}

_tuned = triton.autotune(
    configs=_configs(), key=["M", "K", "l_sr", "l_sc", "r_sr", "r_sc", "HAS_C", "PRECISION"]
)(_sym_kernel)


def _launch(left: Tensor, right: Tensor, alpha: float, beta: float, c: Tensor | None) -> Tensor:
    """``alpha * left right^T (+ beta * c)``, a new contiguous ``[k, M, M]`` tensor."""
    if left.ndim != 3 or left.shape != right.shape:
        raise ValueError(f"expected two stacks [k, M, K] of one shape, got {left.shape} and {right.shape}")
    k, M, K = left.shape
    out = torch.empty(k, M, M, dtype=left.dtype, device=left.device)
    if out.numel() == 0:
        return out
    if K == 0:
        return out.zero_() if c is None else torch.mul(c, beta, out=out)
    cs = c.stride() if c is not None else (0, 0, 0)
    precision = "ieee" if left.dtype == torch.float32 else "tf32"  # bf16/fp16: ignored

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(M, meta["BLOCK_N"]), k)

    kernel, config = (_sym_kernel, INTERPRETER_CONFIG) if INTERPRETED else (_tuned, {})
    kernel[grid](
        left,
        right,
        c if c is not None else out,
        out,
        M,
        K,
        *left.stride(),
        *right.stride(),
        *cs,
        *out.stride(),
        float(alpha),
        float(beta),
        HAS_C=c is not None,
        PRECISION=precision,
        **config,
    )
    return out


def sym_gram(Y: Tensor) -> Tensor:
    """``Y Y^T`` of a stack ``Y`` ``[k, M, K]`` (any strides: ``X.mT`` gives ``X^T X``)."""
    return _launch(Y, Y, 1.0, 0.0, None)


def sym_poly(A: Tensor, b: float, c: float) -> Tensor:
    """``b A + c A A`` of a symmetric stack ``A`` ``[k, M, M]`` (its upper triangle is what is read
    for the ``b A`` term)."""
    return _launch(A, A, c, b, A)


def sym_matmul(P: Tensor, Q: Tensor) -> Tensor:
    """``P Q`` of symmetric, commuting stacks ``[k, M, M]`` (computed as ``P Q^T``)."""
    return _launch(P, Q, 1.0, 0.0, None)


class TritonProducts(Products):
    """``Products`` whose symmetric results (``gram``, ``poly``, ``sym_mm``) come from the upper-tile
    kernel for CUDA bf16 stacks of side ``m >= min_size`` (``TRITON_MIN_SIZE``); everything else, and ``apply`` always,
    is torch's (the base class)."""

    def __init__(self, min_size: int = TRITON_MIN_SIZE) -> None:
        self.min_size = min_size

    def _takes(self, T: Tensor, m: int) -> bool:
        return T.is_cuda and T.dtype == torch.bfloat16 and T.ndim == 3 and m >= self.min_size

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        Z = Y.mT if tall else Y  # the wide orientation, as a view
        return sym_gram(Z) if self._takes(Y, Z.shape[-2]) else super().gram(Y, tall)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        return sym_poly(A, b, c) if self._takes(A, A.shape[-1]) else super().poly(A, b, c)

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        return sym_matmul(P, Q) if self._takes(P, P.shape[-1]) else super().sym_mm(P, Q)
