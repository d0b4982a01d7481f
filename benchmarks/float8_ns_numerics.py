"""Can Newton–Schulz run its early iterations with float8 matmuls? The CPU numerics check.

Question: on Hopper GPUs float8 (e4m3) matmuls run at about twice bf16's rate. Every iteration of the
standard form costs the same FLOPs (``newton_schulz_flops``), so if the first k of 5 iterations ran
their three matmuls in float8 and the last 5 - k in bf16, Newton–Schulz would take about
``1 - k / 10`` of its bf16 time (0.7x at k = 3). Is the result then (nearly) as close to the exact
polar factor as all-bf16?

Method: the standard iteration on the wide orientation (``A = X X^T; B = b A + c A A; X = a X + B X``,
the arithmetic of ``standard_iterations``) on the bf16-normalised input of ``newton_schulz``. In the
first k iterations each of the three matmuls (X X^T, A A, B X) casts its operands to float8_e4m3fn and
runs ``torch._scaled_mm`` with a bf16 output, as torchao and Transformer Engine do:

- tensorwise: one scale per operand, ``448 / amax`` in fp32, ``(x * scale).clamp(-448, 448)`` cast
  to e4m3, the inverse scales passed to ``_scaled_mm``;
- rowwise: the same with one scale per row of the left operand and per column of the right one.
  ``torch._scaled_mm`` on the CPU accepts rowwise scales, so both use it natively; on the CPU it
  accumulates in fp32 and rounds once to bf16 (``check_scaled_mm`` confirms it equals the fp32
  matmul of the dequantised operands).

``B = b A + c A A`` and ``X = a X + B X`` are then formed in fp32 from the bf16 products and rounded
once to bf16 (a fused epilogue would do the same; the one extra bf16 rounding of ``A A`` and ``B X``
against ``baddbmm`` is far below float8's). The last 5 - k iterations are ``standard_iterations``
unchanged; k = 0 is ``newton_schulz`` itself, the reference. Inputs are ``gradient_like`` matrices of
benchmarks/gram_ns_numerics.py (singular values 1/i) of the presets' shapes, for the default quintic x5
and Polar Express x5. Each result is compared with the exact polar factor (fp64 SVD): orthogonality
residual, extreme singular values and ``||O - U V^T||_F / ||U V^T||_F``. As the noise yardstick,
every element of the bf16 input moves by one ulp (up or down at random) and k = 0 runs again.

Conclusion (the numbers ``python benchmarks/float8_ns_numerics.py`` prints; tensorwise and rowwise
scaling differ little, rowwise is a little closer where they differ):

- The default quintic tolerates float8 in 3 of its 5 iterations on every shape: its distance to the
  polar factor grows by at most 0.6% at k = 3, and 2% (tensorwise; 1.5% rowwise) at k = 4. On the
  matrices with 896 or more rows even k = 5 stays within 0.5%; only 128 x 896 breaks at k = 5
  (+19% tensorwise, +6.5% rowwise). Its distance (0.2-0.5) is set by the singular values it leaves
  spread in [0.24, 1.2] on purpose, which float8 does not change.
- Polar Express tolerates less, because it converges further (distance 0.10-0.28) and float8's
  error is then a larger part of what is left: k = 1 stays within 2% on every shape (+1.9% at most),
  k = 2 adds 0.4-2.4% on the 896- and 1536-row matrices and 3.4-4% on 128 x 896, k = 3 adds 0.5-3.4%
  on the large matrices but 31% on 128 x 896, and k = 4, 5 add 4.6-12% on 896 rows.
- So the largest k within 2% of all-bf16 on every shape is 3 (tensorwise) or 4 (rowwise) for the
  default quintic and 1 for Polar Express (2-3 if 2.5-3.5% is acceptable and small matrices stay in
  bf16). Every iteration costs the same FLOPs, so k float8 iterations carry k/5 of them: at float8 =
  2x bf16, k = 3 gives about 0.7x the Newton–Schulz time, k = 4 0.6x, k = 1 0.9x.
- Against the noise yardstick these changes are small: one ulp of input noise moves the output by
  5-14% (float8 at k = 3: 3-5% on the 896- and 1536-row matrices) and the distance to the polar
  factor by 0.8-2.4% (default quintic) and 7-34% (Polar Express), always upwards, because a bf16
  input does not pin down the directions of its small singular values better than that. Between
  draws the distance varies by 0.0-0.5% (1.6% for Polar Express on 896 x 896); float8's changes
  repeat to 0.1% between seeds on the 896- and 1536-row matrices (to 1-2% on 128 x 896), so they
  are systematic, not noise.

Muon's float8 path (``--products-only`` runs just this part): ``Float8Products`` (tensorwise e4m3,
bf16 matmul results, fp32 epilogues; emulated as the fp32 matmul of the dequantised operands, which
is what the CPU's ``_scaled_mm`` computes) in the first k of 5 iterations of ``ns_iterations``, on
every preset shape (896/1536 rows and columns of Qwen2-0.5B/1.5B), in the standard form and, where
it applies, the Gram form; the change of the distance to the polar factor against all-bf16:

- default quintic, standard form: at most +0.25% (k = 1), +0.48% (k = 2), +0.69% (k = 3), the same
  picture as above; so k <= 3 stays within 1% of all-bf16.
- default quintic, Gram form: +0.77% (k = 1), +1.61% (k = 2, on 256 x 1536; +1.54% on 128 x 896,
  under 0.6% on the MLP matrices), and +42% to +1040% at k = 3, where the restart's Gram matrix is
  itself a float8 product: it is no longer positive semidefinite, and the iteration on R multiplies a
  negative eigenvalue by about 12 every step. So in the Gram form k <= 1 stays within 1% (k = 2 within
  1.6%), and Muon never puts the restart or later iterations in float8.
- Polar Express: the standard form +1.3% at k = 1, +2.9% at k = 2, +31% at k = 3 (128 x 896); the
  Gram form breaks at k = 1 on the small-row matrices (128 x 896, 256 x 1536: its first iteration's
  large coefficients drive negative eigenvalues of R up even faster). Float8 is for the default
  coefficients.

The CPU accumulates float8 products exactly in fp32; Hopper's float8 tensor cores accumulate with
fewer bits unless ``use_fast_accum=False``, which the GPU measurement has to choose and check
(benchmarks/bench_ns_float8.py measures both on the GPU)::

    python benchmarks/float8_ns_numerics.py [--products-only]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gram_ns_numerics import gradient_like  # benchmarks/: on the path when a script runs
from ns_float8 import Float8Products
from torch import Tensor

from muonrun.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz,
    newton_schulz_flops,
    ns_iterations,
    orthogonality_residual,
    resolve_ns_coefficients,
    standard_iterations,
    uses_gram_form,
)
from muonrun.optim.ns_products import TORCH_PRODUCTS

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
STEPS = 5
# shape: seeds (one for the largest shape, whose float8 matmuls are slow on the CPU)
CASES = {(896, 4864): (0, 1), (1536, 8960): (0,), (896, 896): (0, 1), (128, 896): (0, 1)}
ULP_DRAWS = 3  # one-ulp perturbations of the input per shape, seed and coefficient set
COEFFICIENT_SETS = (("default quintic", DEFAULT_NS_COEFFICIENTS), ("polar express", "polar_express"))
SCALINGS = ("tensorwise", "rowwise")
WITHIN = 0.02  # "nearly the same distance": within 2% of k = 0


def to_float8(x: Tensor, dim: int | None) -> tuple[Tensor, Tensor]:
    """``x`` cast to e4m3 with scale ``448 / amax`` (per tensor, or amax over ``dim`` kept as a size-1
    dimension) and the inverse scale ``_scaled_mm`` takes, fp32, as torchao computes them."""
    amax = x.abs().amax() if dim is None else x.abs().amax(dim=dim, keepdim=True)
    scale = E4M3_MAX / amax.float().clamp(min=1e-12)
    x8 = (x.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return x8, scale.reciprocal()


def float8_matmul(x: Tensor, y: Tensor, rowwise: bool) -> Tensor:
    """``x @ y`` (2-D) through e4m3 with a bf16 output: tensorwise scales, or one per row of ``x`` and
    one per column of ``y``."""
    x8, x_inv = to_float8(x, dim=-1 if rowwise else None)
    y8, y_inv = to_float8(y, dim=-2 if rowwise else None)
    return torch._scaled_mm(x8, y8, scale_a=x_inv, scale_b=y_inv, out_dtype=torch.bfloat16)


def check_scaled_mm() -> float:
    """Largest difference between ``_scaled_mm`` (rowwise, fp32 output) and the fp32 matmul of the
    dequantised operands, relative to the product's largest entry: 0 when it accumulates exactly."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 320, generator=g), torch.randn(320, 64, generator=g)
    x8, x_inv = to_float8(x, dim=-1)
    y8, y_inv = to_float8(y, dim=-2)
    out = torch._scaled_mm(x8, y8, scale_a=x_inv, scale_b=y_inv, out_dtype=torch.float32)
    ref = (x8.float() * x_inv) @ (y8.float() * y_inv)
    return ((out - ref).abs().max() / ref.abs().max()).item()


