"""Newton–Schulz with float8 (e4m3) products in its early iterations (muonrun/optim/ns_float8.py): each
product against the fp32 matmul of its dequantised operands, the iterations against the polar factor,
Muon's steps against bf16's, the setting's validation and its fallback."""

from __future__ import annotations

import pytest
import torch

from muonrun.optim import Muon, ns_float8
from muonrun.optim.newton_schulz import DEFAULT_NS_COEFFICIENTS, ns_iterations
from muonrun.optim.ns_float8 import Float8Products, cast_e4m3, products_for
from muonrun.optim.ns_products import TORCH_PRODUCTS

PER_STEP = [DEFAULT_NS_COEFFICIENTS] * 5
BF16_ULP = 2.0**-8  # one bf16 rounding of a result, relative to its largest entry, with margin


def dequantised(x: torch.Tensor) -> torch.Tensor:
    """What float8 multiplies: ``x`` cast to e4m3 with its tensorwise scales and back, in fp32."""
    x8, _, inv = cast_e4m3(x, False)
    return x8.float() * inv.view(-1, 1, 1)


def gradient_like(m: int, n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Random singular vectors, singular values 1/i (benchmarks/gram_ns_numerics.py), wide or tall."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, generator=g))
    return ((U * torch.arange(1, k + 1, dtype=torch.float32) ** -1.0) @ V.T).to(device)


def check_products(device: str) -> None:
    """Every product of ``Float8Products`` (one ``_scaled_mm`` per matrix, and the emulation) is the
    fp32 matmul of the dequantised e4m3 operands, rounded once to bf16 (epilogues in fp32)."""
    g = torch.Generator().manual_seed(3)
    Y = (torch.randn(3, 32, 80, generator=g) / 16).bfloat16().to(device)
    for matmul in ("loop", "emulate"):
        ops = Float8Products(matmul=matmul, compiled=False)

        def close(got, want, roundings=1, matmul=matmul):
            assert got.dtype == torch.bfloat16 and got.is_contiguous()
            err = (got.float() - want).abs().max() / want.abs().max()
            assert err <= roundings * BF16_ULP, (matmul, err.item())

        close(ops.gram(Y, False), dequantised(Y) @ dequantised(Y).mT)
        T = Y.mT.contiguous()  # tall: Y^T Y
        close(ops.gram(T, True), dequantised(T).mT @ dequantised(T))
        A = TORCH_PRODUCTS.gram(Y, False)
        # the matmul's bf16 result, then the epilogue's sum rounded once more
        close(
            ops.poly(A, -4.775, 2.0315), -4.775 * A.float() + 2.0315 * dequantised(A) @ dequantised(A).mT, 2
        )
        P = TORCH_PRODUCTS.poly(A, 1.5, -0.5)
        close(ops.sym_mm(P, A), dequantised(P) @ dequantised(A).mT)
        B = torch.randn(3, 32, 32, generator=g).bfloat16().to(device)  # not symmetric: read as it is
        close(ops.apply(B, Y, False), dequantised(B) @ dequantised(Y))
        close(ops.apply(B, T, True), dequantised(T) @ dequantised(B).mT)
        close(ops.apply_add(B, Y, 3.4445, False), 3.4445 * Y.float() + dequantised(B) @ dequantised(Y), 2)
        out = torch.empty_like(Y)
        assert ops.apply(B, Y, False, out) is out
    odd = Y[:, :30, :70].contiguous()  # sides that are not multiples of 16: torch's product, bit for bit
    assert torch.equal(Float8Products().gram(odd, False), TORCH_PRODUCTS.gram(odd, False))
    square = odd[:, :, :30].contiguous()
    assert torch.equal(Float8Products().poly(square, 2.0, -1.0), TORCH_PRODUCTS.poly(square, 2.0, -1.0))


def test_float8_products_are_the_fp32_matmul_of_their_dequantised_operands():
    check_products("cpu")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 32, 48, generator=g)
    x[1].zero_()  # an all-zero matrix casts to zeros with a finite scale
    x8, x8t, inv = cast_e4m3(x, True)
    assert x8.dtype == torch.float8_e4m3fn and torch.isfinite(inv).all()
    assert torch.equal(x8t.view(torch.uint8), x8.mT.contiguous().view(torch.uint8))
    assert x8[0].float().abs().max() == 448 and (x8[1].float() == 0).all()
    with pytest.raises(AssertionError, match="layouts"):  # the GPU's layouts are held on the CPU too
        Float8Products()._mm(x8, inv, x8t, inv)


