"""Newton–Schulz's symmetric products on quack's symmetric GEMM: half their FLOPs, cuBLAS's speed.

``quack.gemm_interface.gemm_symmetric`` (Dao-AILab's quack-kernels, CuTe DSL) computes ``alpha A B +
beta C`` for a symmetric result on a triangular tile schedule: only tiles on and above the diagonal
are computed, each epilogue also writing its transpose; each entry is the same bf16-input,
fp32-accumulated dot product as cuBLAS's. Why a library kernel: torch has no symmetric (syrk-like)
product, and hand-written triangle kernels did not beat cuBLAS (docs/performance.md).

``pip install 'muonrun[quack]'``; Muon takes it on Hopper GPUs (``default_products``). The first
step compiles a few kernels (CuTe DSL JIT).
"""

from __future__ import annotations

import importlib.util
import warnings

import torch
from torch import Tensor

from muonrun.optim.ns_products import SYMMETRIC_MIN_SIZE, TORCH_PRODUCTS, Products

__all__ = ["QuackProducts", "default_products"]

# (tile_M, tile_N, cluster_M, pingpong) on Hopper, the faster ones measured on an H200. The symmetric
# products' clusters stay square, as the triangular schedule needs: 128 x 128 pingpong tiles for the
# polynomials and below side 1024 (``m``, the result's rows on the wide orientation), quack's
# interface's 128 x 256 tiles in clusters of two for the larger Gram matrices and products of
# polynomials; the plain GEMM of ``apply_add`` on quack's default Hopper tiles.
_SMALL, _LARGE, _PLAIN = (128, 128, 1, True), (128, 256, 2, False), (128, 192, 2, True)


def _tma_ready(*tensors: Tensor | None) -> bool:
    """Whether quack's kernels can read or write these tensors: each row contiguous, the other strides
    and the start 16-byte aligned (what Hopper's tensor memory accelerator needs). A NorMuon stack in
    its exchange buffer is strided by its rows' state: aligned at the presets' shapes, not always."""
    for t in tensors:
        if t is None:
            continue
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s * size % 16 for s in t.stride()[:-1]):
            return False
    return True