def float8_iteration(X: Tensor, a: float, b: float, c: float, rowwise: bool) -> Tensor:
    """One standard iteration on a wide bf16 matrix with its three matmuls in float8."""
    A = float8_matmul(X, X.mT, rowwise)
    AA = float8_matmul(A, A, rowwise)
    B = (b * A.float() + c * AA.float()).to(torch.bfloat16)
    BX = float8_matmul(B, X, rowwise)
    return (a * X.float() + BX.float()).to(torch.bfloat16)


def mixed_newton_schulz(G: Tensor, coefficients, k: int, rowwise: bool) -> Tensor:
    """``newton_schulz(G, STEPS, coefficients)`` with its first ``k`` iterations in float8."""
    per_step, norm_scale = resolve_ns_coefficients(coefficients, STEPS)
    tall = G.shape[-2] > G.shape[-1]
    X = G.mT if tall else G  # the iteration on X^T is the same; float8_iteration is written wide
    X = X.to(torch.bfloat16)
    norm = torch.linalg.vector_norm(X) * norm_scale
    X = X / norm.clamp(min=DEFAULT_EPS)
    for a, b, c in per_step[:k]:
        X = float8_iteration(X, a, b, c, rowwise)
    X = standard_iterations(X[None], per_step[k:])[0]
    return X.mT.contiguous() if tall else X


