"""Muon's elementwise passes (momentum into the exchange buffer; decay and update, with NorMuon's row
factors; the owner's Frobenius normalisation), fused by torch.compile on GPUs.

Unfused, the momentum update, Nesterov look-ahead, bf16 cast, weight decay and scaled update read and
write every matrix several times (about 48 bytes per fp32 element); fused, each group is one pass
(about 24). The same Python runs eagerly or compiled. The normalisation takes a stack as the leading
``rows * cols`` elements of each row of a contiguous ``[k, slab]`` tensor: inductor writes a mutated
*strided* input through a temporary and a copy, a slice of a contiguous one in place. Where compiling
is not possible (a CPU, ``eager``, a compile that fails) the same ops run eagerly.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from muonrun import compat, log
from muonrun.compat import compile_error


def momentum_into(
    bufs: Sequence[Tensor], grads: Sequence[Tensor], dsts: Sequence[Tensor], momentum: float, nesterov: bool
) -> None:
    """``buf = lerp(buf, grad, 1 - momentum)``; ``dst = lerp(grad, buf, momentum)`` (Nesterov) or
    ``buf``, cast to ``dst``'s dtype: torch.optim.Muon's momentum, written into the exchange buffer."""
    compat.foreach_lerp_(bufs, grads, 1 - momentum)
    compat.foreach_copy_(dsts, compat.foreach_lerp(grads, bufs, momentum) if nesterov else bufs)


def decay_and_update(
    params: Sequence[Tensor],
    updates: Sequence[Tensor],
    scalars: Tensor | Sequence[float],
    slots: Sequence[tuple[int, int]],
    row_factors: Sequence[Tensor] | None = None,
) -> None:
    """``p = p * scalars[f] + scalars[a] * u`` for each parameter with its slots ``(f, a)`` (decay and
    scale: ``step.UpdateScalars``). With host numbers, torch's two foreach ops (a factor of 1 skipped);
    with a device tensor (compiled: the values change every step without recompiling), the update
    widened to fp32 and scaled, in one pass when fused: an eager and a compiled step agree to rounding.
    ``row_factors`` (NorMuon, ``with_row_factors``) apply to the widened update in the same pass, so
    the Newton–Schulz result is never rescaled in memory."""
    runs: dict[tuple[int, int], list[int]] = {}
    for i, slot in enumerate(slots):
        runs.setdefault(slot, []).append(i)
    for (f, a), idx in runs.items():
        ps, us = [params[i] for i in idx], [updates[i] for i in idx]
        if row_factors is not None:
            us = with_row_factors(us, [row_factors[i] for i in idx])
        if isinstance(scalars, Tensor):
            compat.foreach_mul_(ps, scalars[f])
            compat.foreach_add_(ps, compat.foreach_mul([u.float() for u in us], scalars[a]))
            continue
        if scalars[f] != 1.0:
            compat.foreach_mul_(ps, scalars[f])
        compat.foreach_add_(ps, us, alpha=scalars[a])


def with_row_factors(updates: Sequence[Tensor], row_factors: Sequence[Tensor]) -> list[Tensor]:
    """Each update widened to fp32 with row ``i`` times its factor ``i`` (NorMuon's, ``u.shape[:-1]``)."""
    return [u.float() * f.unsqueeze(-1) for u, f in zip(updates, row_factors, strict=True)]


def frobenius_divisors(X: Tensor, dim: tuple[int, ...], eps: float) -> Tensor:
    """``max(||X||_F, eps)`` over ``dim``: torch.optim.Muon's divisor (zero padding rows change no norm)."""
    return torch.linalg.vector_norm(X, dim=dim).clamp_(min=eps)


def normalize_leading_(base: Tensor, rows: int, cols: int, eps: float) -> None:
    """Each matrix of the stack ``[k, rows, cols]`` held in the first ``rows * cols`` elements of each
    row of ``base`` ``[k, slab]`` divided by ``frobenius_divisors``, in place."""
    X = base[:, : rows * cols].view(base.shape[0], rows, cols)
    X.div_(frobenius_divisors(X, (-2, -1), eps).view(-1, 1, 1))


class Kernels:
    """Functions compiled once per key (each a copy with its own code object: dynamo keeps one cache, so
    one recompile limit, per code object), or run eagerly: where ``compiled`` is off, and after a compile
    fails (said once)."""

    def __init__(self, compiled: bool, backend: str | Callable = "inductor") -> None:
        self.compiled = compiled
        self.backend = backend
        self._fns: dict[tuple, Callable] = {}

    def __call__(self, key: tuple, fn: Callable, *args, options: Callable[[], dict] | None = None):
        """``fn(*args)``, compiled at the first call with ``key`` (the same key must always come with
        the same tensor shapes), with the inductor options ``options()`` returns."""
        if not self.compiled:
            return fn(*args)
        compiled = self._fns.get(key)
        if compiled is None:
            extra = {"options": options()} if options and self.backend == "inductor" else {}
            fresh = types.FunctionType(
                fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
            )
            compiled = torch.compile(fresh, backend=self.backend, fullgraph=True, dynamic=False, **extra)
            self._fns[key] = compiled
        try:
            return compiled(*args)
        except compile_error() as e:  # compiling failed before anything ran
            log.once(
                "compile-failed",
                f"Muon's {fn.__name__} kernel could not be compiled ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}); Muon's small kernels run as eager ops instead "
                "(optimizer.muon.eager=true silences this).",
                warn=True,
            )
            self.compiled = False
            return fn(*args)


class Passes(Kernels):
    """Muon's elementwise passes, compiled per bucket (``compiled=True``) or eager. ``strided``: some
    of a pass's tensors are strided views (stacked experts stored ``[E, in, out]``), compiled without
    inductor's loop reordering (``compat.no_loop_reordering`` says why)."""

    def momentum(
        self, key: tuple, bufs, grads, dsts, momentum: float, nesterov: bool, strided: bool = False
    ) -> None:
        options = compat.no_loop_reordering if strided else None
        self(("momentum", *key), momentum_into, bufs, grads, dsts, momentum, nesterov, options=options)

    def normalize(self, base: Tensor, rows: int, cols: int, eps: float) -> None:
        """``normalize_leading_`` on an owned stack (``base`` contiguous ``[k, slab]``), compiled once per
        layout (shape, strides, dtype) and shared across buckets: no recompiles, few compiles."""
        layout = (tuple(base.shape), base.stride(), base.dtype)
        self(("normalize", layout, rows, cols), normalize_leading_, base, rows, cols, eps)

    def decay_and_update(
        self,
        key: tuple,
        params: Sequence[Tensor],
        updates: Sequence[Tensor],
        scalars: Tensor | Sequence[float],
        slots: Sequence[tuple[int, int]],
        row_factors: list | None = None,
        strided: bool = False,
    ) -> None:
        """``decay_and_update`` on one bucket, ``scalars`` from ``step.UpdateScalars.passed``."""
        options = compat.no_loop_reordering if strided else None
        args = (params, updates, scalars, tuple(slots), row_factors)
        self(("update", *key), decay_and_update, *args, options=options)

    @classmethod
    def choose(cls, eager: bool, device: torch.device | None, backend: str | Callable | None) -> Passes:
        """Compiled with ``backend`` where given (any device: tests), else where ``can_compile`` on
        ``device`` (the parameters'; None: none to step), unless ``eager``."""
        if backend is not None:
            return cls(True, backend)
        return cls(not eager and device is not None and can_compile(device))


def can_compile(device: torch.device) -> bool:
    """Whether the fused passes compile on ``device``: a GPU, with triton (said once where it is missing)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        log.once("no-triton", "Muon's fused elementwise passes need triton to compile; they run eagerly.")
        return False
    return True
