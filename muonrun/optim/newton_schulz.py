"""Newton–Schulz orthogonalisation and Muon's learning-rate scaling: pure functions of tensors, and
``NewtonSchulz``, the one description of the iteration that Muon runs and the dry run counts.

References
----------
- K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024),
  https://kellerjordan.github.io/posts/muon/ -- the quintic iteration, its coefficients
  (3.4445, -4.7750, 2.0315) and the ``original`` lr scaling ``sqrt(max(1, A/B))``.
- J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training", arXiv:2502.16982 -- the
  ``match_rms_adamw`` lr scaling ``0.2 * sqrt(max(A, B))``.
- K. Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv:2504.13074 -- the ``spectral``
  lr scaling ``sqrt(A/B)``, and the iteration passed to the optimizer as an object.
- Z. Li, L. Liu, C. Liang, W. Chen, T. Zhao, "NorMuon: Making Muon more efficient and scalable",
  arXiv:2510.05491 -- the per-row second-moment normalisation (``normuon_row_scale``).
- J. Zhang, N. Amsel, B. Chen, T. Dao, "Gram Newton-Schulz" (blog, 2026),
  https://tridao.me/blog/2026/gram-newton-schulz/ -- iterating on the Gram matrix ``X X^T``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from muonrun.optim.ns_products import TORCH_PRODUCTS, Products

Coefficients = tuple[float, float, float]

DEFAULT_NS_COEFFICIENTS: Coefficients = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5
DEFAULT_EPS = 1e-7

# The Gram form rebuilds its Gram matrix before this iteration: without a restart bf16 rounding compounds
# in it until the result is useless; with one before the third iteration the result is as close to the
# polar factor as the standard iteration's. It runs only on matrices GRAM_MIN_ASPECT times wider than
# tall: on squares it costs more FLOPs, with quack's products it is slower below 1.5 (docs/performance.md).
GRAM_RESTART = 2
GRAM_MIN_ASPECT = 1.5
# The split restart (``gram_iterations``' ``split_restart``) costs four m x m products and the final Q' Q,
# 10 m^3 FLOPs (8 with symmetric products), where the restart from X costs Q X and its Gram matrix,
# 4 m^2 n (3): fewer from n = 2.5 m (2.7); from 3 on both.
SPLIT_RESTART_MIN_ASPECT = 3.0

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral")


def per_step_coefficients(coefficients: Coefficients | Sequence[Coefficients], steps: int) -> tuple:
    """``(a, b, c)`` for each of ``steps`` iterations: one triple for all (torch.optim.Muon's
    ``ns_coefficients``), or one per iteration (the last repeated where ``steps`` is longer)."""
    if not 0 <= steps < 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {steps}")
    if len(coefficients) == 3 and all(isinstance(x, (int, float)) for x in coefficients):
        table = [tuple(coefficients)]
    else:
        table = [tuple(t) for t in coefficients]
        if (not table and steps > 0) or any(len(t) != 3 for t in table):
            raise ValueError("ns_coefficients must be (a, b, c) or a sequence of (a, b, c)")
    return tuple(tuple(float(x) for x in table[min(i, len(table) - 1)]) for i in range(steps))


def uses_gram_form(shape: Sequence[int], steps: int) -> bool:
    """Whether the Gram form applies to a matrix of this shape (where it is cheaper)."""
    m, n = sorted(shape[-2:])
    return steps > 0 and n >= GRAM_MIN_ASPECT * m


def uses_split_restart(shape: Sequence[int], steps: int) -> bool:
    """Whether the Gram form takes its split restart (``gram_iterations``) on a matrix of this shape: it
    restarts, and the split restart costs fewer FLOPs there (``SPLIT_RESTART_MIN_ASPECT``)."""
    m, n = sorted(shape[-2:])
    return uses_gram_form(shape, steps) and steps > GRAM_RESTART and n >= SPLIT_RESTART_MIN_ASPECT * m


@dataclass(frozen=True)
class NewtonSchulz:
    """Muon's orthogonalisation of a stack of same-shaped matrices, as one description: the step runs
    it (``__call__``) and the dry run and the owners' balance count it (``flops``).

    - ``coefficients``: ``(a, b, c)`` per iteration (``per_step_coefficients``); torch.optim.Muon's
      five quintic iterations by default;
    - ``eps``: the Frobenius norm's floor;
    - ``gram``: the Gram form (``gram_iterations``) for matrices at least ``GRAM_MIN_ASPECT`` times
      wider than tall: the same iteration in exact arithmetic, as close to the polar factor in bf16,
      about half the FLOPs on MLP-shaped matrices. False: torch's standard iteration everywhere;
    - ``products``: how the matrix products are evaluated (``ns_products.Products``; quack's
      symmetric GEMM where ``default_products`` picks it).

    A study passes another ``NewtonSchulz`` to Muon (``Muon(..., newton_schulz=...)``): other
    coefficients, or a subclass whose ``iterate`` (and, if its cost differs, ``flops``) is its own.
    """

    coefficients: tuple[Coefficients, ...] = (DEFAULT_NS_COEFFICIENTS,) * DEFAULT_NS_STEPS
    eps: float = DEFAULT_EPS
    gram: bool = False
    products: Products = field(default=TORCH_PRODUCTS, compare=False)

    @property
    def steps(self) -> int:
        return len(self.coefficients)

    def uses_gram(self, shape: Sequence[int]) -> bool:
        return self.gram and uses_gram_form(shape, self.steps)

    def folds_norm(self, shape: Sequence[int]) -> bool:
        """Whether ``__call__`` takes an un-normalised stack of this shape and reads its Frobenius norm
        off the first Gram product (applied to the small m x m products, never to the m x n matrices)."""
        return self.uses_gram(shape)

    def flops(self, shape: Sequence[int]) -> int:
        """Matmul FLOPs of one ``rows x cols`` matrix as ``__call__`` runs it (``newton_schulz_flops``)."""
        return newton_schulz_flops(shape, self.steps, self.gram, self.products.halves(shape))

    def describe(self) -> str:
        """The iteration in words, for the dry run."""
        form = "standard form"
        if self.gram:
            form = f"Gram form where {GRAM_MIN_ASPECT:g}x wide (split restart where {SPLIT_RESTART_MIN_ASPECT:g}x wide)"
        default = self.coefficients == (DEFAULT_NS_COEFFICIENTS,) * self.steps
        return f"{self.steps} iterations, {'torch.optim.Muon' if default else 'custom'} coefficients, {form}, {self.products.name}"

    def __call__(self, X: Tensor, *, normalized: bool = True, out: Tensor | None = None) -> Tensor:
        """Newton–Schulz on a stack ``[k, rows, cols]`` (bf16 or fp32). ``normalized``: each matrix is
        already divided by its Frobenius norm; else it is divided here, or where ``folds_norm`` its norm
        is folded into the first product. Returns a new contiguous tensor, or ``out``."""
        fold = not normalized and self.folds_norm(X.shape)
        if not normalized and not fold:
            X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=self.eps)
        return self.iterate(X, fold_eps=self.eps if fold else None, out=out)

    def iterate(self, X: Tensor, fold_eps: float | None = None, out: Tensor | None = None) -> Tensor:
        """The iterations on a stack ``[k, rows, cols]``: the Gram form where ``uses_gram`` (its split
        restart where ``uses_split_restart``), else the standard one. ``X`` is normalised; with
        ``fold_eps`` it is not, and the Gram form reads its Frobenius norm (at least ``fold_eps``) off its
        first product (the standard form divides first). Returns a new tensor, or ``out``."""
        ops = self.products
        if self.uses_gram(X.shape):
            split = uses_split_restart(X.shape, self.steps)
            return gram_iterations(
                X, self.coefficients, fold_eps=fold_eps, out=out, products=ops, split_restart=split
            )
        if fold_eps is not None:
            X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=fold_eps)
        return standard_iterations(X, self.coefficients, out=out, products=ops)


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: Coefficients | Sequence[Coefficients] = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    *,
    gram: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``G = U S V^T`` (a matrix, or a stack
    ``[..., rows, cols]`` of independent ones) with torch.optim.Muon's ``_zeropower_via_newtonschulz``
    arithmetic: cast to ``dtype``, ``X /= max(||X||_F, eps)``, then ``standard_iterations`` (``gram=True``:
    the Gram form where ``NewtonSchulz`` takes it). ``dtype=torch.float32`` runs the same sequence in fp32
    (faster on CPUs without native bf16 matmuls: ``ns_dtype_for``). Returns a contiguous tensor of
    ``G``'s shape in ``dtype``."""
    per_step = per_step_coefficients(coefficients, steps)
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    X = G.to(dtype).reshape(-1, *G.shape[-2:])
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)  # never writes into G
    return NewtonSchulz(per_step, eps, gram)(X).reshape(G.shape)


