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

import torch
from torch import Tensor

__all__ = [
    "SYMMETRIC_MIN_SIZE",
    "Products",
    "TORCH_PRODUCTS",
    "quack_chosen",
    "quack_installed",
    "quack_pays",
    "runs_symmetric",
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
