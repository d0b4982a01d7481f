"""Newton–Schulz's products with float8 (e4m3) operands: ``Float8Products``, for the early iterations.

Hopper and newer GPUs run float8 matmuls at about twice bf16's rate, and Newton–Schulz's early
iterations tolerate float8's 3-bit mantissa: the iteration pulls every singular value towards 1, so
the error of an early iteration is mostly damped by the later bf16 ones
(benchmarks/float8_ns_numerics.py measures how many iterations may run in float8).

Each product casts its operands to e4m3 with one scale per matrix of the stack (tensorwise:
``448 / amax`` in fp32, as torchao computes it) and multiplies them with ``torch._scaled_mm``
(``compat.scaled_mm``; fp32 accumulation, bf16 output), or for a stack of several matrices on a GPU
with ``torch._scaled_grouped_mm`` in one kernel. ``_scaled_mm`` wants a row-major left and a
column-major right operand: ``Y Y^T`` has them for free (``Y`` and the view ``Y.mT``); a symmetric
operand ``A`` is passed as ``A.mT``, the same values column-major; ``B Y`` needs ``Y`` column-major,
which the cast of ``Y`` writes alongside the row-major copy in the same pass (``gram`` and the
following ``apply`` of one iteration read the same ``Y``, so it is cast once). Each cast (amax, scale,
cast, transposed copy) is one compiled function on GPUs and the same ops eagerly elsewhere. The
epilogues ``b A + c A A`` and ``a Y + B Y`` add the matmul's bf16 result in fp32 and round once
(``c`` rides in the matmul's scale, applied in fp32). A matrix whose sides are not multiples of 16 (``_scaled_mm``'s rule) takes the torch product.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch
from torch import Tensor

from muonrun import compat, log
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products

__all__ = ["E4M3_MAX", "Float8Products", "cast_e4m3", "has_float8_matmuls", "products_for", "say_fallback"]


# torch's float8 matmuls are private names (torchao wraps them); this study calls them directly.


def scaled_mm(
    a: Tensor,
    b: Tensor,
    scale_a: Tensor,
    scale_b: Tensor,
    out_dtype: torch.dtype,
    out: Tensor | None = None,
    fast: bool = False,
) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)`` of 2-D float8 operands (``a`` row-major, ``b`` column-major on
    GPUs), fp32 accumulation (``fast``: Hopper's faster, less exact one), in ``out_dtype`` (into ``out``
    when given); fp32 0-d scales are tensorwise."""
    kw = {"scale_a": scale_a, "scale_b": scale_b, "out_dtype": out_dtype, "use_fast_accum": fast}
    return torch._scaled_mm(a, b, **kw) if out is None else torch._scaled_mm(a, b, **kw, out=out)


def scaled_grouped_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """The batched ``scaled_mm`` of stacks ``a`` ``[g, m, k]`` (row-major) and ``b`` ``[g, k, n]``
    (column-major) in one kernel, bf16 output; rowwise fp32 scales ``[g, m]`` and ``[g, n]``. CUDA only
    (Hopper and newer)."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16)


E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
AMAX_FLOOR = 1e-30  # an all-zero matrix casts to zeros with a finite scale
ALIGN = 16  # _scaled_mm needs every side of its operands to be a multiple of 16
MATMULS = ("auto", "grouped", "loop", "emulate")

CPU_REFERENCE = False
"""Whether CPUs count as having float8 matmuls. torch's CPU ``_scaled_mm`` is exact (fp32 accumulation)
but a reference loop, hundreds of times slower than a bf16 matmul, so Muon falls back to bf16 there;
tests turn it on to run the float8 path on the CPU."""

_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info(message)


def has_float8_matmuls(device: torch.device) -> bool:
    """Whether ``device`` runs e4m3 matmuls: CUDA GPUs of compute capability 8.9 (Ada) and newer;
    CPUs only with ``CPU_REFERENCE``."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and CPU_REFERENCE


def say_fallback(device: torch.device) -> None:
    """Say once that ``optimizer.muon.ns_float8_steps`` runs in bf16 on ``device``."""
    device = torch.device(device)
    _say_once(
        f"fallback-{device.type}",
        f"optimizer.muon.ns_float8_steps: {device.type} has no fast float8 matmuls (CUDA compute "
        "capability 8.9+, best on Hopper); Newton–Schulz runs every iteration in bf16 instead.",
    )


