"""Newton–Schulz's symmetric products on quack's symmetric GEMM: half their FLOPs, cuBLAS's speed.

Three of the four products of an iteration have symmetric results (``ns_products.Products``'
``gram``, ``poly``, ``sym_mm``: the Gram matrix, the polynomial in it and, in the Gram form, the
products of commuting polynomials). ``quack.gemm_interface.gemm_symmetric`` (Dao-AILab's
quack-kernels, CuTe DSL; the kernel of the Gram Newton–Schulz blog post) computes
``alpha * A B + beta * C`` for such a result on a triangular tile schedule: only the tiles on and
above the diagonal are computed, and each one's epilogue also writes its transpose. Each entry is
the same bf16-input, fp32-accumulated dot product as cuBLAS's, rounded once to bf16
(bench_ns_products.py finds the Gram and polynomial results equal to cuBLAS's bit for bit at the
presets' shapes). ``apply`` (``B X``, not symmetric) stays torch's.

Why a library kernel: torch has no symmetric (``syrk``-like) product, and neither hand-written
Triton upper-triangle kernels nor cuBLAS on upper blocks beat
cuBLAS's full product on an H200 (docs/performance.md, [w1]). On an H200 the GPU runs at its power
cap, so the FLOPs this skips also give the model's own matmuls back clock ([v5]).

``pip install 'muonrun[quack]'`` (quack-kernels, nvidia-cutlass-dsl); ``optimizer.muon.ns_products``
chooses it (``optim.build.products_for``). The first step compiles a few kernels (CuTe DSL JIT).
"""

from __future__ import annotations

import torch
from torch import Tensor

from muonrun.optim.ns_products import SYMMETRIC_MIN_SIZE, Products

__all__ = ["QuackProducts"]


class QuackProducts(Products):
    """``Products`` whose symmetric results come from quack's ``gemm_symmetric`` for CUDA bf16 stacks
    of side ``m >= min_size``; everything else, and ``apply`` always, is torch's (the base class)."""

    def __init__(self, min_size: int = SYMMETRIC_MIN_SIZE) -> None:
        from quack.gemm_interface import gemm_symmetric  # optional dependency: muonrun[quack]

        self._gemm_symmetric = gemm_symmetric
        self.min_size = min_size

    def _takes(self, T: Tensor, m: int) -> bool:
        return T.is_cuda and T.dtype == torch.bfloat16 and T.ndim == 3 and m >= self.min_size

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        Z = Y.mT if tall else Y  # the wide orientation, as a view: Z Z^T
        if not self._takes(Y, Z.shape[-2]):
            return super().gram(Y, tall)
        return self._gemm_symmetric(Z, Z.mT)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        if not self._takes(A, A.shape[-1]):
            return super().poly(A, b, c)
        return self._gemm_symmetric(A, A, C=A, alpha=c, beta=b)

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        if not self._takes(P, P.shape[-1]):
            return super().sym_mm(P, Q)
        return self._gemm_symmetric(P, Q)