def one_ulp(G: Tensor, seed: int) -> Tensor:
    """The bf16 input with every element moved by one bf16 ulp, up or down at random."""
    g = torch.Generator().manual_seed(seed)
    x = G.to(torch.bfloat16)
    up = torch.rand(x.shape, generator=g) < 0.5
    return torch.nextafter(x, torch.where(up, torch.inf, -torch.inf).to(torch.bfloat16))


def measure(out: Tensor, polar: Tensor, reference: Tensor | None) -> dict:
    """Orthogonality residual, extreme singular values, distance to the polar factor and to ``reference``."""
    o = out.float()
    gram = o @ o.mT if o.shape[-2] <= o.shape[-1] else o.mT @ o
    s = torch.linalg.eigvalsh(gram).clamp(min=0).sqrt()  # fp32: 1e-7 of singular values near 1
    o = o.double()
    return {
        "residual": orthogonality_residual(out).item(),
        "sv_min": s.min().item(),
        "sv_max": s.max().item(),
        "to_polar": ((o - polar).norm() / polar.norm()).item(),
        "to_ref": 0.0 if reference is None else ((o - reference).norm() / reference.norm()).item(),
    }


def compare(cases=CASES) -> tuple[list[dict], list[dict]]:
    """Every coefficient set, scaling and k on gradient-like matrices; and the one-ulp runs at k = 0."""
    rows, noise = [], []
    for (m, n), seeds in cases.items():
        for seed in seeds:
            G = gradient_like(m, n, seed)
            U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
            polar = U @ Vh
            for label, coefficients in COEFFICIENT_SETS:
                base = newton_schulz(G, STEPS, coefficients)
                if m * n <= 128 * 896 and seed == seeds[0]:  # the float8 path with k = 0 is newton_schulz
                    assert torch.equal(mixed_newton_schulz(G, coefficients, 0, False), base)
                ref = base.double()
                key = {"shape": (m, n), "seed": seed, "coefficients": label}
                rows.append({**key, "scaling": "bf16", "k": 0, **measure(base, polar, None)})
                for scaling in SCALINGS:
                    for k in range(1, STEPS + 1):
                        out = mixed_newton_schulz(G, coefficients, k, scaling == "rowwise")
                        rows.append({**key, "scaling": scaling, "k": k, **measure(out, polar, ref)})
                for draw in range(ULP_DRAWS):
                    out = newton_schulz(one_ulp(G, 1000 * seed + draw), STEPS, coefficients)
                    noise.append({**key, "draw": draw, **measure(out, polar, ref)})
    return rows, noise


