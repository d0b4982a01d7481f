"""Newton–Schulz orthogonalisation and Muon's learning-rate scaling: pure functions of tensors.

``newton_schulz(G)`` approximates the orthogonal polar factor ``U V^T`` of ``G = U S V^T`` (in bf16
unless asked otherwise), its input divided by its Frobenius norm or scaled by AOL (``Scaling``);
``normuon_normalize`` is NorMuon's per-row normalisation of that result (``normuon_row_scale``: the
same as one factor per row);
``adjust_lr`` scales the learning rate by the matrix shape; ``newton_schulz_flops`` counts the
matmul FLOPs of one call (the dry-run plan and Muon's owner balancing use it, through ``sharding.owner_cost``);
``orthogonality_residual`` measures how orthogonal a result is. Imports only torch.

References
----------
- K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024),
  https://kellerjordan.github.io/posts/muon/ -- the quintic iteration, its coefficients
  (3.4445, -4.7750, 2.0315) and the ``original`` lr scaling ``sqrt(max(1, A/B))``.
- J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training", arXiv:2502.16982 -- the
  ``match_rms_adamw`` lr scaling ``0.2 * sqrt(max(A, B))``.
- N. Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their Application to the
  Muon Algorithm", arXiv:2505.16932 -- per-iteration coefficients (``"polar_express"``).
- K. Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv:2504.13074 -- the ``spectral``
  lr scaling ``sqrt(A/B)``.
- Z. Li, L. Liu, C. Liang, W. Chen, T. Zhao, "NorMuon: Making Muon more efficient and scalable",
  arXiv:2510.05491 -- the per-row second-moment normalisation (``normuon_normalize``).
- T. Boissin, T. Massena, F. Mamalet, M. Serrurier, "Turbo-Muon: Accelerating Orthogonality-Based
  Optimization with Pre-Conditioning", arXiv:2512.04632 -- AOL scaling and the ``"turbo"`` table
  (AOL: B. Prach, C. H. Lampert, "Almost-Orthogonal Layers for Efficient General-Purpose Lipschitz
  Networks", arXiv:2208.03160).
- J. Zhang, N. Amsel, B. Chen, T. Dao, "Gram Newton-Schulz: A Fast, Hardware-Aware Newton-Schulz
  Algorithm for Muon" (blog, 2026), https://tridao.me/blog/2026/gram-newton-schulz/ -- iterating on
  the Gram matrix ``X X^T``, stabilised by a restart (``gram=True``).

``python benchmarks/gram_ns_numerics.py`` compares the standard and Gram forms with the exact polar
factor in bf16; docs/performance.md has their cost on the presets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from muonrun.optim.ns_products import TORCH_PRODUCTS, Products, split_bf16
from muonrun.optim.ns_scaling import DEFAULT_EPS, PRECONDITIONS, Scaling, scale_gram_, scale_input

__all__ = [
    "ADJUST_LR_FNS",
    "DEFAULT_NS_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "PRECONDITIONS",
    "TURBO_COEFFICIENTS",
    "Scaling",
    "adjust_lr",
    "gram_iterations",
    "newton_schulz",
    "newton_schulz_flops",
    "normuon_normalize",
    "normuon_row_scale",
    "ns_dtype_for",
    "ns_iterations",
    "orthogonality_residual",
    "resolve_ns_coefficients",
    "standard_iterations",
    "uses_gram_form",
    "uses_split_restart",
]

Coefficients = tuple[float, float, float]
NSCoefficients = Coefficients | Sequence[Coefficients] | str

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
DEFAULT_NS_STEPS = 5

# Polar Express, 5 iterations, as published in modded-nanogpt (arXiv:2505.16932). These already carry
# the paper's safety factor; the input is normalised by ``1.02 * ||X||_F`` instead of ``||X||_F``.
# benchmarks/polar_express_coefficients.py rebuilds the table by the paper's greedy minimax construction
# (l_0 = 1e-3, cushion 0.02, safety factor 1.02 on every iteration but the last) to 1e-14 relative.
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_NORM_SCALE = 1.02

# Turbo-Muon's 4-iteration table for AOL-scaled inputs (T. Boissin et al., arXiv:2512.04632, as
# microsoft/dion ships it in newton_schulz_triton_fast), found by its authors' search for inputs
# scaled by AOL; with ``precondition="aol"`` it stands in for 5 iterations of the default quintic.
# It keeps singular values up to 1.1 bounded (AOL bounds them by 1, bf16 rounding may pass it).
# A minimax refit for AOL-scaled gradient-like spectra under that bound (benchmarks/ns_levers_numerics.py
# --fit) trades its gains on flat spectra for no better than 1.17x the default's distance on steep ones.
TURBO_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (4.6051, -9.6552, 5.6769),
    (4.7505, -6.0861, 2.1790),
    (2.7763, -2.3190, 0.5523),
    (2.4231, -2.2861, 0.8193),
)
NAMED_TABLES: dict[str, tuple[tuple[Coefficients, ...], float]] = {
    "polar_express": (POLAR_EXPRESS_COEFFICIENTS, POLAR_EXPRESS_NORM_SCALE),
    "turbo": (TURBO_COEFFICIENTS, 1.0),
}

# Gram form: restart from the current X before this iteration, because without a restart the bf16
# rounding in the Gram matrix compounds until the result is useless; with one before the third
# iteration it is as close to the exact polar factor as the standard iteration
# (benchmarks/gram_ns_numerics.py). It is used only for matrices at least GRAM_MIN_ASPECT times wider
# than tall: on square ones it costs more FLOPs than the standard iteration. With quack's symmetric
# products it has fewer FLOPs at any aspect above 1, but runs slower below 1.5 (docs/performance.md, [w4]).
GRAM_RESTART = 2
GRAM_MIN_ASPECT = 1.5
# The split restart (``gram_iterations``' ``split_restart``) costs 10 m^3 FLOPs (8 with symmetric
# products) where the restart from X costs 4 m^2 n (3): fewer from n = 2.5 m (2.7); from 3 on both.
SPLIT_RESTART_MIN_ASPECT = 3.0

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral")


def resolve_ns_coefficients(
    coefficients: NSCoefficients, steps: int
) -> tuple[tuple[Coefficients, ...], float]:
    """Per-iteration ``(a, b, c)`` for ``steps`` iterations and the normalisation scale.

    ``coefficients`` is one ``(a, b, c)`` triple (used every iteration, as in torch.optim.Muon), a
    sequence of triples (one per iteration, the last one repeated if ``steps`` is longer), or the
    string ``"polar_express"``: the 5-iteration table, cut to its first ``steps`` rows or with its
    last row repeated. The greedy tables built for 3 or 4 iterations
    (benchmarks/polar_express_coefficients.py) are the cut table with the safety factor taken off the
    last row; on gradient-like matrices they are as close to the polar factor as the cut table (within
    2%) and neither reaches the default quintic at 5 iterations (1.4x its distance at 4 iterations,
    2x at 3), so fewer Polar Express iterations do not save FLOPs at equal error.
    """
    if steps < 0 or steps >= 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {steps}")
    norm_scale = 1.0
    if isinstance(coefficients, str):
        if coefficients not in NAMED_TABLES:
            raise ValueError(
                f"unknown ns_coefficients {coefficients!r} (expected a triple or one of {tuple(NAMED_TABLES)})"
            )
        table, norm_scale = NAMED_TABLES[coefficients]
    elif len(coefficients) == 3 and all(isinstance(x, (int, float)) for x in coefficients):
        table = [tuple(coefficients)]
    else:
        table = [tuple(t) for t in coefficients]
        if (not table and steps > 0) or any(len(t) != 3 for t in table):
            raise ValueError("ns_coefficients must be (a, b, c), a sequence of (a, b, c) or 'polar_express'")
    per_step = tuple(tuple(float(x) for x in table[min(i, len(table) - 1)]) for i in range(steps))
    return per_step, norm_scale  # type: ignore[return-value]


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    *,
    norm_scale: float | None = None,
    fold_identity: bool = False,
    gram: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    precondition: str = "frobenius",
    fold_scaling: bool = False,
    split_restart: bool = False,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``G = U S V^T`` in ``dtype`` (bf16).

    ``G`` is a matrix ``[rows, cols]`` or a stack ``[..., rows, cols]`` (every matrix normalised and
    iterated independently, in one batched matmul per product). Same arithmetic as torch.optim.Muon's
    ``_zeropower_via_newtonschulz``: cast to ``dtype``, ``X /= max(||X||_F, eps)``, then per iteration
    ``A = X X^T; B = b A + c A A; X = a X + B X`` on the wide orientation. A tall matrix (``rows >
    cols``) is not transposed in memory: the same iteration is written ``A = X^T X; X = a X + X B^T``,
    so every tensor stays contiguous and cuBLAS reads the transposes for free.
    ``fold_identity=True`` evaluates ``a X + B X`` as ``(B + a I) X`` (see ``standard_iterations``);
    ``gram=True`` iterates on the Gram matrix where that is cheaper (see ``gram_iterations``), with
    ``split_restart=True`` its split restart where that is cheaper (``uses_split_restart``).
    ``dtype=torch.float32`` runs the same sequence in fp32 (on CPUs without native bf16 matmuls it is
    several times faster: docs/performance.md).
    ``precondition="aol"`` scales the input by AOL instead of its Frobenius norm, and
    ``fold_scaling=True`` folds the Frobenius normalisation into the first iteration (``Scaling``;
    AOL is always folded).
    Returns a contiguous tensor of ``G``'s shape in ``dtype``.
    """
    per_step, default_scale = resolve_ns_coefficients(coefficients, steps)
    scale = default_scale if norm_scale is None else norm_scale
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    if precondition not in PRECONDITIONS:
        raise ValueError(f"unknown precondition {precondition!r}; expected one of {PRECONDITIONS}")
    rows, cols = G.shape[-2], G.shape[-1]
    X = G.to(dtype).reshape(-1, rows, cols)
    scaling = None
    if precondition == "aol" or fold_scaling:
        scaling = Scaling(precondition, scale, eps)  # the iterations never write into X (nor G)
    else:
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        if scale != 1.0:
            norm = norm * scale
        X = X / norm.clamp(min=eps)  # new tensor: never writes into G
    out = ns_iterations(
        X, per_step, gram=gram, fold_identity=fold_identity, scaling=scaling, split_restart=split_restart
    )
    return out.reshape(G.shape)


