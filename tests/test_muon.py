"""Muon: single-device equivalence with torch.optim.Muon, pure functions, and (slow) the distributed
all-to-all path on 1-4 gloo ranks (tests/dist/muon_worker.py)."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch
from helpers import run_workers, tiny_qwen2

from muonrun.optim import (
    DEFAULT_NS_COEFFICIENTS,
    Muon,
    NewtonSchulz,
    adjust_lr,
    newton_schulz,
    newton_schulz_flops,
)
from muonrun.optim.newton_schulz import normuon_row_scale, per_step_coefficients
from muonrun.optim.ns_products import TORCH_PRODUCTS, Products

torch_muon = pytest.importorskip("torch.optim._muon")
TorchMuon = torch.optim.Muon

# wide, tall, square, repeated (batched Newton–Schulz), a row vector and a column vector
SHAPES = [(16, 32), (48, 12), (24, 24), (16, 32), (16, 32), (7, 5), (1, 9), (9, 1)]
LR = 0.05
RTOL = 0.02  # of how far the reference moved: bf16 Newton–Schulz rounding may differ by one ulp
RTOL_FP32 = 1e-5  # fp32 Newton–Schulz: the same sums in other orders
# A per-iteration table (Polar Express's, arXiv:2505.16932, its 1.02 norm folded into the first row): what a
# study passes as its own coefficients
PER_ITERATION = (
    (7.996622083237707, -21.18541479543062, 14.732637283929022),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def set_grads(params_lists, step, shapes=SHAPES):
    g = torch.Generator().manual_seed(100 + step)
    for s, *ps in zip(shapes, *params_lists, strict=True):
        grad = torch.randn(s, generator=g)
        for p in ps:
            p.grad = grad.clone()


def assert_matches(ours, ref, init, rtol=RTOL):
    for p, q, q0 in zip(ours, ref, init, strict=True):
        diff = (p - q).abs().max().item()
        moved = (q - q0).abs().max().item()
        assert moved > 0
        assert diff <= rtol * moved + 1e-7, (tuple(p.shape), diff, moved)


def torch_sequence(G, dtype, ns_coefficients=DEFAULT_NS_COEFFICIENTS, ns_steps=5, eps=1e-7):
    """torch.optim.Muon's ``_zeropower_via_newtonschulz``, line for line, with its cast to bf16 made a
    cast to ``dtype`` (bitwise torch's own in bf16: test_fp32_newton_schulz_is_torchs_sequence_in_fp32)."""
    a, b, c = ns_coefficients
    X = G.to(dtype, copy=True)  # torch.optim.Muon passes its momentum buffer itself without Nesterov
    if G.size(0) > G.size(1):
        X = X.T
    X.div_(X.norm().clamp(min=eps))
    for _ in range(ns_steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if G.size(0) > G.size(1) else X


@pytest.fixture
def torch_muon_in_fp32(monkeypatch):
    """torch.optim.Muon with its Newton–Schulz run in fp32 instead of bf16."""
    monkeypatch.setattr(
        torch_muon,
        "_zeropower_via_newtonschulz",
        lambda grad, coefficients, steps, eps: torch_sequence(grad, torch.float32, coefficients, steps, eps),
    )


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "adjust_lr_fn,nesterov,weight_decay",
    list(itertools.product([None, "original", "match_rms_adamw"], [True, False], [0.0, 0.1])),
)
def test_matches_torch_muon(adjust_lr_fn, nesterov, weight_decay, ns_dtype, request):
    """bf16: torch.optim.Muon itself; fp32 (the CPU path): torch.optim.Muon with its Newton–Schulz cast
    to fp32 instead of bf16, to fp32 rounding."""
    if ns_dtype == torch.float32:
        request.getfixturevalue("torch_muon_in_fp32")
    init = make_params()
    ours = [p.clone() for p in init]
    ref = [p.clone() for p in init]
    kw = dict(lr=LR, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt, ref_opt = Muon(ours, **kw, ns_dtype=ns_dtype), TorchMuon(ref, **kw)
    for step in range(10):
        set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
        if step in (0, 9):
            assert_matches(ours, ref, init, RTOL if ns_dtype == torch.bfloat16 else RTOL_FP32)
    assert opt.stats["orthogonalized"] == 10 * len(SHAPES)
    assert opt.stats["all_to_all"] == 0


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [(None, True), ("match_rms_adamw", False)])
def test_folded_ns_close_to_torch(adjust_lr_fn, nesterov):
    """A study's own iteration, passed as ``newton_schulz`` (the folded (B + aI) X evaluation), is what
    Muon steps with: it differs from torch's a X + B X only by bf16 rounding."""
    from tests.dist.muon_worker import FoldedNewtonSchulz

    init = make_params(2)
    ours, ref = [p.clone() for p in init], [p.clone() for p in init]
    kw = dict(lr=LR, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt, ref_opt = Muon(ours, **kw, newton_schulz=FoldedNewtonSchulz()), TorchMuon(ref, **kw)
    for step in range(10):
        set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
    for p, q, q0 in zip(ours, ref, init, strict=True):
        assert (p - q).abs().max() <= 0.1 * (q - q0).abs().max(), tuple(p.shape)


def test_defaults_match_torch():
    import inspect

    ours = inspect.signature(Muon.__init__).parameters
    theirs = inspect.signature(TorchMuon.__init__).parameters
    for name in (
        "lr",
        "weight_decay",
        "momentum",
        "nesterov",
        "ns_coefficients",
        "eps",
        "ns_steps",
        "adjust_lr_fn",
    ):
        assert ours[name].default == theirs[name].default, name
    # torch's exact bf16 sequence, with no switch to leave it (the folded form is newton_schulz's option)
    assert "torch_compatible_ns" not in ours and "process_group" not in ours
    G = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(10))
    wide, tall = G[0], G[1].T
    for M, steps in ((wide, 5), (tall, 1)):
        assert torch.equal(
            newton_schulz(M, steps),
            torch_muon._zeropower_via_newtonschulz(M, DEFAULT_NS_COEFFICIENTS, steps, 1e-7),
        )
    # A tall matrix is iterated untransposed (X B^T where torch transposes X): bit for bit on some CPUs,
    # on others (AVX2) the transposed operands' bf16 products round apart from the second iteration.
    ref = torch_muon._zeropower_via_newtonschulz(tall, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    torch.testing.assert_close(newton_schulz(tall), ref, rtol=0, atol=RTOL * ref.abs().max().item())


def test_fp32_newton_schulz_is_torchs_sequence_in_fp32():
    """``dtype=torch.float32`` runs torch's iteration in fp32 (the reference cast to bf16 is torch's,
    bit for bit), batched, without transposing tall matrices: equal to fp32 rounding."""
    g = torch.Generator().manual_seed(11)
    for shape in [(16, 32), (48, 12), (24, 24)]:
        G = torch.randn(3, *shape, generator=g)
        ours = newton_schulz(G, dtype=torch.float32)
        assert ours.dtype == torch.float32
        for i in range(3):
            assert torch.equal(
                torch_sequence(G[i], torch.bfloat16),
                torch_muon._zeropower_via_newtonschulz(G[i], DEFAULT_NS_COEFFICIENTS, 5, 1e-7),
            )
            torch.testing.assert_close(ours[i], torch_sequence(G[i], torch.float32), rtol=1e-5, atol=1e-6)


def test_ns_dtype_is_bf16_on_gpus_and_fp32_on_cpus_without_native_bf16(monkeypatch):
    from muonrun.optim.newton_schulz import ns_dtype_for

    assert ns_dtype_for("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert ns_dtype_for("cpu") == torch.float32
    assert Muon([torch.zeros(2, 3)]).ns_dtype == torch.float32  # Muon's own default: its parameters' device
    assert Muon([torch.zeros(2, 3)], ns_dtype=torch.bfloat16).ns_dtype == torch.bfloat16
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert ns_dtype_for("cpu") == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert ns_dtype_for("cpu") == torch.float32
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([torch.zeros(2, 3)], ns_dtype=torch.float16)


def spectral_reference(init, steps, lr, weight_decay, momentum, nesterov):
    """Hand-written Muon with lr * sqrt(A/B), using torch's own Newton–Schulz."""
    params = [p.clone() for p in init]
    bufs = [torch.zeros_like(p) for p in params]
    for step in range(steps):
        set_grads([params], step)
        for p, b in zip(params, bufs, strict=True):
            b.mul_(momentum).add_(p.grad, alpha=1 - momentum)
            u = p.grad + momentum * (b - p.grad) if nesterov else b
            o = torch_muon._zeropower_via_newtonschulz(u, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
            p.mul_(1 - lr * weight_decay)
            p.add_(o.float(), alpha=-lr * math.sqrt(p.shape[0] / p.shape[1]))
    return params


@pytest.mark.parametrize("nesterov,weight_decay", [(True, 0.1), (False, 0.0)])
def test_spectral_against_hand_formula(nesterov, weight_decay):
    init = make_params(1)
    ours = [p.clone() for p in init]
    opt = Muon(
        ours,
        lr=LR,
        weight_decay=weight_decay,
        nesterov=nesterov,
        adjust_lr_fn="spectral",
    )
    for step in range(10):
        set_grads([ours], step)
        opt.step()
    ref = spectral_reference(init, 10, LR, weight_decay, 0.95, nesterov)
    assert_matches(ours, ref, init)


def test_adjust_lr_matches_torch():
    for shape in [(16, 32), (48, 12), (24, 24), (1, 9)]:
        for fn in (None, "original", "match_rms_adamw"):
            assert adjust_lr(0.02, fn, shape) == torch_muon._adjust_lr(0.02, fn, torch.Size(shape))
    assert adjust_lr(0.02, None, (48, 12)) == pytest.approx(0.02 * 2)
    assert adjust_lr(0.02, None, (12, 48)) == pytest.approx(0.02)
    assert adjust_lr(0.02, "match_rms_adamw", (12, 48)) == pytest.approx(0.02 * 0.2 * math.sqrt(48))
    assert adjust_lr(0.02, "spectral", (12, 48)) == pytest.approx(0.02 * 0.5)
    with pytest.raises(ValueError):
        adjust_lr(0.02, "bogus", (2, 2))


def test_newton_schulz_batched_equals_torch():
    g = torch.Generator().manual_seed(3)
    for shape in [(16, 32), (48, 12), (24, 24)]:
        G = torch.randn(4, *shape, generator=g)
        batched = newton_schulz(G)
        assert batched.dtype == torch.bfloat16 and batched.shape == G.shape
        for i in range(4):
            ref = torch_muon._zeropower_via_newtonschulz(G[i], DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
            torch.testing.assert_close(batched[i], ref, atol=1e-2, rtol=1e-2)
        # 2-D input and extra batch dims
        torch.testing.assert_close(newton_schulz(G[0]), batched[0], atol=1e-2, rtol=1e-2)
        assert newton_schulz(G.view(2, 2, *shape)).shape == (2, 2, *shape)
    assert torch.count_nonzero(newton_schulz(torch.zeros(3, 5))) == 0  # eps guards the zero matrix


def test_newton_schulz_orthogonalizes_and_takes_a_table_per_iteration():
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    s_default = torch.linalg.svdvals(newton_schulz(G).float())
    s_table = torch.linalg.svdvals(newton_schulz(G, 5, PER_ITERATION).float())
    assert s_default.min() > 0.5 and s_default.max() < 1.3
    assert (s_table - 1).abs().max() < (s_default - 1).abs().max()  # a table fitted per iteration: tighter
    per_step = per_step_coefficients(PER_ITERATION, 7)
    assert per_step[:5] == PER_ITERATION and per_step[6] == PER_ITERATION[-1]
    assert per_step_coefficients((1.0, 2.0, 3.0), 2) == ((1.0, 2.0, 3.0), (1.0, 2.0, 3.0))
    with pytest.raises(ValueError):
        per_step_coefficients([(1.0, 2.0)], 5)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (2, 7, 3), (2, 7), (3, 7)])
@pytest.mark.parametrize("steps, gram", [(3, False), (3, True), (5, True), (1, True), (2, True)])
def test_newton_schulz_flops_counts_what_runs(shape, steps, gram):
    """The closed form behind the dry-run plan's Muon estimate and the owners' balance equals the matmul
    FLOPs torch counts: the standard form, the Gram form restarting from X (3 x 7, 2.3 times wider than
    tall) and with its split restart (2 x 7)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        newton_schulz(torch.randn(shape), steps=steps, gram=gram)
    flops = newton_schulz_flops(shape, steps, gram)
    assert counter.get_total_flops() == math.prod(shape[:-2]) * flops
    assert newton_schulz_flops((3, 5), 5) == 5 * (4 * 9 * 5 + 2 * 27)  # by hand
    # the split restart (2 x 7) costs 10 m^3 where the restart from X costs Q X and its Gram matrix, 4 m^2 n
    from muonrun.optim.newton_schulz import gram_iterations

    with FlopCounterMode(display=False) as from_x:
        gram_iterations(torch.randn(1, 2, 7), [DEFAULT_NS_COEFFICIENTS] * 5)
    assert newton_schulz_flops((2, 7), 5, True) == from_x.get_total_flops() - 4 * 4 * 7 + 10 * 8
    # symmetric: the products with a symmetric result (all but ``apply``) at half, as counted while they run
    symmetric = SymmetricFlops()
    X = torch.randn(shape).reshape(-1, *shape[-2:])
    with FlopCounterMode(display=False) as whole:
        NewtonSchulz((DEFAULT_NS_COEFFICIENTS,) * steps, gram=gram, products=symmetric).iterate(
            X / X.norm(dim=(-2, -1), keepdim=True)
        )
    assert whole.get_total_flops() - symmetric.flops // 2 == X.shape[0] * newton_schulz_flops(
        shape, steps, gram, symmetric=True
    )


class SymmetricFlops(Products):
    """torch's products, counting the FLOPs of those whose result is symmetric."""

    flops = 0

    def _counted(self, fn, *args):
        from torch.utils.flop_counter import FlopCounterMode

        with FlopCounterMode(display=False) as counter:
            out = fn(*args)
        self.flops += counter.get_total_flops()
        return out

    def gram(self, Y, tall):
        return self._counted(super().gram, Y, tall)

    def poly(self, A, b, c):
        return self._counted(super().poly, A, b, c)

    def sym_mm(self, P, Q):
        return self._counted(super().sym_mm, P, Q)

    def gram_fp32(self, Y, tall):
        return self._counted(super().gram_fp32, Y, tall)

    def split_times(self, S_hi, S_lo, Q):
        return self._counted(super().split_times, S_hi, S_lo, Q)


def test_symmetric_products_are_counted_at_half_only_where_quack_takes_them():
    """quack's products halve the symmetric results of matrices from SYMMETRIC_MIN_SIZE on their smaller
    side (``QuackProducts.halves``, read without importing quack); the iteration counts its FLOPs so."""
    from types import SimpleNamespace

    from muonrun.optim.ns_products import SYMMETRIC_MIN_SIZE
    from muonrun.optim.ns_quack import QuackProducts

    class LikeQuack(Products):
        def halves(self, shape):
            return QuackProducts.halves(SimpleNamespace(min_size=SYMMETRIC_MIN_SIZE), shape)

    ns = NewtonSchulz(gram=True, products=LikeQuack())
    for shape in [(128, 896), (896, 4864), (SYMMETRIC_MIN_SIZE, SYMMETRIC_MIN_SIZE)]:
        takes = min(shape) >= SYMMETRIC_MIN_SIZE
        assert ns.flops(shape) == newton_schulz_flops(shape, 5, True, symmetric=takes)
        assert (ns.flops(shape) < newton_schulz_flops(shape, 5, True)) == takes


def test_muon_balances_owners_on_the_flops_its_iteration_runs():
    """Muon's owner costs are its iteration's ``flops`` (what the dry run counts): halved symmetric
    products where its products halve them, whole otherwise, the Gram form's where it is on."""
    from muonrun.optim.ns_products import SYMMETRIC_MIN_SIZE
    from muonrun.optim.sharding import owner_flops

    class Halving(Products):
        def halves(self, shape):
            return min(shape) >= SYMMETRIC_MIN_SIZE

    shapes = [
        (128, 896),
        (SYMMETRIC_MIN_SIZE, 2 * SYMMETRIC_MIN_SIZE),
        (SYMMETRIC_MIN_SIZE, SYMMETRIC_MIN_SIZE),
    ]
    for ns, symmetric in [
        (NewtonSchulz(gram=True), False),
        (NewtonSchulz(gram=True, products=Halving()), True),
    ]:
        params = [torch.zeros(shape, requires_grad=True) for shape in shapes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = Muon(params, lr=LR, newton_schulz=ns)
        opt.step()
        costs = {(it.rows, it.cols): it.cost for part in opt.plan for b in part.buckets for it in b.items}
        assert costs == {s: owner_flops([s], 1, ns.flops)[0] for s in shapes}
        whole = {s: newton_schulz_flops(s, 5, True) for s in shapes}
        assert [costs[s] < whole[s] for s in shapes] == [False, symmetric, symmetric]
    with pytest.raises(ValueError, match="not both"):
        Muon(params, gram=True, newton_schulz=NewtonSchulz())


def test_gram_newton_schulz_is_cheaper_only_where_it_is_used():
    mlp, square = (1536, 8960), (1536, 1536)  # Qwen2-1.5B's MLP and attention matrices
    # with its split restart (restarting from X it would be 0.59)
    assert newton_schulz_flops(mlp, 5, gram=True) / newton_schulz_flops(mlp, 5) == pytest.approx(
        0.48, abs=0.01
    )
    assert newton_schulz_flops(square, 5, gram=True) == newton_schulz_flops(square, 5)
    G = torch.randn(2, 24, 24)
    assert torch.equal(newton_schulz(G, gram=True), newton_schulz(G))  # square: the standard form


@pytest.mark.parametrize("coefficients", [DEFAULT_NS_COEFFICIENTS, PER_ITERATION])
def test_gram_newton_schulz_is_the_standard_iteration_in_exact_arithmetic(coefficients):
    """In float64 the Gram form (with its restart) and the standard iteration agree to rounding."""
    from muonrun.optim.newton_schulz import gram_iterations, standard_iterations

    g = torch.Generator().manual_seed(4)
    for steps in (1, 2, 3, 5, 7):
        per_step = per_step_coefficients(coefficients, steps)
        for shape in [(3, 6, 16), (2, 20, 4), (1, 1, 9)]:  # wide, tall, a row vector
            X = torch.randn(*shape, generator=g, dtype=torch.float64)
            X = X / X.norm(dim=(-2, -1), keepdim=True)
            standard = standard_iterations(X, per_step)
            gram = gram_iterations(X, per_step)
            assert (gram - standard).abs().max() < 1e-12, (steps, shape)
            if min(shape[1:]) > 1:  # the iteration did move X (a unit row vector is already orthogonal)
                assert (standard - X).norm() > 0.1 * X.norm(), (steps, shape)


def test_gram_newton_schulz_in_bf16_is_as_close_to_the_polar_factor():
    """Gradient-like matrices (power-law spectrum) with the 1.5B MLP's aspect ratio, in bf16."""
    g = torch.Generator().manual_seed(5)
    m, n = 96, 560
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    G = (U * torch.arange(1, m + 1) ** -1.0) @ V.T
    u, _, vh = torch.linalg.svd(G, full_matrices=False)
    polar = u @ vh
    for coefficients in (DEFAULT_NS_COEFFICIENTS, PER_ITERATION):
        for M in (G, G.T):
            standard = newton_schulz(M, coefficients=coefficients).float()
            gram = newton_schulz(M, coefficients=coefficients, gram=True).float()
            target = polar if M is G else polar.T
            err_standard = (standard - target).norm() / target.norm()
            err_gram = (gram - target).norm() / target.norm()
            assert err_gram < 1.15 * err_standard + 0.01, (coefficients, err_gram, err_standard)
            s = torch.linalg.svdvals(gram)
            assert s.min() > 0.6 and s.max() < 1.4, (coefficients, s.min(), s.max())


def test_the_split_restart_is_the_gram_form_to_rounding_and_needs_its_low_half():
    """The split restart: the restart's Gram matrix as ``Q R0 Q^T`` from the first one kept in fp32
    (``[hi | lo]``). In fp64 it is the Gram form to rounding; in bf16 it is as close to the polar
    factor as the restart from X, and Muon with it steps within the Gram form's bound of
    torch.optim.Muon. With the low half dropped (``R0`` in bf16) it lands far from the polar factor:
    the precision is what makes it work. The Gram form takes it where it is cheaper."""
    from muonrun.optim.newton_schulz import gram_iterations, uses_split_restart

    assert uses_split_restart((896, 4864), 5) and uses_split_restart((4864, 896), 5)
    assert not uses_split_restart((896, 2000), 5) and not uses_split_restart((896, 4864), 2)
    assert not uses_split_restart((1536, 1536), 5)
    g = torch.Generator().manual_seed(6)
    for steps in (3, 5, 7):
        per_step = per_step_coefficients(DEFAULT_NS_COEFFICIENTS, steps)
        for shape in [(3, 6, 24), (2, 30, 5)]:
            X = torch.randn(*shape, generator=g, dtype=torch.float64)
            X = X / X.norm(dim=(-2, -1), keepdim=True)
            split = gram_iterations(X, per_step, split_restart=True)
            assert (split - gram_iterations(X, per_step)).abs().max() < 1e-12, (steps, shape)

    class HighHalfOnly(Products):  # R0 rounded to bf16: its low half zero
        def regram(self, Q, R0):
            m = R0.shape[-1] // 2
            return super().regram(Q, torch.cat([R0[..., :m], torch.zeros_like(R0[..., m:])], -1))

    m, n = 96, 560
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, m, generator=g))
    G = (U * torch.arange(1, m + 1) ** -1.0) @ V.T
    u, _, vh = torch.linalg.svd(G, full_matrices=False)
    per_step = per_step_coefficients(DEFAULT_NS_COEFFICIENTS, 5)
    X = (G / torch.linalg.vector_norm(G)).bfloat16()[None]

    def distance(**kw) -> float:
        out = gram_iterations(X, per_step, **kw)[0].float()
        return ((out - u @ vh).norm() / (u @ vh).norm()).item()

    from_x, split = distance(), distance(split_restart=True)
    assert abs(split / from_x - 1) < 0.03, (split, from_x)  # one ulp of input noise moves it 2-7%
    assert distance(split_restart=True, products=HighHalfOnly()) > 2 * from_x
    init = [p.requires_grad_() for p in make_params(23, [(32, 128), (128, 32)])]
    shapes = [tuple(p.shape) for p in init]

    class FromX(NewtonSchulz):  # the Gram form restarting from X everywhere
        def iterate(self, X, fold_eps=None, out=None):
            return gram_iterations(X, self.coefficients, fold_eps=fold_eps, out=out)

    def stepped(make) -> list[torch.Tensor]:
        params = [p.detach().clone().requires_grad_() for p in init]
        opt = make(params)
        for step in range(3):
            set_grads([params], step, shapes)
            opt.step()
        return params

    def off(ours, ref) -> list[float]:  # of how far torch's moved
        pairs = zip(ours, ref, init, strict=True)
        return [((p - q).abs().max() / (q - q0).abs().max()).item() for p, q, q0 in pairs]

    torchs = stepped(lambda ps: torch.optim.Muon(ps, lr=LR))
    from_x = stepped(lambda ps: Muon(ps, lr=LR, newton_schulz=FromX(gram=True), ns_dtype=torch.bfloat16))
    split = stepped(lambda ps: Muon(ps, lr=LR, gram=True, ns_dtype=torch.bfloat16))
    assert not any(torch.equal(a, b) for a, b in zip(split, from_x, strict=True))  # it ran
    # the Gram form is 2-4% of a step from torch's on these small matrices; the split restart too
    for ours, gram_form in zip(off(split, torchs), off(from_x, torchs), strict=True):
        assert 0 < ours < 1.25 * gram_form + 0.005, (ours, gram_form)


@pytest.mark.parametrize("variant", ["muon", "normuon"])
@pytest.mark.parametrize("gram", [False, True])
def test_eager_changes_nothing_on_a_cpu(gram, variant, capsys):
    """On a CPU the passes run as eager foreach ops and no graph is made, so ``eager=True`` steps bit for
    bit as the default (and so torch.optim.Muon's, within bf16 rounding, without the Gram form), and
    nothing is said about compiling."""
    init = make_params(16)
    runs = {name: [p.clone() for p in init] for name in ("eager", "default", "torch")}
    kw = dict(lr=LR, weight_decay=0.1, nesterov=True)
    opts = {
        "eager": Muon(runs["eager"], **kw, eager=True, gram=gram, variant=variant, ns_dtype=torch.bfloat16),
        "default": Muon(runs["default"], **kw, gram=gram, variant=variant, ns_dtype=torch.bfloat16),
        "torch": TorchMuon(runs["torch"], **kw),
    }
    for step in range(10):
        set_grads(list(runs.values()), step)
        for opt in opts.values():
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(runs["eager"], runs["default"], strict=True))
    if not gram and variant == "muon":
        assert_matches(runs["default"], runs["torch"], init)
    assert not opts["default"]._passes.compiled and opts["default"]._graph is None
    assert "compile" not in capsys.readouterr().out


def test_fused_passes_trace_to_one_graph_per_bucket_and_match_the_eager_ops():
    """The compiled form of the passes (a backend that runs dynamo's graph as it is) gives what the
    eager foreach ops give, with one graph per pass and bucket (the owner's passes: per stack
    layout, fewer than the stacks): an lr that changes every step (a schedule) compiles nothing new."""
    init = make_params(17)
    for variant in ("muon", "normuon"):
        compiled = []

        def backend(gm, example_inputs, compiled=compiled):
            compiled.append(gm)
            return gm.forward

        eager, traced = [p.clone() for p in init], [p.clone() for p in init]
        kw = dict(lr=LR, weight_decay=0.1, variant=variant)
        opts = [Muon(eager, **kw), Muon(traced, **kw, bucket_numel=700)]
        opts[1].compile_backend = backend
        graphs = []
        for step in range(4):
            set_grads([eager, traced], step)
            for opt in opts:
                for group in opt.param_groups:
                    group["lr"] = LR * (step + 1) / 4
                opt.step()
            graphs.append(len(compiled))
        buckets = opts[1].plan[0].buckets
        assert opts[1]._passes.compiled and len(buckets) > 1
        # the owner's normalisation compiles once per stack layout, shared by buckets: NorMuon's
        # too, whose rows' state sits between its matrices (its row factors ride in the update pass)
        keys = list(opts[1]._passes._fns)
        layouts = [key for key in keys if key[0] == "normalize"]
        stacks = sum(len(b.owned) for b in buckets)
        assert 0 < len(layouts) < stacks, (layouts, stacks)
        assert {key[0] for key in keys} == {"momentum", "update", "normalize"}, keys
        expected = 2 * len(buckets) + len(layouts)
        assert graphs == [expected] * 4, (graphs, len(buckets), len(layouts))
        for p, q, q0 in zip(traced, eager, init, strict=True):
            assert (p - q).abs().max() <= 1e-5 * (q - q0).abs().max(), (variant, tuple(p.shape))


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_a_norm_folded_into_the_gram_form_steps_as_the_pass_that_divides_by_it(variant):
    """A Gram-form stack held in place (one rank; stacked experts) takes its Frobenius norm from the trace
    of its first Gram product (two m x m products scaled) and never goes through the dividing pass; the
    standard form's stacks still do. Dense matrices (wide, tall, square) and a stack of experts step
    within bf16 rounding of an iteration that divides first (``folds_norm`` off), eager and traced."""
    shapes = [(16, 48), (40, 8), (24, 24), (16, 48)]
    init = make_params(21, shapes) + [torch.randn(3, 32, 48, generator=torch.Generator().manual_seed(22))]

    class DividesFirst(NewtonSchulz):
        def folds_norm(self, shape):
            return False

    class Counted(Products):  # torch's, counting where a folded scale is applied
        def scale(self, T, f):
            seen.append(("scale", tuple(T.shape)))
            return super().scale(T, f)

    runs, calls = {}, {}
    for name in ("pass", "folded", "traced"):
        ps = [p.clone() for p in init]
        seen = calls[name] = []
        ns = (DividesFirst if name == "pass" else NewtonSchulz)(gram=True, products=Counted())
        opt = Muon(
            [{"params": ps[:-1]}, {"params": ps[-1:], "matrices_per_expert": 2}],
            lr=LR,
            weight_decay=0.1,
            variant=variant,
            newton_schulz=ns,
            ns_dtype=torch.bfloat16,
        )
        if name == "traced":
            opt.compile_backend = lambda gm, example_inputs: gm.forward
        for step in range(5):
            g = torch.Generator().manual_seed(300 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            if step == 0:  # the first step chose the passes: count what the others call
                original = opt._passes.normalize

                def counted(*args, original=original, seen=seen):
                    seen.append(("normalize", tuple(args[0].shape)))
                    return original(*args)

                opt._passes.normalize = counted
                del seen[:]
        runs[name] = ps
    # per step: the dividing pass over each stack (two wide matrices, tall, square, six expert matrices)
    assert [(name, shape[0]) for name, shape in calls["pass"]] == 4 * [("normalize", k) for k in (2, 1, 1, 6)]
    # folded: each Gram-form stack's R and Q scaled, m x m (the tall one on its wide orientation);
    # the square stack (standard form) still divided, its slab holding NorMuon's rows' state
    square = ("normalize", (1, 24 * 24 + 24 * 4 * (variant == "normuon")))
    one_step = (
        [("scale", (2, 16, 16))] * 2 + [("scale", (1, 8, 8))] * 2 + [square] + [("scale", (6, 16, 16))] * 2
    )
    assert calls["folded"] == calls["traced"] == 4 * one_step
    assert_matches(runs["folded"], runs["pass"], init)
    assert not all(torch.equal(p, q) for p, q in zip(runs["folded"], runs["pass"], strict=True))
    assert_matches(runs["traced"], runs["folded"], init, rtol=1e-5)


def test_a_norm_folded_into_the_first_product_is_the_normalised_iteration():
    """In float64, Newton–Schulz with the input's norm read off the trace of its first Gram product
    equals dividing first, then iterating: standard and Gram forms, wide and tall, 0 to 5 iterations, and
    written into its own input's memory (``out``)."""
    g = torch.Generator().manual_seed(18)
    for shape in [(3, 6, 16), (2, 20, 4), (1, 9, 9)]:
        X = torch.randn(*shape, generator=g, dtype=torch.float64)
        normalized = X / X.norm(dim=(-2, -1), keepdim=True)
        for steps in (0, 1, 2, 3, 5):
            per_step = per_step_coefficients(PER_ITERATION, steps)
            for gram in (False, True):
                ns = NewtonSchulz(per_step, gram=gram)
                expected = ns.iterate(normalized)
                got = ns.iterate(X, fold_eps=1e-7)
                # the scale is computed in fp32, the iteration in fp64
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
                buf = X.clone()
                assert ns.iterate(buf, fold_eps=1e-7, out=buf) is buf
                torch.testing.assert_close(buf, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gram", [False, True])
def test_zero_newton_schulz_steps_on_one_rank_step_with_the_normalised_momentum(gram):
    """With ns_steps=0 the owner's result is its (normalised) input itself: on one rank the buffer it
    lives in is also where the result goes, which must not be copied onto itself."""
    init = make_params(20)
    ours = [p.clone() for p in init]
    opt = Muon(ours, lr=LR, weight_decay=0.0, ns_steps=0, nesterov=False, gram=gram, ns_dtype=torch.bfloat16)
    set_grads([ours], 0)
    grads = [p.grad.clone() for p in ours]
    opt.step()
    for p, p0, grad in zip(ours, init, grads, strict=True):
        u = 0.05 * grad  # the first momentum: (1 - 0.95) * grad
        step = adjust_lr(LR, None, p.shape) * u / u.norm()
        # three bf16 roundings (input, norm, quotient) of 2^-9 each
        torch.testing.assert_close(p0 - p, step, rtol=2**-7, atol=2**-9 * step.abs().max().item())


def test_the_dry_run_counts_the_iteration_the_step_runs():
    """One description: the builder's Muon runs ``build.muon_iteration``, the one the dry run counts and
    names."""
    from muonrun.config import load_config
    from muonrun.optim.build import build_optimizers, muon_iteration

    for preset, form in (("tiny", "standard form"), ("qwen2-muon-fsdp2", "Gram form where 1.5x wide")):
        o = load_config(preset, ["optimizer.name=muon"]).optimizer
        ns = muon_iteration(o, "cpu")
        muon = build_optimizers(tiny_qwen2(tied=True), o, "cpu")[0]
        assert muon.newton_schulz == ns and type(muon.newton_schulz.products) is type(ns.products)
        assert ns.describe().startswith("5 iterations, torch.optim.Muon coefficients, " + form)
        assert ns.describe().endswith("torch's products")
        assert ns.flops((896, 4864)) == newton_schulz_flops((896, 4864), 5, o.muon.gram_ns)


def test_newton_schulz_products_are_torchs_off_hopper():
    """quack's products only on a Hopper GPU with quack-kernels installed; torch's on a CPU whatever is
    installed, and for every Muon the CLI builds there."""
    from muonrun.config import load_config
    from muonrun.optim.build import build_optimizers
    from muonrun.optim.ns_quack import default_products

    assert default_products("cpu") is TORCH_PRODUCTS
    muon = build_optimizers(tiny_qwen2(tied=True), load_config("qwen2-muon-fsdp2", []).optimizer, "cpu")[0]
    assert (
        muon.newton_schulz.products is TORCH_PRODUCTS
        and Muon([torch.zeros(2, 3)]).newton_schulz.products is TORCH_PRODUCTS
    )


def normuon_normalize(X: torch.Tensor, v: torch.Tensor, beta2: float, eps: float):
    """NorMuon as the paper writes it (the reference ``normuon_row_scale`` is held to): the update
    ``U = Y sqrt(min(m, n)) / ||Y||_F`` with ``Y = X / (sqrt(v) + eps)`` row-wise, and the new ``v``; a
    zero ``Y`` gives a zero update."""
    X = X.float()
    v = torch.lerp(v, X.square().mean(dim=-1), 1 - beta2)
    hat = X / (v.sqrt() + eps).unsqueeze(-1)
    m, n = X.shape[-2:]
    norm = torch.linalg.vector_norm(hat, dim=(-2, -1), keepdim=True)
    return hat.mul_(torch.where(norm > 0, math.sqrt(min(m, n)) / norm.clamp(min=1e-30), 0.0)), v


def test_normuon_row_scale_is_normuon_normalize():
    g = torch.Generator().manual_seed(21)
    X = newton_schulz(torch.randn(3, 12, 40, generator=g))
    v = torch.rand(3, 12, generator=g) * 1e-2
    U, v_new = normuon_normalize(X, v, beta2=0.9, eps=1e-8)
    f, v_rows = normuon_row_scale(X, v, beta2=0.9, eps=1e-8)
    torch.testing.assert_close(f.unsqueeze(-1) * X.float(), U)
    torch.testing.assert_close(v_rows, v_new)


def round_robin(shapes, world: int, flops) -> list[int]:
    """Each shape's matrices dealt to the ranks in turn (grouped by shape in order of appearance, the
    next shape starting where the last one stopped): what owner balancing is measured against."""
    by_shape: dict[tuple, list] = {}
    for shape in shapes:
        by_shape.setdefault(tuple(shape), []).append(shape)
    per_rank = [0] * world
    for i, shape in enumerate(s for group in by_shape.values() for s in group):
        per_rank[i % world] += flops(shape)
    return per_rank


def test_owners_balance_newton_schulz_flops_where_round_robin_cannot():
    from muonrun.optim.sharding import owner_flops

    big, small = newton_schulz_flops((4, 4)), newton_schulz_flops((2, 2))  # 1920, 240 with 5 steps
    shapes = [(4, 4)] * 3 + [(2, 2)] * 3
    standard = NewtonSchulz().flops
    per_rank = owner_flops(shapes, 2, standard)
    # round-robin per shape: big, small, big on rank 0; greedy: the third big one's rank gets no small one
    assert round_robin(shapes, 2, standard) == [2 * big + small, big + 2 * small]
    assert per_rank == [2 * big, big + 3 * small]
    assert owner_flops(shapes, 1, standard) == [3 * big + 3 * small]
    # a matrix is never split: with more ranks than matrices some ranks idle
    assert sorted(owner_flops(shapes, 8, standard)) == [0, 0] + [small] * 3 + [big] * 3
    assert owner_flops([(3, 5)], 1, NewtonSchulz(gram=True).flops)[0] < newton_schulz_flops((3, 5))
    # the same owners however the matrices are bucketed, when the split does not matter
    assert owner_flops(shapes, 2, standard, bucket_numel=16) == per_rank
    # Qwen2-1.5B's 196 matrices on 8 ranks: 84 MLP matrices do not divide by 8
    h, i, kv = 1536, 8960, 256
    qwen = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * 28
    per_rank = owner_flops(qwen, 8, standard)
    average = sum(per_rank) / 8
    assert max(round_robin(qwen, 8, standard)) > 1.04 * average and max(per_rank) < 1.001 * average


def test_a_study_passes_its_own_coefficients_and_per_group_ones_are_refused():
    """Coefficients per iteration reach the step (the same as torch's: ``ns_coefficients``); torch's
    per-group Newton–Schulz settings, which one iteration for the whole optimizer would silently ignore,
    are refused, also when set on a group between steps."""
    params = make_params(5)
    opt = Muon(params, lr=LR, ns_coefficients=PER_ITERATION, ns_steps=5)
    assert opt.newton_schulz.coefficients == PER_ITERATION
    set_grads([params], 0)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([{"params": make_params(5), "ns_steps": 3}])
    opt.param_groups[0]["ns_coefficients"] = PER_ITERATION
    with pytest.raises(ValueError, match="ns_coefficients"):
        opt.step()


def test_param_groups_lr_changes_and_none_grads():
    init = make_params(6)
    ours, ref = [p.clone() for p in init], [p.clone() for p in init]

    def groups(ps):
        return [
            {"params": ps[:4], "lr": 0.02, "weight_decay": 0.0},
            {
                "params": ps[4:],
                "lr": 0.05,
                "weight_decay": 0.2,
                "nesterov": False,
                "adjust_lr_fn": "match_rms_adamw",
            },
        ]

    opt, ref_opt = Muon(groups(ours)), TorchMuon(groups(ref))
    for step in range(4):
        set_grads([ours, ref], step)
        for ps in (ours, ref):  # one matrix without gradient in every step: skipped
            ps[step].grad = None
        for o in (opt, ref_opt):  # the trainer's schedule writes group["lr"]
            o.param_groups[0]["lr"] = 0.02 * (step + 1)
        opt.step()
        ref_opt.step()
    assert_matches(ours, ref, init)
    untouched = Muon([init[0].clone()])
    untouched.step()  # no gradients at all: a no-op
    assert len(untouched.state) == 0


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_state_dict_round_trip(variant):
    init = make_params(7)
    a = [p.clone() for p in init]
    opt = Muon(a, lr=LR, variant=variant)
    for step in range(3):
        set_grads([a], step)
        opt.step()
    keys = {"momentum_buffer", "second_moment"} if variant == "normuon" else {"momentum_buffer"}
    assert all(set(opt.state[p]) == keys for p in a)
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in a)
    b = [p.clone() for p in a]
    opt_b = Muon(b, lr=LR, variant=variant)
    saved = copy.deepcopy(opt.state_dict())  # load_state_dict may alias tensors
    opt_b.load_state_dict(saved)
    for step in range(3, 6):
        set_grads([a, b], step)
        opt.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("ns_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "adjust_lr_fn,nesterov,weight_decay", [("match_rms_adamw", False, 0.1), ("original", True, 0.0)]
)
def test_normuon_matches_the_paper(adjust_lr_fn, nesterov, weight_decay, ns_dtype):
    """NorMuon on one device against NorMuonReference, written from arXiv:2510.05491 (with
    match_rms_adamw, the paper's step 0.2 lr sqrt(m n) / ||Ô||_F), after 1 and 10 steps."""
    from tests.dist.muon_worker import NorMuonReference, reference_ns

    init = make_params(12)
    ours, ref = [p.clone() for p in init], [p.clone() for p in init]
    kw = dict(lr=LR, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = Muon(ours, **kw, variant="normuon", beta2=0.9, ns_dtype=ns_dtype)
    ref_opt = NorMuonReference(ref, reference_ns(False, False, ns_dtype), **kw, beta2=0.9)
    for step in range(10):
        set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
        if step in (0, 9):
            # bf16: the update returns in bf16 (2^-9 relative), the reference keeps it in fp32
            assert_matches(ours, ref, init, RTOL if ns_dtype == torch.bfloat16 else RTOL_FP32)
    for p, q in zip(ours, ref, strict=True):
        v = opt.state[p]["second_moment"]
        assert v.dtype == torch.float32 and v.shape == (p.shape[0],)
        torch.testing.assert_close(v, ref_opt.state[q]["second_moment"], rtol=RTOL, atol=0)


@pytest.mark.parametrize("gram", [False, True])
def test_normuon_leaves_a_matrix_with_zero_momentum_where_muon_does(gram):
    """A matrix whose gradient and momentum are exactly zero (LoRA's A while its B is still zero, an
    expert that got no tokens) has zero rows after Newton–Schulz: NorMuon's update of it is zero, as
    torch.optim.Muon's is, and only weight decay moves it; its row factors must not overflow to inf
    (inf times the zero rows was NaN from min(m, n) >= 12 on). The other matrix trains as usual."""
    shapes = [(16, 64), (64, 16)]
    init = make_params(5, shapes)
    ours, ref = [p.clone() for p in init], [p.clone() for p in init]
    opt = Muon(ours, lr=LR, weight_decay=0.1, variant="normuon", gram=gram)
    ref_opt = torch_muon.Muon(ref, lr=LR, weight_decay=0.1)
    for step in range(3):
        for params in (ours, ref):
            params[0].grad = torch.zeros(shapes[0])
            params[1].grad = torch.randn(shapes[1], generator=torch.Generator().manual_seed(step))
        opt.step()
        ref_opt.step()
    assert all(torch.isfinite(p).all() for p in ours)
    torch.testing.assert_close(ours[0], ref[0])  # decay only: (1 - lr * wd)^3 * init
    torch.testing.assert_close(ours[0], init[0] * (1 - LR * 0.1) ** 3)
    assert not torch.allclose(ours[1], init[1] * (1 - LR * 0.1) ** 3)
    f, v = normuon_row_scale(torch.zeros(2, 16, 64), torch.zeros(2, 16), 0.95, 1e-8)
    assert torch.count_nonzero(f) == 0 and torch.count_nonzero(v) == 0


def test_normuon_equalizes_rows_and_keeps_an_orthogonal_matrix_norm():
    """From zero second moments one step divides every row by its own RMS: all rows of the update
    have the same norm, and the whole has the Frobenius norm sqrt(min(m, n)) of an orthogonal one."""
    X = newton_schulz(
        torch.randn(2, 12, 40, generator=torch.Generator().manual_seed(13)), dtype=torch.float32
    )
    X[:, 0] *= 5  # one loud neuron
    f, v = normuon_row_scale(X, torch.zeros(2, 12), beta2=0.95, eps=1e-8)
    U = f.unsqueeze(-1) * X
    rows = U.norm(dim=-1)
    torch.testing.assert_close(rows, rows[:, :1].expand_as(rows), rtol=1e-4, atol=0)
    torch.testing.assert_close(U.norm(dim=(-2, -1)), torch.full((2,), math.sqrt(12)))
    torch.testing.assert_close(v, 0.05 * X.square().mean(-1))
    assert torch.count_nonzero(normuon_row_scale(torch.zeros(1, 3, 4), torch.zeros(1, 3), 0.95, 1e-8)[0]) == 0


def test_telemetry_keys_and_values_on_one_device():
    """Muon and AdamW fill `telemetry` with 0-d tensors equal to what they did, and collecting it
    changes nothing they compute."""
    from muonrun.optim import AdamW
    from muonrun.optim.newton_schulz import orthogonality_residual

    init = make_params(14)
    for variant in ("muon", "normuon"):
        quiet, loud = [p.clone() for p in init], [p.clone() for p in init]
        opts = [Muon(ps, lr=LR, weight_decay=0.1, variant=variant) for ps in (quiet, loud)]
        opts[1].collect_telemetry = True
        for step in range(3):
            set_grads([quiet, loud], step)
            before = [p.clone() for p in loud]
            bufs = [
                opts[1].state[p]["momentum_buffer"].clone() if step else torch.zeros_like(p) for p in loud
            ]
            for o in opts:
                o.step()
        assert all(torch.equal(p, q) for p, q in zip(quiet, loud, strict=True)) and opts[0].telemetry == {}
        tel = opts[1].telemetry
        assert set(tel) == {"update_rms", "momentum_norm", "ortho_residual"}
        assert all(t.ndim == 0 and t.dtype == torch.float32 for t in tel.values())
        numel = sum(p.numel() for p in loud)
        update = torch.cat([(p - b).flatten() for p, b in zip(loud, before, strict=True)])
        torch.testing.assert_close(
            tel["update_rms"], update.square().sum().div(numel).sqrt(), rtol=1e-3, atol=0
        )
        momenta = [opts[1].state[p]["momentum_buffer"] for p in loud]
        torch.testing.assert_close(tel["momentum_norm"], torch.cat([m.flatten() for m in momenta]).norm())
        # the sampled matrix: the first one orthogonalised (here the first parameter), Nesterov
        u = loud[0].grad.lerp(bufs[0].lerp(loud[0].grad, 0.05), 0.95)
        torch.testing.assert_close(
            tel["ortho_residual"], orthogonality_residual(newton_schulz(u)), rtol=1e-3, atol=0
        )

    quiet, loud = [p.clone() for p in init], [p.clone() for p in init]
    opts = [AdamW(ps, lr=0.01, weight_decay=0.1) for ps in (quiet, loud)]
    opts[1].collect_telemetry = True
    for step in range(2):
        set_grads([quiet, loud], step)
        before = [p.clone() for p in loud]
        for o in opts:
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(quiet, loud, strict=True)) and opts[0].telemetry == {}
    tel = opts[1].telemetry
    assert set(tel) == {"update_rms", "momentum_norm"} and all(t.ndim == 0 for t in tel.values())
    update = torch.cat([(p - b).flatten() for p, b in zip(loud, before, strict=True)])
    torch.testing.assert_close(tel["update_rms"], update.square().mean().sqrt())
    exp_avg = torch.cat([opts[1].state[p]["exp_avg"].flatten() for p in loud])
    torch.testing.assert_close(tel["momentum_norm"], exp_avg.norm())


def test_the_config_builds_the_muon_the_class_defaults_build():
    """`muonrun pretrain`'s Muon is `Muon(...)` with the config's values and the class's own defaults
    for the rest: the default config's optimizer steps bit for bit as a Muon built by hand with those
    values, the preset's (Gram form, NorMuon, eager) too; and the settings reach it."""
    from muonrun.config import load_config
    from muonrun.optim.build import build_optimizers

    for overrides in (
        [],
        ["optimizer.muon.gram_ns=true", "optimizer.muon.variant=normuon", "optimizer.muon.beta2=0.9"],
    ):
        o = load_config("tiny", ["optimizer.name=muon", *overrides]).optimizer
        model = tiny_qwen2(tied=True)
        built = build_optimizers(model, o, "cpu")[0]
        params = [p.detach().clone() for p in built.param_groups[0]["params"]]
        m = o.muon
        by_hand = Muon(
            params,
            lr=m.lr,
            weight_decay=o.weight_decay,
            momentum=m.momentum,
            nesterov=m.nesterov,
            gram=m.gram_ns,
            variant=m.variant,
            beta2=m.beta2,
        )
        assert built.newton_schulz == by_hand.newton_schulz and built.ns_dtype == by_hand.ns_dtype
        assert built.eager is by_hand.eager is False and built.defaults["beta2"] == m.beta2
        ours = built.param_groups[0]["params"]
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            for p, q in zip(ours, params, strict=True):
                p.grad = torch.randn(p.shape, generator=g)
                q.grad = p.grad.clone()
            built.step()
            by_hand.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, params, strict=True))
    eager = build_optimizers(
        tiny_qwen2(tied=True),
        load_config("tiny", ["optimizer.name=muon", "optimizer.muon.eager=true"]).optimizer,
        "cuda",
    )[0]
    assert eager.eager and eager.ns_dtype == torch.bfloat16 and not eager.newton_schulz.products.compiled