def print_tables(rows: list[dict], noise: list[dict]) -> None:
    base = {(r["shape"], r["seed"], r["coefficients"]): r for r in rows if r["k"] == 0}
    for r in rows:
        r["change"] = r["to_polar"] / base[r["shape"], r["seed"], r["coefficients"]]["to_polar"] - 1
    for r in noise:
        r["change"] = r["to_polar"] / base[r["shape"], r["seed"], r["coefficients"]]["to_polar"] - 1

    print("float8 iterations first, bf16 after them; distance = |O - polar|/|polar|, change against k = 0,")
    print("|O - O0| = |O - O_bf16|/|O_bf16|; mean over seeds (sv min/max: extremes over seeds)")
    header = (
        f"{'shape':<11} {'coefficients':<16} {'scaling':<10} {'k':>1} {'residual':>8} {'sv min':>7} "
        f"{'sv max':>7} {'distance':>8} {'change':>7} {'|O - O0|':>8}"
    )
    for label, _ in COEFFICIENT_SETS:
        print("\n" + header)
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for scaling in ("bf16", *SCALINGS):
                for k in range(STEPS + 1):
                    sel = [
                        r
                        for r in rows
                        if (r["shape"], r["coefficients"], r["scaling"], r["k"]) == (shape, label, scaling, k)
                    ]
                    if not sel:
                        continue
                    print(
                        f"{shape[0]}x{shape[1]:<6} {label:<16} {scaling:<10} {k:>1} "
                        f"{np.mean([r['residual'] for r in sel]):>8.3f} {min(r['sv_min'] for r in sel):>7.3f} "
                        f"{max(r['sv_max'] for r in sel):>7.3f} {np.mean([r['to_polar'] for r in sel]):>8.4f} "
                        f"{np.mean([r['change'] for r in sel]):>+7.1%} {np.mean([r['to_ref'] for r in sel]):>8.4f}"
                    )

    print(
        f"\none-ulp input noise at k = 0 ({ULP_DRAWS} draws per shape and seed): the distance it gives, its"
    )
    print("shift against k = 0 (largest |change|), the spread between draws of one seed, and |O - O0|")
    print(
        f"{'shape':<11} {'coefficients':<16} {'k = 0':>7} {'one ulp':>7} {'shift':>7} {'spread':>7} "
        f"{'|O - O0|':>8}"
    )
    band = {}
    for shape in dict.fromkeys(r["shape"] for r in noise):
        for label, _ in COEFFICIENT_SETS:
            sel = [r for r in noise if (r["shape"], r["coefficients"]) == (shape, label)]
            band[shape, label] = max(abs(r["change"]) for r in sel)
            spread = max(
                np.ptp([r["change"] for r in sel if r["seed"] == seed]) for seed in {r["seed"] for r in sel}
            )
            dist = np.mean([base[shape, r["seed"], label]["to_polar"] for r in sel])
            print(
                f"{shape[0]}x{shape[1]:<6} {label:<16} {dist:>7.4f} {np.mean([r['to_polar'] for r in sel]):>7.4f} "
                f"{band[shape, label]:>7.1%} {spread:>7.2%} {np.mean([r['to_ref'] for r in sel]):>8.4f}"
            )

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    print(
        f"\nworst change in distance over shapes and seeds ({WITHIN:.0%} of k = 0: '*'; within the one-ulp shift: 'u')"
    )
    print(
        f"{'coefficients':<16} {'scaling':<10} "
        + " ".join(f"{'k=' + str(k):>9}" for k in range(1, STEPS + 1))
    )
    for label, _ in COEFFICIENT_SETS:
        for scaling in SCALINGS:
            cells = []
            for k in range(1, STEPS + 1):
                sel = [r for r in rows if (r["coefficients"], r["scaling"], r["k"]) == (label, scaling, k)]
                worst = max(sel, key=lambda r: abs(r["change"]))
                within = all(abs(r["change"]) <= WITHIN for r in sel)
                in_band = all(abs(r["change"]) <= band[r["shape"], label] for r in sel)
                cells.append(f"{worst['change']:>+7.1%}{'*' if within else ' '}{'u' if in_band else ' '}")
            print(f"{label:<16} {scaling:<10} " + " ".join(cells))

    def largest_k(label: str, scaling: str, shape: tuple[int, int], tolerance: float) -> int:
        """The largest k with every k' <= k within ``tolerance`` of k = 0 on every seed."""
        largest = 0
        for k in range(1, STEPS + 1):
            sel = [
                r
                for r in rows
                if (r["coefficients"], r["scaling"], r["k"], r["shape"]) == (label, scaling, k, shape)
            ]
            if any(abs(r["change"]) > tolerance for r in sel):
                break
            largest = k
        return largest

    print(f"\nlargest k within {WITHIN:.0%} of k = 0 / within the one-ulp shift, per shape (every seed)")
    print(f"{'coefficients':<16} {'scaling':<10} " + " ".join(f"{f'{m}x{n}':>10}" for m, n in shapes))
    for label, _ in COEFFICIENT_SETS:
        for scaling in SCALINGS:
            cells = [
                f"{largest_k(label, scaling, sh, WITHIN)} / {largest_k(label, scaling, sh, band[sh, label])}"
                for sh in shapes
            ]
            print(f"{label:<16} {scaling:<10} " + " ".join(f"{c:>10}" for c in cells))

    assert all(newton_schulz_flops(sh, STEPS) == STEPS * newton_schulz_flops(sh, 1) for sh in shapes)
    print(
        "\nevery iteration costs the same FLOPs, so k float8 iterations carry k/5 of them; Newton–Schulz time"
        "\nat float8 = 2x bf16 (casts not counted): "
        + ", ".join(f"k={k}: {k / STEPS:.0%} -> {1 - k / STEPS / 2:.1f}x" for k in range(1, STEPS + 1))
    )


