"""Can the Gram form's rectangular products get cheaper? The CPU numerics check of three levers.

At the presets' MLP shapes (896 x 4864, 1536 x 8960) the Gram form's four products with an n-sized side
(``X X^T`` and ``Q X`` at the start, at the restart and at the end: ``gram_iterations``) carry about
70% of Newton–Schulz's FLOPs as quack's symmetric products run them, the restart alone (``X <- Q X``,
``R <- X X^T``) about a third. Three levers would make them cheaper without dropping an iteration:

- **float8 for ``Q X``**: the restart's product, or the final one, or both, with e4m3 operands
  (``ns_float8.Float8Products``' ``apply``, tensorwise scales, emulated as the fp32 matmul of the
  dequantised operands, which is what the CPU's ``_scaled_mm`` computes); every other product bf16.
  On Hopper that is twice bf16's rate for 2 m^2 n FLOPs of each.
- **no restart, the m x m side in fp16**: the restart exists because bf16 rounding in ``R`` compounds
  (``newton_schulz.GRAM_RESTART``); fp16 has three more mantissa bits at the same tensor-core rate.
  Here ``R = X X^T`` is rounded to fp16 (bf16 operands, fp32 accumulation), the polynomials and their
  products are fp16 (fp32 accumulation, rounded once), ``Q`` is rounded to bf16 for the final ``Q X``,
  and there is no restart. fp32 on the m x m side without a restart is the bound on what precision
  alone can give (fp32 products run far slower, so it is no lever).
- **the split restart** (``split_restart``, Muon's ``ns_split_restart``): the restart's ``R`` as
  ``Q R0 Q^T`` from the first Gram matrix kept in fp32 as two bf16 halves, on the m x m side, and the
  final product ``(Q' Q) X``. "R0 in bf16" drops the low half, to show what the halves are for.

Method: the default quintic x5 on the bf16, Frobenius-normalised input of each preset shape Muon runs in
the Gram form, with singular values ``1/i`` (steep, gradient-like, ``gram_ns_numerics.gradient_like``)
and ``1/sqrt(i)`` (flatter), random singular vectors; each result against the exact polar factor (fp64
SVD), ``||O - U V^T||_F / ||U V^T||_F``, as a change against the bf16 Gram form Muon runs. The yardstick:
every element of the bf16 input moved by one ulp (up or down at random), then the bf16 Gram form again.

Conclusion (what ``python benchmarks/gram_precision_numerics.py`` prints, worst of two seeds; the first two
levers rejected). One ulp of input noise moves the distance by 0.7-6.7% on the steep spectrum and 0.1-0.4% on the
flatter one; torch.optim.Muon's standard form lands 0.7-5.8% closer than the Gram form on the steep one.

- float8 ``Q X`` at the restart: +38% on the 0.5B MLP matrices (896 x 4864), +14% to +81% over the steep
  spectrum's shapes (256 x 1536 the worst), +1% to +7% on the flatter one. float8 for the final ``Q X``
  alone: +11% at 896 x 4864, +4% to +31% (steep), +2.5% to +8% (flatter). The Gram form's ``Q`` maps
  the small singular directions of ``X`` up by an order of magnitude, and with them e4m3's rounding
  error of ``X`` (3 mantissa bits); in the first iterations (``float8_ns_numerics.py``) later bf16
  iterations still correct that error, here none follows.
- fp16 without a restart: on the flatter spectrum, and on 1536 x 8960, as close as fp32 (within 0.3%);
  on the steep spectrum +4.3% at 896 x 4864 and 128 x 896 and +47% at 256 x 1536, where fp32 without a
  restart lands with the standard form (-0.7% to -5.6%). fp16 with the restart is as close as fp32,
  but it is not cheaper than what Muon runs.

- the split restart: within 0.6% of the restart from ``X`` on every shape and spectrum, well inside one ulp
  of input noise; with ``R0`` in bf16 it lands 2.7x (1536 x 8960) to 81x (256 x 1536) farther on the
  steep spectrum. Its speed: docs/performance.md ([w8]); it is the setting ``ns_split_restart``.

So both ``Q X`` products stay bf16, and the restart's precision comes from the split, not from fp16::

    python benchmarks/gram_precision_numerics.py   # a few minutes on a CPU
"""

from __future__ import annotations

import torch
from ns_float8 import Float8Products  # benchmarks/: on the path when a script runs
from torch import Tensor

from muonrun.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    gram_iterations,
    newton_schulz,
    resolve_ns_coefficients,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products

SHAPES = ((128, 896), (896, 4864), (4864, 896), (256, 1536), (1536, 8960))  # the presets' Gram-form shapes
SPECTRA = (("1/i", -1.0), ("1/sqrt(i)", -0.5))
SEEDS = (0, 1)
STEPS = 5