@pytest.mark.gpu
def test_on_a_gpu_muon_keeps_torchs_bf16_newton_schulz():
    """The CPU's fp32 choice leaves GPUs alone: there the builder picks bf16, and Muon steps as
    torch.optim.Muon does: within rounding as it ships (compiled passes, the norm folded into them),
    bit for bit where the bf16 norm rounds alike with `eager=True` (torch's own ops); NorMuon runs there
    too."""
    from muonrun.optim.newton_schulz import ns_dtype_for

    assert ns_dtype_for("cuda") == torch.bfloat16
    init = [p.cuda() for p in make_params(15)]
    ours, eager, ref, nor = ([p.clone() for p in init] for _ in range(4))
    opts = [
        Muon(ours, lr=LR, weight_decay=0.1),
        Muon(eager, lr=LR, weight_decay=0.1, eager=True),
        TorchMuon(ref, lr=LR, weight_decay=0.1),
        Muon(nor, lr=LR, variant="normuon", adjust_lr_fn="match_rms_adamw"),
    ]
    for step in range(10):
        grads = make_params(100 + step)
        for ps in (ours, eager, ref, nor):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.cuda()
        for o in opts:
            o.step()
    assert_matches(ours, ref, init)
    assert_matches(eager, ref, init)
    assert sum(torch.equal(p, q) for p, q in zip(eager, ref, strict=True)) >= len(SHAPES) // 2
    assert all(torch.isfinite(p).all() for p in nor)