def ns_dtype_for(device_type: str) -> torch.dtype:
    """Newton–Schulz's dtype: bf16 (torch.optim.Muon's) on GPUs and on x86 CPUs with native bf16 dot
    products (AVX512-BF16, also on AMX CPUs); fp32 on other CPUs, where bf16 matmuls are emulated and
    2.5x (AVX-512) to tens of times (AVX2) slower than fp32 (docs/performance.md)."""
    if device_type != "cpu":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if native and torch.backends.cpu.get_cpu_capability() == "AVX512" else torch.float32


def _fold_norm_(A: Tensor, eps: float, ops: Products) -> Tensor:
    """``A <- A / s^2`` in place for the first Gram product ``A = X X^T`` of a stack ``[k, m, m]``, with
    ``s = max(||X||_F, eps)`` from its trace; returns the fp32 ``1 / s`` ``[k, 1, 1]`` for the first
    product with ``X``. It stays fp32 (``Products.scale``): rounded to bf16 it would move every singular
    value by up to 0.2%. ``A``'s entries are the input's squares: inputs past about 1e17 overflow bf16
    (the step is then not finite, as a NaN step is)."""
    trace = A.diagonal(dim1=-2, dim2=-1).float().sum(-1).view(-1, 1, 1)
    d = trace.sqrt().clamp_(min=eps).reciprocal_()
    ops.scale(A, d.square())
    return d