class Float8Apply(Products):
    """torch's products, but ``Q X`` with e4m3 operands (``Float8Products``, emulated)."""

    def __init__(self) -> None:
        self._float8 = Float8Products(matmul="emulate")

    def apply(self, B: Tensor, Y: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
        return self._float8.apply(B, Y, tall, out)


class SmallSide(Products):
    """The m x m side (``R``, the polynomials, their products) in ``dtype``: operands of their stored
    precision, fp32 accumulation, each result rounded once to ``dtype`` (held as fp32 values here); the
    final ``Q X`` from ``Q`` rounded to bf16, as Muon's products take it."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def _round(self, T: Tensor) -> Tensor:
        return T.to(self.dtype).float()

    def gram(self, Y: Tensor, tall: bool) -> Tensor:
        Y = Y.float()
        return self._round(Y.mT @ Y if tall else Y @ Y.mT)

    def poly(self, A: Tensor, b: float, c: float) -> Tensor:
        return self._round(b * A + c * (A @ A))

    def sym_mm(self, P: Tensor, Q: Tensor) -> Tensor:
        return self._round(self._round(P) @ self._round(Q))  # P + a I: rounded before it is used

    def apply(self, B: Tensor, Y: Tensor, tall: bool, out: Tensor | None = None) -> Tensor:
        bf16 = torch.bfloat16
        return TORCH_PRODUCTS.apply(B.to(bf16), Y.to(bf16), tall, out)


class HighHalfOnly(Products):
    """torch's products, but the split restart's first Gram matrix rounded to bf16 (its low half zero)."""

    def regram(self, Q: Tensor, R0: Tensor) -> Tensor:
        m = R0.shape[-1] // 2
        return super().regram(Q, torch.cat([R0[..., :m], torch.zeros_like(R0[..., m:])], dim=-1))


def test_matrix(m: int, n: int, power: float, seed: int) -> Tensor:
    """An ``m x n`` fp32 matrix with singular values ``i ** power`` and random singular vectors."""
    k = min(m, n)
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    return (U * torch.arange(1, k + 1, dtype=torch.float32) ** power) @ V.T


def one_ulp(G: Tensor, seed: int) -> Tensor:
    """``G`` in bf16 with every element moved one ulp up or down at random."""
    b = G.to(torch.bfloat16)
    up = torch.nextafter(b, torch.full_like(b, float("inf")))
    down = torch.nextafter(b, torch.full_like(b, float("-inf")))
    pick = torch.rand(b.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
    return torch.where(pick, up, down).float()


def gram_form(
    G: Tensor, products: tuple[Products, ...] | None = None, restart: int | None = 2, split: bool = False
) -> Tensor:
    """Muon's Gram form of ``G`` (bf16 input, Frobenius-normalised), with ``products`` per iteration
    and, with ``split``, the split restart."""
    per_step, norm_scale = resolve_ns_coefficients(DEFAULT_NS_COEFFICIENTS, STEPS)
    X = G.to(torch.bfloat16)[None]
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale).clamp(min=DEFAULT_EPS)
    return gram_iterations(X, per_step, restart, products=products, split_restart=split)[0].double()


def standard_form(G: Tensor) -> Tensor:
    """torch.optim.Muon's iteration of ``G`` (bf16), for comparison."""
    return newton_schulz(G, STEPS, DEFAULT_NS_COEFFICIENTS).double()


def variants() -> dict[str, tuple[tuple[Products, ...], int | None, bool]]:
    """Each lever: its products per iteration, its restart (a restart before iteration i and the final
    ``Q X`` take iteration i's and the last iteration's products) and whether it is the split restart."""
    t, f8 = TORCH_PRODUCTS, Float8Apply()
    fp16, fp32 = (SmallSide(torch.float16),) * STEPS, (SmallSide(torch.float32),) * STEPS
    return {
        "float8 restart QX": ((t, t, f8, t, t), 2, False),
        "float8 final QX": ((t, t, t, t, f8), 2, False),
        "float8 both": ((t, t, f8, t, f8), 2, False),
        "fp16, no restart": (fp16, None, False),
        "fp16, restart": (fp16, 2, False),
        "fp32, no restart": (fp32, None, False),
        "split restart": ((t,) * STEPS, 2, True),
        "split, R0 in bf16": ((HighHalfOnly(),) * STEPS, 2, True),
    }


def main() -> None:
    levers = variants()
    names = ["one ulp", "standard form", *levers]
    print("distance to the polar factor of Muon's bf16 Gram form, and each variant's change against it")
    print(f"{'spectrum':<10} {'shape':<10} {'bf16 Gram':>9}" + "".join(f"{n:>19}" for n in names))
    for label, power in SPECTRA:
        for m, n in SHAPES:
            worst: dict[str, float] = {}
            base_sum = 0.0
            for seed in SEEDS:
                G = test_matrix(m, n, power, seed)
                U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
                polar = U @ Vh

                def distance(out: Tensor, polar: Tensor = polar) -> float:
                    return ((out - polar).norm() / polar.norm()).item()

                base = distance(gram_form(G))
                base_sum += base
                changes = {
                    "one ulp": distance(gram_form(one_ulp(G, seed))) / base - 1,
                    "standard form": distance(standard_form(G)) / base - 1,
                }
                for name, (products, restart, split) in levers.items():
                    changes[name] = distance(gram_form(G, products, restart, split)) / base - 1
                for name, change in changes.items():
                    worst[name] = max(worst.get(name, change), change, key=abs)
            cells = "".join(f"{worst[name]:>+19.1%}" for name in names)
            print(f"{label:<10} {f'{m}x{n}':<10} {base_sum / len(SEEDS):>9.4f}{cells}", flush=True)


if __name__ == "__main__":
    main()
