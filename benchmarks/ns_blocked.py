"""Newton–Schulz's symmetric products from their upper blocks, each block one cuBLAS product.

Three of the four products of a Newton–Schulz iteration (``ns_products.Products``) have symmetric
results: the Gram matrix ``Y Y^T``, the polynomial ``b A + c A A`` of a symmetric ``A`` and the
product ``P Q`` of two commuting symmetric matrices; all three are ``alpha * L R^T (+ beta * C)``.
Split the result into ``n x n`` blocks: the blocks on and above the diagonal are ``n (n + 1) / 2``
batched products of row blocks of ``L`` and ``R`` (1/4 fewer FLOPs than the whole product at n = 2,
1/3 at 3, 3/8 at 4), each written by cuBLAS straight into its place in the result (a row-major block
of a row-major matrix is a valid strided output: no copy); the blocks below the diagonal are the
transposes of those above, one copy each.

It is the same idea as the upper-triangle Triton kernels (``ns_triton.py``), which skip half the
FLOPs but lose to cuBLAS on an H200 (docs/performance.md); here every product stays a cuBLAS
product, at the price of fewer FLOPs skipped, smaller products and the mirror copies. On an H200 the
trade loses except for the rectangular Gram product (docs/performance.md, [w1]:
``bench_ns_products.py --evaluations blocked2,blocked3``); this is a study, not part of Muon.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from muonrun.optim.ns_products import Products

__all__ = ["BlockedProducts", "block_bounds", "symmetric_product"]


def block_bounds(m: int, blocks: int) -> list[tuple[int, int]]:
    """``blocks`` contiguous ranges covering ``0..m``, as even as possible."""
    edges = [round(i * m / blocks) for i in range(blocks + 1)]
    return [(lo, hi) for lo, hi in itertools.pairwise(edges) if hi > lo]


def symmetric_product(
    L: Tensor, Rt: Tensor, blocks: int, C: Tensor | None = None, beta: float = 0.0, alpha: float = 1.0
) -> Tensor:
    """``alpha * L @ Rt + beta * C`` for ``L`` ``[k, m, p]`` and ``Rt`` ``[k, p, m]`` (any strides) whose
    result is symmetric in exact arithmetic (``C`` too when given): the upper blocks computed, the
    lower ones mirrored. Returns a new contiguous ``[k, m, m]``."""
    k, m = L.shape[0], L.shape[1]
    out = torch.empty(k, m, m, dtype=L.dtype, device=L.device)
    bounds = block_bounds(m, blocks)
    for i, (r0, r1) in enumerate(bounds):
        for c0, c1 in bounds[i:]:
            dst = out[:, r0:r1, c0:c1]
            if C is None:
                torch.bmm(L[:, r0:r1], Rt[:, :, c0:c1], out=dst)
                if alpha != 1.0:
                    dst.mul_(alpha)
            else:
                torch.baddbmm(
                    C[:, r0:r1, c0:c1], L[:, r0:r1], Rt[:, :, c0:c1], beta=beta, alpha=alpha, out=dst
                )
            if c0 != r0:
                out[:, c0:c1, r0:r1].copy_(dst.mT)
    return out


class BlockedProducts(Products):
    """torch's evaluation, but each symmetric result from its ``blocks x blocks`` upper blocks."""

    def __init__(self, blocks: int = 2) -> None:
        if blocks < 1:
            raise ValueError(f"blocks must be at least 1, got {blocks}")
        self.blocks = blocks

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        return symmetric_product(Y.mT, Y, self.blocks) if tall else symmetric_product(Y, Y.mT, self.blocks)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        return symmetric_product(A, A, self.blocks, C=A, beta=b, alpha=c)

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        return symmetric_product(P, Q, self.blocks)
