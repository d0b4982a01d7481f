"""The matrix products of one Newton–Schulz iteration, as an object the iterations call.

``newton_schulz.standard_iterations`` and ``gram_iterations`` compute every product through a
``Products`` per iteration, so a faster evaluation of some products (a kernel that writes only one
triangle of a symmetric result, lower-precision operands for the early iterations) plugs in without
touching the iteration itself. ``Products`` is torch's evaluation (cuBLAS/CPU ``bmm``): the results
are bit for bit those of the iterations written with ``torch.bmm``/``baddbmm`` directly.

Every tensor is a stack ``[k, r, c]``. "Symmetric" inputs are symmetric in exact arithmetic (Gram
matrices and polynomials in one Gram matrix, which also commute with each other); an implementation
may read only one triangle of them and must return a full (both triangles), contiguous result.

``products_for`` picks the evaluation of each iteration from Muon's ``ns_kernel``: ``"torch"``,
``"triton"`` (``ns_triton.TritonProducts``: the symmetric results from a kernel that computes only
their upper triangle) or ``"auto"`` (triton on CUDA where triton imports, torch otherwise).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from muonrun import log

__all__ = [
    "NS_KERNELS",
    "TRITON_MIN_SIZE",
    "Products",
    "TORCH_PRODUCTS",
    "kernel_products",
    "products_for",
    "resolve_ns_kernel",
]

NS_KERNELS = ("auto", "torch", "triton")
TRITON_MIN_SIZE = 256
"""Smallest side ``m`` of a symmetric result the triton products compute by their upper triangle:
below it a matrix is at most a few tiles (one or two 128-tiles per side), so skipping the lower
ones saves little, while cuBLAS's batched kernels are tuned for such sizes. Qwen2's 128 x 896 and
256 x 1536 key/value projections (m = 128, 256) are the only preset shapes near it, a few percent of
Newton–Schulz's FLOPs."""


class Products:
    """torch's evaluation of Newton–Schulz's products (the reference every other one is held to)."""

    name = "torch"

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


TORCH_PRODUCTS = Products()


_said: set[str] = set()


@functools.cache
def _triton_products() -> Products | None:
    """``ns_triton.TritonProducts()``, or None where triton does not import."""
    try:
        from muonrun.optim.ns_triton import TritonProducts
    except ImportError:
        return None
    return TritonProducts()


def resolve_ns_kernel(kernel: str, device_type: str) -> str:
    """``"torch"`` or ``"triton"`` for ``optimizer.muon.ns_kernel`` on ``device_type``: ``auto`` is
    triton on CUDA where triton imports, torch otherwise; ``triton`` where it cannot run falls back
    to torch and says so once."""
    if kernel not in NS_KERNELS:
        raise ValueError(f"ns_kernel must be one of {NS_KERNELS}, got {kernel!r}")
    if kernel == "torch":
        return "torch"
    runs = device_type == "cuda" and _triton_products() is not None
    if kernel == "triton" and not runs and "triton" not in _said:
        _said.add("triton")
        why = "triton does not import" if device_type == "cuda" else f"it needs CUDA, not {device_type}"
        log.warning(
            f"optimizer.muon.ns_kernel=triton: {why}; Newton–Schulz uses torch's matmuls instead "
            "(the same results up to bf16 rounding)."
        )
    return "triton" if runs else "torch"


def kernel_products(kernel: str, device_type: str) -> Products:
    """The ``Products`` for ``ns_kernel`` on ``device_type`` (``resolve_ns_kernel``)."""
    if resolve_ns_kernel(kernel, device_type) == "triton":
        return _triton_products()  # type: ignore[return-value]
    return TORCH_PRODUCTS


def products_for(steps: int, kernel: str = "torch", device_type: str = "cpu") -> tuple[Products, ...] | None:
    """One ``Products`` per iteration of a ``steps``-iteration Newton–Schulz, for ``ns_iterations``:
    None where all of them are torch's (the iterations' own default)."""
    ops = kernel_products(kernel, device_type)
    return None if ops is TORCH_PRODUCTS else (ops,) * steps
