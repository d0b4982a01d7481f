"""Muon: single-device equivalence with torch.optim.Muon, pure functions, and (slow) the distributed
all-to-all path on 1-4 gloo ranks (tests/dist/muon_worker.py)."""

from __future__ import annotations

import copy
import itertools
import math
from pathlib import Path

import pytest
import torch

from muonrun.optim import (
    DEFAULT_NS_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    Muon,
    adjust_lr,
    newton_schulz,
    newton_schulz_flops,
    resolve_ns_coefficients,
)

torch_muon = pytest.importorskip("torch.optim._muon")
TorchMuon = torch.optim.Muon

# wide, tall, square, repeated (batched Newton–Schulz), a row vector and a column vector
SHAPES = [(16, 32), (48, 12), (24, 24), (16, 32), (16, 32), (7, 5), (1, 9), (9, 1)]
LR = 0.05
RTOL = 0.02  # of how far the reference moved: bf16 Newton–Schulz rounding may differ by one ulp


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: intra-op threads only add overhead (and stall on a busy 2-core CI machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_params(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def set_grads(params_lists, step, shapes=SHAPES):
    g = torch.Generator().manual_seed(100 + step)
    for s, *ps in zip(shapes, *params_lists, strict=True):
        grad = torch.randn(s, generator=g)
        for p in ps:
            p.grad = grad.clone()


def assert_matches(ours, ref, init):
    for p, q, q0 in zip(ours, ref, init, strict=True):
        diff = (p - q).abs().max().item()
        moved = (q - q0).abs().max().item()
        assert moved > 0
        assert diff <= RTOL * moved + 1e-7, (tuple(p.shape), diff, moved)


@pytest.mark.parametrize(
    "adjust_lr_fn,nesterov,weight_decay",
    list(itertools.product([None, "original", "match_rms_adamw"], [True, False], [0.0, 0.1])),
)
def test_matches_torch_muon(adjust_lr_fn, nesterov, weight_decay):
    init = make_params()
    ours = [p.clone() for p in init]
    ref = [p.clone() for p in init]
    kw = dict(lr=LR, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt, ref_opt = Muon(ours, **kw), TorchMuon(ref, **kw)
    for step in range(10):
        set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
        if step in (0, 9):
            assert_matches(ours, ref, init)
    assert opt.stats["orthogonalized"] == 10 * len(SHAPES)
    assert opt.stats["all_to_all"] == 0


@pytest.mark.parametrize("adjust_lr_fn,nesterov", [(None, True), ("match_rms_adamw", False)])
def test_folded_ns_close_to_torch(adjust_lr_fn, nesterov):
    """The folded (B + aI) X evaluation differs from torch's a X + B X only by bf16 rounding."""
    from tests.dist.muon_worker import FoldedMuon

    init = make_params(2)
    ours, ref = [p.clone() for p in init], [p.clone() for p in init]
    kw = dict(lr=LR, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt, ref_opt = FoldedMuon(ours, **kw), TorchMuon(ref, **kw)
    for step in range(10):
        set_grads([ours, ref], step)
        opt.step()
        ref_opt.step()
    for p, q, q0 in zip(ours, ref, init, strict=True):
        assert (p - q).abs().max() <= 0.1 * (q - q0).abs().max(), tuple(p.shape)


def test_folded_ns_is_as_orthogonal_as_torch():
    g = torch.Generator().manual_seed(9)
    for shape in [(64, 128), (256, 64), (96, 96)]:
        G = torch.randn(3, *shape, generator=g)
        U, _, Vh = torch.linalg.svd(G, full_matrices=False)
        polar = U @ Vh
        exact = newton_schulz(G).float()
        folded = newton_schulz(G, fold_identity=True).float()
        err_exact = (exact - polar).norm() / polar.norm()
        err_folded = (folded - polar).norm() / polar.norm()
        assert (folded - exact).norm() / exact.norm() < 0.05
        assert err_folded < 1.1 * err_exact + 0.01, (shape, err_folded, err_exact)


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
    for M in (G[0], G[1].T):
        assert torch.equal(
            newton_schulz(M), torch_muon._zeropower_via_newtonschulz(M, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        )


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


def test_newton_schulz_orthogonalizes_and_polar_express_is_tighter():
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    s_default = torch.linalg.svdvals(newton_schulz(G).float())
    s_pe = torch.linalg.svdvals(newton_schulz(G, 5, "polar_express").float())
    assert s_default.min() > 0.5 and s_default.max() < 1.3
    assert (s_pe - 1).abs().max() < (s_default - 1).abs().max()
    per_step, scale = resolve_ns_coefficients("polar_express", 7)
    assert per_step[:5] == POLAR_EXPRESS_COEFFICIENTS and per_step[6] == POLAR_EXPRESS_COEFFICIENTS[-1]
    assert scale == pytest.approx(1.02)
    assert resolve_ns_coefficients((1.0, 2.0, 3.0), 2) == (((1.0, 2.0, 3.0), (1.0, 2.0, 3.0)), 1.0)
    with pytest.raises(ValueError):
        resolve_ns_coefficients("bogus", 5)


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (2, 7, 3)])
@pytest.mark.parametrize("steps, gram", [(3, False), (3, True), (5, True), (1, True)])
def test_newton_schulz_flops_counts_what_runs(shape, steps, gram):
    """The closed form behind the dry-run plan's Muon estimate equals the matmul FLOPs torch counts."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        newton_schulz(torch.randn(shape), steps=steps, gram=gram)
    assert counter.get_total_flops() == math.prod(shape[:-2]) * newton_schulz_flops(shape, steps, gram)
    assert newton_schulz_flops((3, 5), 5) == 5 * (4 * 9 * 5 + 2 * 27)  # by hand


def test_gram_newton_schulz_is_cheaper_only_where_it_is_used():
    mlp, square = (1536, 8960), (1536, 1536)  # Qwen2-1.5B's MLP and attention matrices
    assert newton_schulz_flops(mlp, 5, gram=True) / newton_schulz_flops(mlp, 5) == pytest.approx(
        0.59, abs=0.01
    )
    assert newton_schulz_flops(square, 5, gram=True) == newton_schulz_flops(square, 5)
    G = torch.randn(2, 24, 24)
    assert torch.equal(newton_schulz(G, gram=True), newton_schulz(G))  # square: the standard form


@pytest.mark.parametrize("coefficients", [DEFAULT_NS_COEFFICIENTS, "polar_express"])
def test_gram_newton_schulz_is_the_standard_iteration_in_exact_arithmetic(coefficients):
    """In float64 the Gram form (with its restart) and the standard iteration agree to rounding."""
    from muonrun.optim.newton_schulz import gram_iterations, standard_iterations

    g = torch.Generator().manual_seed(4)
    for steps in (1, 2, 3, 5, 7):
        per_step, _ = resolve_ns_coefficients(coefficients, steps)
        for shape in [(3, 6, 16), (2, 20, 4), (1, 1, 9)]:  # wide, tall, a row vector
            X = torch.randn(*shape, generator=g, dtype=torch.float64)
            X = X / X.norm(dim=(-2, -1), keepdim=True)
            standard = standard_iterations(X, per_step, fold_identity=True)
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
    for coefficients in (DEFAULT_NS_COEFFICIENTS, "polar_express"):
        for M in (G, G.T):
            standard = newton_schulz(M, coefficients=coefficients, fold_identity=True).float()
            gram = newton_schulz(M, coefficients=coefficients, gram=True).float()
            target = polar if M is G else polar.T
            err_standard = (standard - target).norm() / target.norm()
            err_gram = (gram - target).norm() / target.norm()
            assert err_gram < 1.15 * err_standard + 0.01, (coefficients, err_gram, err_standard)
            s = torch.linalg.svdvals(gram)
            assert s.min() > 0.6 and s.max() < 1.4, (coefficients, s.min(), s.max())


def test_ns_flops_per_rank_splits_matrices_but_never_one_matrix():
    from muonrun.plan import ns_flops_per_rank

    shapes = [(3, 5), (3, 5), (2, 2)]  # 1170 + 1170 + 240 FLOPs with 5 steps
    assert ns_flops_per_rank(shapes, 5, 1) == 2580
    assert ns_flops_per_rank(shapes, 5, 2) == 1290
    assert ns_flops_per_rank(shapes, 5, 8) == 1170  # one whole (3, 5) matrix on some rank
    assert ns_flops_per_rank(shapes, 5, 1, gram=True) < 2580  # (3, 5) is 1.67x wider than tall


def test_polar_express_option_steps():
    params = make_params(5)
    opt = Muon(params, lr=LR, ns_coefficients="polar_express")
    set_grads([params], 0)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


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


def test_changing_ns_settings_between_steps_takes_effect():
    params = make_params(8)
    opt = Muon(params, lr=LR)
    set_grads([params], 0)
    opt.step()
    opt.param_groups[0]["ns_steps"] = 3
    opt.param_groups[0]["ns_coefficients"] = "polar_express"
    set_grads([params], 1)
    opt.step()
    (part,) = opt._plan
    assert part.ns.per_step == POLAR_EXPRESS_COEFFICIENTS[:3]


def test_state_dict_round_trip():
    init = make_params(7)
    a = [p.clone() for p in init]
    opt = Muon(a, lr=LR)
    for step in range(3):
        set_grads([a], step)
        opt.step()
    assert all(set(opt.state[p]) == {"momentum_buffer"} for p in a)
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in a)
    b = [p.clone() for p in a]
    opt_b = Muon(b, lr=LR)
    opt_b.load_state_dict(copy.deepcopy(opt.state_dict()))  # load_state_dict may alias tensors
    for step in range(3, 6):
        set_grads([a, b], step)
        opt.step()
        opt_b.step()
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


def test_rejects_bad_params():
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(3)])
    with pytest.raises(ValueError, match="2D"):
        Muon([torch.zeros(2, 3, 4)])
    with pytest.raises(ValueError, match="not supported"):
        Muon([torch.zeros(2, 3)], adjust_lr_fn="bogus")
    with pytest.raises(ValueError):
        Muon([torch.zeros(2, 3)], lr=-1.0)


def test_rejects_tensor_parallel_placement():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        tp = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
        with pytest.raises(ValueError, match=r"layers\.0\.weight.*Shard\(dim=1\)"):
            Muon([("layers.0.weight", tp)])
        ok = torch.nn.Parameter(distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)]))
        ref = ok.full_tensor().detach().clone().requires_grad_()
        ok.grad = distribute_tensor(torch.ones(4, 6), mesh, [Shard(0)])
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
    muonrun.clip against torch's clip_grad_norm_ and muonrun's AdamW (local shards) against torch's AdamW."""
    from tests.dist.launch import run_workers

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
