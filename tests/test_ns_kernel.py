"""optimizer.muon.ns_kernel: which evaluation Newton–Schulz's products get, the CPU fallback, the FLOPs
the upper-triangle kernel saves; on a GPU, the Triton products against torch's and Muon with them."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from muonrun.optim import Muon, ns_choice, ns_products
from muonrun.optim.newton_schulz import newton_schulz_flops
from muonrun.optim.ns_choice import products_for, resolve_ns_kernel
from muonrun.optim.ns_products import TORCH_PRODUCTS, TRITON_MIN_SIZE

ROOT = Path(__file__).resolve().parent.parent


def test_ns_kernel_triton_falls_back_to_torchs_products_where_it_cannot_run_and_says_so_once(
    capsys, monkeypatch
):
    monkeypatch.setattr(ns_choice, "_said", set())
    assert resolve_ns_kernel("triton", "cpu") == "torch" and resolve_ns_kernel("triton", "cpu") == "torch"
    assert products_for(5, "triton", "cpu") is None and products_for(5, "auto", "cpu") is None
    assert products_for(5, "torch", "cuda") is None and resolve_ns_kernel("auto", "cpu") == "torch"
    err = capsys.readouterr().err
    assert err.count("ns_kernel=triton") == 1 and "needs CUDA, not cpu" in err and "torch's matmuls" in err
    # CUDA without triton: auto quietly, triton with a message naming why
    monkeypatch.setattr(ns_choice, "_said", set())
    monkeypatch.setattr(ns_choice, "_triton_products", lambda: None)
    assert resolve_ns_kernel("auto", "cuda") == "torch" and capsys.readouterr().err == ""
    assert resolve_ns_kernel("triton", "cuda") == "torch"
    assert "triton does not import" in capsys.readouterr().err
    with pytest.raises(ValueError, match="ns_kernel"):
        resolve_ns_kernel("cublas", "cpu")


def test_ns_kernel_picks_one_products_object_per_iteration_where_triton_runs(monkeypatch):
    class Fake(ns_products.Products):
        name = "triton"

    fake = Fake()
    monkeypatch.setattr(ns_choice, "_triton_products", lambda: fake)
    assert products_for(4, "auto", "cuda") == (fake,) * 4 and products_for(3, "triton", "cuda") == (fake,) * 3
    assert (
        products_for(4, "auto", "cpu") is None
        and ns_choice.kernel_products("torch", "cuda") is TORCH_PRODUCTS
    )


def test_muon_with_ns_kernel_triton_on_a_cpu_steps_exactly_as_with_torchs_products(monkeypatch):
    """The fallback is torch's evaluation itself: bit for bit the same parameters, both forms."""
    monkeypatch.setattr(ns_choice, "_said", {"triton"})  # the message is the test above's
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 24), (24, 8), (12, 12)]
    init = [torch.randn(s, generator=g) for s in shapes]
    for gram in (False, True):
        runs = []
        for kernel in ("torch", "triton"):
            ps = [p.clone() for p in init]
            opt = Muon(ps, lr=0.05, gram=gram, ns_kernel=kernel)
            for step in range(2):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
                opt.step()
            runs.append(ps)
        assert all(torch.equal(p, q) and not torch.equal(p, p0) for p, q, p0 in zip(*runs, init, strict=True))
    with pytest.raises(ValueError, match="ns_kernel"):
        Muon([torch.zeros(2, 3)], ns_kernel="cublas")


def test_ns_kernel_is_a_documented_setting_that_defaults_to_auto():
    from muonrun.config import MuonConfig
    from muonrun.config.docs import field_docs

    assert MuonConfig().ns_kernel == "auto"
    _, _, doc = field_docs()["optimizer.muon.ns_kernel"]
    assert all(w in doc for w in ("upper triangle", "`auto`", "falls back", "once", "triton imports"))


def test_symmetric_flops_count_the_upper_triangle_of_every_symmetric_product():
    """Standard form: X X^T and A A symmetric, B X not; Gram form (5 iterations, restart before the
    third): X X^T twice and all 14 m^3 products symmetric, Q X twice not."""
    m, n, steps = 512, 2048, 5
    half = (m + 1) / (2 * m)
    standard = steps * (2 * m * m * n + half * (2 * m * m * n + 2 * m**3))
    gram = 2 * 2 * m * m * n + half * (2 * 2 * m * m * n + 14 * 2 * m**3)
    assert newton_schulz_flops((m, n), steps, symmetric=True) == standard
    assert newton_schulz_flops((n, m), steps, gram=True, symmetric=True) == gram
    assert newton_schulz_flops((m, n), steps, gram=True) == 4 * 2 * m * m * n + 14 * 2 * m**3
    small = TRITON_MIN_SIZE - 1  # below the kernel's threshold nothing is saved
    assert newton_schulz_flops((small, n), symmetric=True) == newton_schulz_flops((small, n))
    saved = 1 - newton_schulz_flops((896, 4864), gram=True, symmetric=True) / newton_schulz_flops(
        (896, 4864), gram=True
    )
    assert 0.34 < saved < 0.35