@pytest.mark.gpu
def test_on_a_gpu_the_compiled_passes_step_as_the_eager_ops():
    """On a GPU the elementwise passes compile (inductor kernels), the owner's normalisation and
    NorMuon's row scaling among them, and the Gram form's folded norm (its scale compiled): 10 steps stay
    within rounding of ``eager``'s, for Muon and NorMuon."""
    init = [p.cuda() for p in make_params(16)]
    for variant, gram in itertools.product(("muon", "normuon"), (False, True)):
        runs = {eager: [p.clone() for p in init] for eager in (False, True)}
        kw = dict(lr=LR, weight_decay=0.1, variant=variant, gram=gram)
        opts = {e: Muon(ps, **kw, eager=e) for e, ps in runs.items()}
        for step in range(10):
            grads = make_params(100 + step)
            for ps in runs.values():
                for p, g in zip(ps, grads, strict=True):
                    p.grad = g.cuda()
            for opt in opts.values():
                opt.step()
        keys = list(opts[False]._passes._fns)
        assert opts[False]._passes.compiled and not opts[True]._passes.compiled
        assert {key[0] for key in keys} == {"momentum", "update", "normalize"}, keys
        assert_matches(runs[False], runs[True], init)


@pytest.mark.gpu
def test_on_a_gpu_quacks_products_are_torchs_products():
    """quack's GEMMs (``ns_quack.QuackProducts``) against torch's bmm on a GPU, on both tile configurations
    Hopper uses (sides below and above 1024): each symmetric result within one bf16 rounding and
    exactly symmetric where both triangles are the same dot products, the standard form's
    ``a X + B X`` within one rounding (into a fresh tensor, an aligned strided one, and an unaligned
    one that stays torch's), Newton–Schulz in both forms within rounding, and Muon and NorMuon (Gram
    form, NorMuon's stacks strided by their rows' state) stepping as with torch's."""
    pytest.importorskip("quack", reason="needs quack-kernels (pip install 'muonrun[quack]')")
    from muonrun.optim.ns_quack import QuackProducts

    quack = QuackProducts()
    calls = []
    for name in ("_gemm", "_gemm_symmetric", "_gemm_symmetric_tiled"):
        fn = getattr(quack, name)
        setattr(quack, name, lambda *a, fn=fn, name=name, **kw: calls.append(name) or fn(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(5)
    for shape in [(3, 640, 640), (3, 640, 1536), (3, 1536, 640), (2, 1152, 1152)]:  # square, wide, tall
        X = torch.randn(shape, device="cuda", generator=g).bfloat16()
        X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
        tall = shape[1] > shape[2]
        A = TORCH_PRODUCTS.gram(X, tall)
        P = TORCH_PRODUCTS.poly(A, -4.775, 2.0315)
        for got, ref, exact in [
            (quack.gram(X, tall), A, True),
            (quack.poly(A, -4.775, 2.0315), P, True),
            (quack.sym_mm(P, A), TORCH_PRODUCTS.sym_mm(P, A), False),  # P A: commuting, rounded apart
        ]:
            torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=2**-8 * ref.abs().max().item())
            assert torch.equal(got, got.mT) or not exact
        ref = TORCH_PRODUCTS.apply_add(P, X, 3.4445, tall)
        k, r, c = shape
        padded = torch.zeros(k, r * c + 8, dtype=X.dtype, device="cuda")  # aligned rows of a wider buffer
        skewed = torch.zeros(k, r * c + 3, dtype=X.dtype, device="cuda")  # batch stride not 16-byte aligned
        outs = [None, padded[:, : r * c].view(k, r, c), skewed[:, : r * c].view(k, r, c)]
        for i, out in enumerate(outs):
            before = calls.count("_gemm")
            got = quack.apply_add(P, X, 3.4445, tall, out)
            assert got is out or out is None
            torch.testing.assert_close(got.float(), ref.float(), rtol=0, atol=2**-8 * ref.abs().max().item())
            assert calls.count("_gemm") == before + (i < 2), shape  # unaligned (the last): torch's
        per_step = [DEFAULT_NS_COEFFICIENTS] * 5
        for gram in (False, True):
            ours = NewtonSchulz(per_step, gram=gram, products=quack).iterate(X).float()
            ref = NewtonSchulz(per_step, gram=gram).iterate(X).float()
            assert (ours - ref).norm() / ref.norm() < 0.02, (shape, gram)
    symmetric = sum(name != "_gemm" for name in calls)
    assert symmetric >= 4 * (3 + 2 * 5)  # at least the checks' and the standard form's ran on quack
    before = len(calls)
    shapes = [(640, 1536), (1536, 640), (640, 640), (640, 1536)]  # at least SYMMETRIC_MIN_SIZE on a side
    init = [p.cuda() for p in make_params(17, shapes)]
    for variant in ("muon", "normuon"):
        runs = {name: [p.clone() for p in init] for name in ("quack", "torch")}
        opts = {
            name: Muon(
                ps,
                lr=LR,
                weight_decay=0.1,
                variant=variant,
                newton_schulz=NewtonSchulz(gram=True, products=quack if name == "quack" else TORCH_PRODUCTS),
            )
            for name, ps in runs.items()
        }
        for step in range(10):
            grads = make_params(100 + step, shapes)
            for ps in runs.values():
                for p, grad in zip(ps, grads, strict=True):
                    p.grad = grad.cuda()
            for opt in opts.values():
                opt.step()
        assert len(calls) > before
        assert_matches(runs["quack"], runs["torch"], init)


def test_rejects_bad_params():
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(3)])
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(2, 3, 4)])
    with pytest.raises(ValueError, match="not supported"):
        Muon([torch.zeros(2, 3)], adjust_lr_fn="bogus")
    with pytest.raises(ValueError):
        Muon([torch.zeros(2, 3)], lr=-1.0)
    with pytest.raises(ValueError, match="variant"):
        Muon([torch.zeros(2, 3)], variant="adamuon")
    with pytest.raises(ValueError, match="beta2"):
        Muon([torch.zeros(2, 3)], variant="normuon", beta2=1.0)


