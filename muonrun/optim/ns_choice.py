"""Which evaluation of Newton–Schulz's products (``ns_products.Products``) each iteration uses.

``products_for`` picks it from Muon's ``ns_kernel``: ``"torch"``, ``"triton"``
(``ns_triton.TritonProducts``: the symmetric results from a kernel that computes only their upper
triangle) or ``"auto"`` (triton on CUDA where triton imports, torch otherwise). Kept apart from
``ns_products`` because it imports the kernels, which build on ``ns_products.Products``.
"""

from __future__ import annotations

import functools

from muonrun import log
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products

__all__ = ["NS_KERNELS", "kernel_products", "products_for", "resolve_ns_kernel"]

NS_KERNELS = ("auto", "torch", "triton")

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