INTERPRETED = textwrap.dedent(
    """
    import torch
    from muonrun.optim import ns_triton as nt
    torch.manual_seed(0)
    worst = 0.0
    for k, m, n in [(1, 1, 1), (2, 5, 9), (3, 70, 33), (1, 97, 130)]:
        Y = torch.randn(k, m, n)
        padded = torch.randn(k, m + 3, n)[:, :m]  # a batch stride that is not m * n
        for Z in (Y, Y.mT, padded):
            got = nt.sym_gram(Z)
            assert torch.equal(got, got.mT) and got.is_contiguous()
            worst = max(worst, ((got - Z @ Z.mT).abs().max() / (Z @ Z.mT).abs().max()).item())
        A = nt.sym_gram(Y) / n
        P, Q = 0.3 * A + A @ A, 2.0 * A - A @ A
        for got, ref in ((nt.sym_poly(A, 0.7, -1.3), 0.7 * A - 1.3 * A @ A), (nt.sym_matmul(P, Q), P @ Q)):
            assert torch.equal(got, got.mT)
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    assert worst < 1e-5, worst
    print("ok", worst)
    """
)


def test_triton_kernels_compute_upper_tiles_and_mirror_them_exactly_under_the_interpreter():
    """The kernels' tiling, triangle masks, strides and epilogue on the CPU (triton's interpreter, fp32
    operands, uneven 32 x 64 tiles): exactly symmetric results equal to torch's. Needs triton."""
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


# --- GPU ---------------------------------------------------------------------------------------------

GPU_SHAPES = [
    (1, 1, 7),
    (3, 1, 300),
    (2, 77, 131),
    (1, 129, 129),
    (5, 200, 333),
    (2, 257, 600),
    (1, 300, 301),
]


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


@pytest.mark.gpu
def test_triton_products_equal_torchs_within_bf16_rounding_on_odd_sizes():
    """Each symmetric product on sizes that are not multiples of a tile (m = 1, k > 1, tall and wide,
    a strided stack): within 2^-7 of the largest entry (bf16 rounds to 2^-8 relative), exactly
    symmetric, contiguous bf16; fp32 and CPU stacks are torch's own."""
    pytest.importorskip("triton")
    from muonrun.optim.ns_triton import TritonProducts

    ops, ref = TritonProducts(min_size=1), TORCH_PRODUCTS
    g = torch.Generator(device="cuda").manual_seed(0)
    bound = 2.0**-7
    for k, m, n in GPU_SHAPES:
        Y = (torch.randn(k, m, n, device="cuda", generator=g) / n**0.5).bfloat16()
        for X, tall in ((Y, False), (Y.mT.contiguous(), True), (Y.mT, True)):
            got = ops.gram(X, tall)
            assert got.shape == (k, m, m) and got.dtype == torch.bfloat16 and got.is_contiguous()
            assert torch.equal(got, got.mT) and _rel(got, ref.gram(X, tall)) <= bound, (k, m, n, tall)
        padded = torch.randn(k, m + 5, n, device="cuda", generator=g).bfloat16()[:, :m]
        assert _rel(ops.gram(padded, False), ref.gram(padded, False)) <= bound
        A = ref.gram(Y, False)
        b, c = -4.775, 2.0315
        got = ops.poly(A, b, c)
        assert torch.equal(got, got.mT) and _rel(got, ref.poly(A, b, c)) <= bound, (k, m, n)
        P, Q = ref.poly(A, 1.0, 0.5), ref.poly(A, -0.5, 1.0)
        P.diagonal(dim1=-2, dim2=-1).add_(3.0)
        got = ops.sym_mm(P, Q)
        assert torch.equal(got, got.mT) and _rel(got, ref.sym_mm(P, Q)) <= bound, (k, m, n)
    Yf = torch.randn(2, 300, 400, device="cuda")
    assert torch.equal(ops.gram(Yf, False), ref.gram(Yf, False))  # fp32: torch's
    assert torch.equal(TritonProducts().gram(Y.cpu(), False), ref.gram(Y.cpu(), False))


@pytest.mark.gpu
def test_muon_with_the_triton_kernel_stays_as_close_to_torchs_as_bf16_is_to_fp32():
    """Five steps on matrices the kernel takes (side >= 256) and one it leaves to torch, both forms:
    per parameter, ns_kernel=triton differs from torch's bf16 products by at most twice what torch's
    bf16 Newton–Schulz differs from its fp32 one (both are rounding), and by at most 5% of the
    movement anywhere."""
    pytest.importorskip("triton")
    shapes = [(288, 544), (544, 288), (320, 320), (64, 160)]
    g = torch.Generator(device="cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=g) * 0.02 for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g) for s in shapes] for _ in range(5)]
    for gram in (False, True):
        runs = {}
        for label, kw in (
            ("torch", {}),
            ("triton", {"ns_kernel": "triton"}),
            ("fp32", {"ns_dtype": torch.float32}),
        ):
            ps = [p.clone() for p in init]
            opt = Muon(ps, lr=0.02, gram=gram, **kw)
            for step_grads in grads:
                for p, grad in zip(ps, step_grads, strict=True):
                    p.grad = grad
                opt.step()
            runs[label] = ps
        for i, p0 in enumerate(init):
            torch_, triton_, fp32 = runs["torch"][i], runs["triton"][i], runs["fp32"][i]
            moved = (torch_ - p0).abs().max().item()
            rounding = (torch_ - fp32).norm().item()
            diff = (triton_ - torch_).norm().item()
            assert torch.isfinite(triton_).all() and moved > 0
            assert diff <= 2 * rounding + 1e-6, (shapes[i], gram, diff, rounding)
            assert (triton_ - torch_).abs().max().item() <= 0.05 * moved, (shapes[i], gram)
            if min(shapes[i]) < TRITON_MIN_SIZE:  # left to torch: the same bits
                assert torch.equal(triton_, torch_), (shapes[i], gram)