def ns_dtype_for(name: str, device_type: str) -> torch.dtype:
    """The dtype for Newton–Schulz named ``"bfloat16"``, ``"float32"`` or ``"auto"``: bf16 on GPUs
    and on x86 CPUs with native bf16 dot products (AVX512-BF16, also on AMX CPUs), where it is two to
    three times faster than fp32; fp32 on other CPUs, where bf16 matmuls are emulated and 2.5x
    (AVX-512) to tens of times (AVX2) slower than fp32 (docs/performance.md;
    ``ATEN_CPU_CAPABILITY=avx2`` makes this say fp32; docs/performance.md has both speeds)."""
    if name != "auto":
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]
    if device_type != "cpu":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return torch.bfloat16 if native and torch.backends.cpu.get_cpu_capability() == "AVX512" else torch.float32


def uses_gram_form(shape: Sequence[int], steps: int) -> bool:
    """Whether ``gram=True`` takes the Gram form for a matrix of this shape (where it is cheaper)."""
    m, n = sorted(shape[-2:])
    return steps > 0 and n >= GRAM_MIN_ASPECT * m


def uses_split_restart(shape: Sequence[int], steps: int) -> bool:
    """Whether ``split_restart`` applies to a matrix of this shape in the Gram form: it has a restart,
    and its long side is long enough for the split restart to cost fewer FLOPs."""
    m, n = sorted(shape[-2:])
    return uses_gram_form(shape, steps) and steps > GRAM_RESTART and n >= SPLIT_RESTART_MIN_ASPECT * m