class QuackProducts(Products):
    """``Products`` whose symmetric results (the Gram matrix, the polynomial in it, the Gram form's
    products of commuting polynomials), and the standard form's ``a X + B X`` (quack's plain GEMM, ``a
    X`` in its epilogue), come from quack for CUDA bf16 stacks of side ``m >= min_size``; everything
    else, and ``apply`` (``B X``) always, is torch's (the base class)."""

    name = "quack's symmetric products (one triangle of each symmetric result)"

    def __init__(self, min_size: int = SYMMETRIC_MIN_SIZE) -> None:
        from quack.gemm import gemm
        from quack.gemm_interface import gemm_symmetric
        from quack.gemm_symmetric import gemm_symmetric as gemm_symmetric_tiled

        self._gemm = gemm
        self._gemm_symmetric = gemm_symmetric
        self._gemm_symmetric_tiled = gemm_symmetric_tiled
        self.min_size = min_size
        self._hopper: dict[int, bool] = {}

    def halves(self, shape) -> bool:
        return min(shape[-2:]) >= self.min_size

    def _takes(self, T: Tensor, m: int, *others: Tensor | None) -> bool:
        return (
            T.is_cuda
            and T.dtype == torch.bfloat16
            and T.ndim == 3
            and m >= self.min_size
            and _tma_ready(T, *others)
        )

    def _on_hopper(self, T: Tensor) -> bool:
        index = T.device.index if T.device.index is not None else torch.cuda.current_device()
        if index not in self._hopper:
            self._hopper[index] = torch.cuda.get_device_capability(index)[0] == 9
        return self._hopper[index]

    def _symmetric(
        self, product: str, A: Tensor, B: Tensor, C: Tensor | None = None, alpha=1.0, beta=1.0, dtype=None
    ):
        """Symmetric ``alpha A B + beta C`` (``A`` ``[k, m, n]``, ``B`` ``[k, n, m]``) in ``dtype`` or A's."""
        if not self._on_hopper(A):
            return self._gemm_symmetric(A, B, C=C, alpha=alpha, beta=beta, out_dtype=dtype)
        m = A.shape[-2]
        out = torch.empty(A.shape[0], m, m, dtype=dtype or A.dtype, device=A.device)
        tile_m, tile_n, cluster_m, pingpong = _SMALL if product == "poly" or m < 1024 else _LARGE
        self._gemm_symmetric_tiled(
            A, B.mT, out, C, None, tile_M=tile_m, tile_N=tile_n, cluster_M=cluster_m, cluster_N=1,
            pingpong=pingpong, persistent=True, is_dynamic_persistent=False, alpha=alpha, beta=beta,
        )  # fmt: skip
        return out

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        Z = Y.mT if tall else Y  # the wide orientation, as a view: Z Z^T
        if not self._takes(Y, Z.shape[-2]):
            return super().gram(Y, tall)
        return self._symmetric("gram", Z, Z.mT)

    def gram_fp32(self, Y: Tensor, tall: bool) -> Tensor:
        Z = Y.mT if tall else Y
        if not self._takes(Y, Z.shape[-2]):
            return super().gram_fp32(Y, tall)
        return self._symmetric("gram", Z, Z.mT, dtype=torch.float32)

    def split_times(self, S_hi: Tensor, S_lo: Tensor, Q: Tensor) -> Tensor:
        if not self._takes(Q, Q.shape[-1], S_hi, S_lo):
            return super().split_times(S_hi, S_lo, Q)
        # Q^T is Q bit for bit: quack's products made it, one triangle mirrored (the same _takes)
        return self._symmetric("sym_mm", S_hi, Q, C=self._symmetric("sym_mm", S_lo, Q))

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        if not self._takes(A, A.shape[-1]):
            return super().poly(A, b, c)
        return self._symmetric("poly", A, A, C=A, alpha=c, beta=b)

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        if not self._takes(P, P.shape[-1]):
            return super().sym_mm(P, Q)
        return self._symmetric("sym_mm", P, Q)

    def apply_add(self, B: Tensor, Y: Tensor, a: float, tall: bool, out: Tensor | None = None) -> Tensor:
        if not (self._takes(Y, B.shape[-1], out) and self._on_hopper(Y)):
            return super().apply_add(B, Y, a, tall, out)
        left, right = (Y, B.mT) if tall else (B, Y)  # a Y + left @ right
        out = torch.empty_like(Y) if out is None else out
        tile_m, tile_n, cluster_m, pingpong = _PLAIN
        self._gemm(
            left, right.mT, out, Y, None, tile_M=tile_m, tile_N=tile_n, cluster_M=cluster_m, cluster_N=1,
            pingpong=pingpong, persistent=True, is_dynamic_persistent=False, alpha=1.0, beta=a,
        )  # fmt: skip
        return out


def default_products(device_type: str) -> Products:
    """quack's symmetric products on Hopper GPUs (compute capability 9.x) where quack-kernels is
    installed, where they are measured faster than cuBLAS's whole products (docs/performance.md); torch's
    everywhere else. An installed quack that fails to import is warned about, not fatal."""
    if device_type != "cuda" or importlib.util.find_spec("quack") is None or not torch.cuda.is_available():
        return TORCH_PRODUCTS
    if torch.cuda.get_device_capability()[0] != 9:
        return TORCH_PRODUCTS
    try:
        return QuackProducts()
    except Exception as e:  # a broken optional install must not stop a run that did not ask for it
        warnings.warn(
            f"quack-kernels is installed but does not import ({type(e).__name__}: {e}); Muon's Newton-Schulz "
            "uses torch's products. Uninstall it or repair it to silence this.",
            stacklevel=2,
        )
        return TORCH_PRODUCTS