# Muon's float8 path (muonrun.optim.ns_float8.Float8Products) on every preset matrix shape, in the
# form Muon uses for it (the Gram form where it applies) and the standard one: shape -> seeds.
PRESET_CASES = {
    (896, 896): (0, 1),
    (128, 896): (0, 1),
    (4864, 896): (0,),
    (896, 4864): (0,),
    (1536, 1536): (0,),
    (256, 1536): (0, 1),
    (8960, 1536): (0,),
    (1536, 8960): (0,),
}
PRODUCT_KS = (1, 2, 3)
MUON_WITHIN = 0.01  # the bar for Muon's setting: within 1% of all-bf16


def products_distance(G: Tensor, polar: Tensor, coefficients, gram: bool, k: int) -> float:
    """Distance to the polar factor of ``ns_iterations`` (bf16, Frobenius-normalised as Muon's owner
    does) with the first ``k`` iterations' products in float8 (``Float8Products``, emulated: the fp32
    matmul of the dequantised e4m3 operands, which is what the CPU's ``_scaled_mm`` computes)."""
    per_step, norm_scale = resolve_ns_coefficients(coefficients, STEPS)
    X = G.to(torch.bfloat16)[None]
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) * norm_scale).clamp(min=DEFAULT_EPS)
    float8 = Float8Products(matmul="emulate")
    products = (float8,) * k + (TORCH_PRODUCTS,) * (STEPS - k)
    out = ns_iterations(X, per_step, gram=gram, products=products)[0].double()
    return ((out - polar).norm() / polar.norm()).item()