def distances(X: torch.Tensor, polar: torch.Tensor, gram: bool, ks=(0, 1, 2)) -> dict[int, float]:
    out = {}
    for k in ks:
        products = products_for(5, float8_steps=k)
        got = ns_iterations(X, PER_STEP, gram=gram, products=products)[0].double().cpu()
        out[k] = ((got - polar).norm() / polar.norm()).item()
    return out


def check_near_polar(device: str) -> None:
    """Float8 in the first 1 or 2 of 5 iterations stays within a few percent of all-bf16's distance to
    the exact polar factor, in both forms (measured on these matrices: +0.4% at most in the standard
    form, +4.3% in the Gram form; the bounds leave margin for the GPU's own rounding)."""
    for (m, n), seed in (((64, 192), 0), ((64, 192), 2), ((96, 96), 1), ((192, 64), 0)):
        G = gradient_like(m, n, seed)
        U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
        polar = U @ Vh
        X = G.bfloat16().to(device)[None]
        X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        for gram in (False, True):
            d = distances(X, polar, gram)
            bound = 1.08 if gram and m != n else 1.03
            assert d[1] <= bound * d[0] and d[2] <= bound * d[0], ((m, n), seed, gram, d)


def test_float8_early_iterations_stay_near_the_polar_factor_in_both_forms(monkeypatch):
    check_near_polar("cpu")


def check_muon_tracks_bf16(device: str) -> None:
    """Muon with the first 2 iterations in float8 moves the parameters as all-bf16 Muon does, within a
    small share of the movement, over a few steps (standard and Gram forms)."""
    shapes = [(64, 192), (96, 96), (192, 64), (30, 70)]  # the last one takes torch's products
    g = torch.Generator().manual_seed(7)
    init = [torch.randn(s, generator=g).to(device) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=g).to(device) for s in shapes] for _ in range(4)]
    for gram in (False, True):
        runs = {k: [p.clone() for p in init] for k in (0, 2)}
        opts = {
            k: Muon(ps, lr=0.02, weight_decay=0.1, gram=gram, ns_float8_steps=k) for k, ps in runs.items()
        }
        for step_grads in grads:
            for k, ps in runs.items():
                for p, grad in zip(ps, step_grads, strict=True):
                    p.grad = grad.clone()
                opts[k].step()
        assert all(ops[0].name == "float8" for ops in opts[2]._products.values())
        for p, q, p0 in zip(runs[2], runs[0], init, strict=True):
            moved = (q - p0).norm()
            assert (p - q).norm() <= 0.1 * moved, (gram, p.shape, ((p - q).norm() / moved).item())
        assert torch.equal(runs[2][3], runs[0][3])  # 30 x 70: torch's products, bit for bit


def test_muon_with_two_float8_iterations_tracks_bf16_muon_on_the_cpu(monkeypatch):
    monkeypatch.setattr(ns_float8, "CPU_REFERENCE", True)  # the CPU's exact (slow) _scaled_mm
    check_muon_tracks_bf16("cpu")


def test_the_gram_form_keeps_its_restart_and_later_iterations_in_bf16(monkeypatch):
    monkeypatch.setattr(ns_float8, "CPU_REFERENCE", True)
    params = [torch.randn(32, 96), torch.randn(32, 32)]  # wide: the Gram form; square: the standard one
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=0.02, gram=True, ns_float8_steps=4)
    opt.step()
    float8 = {key[1]: [o.name for o in ops] for key, ops in opt._products.items()}
    assert float8 == {2: ["float8"] * 2 + ["torch"] * 3, 4: ["float8"] * 4 + ["torch"]}