def test_a_sparse_gradient_is_refused_before_anything_is_updated():
    dense, sparse = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4, 6))
    before = dense.detach().clone()
    dense.grad, sparse.grad = torch.ones(4, 6), torch.ones(4, 6).to_sparse()
    opt = Muon([dense, sparse], lr=LR)
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(dense.detach(), before) and not opt.state


def test_refuses_a_partial_placement_and_steps_a_column_split_on_one_rank():
    """A partial (unreduced) parameter cannot be orthogonalised: refused naming it. A column split on a
    one-rank mesh (tensor parallelism of size 1) steps as torch.optim.Muon does."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        partial = torch.nn.Parameter(DTensor.from_local(torch.zeros(4, 6), mesh, [Partial()]))
        with pytest.raises(ValueError, match=r"layers\.0\.weight.*Partial"):
            Muon([("layers.0.weight", partial)])
        for placement in (Shard(0), Shard(1)):
            ok = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [placement]))
            ref = ok.full_tensor().detach().clone().requires_grad_()
            ok.grad = distribute_tensor(torch.ones(4, 6), mesh, [placement])
            ref.grad = torch.ones(4, 6)
            Muon([ok], lr=LR).step()
            TorchMuon([ref], lr=LR).step()
            torch.testing.assert_close(ok.full_tensor(), ref.detach(), atol=1e-4, rtol=0)
    finally:
        dist.destroy_process_group()


WORKER = Path(__file__).parent / "dist" / "muon_worker.py"


@pytest.mark.slow
def test_distributed_matches_reference(tmp_path):
    """One 4-rank gloo launch: shard groups of 1, 2, 3 and 4 ranks (sub-meshes), then HSDP 2x2.
    Each: all adjust_lr_fn x nesterov x wd combos vs torch.optim.Muon after 1 and 10 steps, uneven
    and empty shards, exactly-once orthogonalisation, a real FSDP2 backward, DCP save/load/resume,
    muonrun.train.clip against torch's clip_grad_norm_ and muonrun's AdamW (local shards) against torch's AdamW;
    at the end, release_process_groups leaves no gloo thread for interpreter teardown."""

    out = run_workers(WORKER, 4, str(tmp_path), timeout=600)
    assert "MUON_WORKER_OK" in out, out
    for n in (1, 2, 3, 4):
        assert f"fsdp shard group of {n}: 16 combinations OK" in out, out
        assert f"fsdp shard group of {n} dcp save/load/resume: bitwise equal" in out, out
        assert f"fsdp shard group of {n} clip: norms and clipped shards match torch" in out, out
        assert f"fsdp shard group of {n} adamw: local shards match torch" in out, out
    assert "hsdp 2x2: 6 combinations OK" in out, out
    assert "hsdp 2x2 clip: norms and clipped shards match torch" in out, out
    assert "hsdp 2x2 adamw: local shards match torch" in out, out