def ns_iterations(
    X: Tensor,
    per_step: Sequence[Coefficients],
    *,
    gram: bool = False,
    fold_identity: bool = False,
    scaling: Scaling | None = None,
    out: Tensor | None = None,
    products: Sequence[Products] | None = None,
    split_restart: bool = False,
) -> Tensor:
    """Newton–Schulz on a stack ``[k, rows, cols]``: with ``gram``, the Gram form where
    ``uses_gram_form``; else the standard one. ``X`` is normalised, or with ``scaling`` it is not and
    its scale is folded into the first iteration. ``products``: how each iteration's matrix products
    are evaluated (one ``ns_products.Products`` per iteration; None: torch's for all).
    ``split_restart``: the Gram form's split restart where ``uses_split_restart``.
    Returns a new contiguous tensor, or ``out``."""
    if gram and uses_gram_form(X.shape, len(per_step)):
        split = split_restart and uses_split_restart(X.shape, len(per_step))
        return gram_iterations(X, per_step, scaling=scaling, out=out, products=products, split_restart=split)
    return standard_iterations(X, per_step, fold_identity, scaling=scaling, out=out, products=products)


def standard_iterations(
    X: Tensor,
    per_step: Sequence[Coefficients],
    fold_identity: bool = False,
    *,
    scaling: Scaling | None = None,
    out: Tensor | None = None,
    products: Sequence[Products] | None = None,
) -> Tensor:
    """Newton–Schulz iterations on a normalised stack (bf16 or fp32) ``[k, rows, cols]`` (returns a new tensor).

    ``fold_identity=False`` computes ``a X + B X`` with ``baddbmm(X, B, X, beta=a)`` like
    torch.optim.Muon; being out of place, that first copies the full-size ``X`` into its output,
    every iteration. ``fold_identity=True`` computes ``(B + a I) X``: ``a`` goes onto the small
    Gram-sized matrix and no full-size copy is made. The results differ by where one bf16 rounding
    happens (the diagonal of ``B + a I`` is stored in bf16): about 2% of the output's norm, the same
    as torch's own output moves when its input moves by one bf16 ulp, and equally close to the
    exact polar factor.

    ``scaling`` (see ``Scaling``): ``X`` is not normalised; its scale comes from the first Gram
    product ``A = X X^T`` and is folded into the first iteration, which computes ``(B' + a I) D X``
    with ``A' = D A D`` (``D`` diagonal), so no pass over the full-size ``X`` normalises it.
    ``out``: a tensor of ``X``'s shape and dtype the last product writes into (it may be ``X``'s
    own memory, then a copy is made); returned in place of a new tensor.
    ``products``: one ``ns_products.Products`` per iteration (None: torch's).
    """
    tall = X.shape[-2] > X.shape[-1]
    if not per_step:
        return _finish(X if scaling is None else scale_input(X, scaling), out)
    ops_at = [TORCH_PRODUCTS] * len(per_step) if products is None else products
    last = len(per_step) - 1
    for i, (a, b, c) in enumerate(per_step):
        ops = ops_at[i]
        A = ops.gram(X, tall)  # tall: the iteration on X^T
        d = scale_gram_(A, scaling) if i == 0 and scaling is not None else None  # A' = D A D
        B = ops.poly(A, b, c)
        dst = out if i == last and out is not None and not _overlaps(out, X) else None
        if fold_identity or d is not None:
            B.diagonal(dim1=-2, dim2=-1).add_(a)
            if d is not None:
                scaling.multiply(B, d)  # (B' + a I) D: the scale of X folded into the product
            X = ops.apply(B, X, tall, dst)
        else:
            X = ops.apply_add(B, X, a, tall, dst)
    return _finish(X, out)