def cast_e4m3(x: Tensor, transposed: bool) -> tuple[Tensor, Tensor | None, Tensor]:
    """A stack ``x`` ``[k, r, c]`` cast to e4m3 with one scale ``448 / amax`` per matrix: the row-major
    copy ``[k, r, c]``, with ``transposed`` also a contiguous ``[k, c, r]`` copy of its transpose
    (else None), and the inverse scales ``_scaled_mm`` takes (fp32 ``[k]``)."""
    amax = x.abs().amax(dim=(-2, -1), keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = E4M3_MAX / amax
    x8 = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return x8, x8.mT.contiguous() if transposed else None, scale.reciprocal().view(-1)


def _fresh(fn: Callable) -> Callable:
    """A copy of ``fn`` with its own code object (dynamo keeps one cache per code object)."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


class Float8Products(Products):
    """Newton–Schulz's products through e4m3 operands (see the module docstring).

    ``matmul``: ``"grouped"`` (a stack in one ``_scaled_grouped_mm``, Hopper+), ``"loop"`` (one
    ``_scaled_mm`` per matrix), ``"emulate"`` (the fp32 matmul of the dequantised operands: what the
    CPU's ``_scaled_mm`` computes, at the speed of an fp32 matmul, for numerics studies) or
    ``"auto"``: grouped for stacks on CUDA (loop if this torch or GPU lacks it, said once), loop
    elsewhere. ``fast_accum``: Hopper's faster float8 accumulation (fewer accumulator bits).
    ``compiled``: the casts compiled (None: on CUDA)."""

    def __init__(self, matmul: str = "auto", fast_accum: bool = False, compiled: bool | None = None) -> None:
        if matmul not in MATMULS:
            raise ValueError(f"matmul must be one of {MATMULS}, got {matmul!r}")
        self.matmul = matmul
        self.fast_accum = fast_accum
        self.compiled = compiled
        self._casts: dict[tuple, Callable] = {}
        self._last: tuple[Tensor, Tensor, Tensor, Tensor] | None = None  # Y, its two casts, scales

    # -- casts -----------------------------------------------------------------------------------------

    def _cast(self, x: Tensor, transposed: bool) -> tuple[Tensor, Tensor | None, Tensor]:
        compiled = self.compiled if self.compiled is not None else x.device.type == "cuda"
        if not compiled:
            return cast_e4m3(x, transposed)
        key = (x.shape[-2], x.shape[-1], x.dtype, transposed)
        fn = self._casts.get(key)
        if fn is None:
            fn = self._casts[key] = torch.compile(_fresh(cast_e4m3), fullgraph=True)
        try:
            return fn(x, transposed)
        except compat.compile_error() as e:  # compiling failed before anything ran
            _say_once(
                "compile",
                f"Newton–Schulz's float8 casts could not be compiled ({type(e).__name__}); they run as "
                "eager ops (more passes over memory).",
            )
            self.compiled = False
            return cast_e4m3(x, transposed)

    def _cast_both(self, Y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``Y``'s row-major and transposed e4m3 copies and scales, from one pass (reused by the
        next product that reads the same ``Y``)."""
        last = self._last
        if last is not None and last[0] is Y:
            return last[1], last[2], last[3]
        y8, y8t, inv = self._cast(Y, True)
        self._last = (Y, y8, y8t, inv)
        return y8, y8t, inv

    # -- the matmul ------------------------------------------------------------------------------------

    def _mm(self, a8: Tensor, sa: Tensor, b8: Tensor, sb: Tensor, out: Tensor | None = None) -> Tensor:
        """``(a8 * sa) @ (b8 * sb)`` per matrix of the stacks, bf16 (into ``out`` when given): ``a8``
        row-major, ``b8`` column-major (``_scaled_mm``'s layouts, checked here because the CPU's
        accepts any), ``sa``, ``sb`` fp32 ``[k]``."""
        if a8.stride(-1) != 1 or b8.stride(-2) != 1:
            raise AssertionError(
                f"float8 operand layouts: {a8.stride()} row-major, {b8.stride()} column-major"
            )
        k, m, n = a8.shape[0], a8.shape[1], b8.shape[2]
        mode = self.matmul
        if mode == "auto":
            mode = "grouped" if k > 1 and a8.device.type == "cuda" else "loop"
        if mode == "emulate":
            prod = torch.bmm(a8.float() * sa.view(-1, 1, 1), b8.float() * sb.view(-1, 1, 1))
            return prod.to(torch.bfloat16) if out is None else out.copy_(prod)
        if mode == "grouped" and k > 1:
            try:
                prod = scaled_grouped_mm(
                    a8, b8, sa.view(k, 1).expand(k, m).contiguous(), sb.view(k, 1).expand(k, n).contiguous()
                )
                return prod if out is None else out.copy_(prod)
            except (RuntimeError, NotImplementedError) as e:
                if self.matmul != "auto":
                    raise
                _say_once(
                    "grouped",
                    f"The grouped float8 matmul is not available here ({str(e).splitlines()[0][:160]}); "
                    "Newton–Schulz's float8 products run one matrix at a time.",
                )
                self.matmul = "loop"
        if out is None:
            out = torch.empty(k, m, n, dtype=torch.bfloat16, device=a8.device)
        for i in range(k):
            scaled_mm(a8[i], b8[i], sa[i], sb[i], torch.bfloat16, out=out[i], fast=self.fast_accum)
        return out

    @staticmethod
    def _fits(*tensors: Tensor) -> bool:
        return all(t.shape[-1] % ALIGN == 0 and t.shape[-2] % ALIGN == 0 for t in tensors)

    # -- the products ----------------------------------------------------------------------------------

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        if not self._fits(Y):
            return super().gram(Y, tall)
        y8, y8t, inv = self._cast_both(Y)
        if tall:  # Y^T Y: Y^T row-major is the transposed copy, Y column-major its view
            return self._mm(y8t, inv, y8t.mT, inv)
        return self._mm(y8, inv, y8.mT, inv)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        if not self._fits(A):
            return super().poly(A, b, c)
        a8, _, inv = self._cast(A, False)
        AA = self._mm(a8, inv * c, a8.mT, inv)  # c A A: c in the scale, applied in fp32
        return AA.add_(A, alpha=b)  # b A + c A A in fp32 (opmath), rounded once

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        self._last = None  # the Gram form's products on R follow: X's casts are not read again soon
        if not self._fits(P, Q):
            return super().sym_mm(P, Q)
        p8, _, p_inv = self._cast(P, False)
        q8, _, q_inv = p8, None, p_inv
        if Q is not P:
            q8, _, q_inv = self._cast(Q, False)
        return self._mm(p8, p_inv, q8.mT, q_inv)

    def apply(self, B: Tensor, Y: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
        if not self._fits(B, Y):
            self._last = None
            return super().apply(B, Y, tall, out)
        b8, _, b_inv = self._cast(B.contiguous(), False)
        y8, y8t, y_inv = self._cast_both(Y)
        self._last = None  # the iteration moves on to a new Y
        if tall:  # Y B^T: B^T column-major is B's row-major copy seen transposed
            return self._mm(y8, y_inv, b8.mT, b_inv, out)
        return self._mm(b8, b_inv, y8t.mT, y_inv, out)

    def apply_add(self, B: Tensor, Y: Tensor, a: float, tall: bool, out: Tensor | None = None) -> Tensor:
        if not self._fits(B, Y):
            self._last = None
            return super().apply_add(B, Y, a, tall, out)
        BY = self.apply(B, Y, tall)
        return torch.add(BY, Y, alpha=a, out=out)  # a Y + B Y in fp32 (opmath), rounded once


def products_for(
    steps: int, float8_steps: int = 0, device: torch.device | None = None
) -> tuple[Products, ...] | None:
    """How each of ``steps`` Newton–Schulz iterations evaluates its products, for ``ns_iterations``'s
    ``products`` (None: torch's for every iteration). ``float8_steps``: the first that many iterations
    with e4m3 operands (``Float8Products``, one instance shared by them) where ``device`` has float8
    matmuls; on a device without them torch's, and that is said once."""
    if not 0 <= float8_steps <= steps:
        raise ValueError(f"float8_steps must be in [0, {steps}] (the iterations), got {float8_steps}")
    if float8_steps == 0:
        return None
    if device is not None and not has_float8_matmuls(device):
        say_fallback(device)
        return None
    float8 = Float8Products()
    return (float8,) * float8_steps + (TORCH_PRODUCTS,) * (steps - float8_steps)