def standard_iterations(
    X: Tensor,
    per_step: Sequence[Coefficients],
    *,
    out: Tensor | None = None,
    products: Products = TORCH_PRODUCTS,
) -> Tensor:
    """torch.optim.Muon's iterations on a normalised stack ``[k, rows, cols]`` (bf16 or fp32): ``A = X
    X^T; B = b A + c A A; X = a X + B X`` (``baddbmm``). A tall ``X`` is not transposed in memory: the
    iteration is written ``A = X^T X; X = a X + X B^T``, so every tensor stays contiguous and cuBLAS
    reads the transposes for free. ``out``: where the last product writes (it may be ``X``'s own memory,
    then a copy is made)."""
    tall = X.shape[-2] > X.shape[-1]
    last = len(per_step) - 1
    for i, (a, b, c) in enumerate(per_step):
        B = products.poly(products.gram(X, tall), b, c)
        dst = out if i == last and out is not None and not _overlaps(out, X) else None
        X = products.apply_add(B, X, a, tall, dst)
    return _finish(X, out)


def gram_iterations(
    X: Tensor,
    per_step: Sequence[Coefficients],
    *,
    fold_eps: float | None = None,
    out: Tensor | None = None,
    products: Products = TORCH_PRODUCTS,
    split_restart: bool = False,
) -> Tensor:
    """The iterations on the Gram matrix of a stack ``[k, rows, cols]``: on the wide orientation ``m x
    n`` (``m < n``), with ``R = X X^T`` and ``Q = I``, each iteration forms ``P = a I + b R + c R^2`` and
    updates ``Q <- P Q``, ``R <- P R P``; the result is ``Q X``. In exact arithmetic that is the
    standard iteration (every P is a polynomial in the first R, so they commute), but the n-sized
    products happen only at the start, at the restart (``X <- Q X``, ``R <- X X^T`` before iteration
    ``GRAM_RESTART``) and at the end: 8 m^2 n + ~28 m^3 FLOPs for 5 iterations instead of 20 m^2 n +
    10 m^3. ``fold_eps`` and ``out`` as in ``NewtonSchulz.iterate``: the first ``R`` gives the scale
    ``D`` (``R <- D R D``) and the first product with ``X`` applies ``Q D``.

    ``split_restart``: rebuild ``R`` at the restart from the first Gram matrix, not from ``X``: ``R0 = X
    X^T`` is kept with its fp32 accumulation (as two bf16 halves, ``Products.split``), the restart forms
    ``R <- Q R0 Q^T`` on the m x m side (``Products.regram``) and starts a new ``Q``, and the end applies
    ``(Q' Q) X``, one product with ``X`` instead of three (the FLOPs: ``SPLIT_RESTART_MIN_ASPECT``). The
    same exact arithmetic, but not in bf16 alone: ``R0`` rounded to bf16 makes ``Q R0 Q^T`` disagree
    with the Gram matrix of ``Q X`` by far more than the restart removes.
    """
    tall = X.shape[-2] > X.shape[-1]
    ops = products

    def apply(Q: Tensor, Y: Tensor, d: Tensor | None, dst: Tensor | None = None) -> Tensor:
        if d is not None:  # Q D X
            ops.scale(Q, d)
        return ops.apply(Q, Y, tall, dst)

    if not per_step:  # nothing to iterate: X, normalised as the standard form does
        return NewtonSchulz(per_step).iterate(X, fold_eps, out)
    split = split_restart and len(per_step) > GRAM_RESTART
    R, Q, Q_before = (ops.gram_fp32 if split else ops.gram)(X, tall), None, None
    d = _fold_norm_(R, fold_eps, ops) if fold_eps is not None else None  # R' = D R D
    if split:
        R0 = ops.split(R, X.dtype)  # [hi | lo]; the iterations take the high half
        R = R0[..., : R.shape[-1]]
    last = len(per_step) - 1
    for i, (a, b, c) in enumerate(per_step):
        if i == GRAM_RESTART and Q is not None:
            if split:  # Q R0 Q^T is the Gram matrix of Q X; the end applies the new Q times this one
                R, Q_before, Q = ops.regram(Q, R0), Q, None
            else:
                X, d = apply(Q, X, d), None
                R, Q = ops.gram(X, tall), None
        P = ops.poly(R, b, c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else ops.sym_mm(P, Q)
        if i < last and i + 1 != GRAM_RESTART:  # the next iteration needs R; a restart rebuilds it
            R = ops.sym_mm(ops.sym_mm(P, R), P)
    if Q_before is not None:  # polynomials in different Gram matrices: the whole product, not a triangle
        Q = ops.mm(Q, Q_before)
    dst = out if out is not None and not _overlaps(out, X) else None
    return _finish(apply(Q, X, d, dst), out)


def _overlaps(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors share any storage bytes (conservatively, by their spans)."""
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _finish(X: Tensor, out: Tensor | None) -> Tensor:
    """``X`` contiguous, or written into ``out`` when it is not already there."""
    if out is None:
        return X.contiguous()
    if X.data_ptr() != out.data_ptr() or X.stride() != out.stride():
        out.copy_(X)
    return out


def normuon_row_scale(X: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """NorMuon's step on Newton–Schulz results ``X`` ``[k, m, n]`` (the paper's O) and per-row second
    moments ``v`` ``[k, m]`` (fp32): one fp32 factor ``f`` ``[k, m]`` per row of ``X``, and the new ``v``::

        v_i = beta2 * v_i + (1 - beta2) * mean_j X_ij^2     # per row (output neuron)
        Y   = X / (sqrt(v) + eps)                           # row-wise (the paper's Ô)
        U   = Y * sqrt(min(m, n)) / ||Y||_F = f[..., None] * X

    ``U`` has the Frobenius norm of the orthogonal matrix Newton–Schulz approximates, so Muon's
    ``adjust_lr`` scales it as it scales ``X``; with ``match_rms_adamw`` the step is the paper's
    ``0.2 * lr * sqrt(m n) / ||Y||_F * Y``.

    It reads ``X`` once, for each row's sum of squares ``q_i`` (fp32 accumulation): ``||Y||_F^2 = sum_i
    q_i / (sqrt(v_i) + eps)^2``, so the factors ride in the update pass and ``X`` is never rescaled.
    """
    m, n = X.shape[-2:]
    q = torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32).square_()
    v = torch.lerp(v, q / n, 1 - beta2)
    r = (v.sqrt() + eps).reciprocal_()
    norm = (q * r.square()).sum(-1, keepdim=True).sqrt_()
    # 0 where the norm is 0: a matrix whose momentum is exactly zero (LoRA's A until its B moves, an expert
    # without tokens for long) has factors 1 / eps, and a clamped zero norm overflows fp32 to inf, which
    # times its zero rows is NaN. A zero factor keeps its update zero, as torch.optim.Muon's is.
    return r.mul_(torch.where(norm > 0, math.sqrt(min(m, n)) / norm.clamp(min=1e-30), 0.0)), v


def orthogonality_residual(X: Tensor) -> Tensor:
    """``||X X^T - I||_F / sqrt(m)`` of one ``m x n`` matrix on its wide orientation (``m <= n``), in
    fp32: 0 for orthogonal rows. The default quintic leaves the singular values spread around 1 on
    purpose: about 0.35 on Gaussian matrices after 5 iterations."""
    X = X.float()
    if X.shape[-2] > X.shape[-1]:
        X = X.mT
    gram = X @ X.mT
    gram.diagonal().sub_(1.0)
    return torch.linalg.vector_norm(gram) / math.sqrt(X.shape[-2])


def newton_schulz_flops(
    shape: Sequence[int], steps: int = DEFAULT_NS_STEPS, gram: bool = False, symmetric: bool = False
) -> int:
    """Matmul FLOPs of Newton–Schulz on one ``rows x cols`` matrix: per iteration, on the wide
    orientation ``m x n`` (``m <= n``), ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n).
    With ``gram`` (where it applies): the products ``gram_iterations`` makes, its split restart where
    ``uses_split_restart``. ``symmetric``: the products whose result is symmetric (every one but
    ``B X``, ``Q X`` and the split restart's ``Q R0`` and ``Q' Q``) counted at half, as a symmetric
    GEMM that computes one triangle makes them (``ns_quack``)."""
    m, n = sorted(shape[-2:])
    half = 1 if symmetric else 2  # FLOPs per multiply-add of a symmetric result
    if not (gram and uses_gram_form(shape, steps)):
        return steps * (half * m * m * n + half * m**3 + 2 * m * m * n)
    restart = steps > GRAM_RESTART
    flops = (half + 2) * m * m * n  # X X^T and the final Q X
    if uses_split_restart(shape, steps):
        flops += (2 * 2 + 2 * half + 2) * m**3  # Q R0 (two halves), its halves times Q, the final Q' Q
    elif restart:
        flops += (half + 2) * m * m * n  # Q X and its Gram matrix
    for i in range(steps):
        fresh = i == 0 or (restart and i == GRAM_RESTART)  # Q = I: P Q costs nothing
        keeps_r = i < steps - 1 and i + 1 != GRAM_RESTART
        flops += half * m**3 * (1 + (not fresh) + 2 * keeps_r)
    return flops


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Scale ``lr`` for a matrix of ``shape = (A, B)`` (A = rows = fan-out, B = cols = fan-in).

    - ``None`` or ``"original"`` (KellerJordan, torch's default): ``lr * sqrt(max(1, A / B))``
    - ``"match_rms_adamw"`` (Moonlight): ``lr * 0.2 * sqrt(max(A, B))``
    - ``"spectral"`` (dion's spectral-norm scaling): ``lr * sqrt(A / B)``
    """
    A, B = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral":
        ratio = math.sqrt(A / B)
    else:
        raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")
    return lr * ratio