def gram_iterations(
    X: Tensor,
    per_step: Sequence[Coefficients],
    restart: int | None = GRAM_RESTART,
    *,
    scaling: Scaling | None = None,
    out: Tensor | None = None,
    products: Sequence[Products] | None = None,
    split_restart: bool = False,
) -> Tensor:
    """The same iterations on the Gram matrix of a normalised stack ``[k, rows, cols]``.

    On the wide orientation ``m x n`` (``m < n``), with ``R = X X^T`` and ``Q = I``, each iteration
    forms ``P = a I + b R + c R^2`` and updates ``Q <- P Q``, ``R <- P R P``; the result is ``Q X``.
    In exact arithmetic that is the standard iteration (every P is a polynomial in the first R, so
    they commute), but the n-sized products happen only at the start, at the restart (``X <- Q X``,
    ``R <- X X^T`` before iteration ``restart``, which stops bf16 rounding in R from compounding)
    and at the end: 8 m^2 n + ~28 m^3 FLOPs for 5 iterations instead of 20 m^2 n + 10 m^3.
    ``restart=None`` never restarts (for the numerics study, benchmarks/gram_ns_numerics.py).
    ``scaling`` and ``out`` as in ``standard_iterations``: with ``scaling`` the first ``R`` gives the
    diagonal scale ``D`` (``R <- D R D``) and the first product with ``X`` applies ``Q D``.
    ``products``: one ``ns_products.Products`` per iteration (None: torch's); a restart before
    iteration i and the final ``Q X`` use iteration i's and the last iteration's.

    ``split_restart``: rebuild ``R`` at the restart from the first Gram matrix instead of from ``X``:
    ``R0 = X X^T`` is kept with its fp32 accumulation (as two bf16 halves, ``split_bf16``), the
    restart forms ``R <- Q R0 Q^T`` on the m x m side (``Products.regram``) and starts a new ``Q``, and
    the end applies ``(Q' Q) X``, one product with ``X`` instead of three. The exact arithmetic is
    the same; bf16 alone is not enough for it: ``R0`` rounded to bf16 makes ``Q R0 Q^T`` disagree with
    the Gram matrix of ``Q X`` by far more than the restart removes (benchmarks/gram_precision_numerics.py).
    The restart's products with the n-sized side (``Q X``, 2 m^2 n FLOPs, and its Gram matrix, 2 m^2 n
    or m^2 n as a symmetric product) become four m x m products and the final ``Q' Q`` (10 m^3 FLOPs,
    8 m^3 with symmetric products): fewer where ``uses_split_restart``.
    """
    tall = X.shape[-2] > X.shape[-1]

    def apply(ops: Products, Q: Tensor, Y: Tensor, d: Tensor | None, dst: Tensor | None = None) -> Tensor:
        if d is not None:  # Q D X
            scaling.multiply(Q, d)
        return ops.apply(Q, Y, tall, dst)

    if not per_step:
        return _finish(X if scaling is None else scale_input(X, scaling), out)
    ops_at = [TORCH_PRODUCTS] * len(per_step) if products is None else products
    split = split_restart and restart is not None and 0 < restart < len(per_step)
    R, Q, Q_before = (ops_at[0].gram_fp32 if split else ops_at[0].gram)(X, tall), None, None
    d = scale_gram_(R, scaling) if scaling is not None else None  # R' = D R D
    if split:
        R0 = split_bf16(R, X.dtype)  # [hi | lo]; the iterations take the high half
        R = R0[..., : R.shape[-1]]
    last = len(per_step) - 1
    for i, (a, b, c) in enumerate(per_step):
        ops = ops_at[i]
        if i == restart and Q is not None:
            if split:  # Q R0 Q^T is the Gram matrix of Q X; the end applies the new Q times this one
                R, Q_before, Q = ops.regram(Q, R0), Q, None
            else:
                X, d = apply(ops, Q, X, d), None
                R, Q = ops.gram(X, tall), None
        P = ops.poly(R, b, c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else ops.sym_mm(P, Q)
        if i < last and i + 1 != restart:  # the next iteration needs R; a restart rebuilds it
            R = ops.sym_mm(ops.sym_mm(P, R), P)
    if Q_before is not None:  # polynomials in different Gram matrices: the whole product, not a triangle
        Q = ops_at[last].mm(Q, Q_before)
    dst = out if out is not None and not _overlaps(out, X) else None
    return _finish(apply(ops_at[last], Q, X, d, dst), out)


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


def normuon_normalize(X: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """NorMuon's step on Newton–Schulz results ``X`` ``[k, m, n]`` (the paper's O) and per-row second
    moments ``v`` ``[k, m]`` (fp32): returns the update and the new ``v``, both fp32 and new tensors::

        v_i = beta2 * v_i + (1 - beta2) * mean_j X_ij^2     # per row (output neuron)
        Y   = X / (sqrt(v) + eps)                           # row-wise (the paper's Ô)
        U   = Y * sqrt(min(m, n)) / ||Y||_F                 # an orthogonal m x n matrix's norm

    ``U`` has the Frobenius norm of the orthogonal matrix Newton–Schulz approximates, so Muon's
    ``adjust_lr`` scales it as it scales ``X``; with ``match_rms_adamw`` (``0.2 sqrt(max(m, n))``)
    the step is the paper's ``0.2 * lr * sqrt(m n) / ||Y||_F * Y``.
    """
    X = X.float()
    v = torch.lerp(v, X.square().mean(dim=-1), 1 - beta2)
    hat = X / (v.sqrt() + eps).unsqueeze(-1)
    m, n = X.shape[-2:]
    norm = torch.linalg.vector_norm(hat, dim=(-2, -1), keepdim=True)
    return hat.mul_(_orthogonal_norm_over(norm, m, n)), v


def normuon_row_scale(X: Tensor, v: Tensor, beta2: float, eps: float) -> tuple[Tensor, Tensor]:
    """``normuon_normalize`` as one factor per row: returns ``f`` (fp32 ``[k, m]``) with
    ``normuon_normalize(X, v, ...)[0] == f[..., None] * X`` up to fp32 rounding, and the new ``v``.

    It reads ``X`` once, for each row's sum of squares ``q_i`` (fp32 accumulation, no fp32 copy of
    ``X`` on GPUs); the Frobenius norm of ``Y = X / (sqrt(v) + eps)`` follows from the rows alone,
    ``||Y||_F^2 = sum_i q_i / (sqrt(v_i) + eps)^2``, so the owner can scale ``X`` in place (one more
    pass) instead of materialising ``Y`` in fp32 and rounding it back.
    """
    m, n = X.shape[-2:]
    q = torch.linalg.vector_norm(X, dim=-1, dtype=torch.float32).square_()
    v = torch.lerp(v, q / n, 1 - beta2)
    r = (v.sqrt() + eps).reciprocal_()
    norm = (q * r.square()).sum(-1, keepdim=True).sqrt_()
    return r.mul_(_orthogonal_norm_over(norm, m, n)), v


def _orthogonal_norm_over(norm: Tensor, m: int, n: int) -> Tensor:
    """``sqrt(min(m, n)) / norm``, and 0 where ``norm`` is 0. A matrix whose momentum is exactly zero
    (LoRA's A until its B moves, an expert that got no tokens for long) has all rows zero; its rows'
    factors are then ``1 / eps``, and dividing by a clamped zero norm overflows fp32 to inf, which times
    the zero rows is NaN. A zero factor keeps its update zero, as torch.optim.Muon's is."""
    return torch.where(norm > 0, math.sqrt(min(m, n)) / norm.clamp(min=1e-30), 0.0)


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
    shape: Sequence[int],
    steps: int = DEFAULT_NS_STEPS,
    gram: bool = False,
    symmetric: bool = False,
    split_restart: bool = False,
) -> int:
    """Matmul FLOPs of ``newton_schulz`` on one ``rows x cols`` matrix: per iteration, on the wide
    orientation ``m x n`` (``m <= n``), ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n).
    With ``gram`` (where it applies): the products ``gram_iterations`` makes, with ``split_restart``
    its split restart where ``uses_split_restart``. ``symmetric``: the products whose result is
    symmetric (every one but ``B X``, ``Q X`` and the split restart's ``Q R0`` and ``Q' Q``) counted
    at half, as a symmetric GEMM that computes one triangle makes them (``ns_quack``)."""
    m, n = sorted(shape[-2:])
    half = 1 if symmetric else 2  # FLOPs per multiply-add of a symmetric result
    if not (gram and uses_gram_form(shape, steps)):
        return steps * (half * m * m * n + half * m**3 + 2 * m * m * n)
    restart = steps > GRAM_RESTART
    flops = (half + 2) * m * m * n  # X X^T and the final Q X
    if split_restart and uses_split_restart(shape, steps):
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