def compare_products(cases=PRESET_CASES) -> list[dict]:
    """Both forms (the Gram form where it applies), both coefficient sets, k = 0 and ``PRODUCT_KS``."""
    rows = []
    for (m, n), seeds in cases.items():
        for seed in seeds:
            G = gradient_like(m, n, seed) if m <= n else gradient_like(n, m, seed).T.contiguous()
            U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
            polar = U @ Vh
            forms = ("standard", "gram") if uses_gram_form((m, n), STEPS) else ("standard",)
            for label, coefficients in COEFFICIENT_SETS:
                for form in forms:
                    for k in (0, *PRODUCT_KS):
                        d = products_distance(G, polar, coefficients, form == "gram", k)
                        rows.append(
                            {
                                "shape": (m, n),
                                "seed": seed,
                                "coefficients": label,
                                "form": form,
                                "k": k,
                                "to_polar": d,
                            }
                        )
            print(f"{m}x{n} seed {seed} done", flush=True)
    return rows


def print_products_table(rows: list[dict]) -> None:
    base = {(r["shape"], r["seed"], r["coefficients"], r["form"]): r["to_polar"] for r in rows if r["k"] == 0}
    for r in rows:
        r["change"] = r["to_polar"] / base[r["shape"], r["seed"], r["coefficients"], r["form"]] - 1
    print("\nMuon's float8 products (Float8Products: tensorwise e4m3, bf16 outputs, fp32 epilogues) in the")
    print("first k of 5 iterations; distance to the polar factor at k = 0 and its change (worst over seeds)")
    ks = "".join(f"{'k=' + str(k):>9}" for k in PRODUCT_KS)
    print(f"{'shape':<11} {'coefficients':<16} {'form':<9} {'k = 0':>7}{ks}")
    for label, _ in COEFFICIENT_SETS:
        for shape in dict.fromkeys(r["shape"] for r in rows):
            for form in ("standard", "gram"):
                sel = [r for r in rows if (r["shape"], r["coefficients"], r["form"]) == (shape, label, form)]
                if not sel:
                    continue
                d0 = np.mean([r["to_polar"] for r in sel if r["k"] == 0])
                cells = "".join(
                    f"{max((r['change'] for r in sel if r['k'] == k), key=abs):>+9.2%}" for k in PRODUCT_KS
                )
                print(f"{shape[0]}x{shape[1]:<6} {label:<16} {form:<9} {d0:>7.4f}{cells}")
    print(
        f"\nlargest k with every shape within {MUON_WITHIN:.0%} of all-bf16 (the form Muon uses: Gram where wide)"
    )
    for label, _ in COEFFICIENT_SETS:
        for form in ("standard", "gram", "muon"):
            largest = 0
            for k in PRODUCT_KS:
                sel = [
                    r
                    for r in rows
                    if r["coefficients"] == label
                    and r["k"] == k
                    and (
                        r["form"] == form
                        or (
                            form == "muon"
                            and r["form"] == ("gram" if uses_gram_form(r["shape"], STEPS) else "standard")
                        )
                    )
                ]
                if any(abs(r["change"]) > MUON_WITHIN for r in sel):
                    break
                largest = k
            print(f"{label:<16} {form:<9} k <= {largest}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--products-only", action="store_true", help="only the section on Muon's float8 products")
    args = ap.parse_args()
    start = time.perf_counter()
    print(f"rowwise torch._scaled_mm against the dequantised fp32 matmul: {check_scaled_mm():.1e} relative\n")
    if not args.products_only:
        rows, noise = compare()
        print_tables(rows, noise)
    print_products_table(compare_products())
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