def test_without_float8_matmuls_muon_runs_bf16_and_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(ns_float8, "_said", set())
    init = [torch.randn(32, 64) for _ in range(2)]
    runs = {k: [p.clone() for p in init] for k in (0, 3)}
    for k, ps in runs.items():
        for p in ps:
            p.grad = torch.ones_like(p)
        Muon(ps, lr=0.02, ns_float8_steps=k).step()
        Muon(ps, lr=0.02, ns_float8_steps=k).step()
    assert all(torch.equal(p, q) for p, q in zip(runs[0], runs[3], strict=True))
    out = capsys.readouterr().out
    assert out.count("ns_float8_steps: cpu has no fast float8 matmuls") == 1, out


def test_products_for_puts_float8_in_the_first_iterations_only():
    assert products_for(5) is None and products_for(5, float8_steps=0) is None
    ops = products_for(5, float8_steps=2)
    assert [o.name for o in ops] == ["float8", "float8", "torch", "torch", "torch"]
    assert ops[0] is ops[1]  # one instance: an iteration's casts are shared by its products
    with pytest.raises(ValueError, match="float8_steps"):
        products_for(4, float8_steps=5)
    with pytest.raises(ValueError, match="ns_float8_steps"):
        Muon([torch.zeros(16, 16)], ns_float8_steps=-1)


def test_the_float8_setting_is_validated_built_and_named_in_the_dry_run():
    from muonrun.config import load_config
    from muonrun.config import MuonConfig
    from muonrun.errors import UserError
    from muonrun.optim.build import build_optimizers
    from muonrun.tools.plan import ns_settings

    with pytest.raises(UserError, match=r"'optimizer\.muon\.ns_float8_steps' is 6.*ns_steps \(5\)"):
        load_config("qwen2-muon-fsdp2", ["optimizer.muon.ns_float8_steps=6"])
    with pytest.raises(UserError, match="ns_float8_steps"):
        MuonConfig(ns_float8_steps=-1)
    cfg = load_config("qwen2-muon-fsdp2", ["optimizer.muon.ns_float8_steps=2"])
    assert "the first 2 in float8" in ns_settings(cfg.optimizer.muon)
    assert "float8" not in ns_settings(MuonConfig())
    from helpers import tiny_qwen2

    assert build_optimizers(tiny_qwen2(tied=True), cfg.optimizer, "cpu")[0].ns_float8_steps == 2


def test_the_cli_rejects_too_many_float8_iterations_with_exit_code_2(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "muonrun",
            "pretrain",
            "qwen2-muon-fsdp2",
            "optimizer.muon.ns_float8_steps=9",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "optimizer.muon.ns_float8_steps" in r.stderr and "Traceback" not in r.stderr


def _cuda_float8() -> bool:
    return torch.cuda.is_available() and ns_float8.has_float8_matmuls(torch.device("cuda"))


@pytest.mark.gpu
def test_on_a_gpu_float8_products_and_muon_track_bf16():
    """The same checks on a GPU with float8 matmuls: each product (one ``_scaled_mm`` per matrix; a
    stack in one ``_scaled_grouped_mm`` where this torch has it) against the dequantised fp32 matmul,
    the iterations against the polar factor, Muon against all-bf16 Muon (the casts compiled)."""
    if not _cuda_float8():
        pytest.skip("needs a GPU with float8 matmuls (compute capability 8.9+)")
    check_products("cuda")
    g = torch.Generator().manual_seed(5)
    Y = (torch.randn(4, 64, 160, generator=g) / 16).bfloat16().cuda()
    want = dequantised(Y) @ dequantised(Y).mT
    for ops in (Float8Products(matmul="auto"), Float8Products(compiled=True)):
        err = (ops.gram(Y, False).float() - want).abs().max() / want.abs().max()
        assert err <= 2 * BF16_ULP, (ops.matmul, err.item())  # compiled casts may round an element apart
    check_near_polar("cuda")
    check_muon_tracks_bf16("cuda")
