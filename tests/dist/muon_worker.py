"""Distributed Muon (and gradient clipping, local-shard AdamW) checks, run by tests/test_muon.py under
torch.distributed.run (gloo, CPU).

usage: muon_worker.py CHECKPOINT_DIR

Every rank builds the same full matrices and gradients from fixed seeds, shards a copy with FSDP2's
``fully_shard`` and keeps an unsharded reference stepped with torch.optim.Muon (or, for
``adjust_lr_fn="spectral"`` which torch lacks, for fp32 Newton–Schulz and for the folded and Gram
evaluations, our Muon on plain tensors, itself checked against torch, exact arithmetic or a hand
formula in test_muon.py; for NorMuon, ``NorMuonReference``, written from the paper). Comparisons are
made on each rank's own rows, without communication, and include the optimizer telemetry and the
owners' Newton–Schulz FLOPs (``owner_flops``).

Launched on 4 ranks, one launch covers shard groups of 1, 2, 3 and 4 ranks on sub-meshes (3 ranks
next to 1 rank, then two pairs, then all four), then HSDP on a 2 x 2 mesh. On any other number of
ranks it checks that one world size. Global rank 0 prints ``MUON_WORKER_OK`` at the end.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from muonrun.distributed import destroy, release_process_groups
from muonrun.optim import DEFAULT_NS_COEFFICIENTS, AdamW, Muon, NewtonSchulz, adjust_lr, newton_schulz
from muonrun.optim.newton_schulz import orthogonality_residual
from muonrun.optim.sharding import owner_flops
from muonrun.train.clip import clip_grad_norm

# (out_features, in_features): parameter shape is (out, in). Includes repeated shapes (several
# owners per chunk, partial last chunk), rows not divisible by 3 or 4, fewer rows than ranks
# (3 x 5 at world 4 gives one rank an empty shard), tall, wide and square matrices.
SHAPES = [(8, 6)] * 5 + [(10, 7), (3, 5), (6, 16), (6, 16), (6, 16), (20, 4), (12, 12), (12, 12), (1, 9)]
LR = 0.05
# bf16 tolerance: the Frobenius norm that scales each Newton–Schulz input is a bf16 number whose
# rounding can differ by one ulp (2^-8) between memory layouts, which moves that matrix's update by
# ~0.4%. A misplaced row or a wrong scale moves it by 100%.
RTOL = 0.02
RTOL_FP32 = 1e-4  # fp32 Newton–Schulz: the same sums in other orders, amplified over 10 steps

T0 = time.perf_counter()


class FoldedNewtonSchulz(NewtonSchulz):
    """A study's own iteration, passed to Muon as ``newton_schulz``: the standard form evaluated as
    ``(B + a I) X`` (no full-size copy per iteration, other bf16 rounding than torch's ``a X + B X``);
    the Gram form as Muon's. The tests check that it steps through the whole optimizer, sharded or
    not, as on one device."""

    def iterate(self, X, fold_eps=None, out=None):
        if self.uses_gram(X.shape):
            return super().iterate(X, fold_eps, out)
        if fold_eps is not None:
            X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=fold_eps)
        tall = X.shape[-2] > X.shape[-1]
        for a, b, c in self.coefficients:
            A = X.mT @ X if tall else X @ X.mT
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)
            B.diagonal(dim1=-2, dim2=-1).add_(a)
            X = X @ B.mT if tall else B @ X
        return X.contiguous() if out is None else out.copy_(X)


class DividesFirst:
    """An iteration that never folds the norm into its first product: what a sharded owner runs (it
    divides while reassembling the rows), for a reference on plain tensors, which would fold it."""

    def folds_norm(self, shape):
        return False


class Unfolded(DividesFirst, NewtonSchulz):
    pass


class FoldedUnfolded(DividesFirst, FoldedNewtonSchulz):
    pass


def iteration(fast: bool, gram: bool, folds: bool = True) -> NewtonSchulz:
    """Muon's iteration or, ``fast``, the study's; ``folds``: the norm folded where a rank holds a
    matrix whole (as Muon's own does), else divided first."""
    kinds = {(False, True): NewtonSchulz, (True, True): FoldedNewtonSchulz, (False, False): Unfolded}
    return kinds.get((fast, folds), FoldedUnfolded)(gram=gram)


def make_muon(params, fast: bool = False, gram: bool = False, folds: bool = True, **kw) -> Muon:
    """Our Muon with ``iteration(fast, gram, folds)``."""
    return Muon(params, newton_schulz=iteration(fast, gram, folds), **kw)


def reference_ns(fast: bool, gram: bool, dtype: torch.dtype, folds: bool = True):
    """The Newton–Schulz a reference uses: torch.optim.Muon's own, or (folded, Gram, fp32) ours."""
    if not fast and not gram and dtype == torch.bfloat16:
        return lambda u: torch.optim._muon._zeropower_via_newtonschulz(u, DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
    ns = iteration(fast, gram, folds)
    return lambda u: ns(u.to(dtype)[None], normalized=False)[0]


class NorMuonReference:
    """NorMuon on full matrices, one at a time, written from the paper (arXiv:2510.05491, Algorithm 1):
    M = b1 M + (1 - b1) G (Nesterov: orthogonalise G + b1 (M - G)); O = NS(M); per row
    v = b2 v + (1 - b2) mean_j O_ij^2; Ô = O / (sqrt(v) + eps); decoupled weight decay; step
    0.2 lr sqrt(m n) / ||Ô||_F for match_rms_adamw (the paper's), else Muon's lr scaling of a matrix
    with an orthogonal one's norm sqrt(min(m, n))."""

    def __init__(self, params, ns, lr, weight_decay, nesterov, adjust_lr_fn, momentum=0.95, beta2=0.95):
        self.params, self.ns, self.lr, self.wd, self.nesterov = params, ns, lr, weight_decay, nesterov
        self.fn, self.b1, self.b2, self.eps = adjust_lr_fn, momentum, beta2, 1e-8
        self.state = {
            p: {"momentum_buffer": torch.zeros_like(p), "second_moment": p.new_zeros(len(p))} for p in params
        }

    def step(self) -> None:
        for p in self.params:
            M, v = self.state[p]["momentum_buffer"], self.state[p]["second_moment"]
            M.mul_(self.b1).add_(p.grad, alpha=1 - self.b1)
            ortho = self.ns(p.grad + self.b1 * (M - p.grad) if self.nesterov else M).float()
            v.mul_(self.b2).add_(ortho.square().mean(dim=1), alpha=1 - self.b2)
            ortho_hat = ortho / (v.sqrt() + self.eps)[:, None]
            m, n = p.shape
            if self.fn == "match_rms_adamw":
                step = 0.2 * self.lr * math.sqrt(m * n) / ortho_hat.norm()
            else:
                step = adjust_lr(self.lr, self.fn, p.shape) * math.sqrt(min(m, n)) / ortho_hat.norm()
            p.mul_(1 - self.lr * self.wd)
            p.sub_(step * ortho_hat)


def log(mesh, msg: str) -> None:
    """Printed by the first rank of ``mesh`` (None: global rank 0)."""
    first = (
        dist.get_rank() == 0 if mesh is None else all(mesh.get_local_rank(d) == 0 for d in range(mesh.ndim))
    )
    if first:
        print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def shard_size(mesh) -> int:
    return mesh.size(mesh.ndim - 1)


class Mats(nn.Module):
    def __init__(self, shapes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in shapes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x[:, : layer.in_features]).square().mean() for layer in self.layers)


def make_model(seed: int = 0) -> Mats:
    torch.manual_seed(seed)
    return Mats(SHAPES)


def full_grads(step: int, salt: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * salt + step)
    return [torch.randn(o, i, generator=g) for o, i in SHAPES]


def set_sharded_grads(params, grads) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = distribute_local(g, p)


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rows of ``full`` that this rank holds for the DTensor ``like`` (torch.chunk layout)."""
    local = full
    for md, pl in enumerate(like.placements):
        if isinstance(pl, Shard):
            chunks = torch.chunk(local, like.device_mesh.size(md), dim=0)
            r = like.device_mesh.get_local_rank(md)
            local = chunks[r] if r < len(chunks) else full.new_zeros(0, full.shape[1])
    return local


def distribute_local(full: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor laid out like ``like`` holding ``full`` (no communication)."""
    local = local_part(full, like).clone()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False
    )


def reference_optimizer(
    params, fast: bool, gram: bool = False, variant="muon", ns_dtype=torch.bfloat16, folds=True, **kw
):
    """Unsharded reference: NorMuonReference; torch.optim.Muon; or our Muon on plain tensors for the
    folded (fast), Gram or fp32 Newton–Schulz and for "spectral" (checked against torch / exact
    arithmetic / a hand formula / the paper in test_muon.py). ``folds``: the Gram form's norm folded, as
    a shard group of one rank folds it (several ranks divide while reassembling)."""
    if variant == "normuon":
        return NorMuonReference(params, reference_ns(fast, gram, ns_dtype, folds), **kw)
    if fast or gram or ns_dtype != torch.bfloat16:
        return make_muon(params, fast, gram, folds, ns_dtype=ns_dtype, **kw)
    if kw.get("adjust_lr_fn") == "spectral":
        return Muon(params, ns_dtype=ns_dtype, **kw)
    return torch.optim.Muon(params, **kw)


def assert_close_to_reference(sharded, ref, init, what: str, rtol: float = RTOL) -> float:
    """Per matrix, on this rank's rows (no communication): |ours - reference| <= rtol * (how far the
    reference matrix moved from init). Returns the largest |diff| seen."""
    worst = 0.0
    for i, (p, q, q0) in enumerate(zip(sharded, ref, init, strict=True)):
        mine = p._local_tensor if isinstance(p, DTensor) else p.detach()
        theirs = local_part(q, p) if isinstance(p, DTensor) else q
        diff = (mine - theirs).abs().max().item() if mine.numel() else 0.0
        moved = (q - q0).abs().max().item()
        assert moved > 0 and diff <= rtol * moved + 1e-7, (
            f"{what}: rank {dist.get_rank()} matrix {i} {tuple(q.shape)}: max |diff| {diff:.3e} vs moved {moved:.3e}"
        )
        worst = max(worst, diff)
    return worst


ALL_COMBOS = list(
    itertools.product([None, "original", "match_rms_adamw", "spectral"], [True, False], [0.0, 0.1])
)


def check_equivalence(mesh, tag: str, combos=ALL_COMBOS) -> None:
    """adjust_lr_fn x nesterov x weight decay combinations, 1 and 10 steps, vs the reference; a third
    of them NorMuon (bf16 and fp32 exchange), a third Muon with fp32 Newton–Schulz (the CPU path), a
    third torch's bf16 Muon; half with the Gram form (its split restart on the 20 x 4 and 1 x 9
    matrices, the restart from X on the others), half with a study's own iteration
    (``FoldedNewtonSchulz``). Telemetry on throughout, checked against the reference's last step."""
    shard_dim = len(mesh.shape) - 1
    shard_group = mesh.get_group(shard_dim)
    W = mesh.size(shard_dim)
    for ci, (fn, nesterov, wd) in enumerate(combos):
        model = make_model()
        ref_params = [p.detach().clone() for p in model.parameters()]
        init = [p.clone() for p in ref_params]
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        kw = dict(lr=LR, weight_decay=wd, nesterov=nesterov, adjust_lr_fn=fn)
        fast = nesterov != (wd > 0)  # half the combos with a study's iteration (FoldedNewtonSchulz)
        gram = fn in ("original", "spectral")  # half with the Gram form for the wide and tall matrices
        variant = "normuon" if ci % 3 == 1 else "muon"
        ns_dtype = torch.float32 if ci % 3 == 2 or (variant == "normuon" and ci % 2 == 0) else torch.bfloat16
        rtol = RTOL if ns_dtype == torch.bfloat16 else RTOL_FP32
        # mostly one big bucket, sometimes many tiny ones (exercises the async prefetch pipeline at
        # depths 1 to 3)
        bucket = 200 if ci % 4 == 1 else 1 << 26
        opt = make_muon(params, fast, gram, **kw, bucket_numel=bucket, variant=variant, ns_dtype=ns_dtype)
        opt.prefetch = 1 + ci % 3
        opt.collect_telemetry = True
        ref = reference_optimizer(ref_params, fast, gram, variant, ns_dtype, folds=W == 1, **kw)
        what = f"{tag} fn={fn} nesterov={nesterov} wd={wd} fast={fast} gram={gram} {variant} {ns_dtype}"
        for step in range(10):
            grads = full_grads(step, ci)
            set_sharded_grads(params, grads)
            for q, g in zip(ref_params, grads, strict=True):
                q.grad = g.clone()
            before = [q.clone() for q in ref_params]
            opt.step()
            ref.step()
            if step in (0, 9):
                diff = assert_close_to_reference(params, ref_params, init, f"{what} step={step + 1}", rtol)
        check_telemetry(
            opt, params, ref, ref_params, before, reference_ns(fast, gram, ns_dtype), nesterov, what
        )
        # every matrix orthogonalised exactly once per step in the shard group
        stats = [opt.stats["orthogonalized"], opt.stats["all_to_all"], opt.stats["gram"]]
        t = torch.tensor(stats, dtype=torch.int64)
        dist.all_reduce(t, group=shard_group)
        assert int(t[0]) == 10 * len(SHAPES), (tag, fn, int(t[0]))
        wide_or_tall = sum(max(s) >= 1.5 * min(s) for s in SHAPES)  # (6, 16) x 3, (20, 4), (3, 5), (1, 9)
        assert int(t[2]) == (10 * wide_or_tall if gram else 0), (tag, fn, int(t[2]))
        # owners balanced by Newton–Schulz FLOPs, as the dry-run plan computes them
        per_rank = [0] * W
        for it in (it for part in opt.plan for b in part.buckets for it in b.items):
            per_rank[it.owner] += it.cost
        expected = owner_flops(SHAPES, W, opt.newton_schulz.flops, bucket)
        assert per_rank == expected, (what, per_rank)
        # state: one momentum buffer per matrix, a DTensor with the parameter's placements; NorMuon's
        # per-row second moment laid out like the rows, equal to the reference's on this rank's rows
        for p, q in zip(params, ref_params, strict=True):
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == p.placements and buf.shape == p.shape
            if variant == "normuon":
                v, v_ref = opt.state[p]["second_moment"], ref.state[q]["second_moment"]
                assert isinstance(v, DTensor) and v.placements == p.placements and v.shape == (len(q),)
                mine = v.to_local()
                theirs = local_part(v_ref[:, None], p)[:, 0]
                assert (mine - theirs).abs().max() <= 4 * rtol * theirs.abs().max() if len(mine) else True, (
                    what
                )
        log(mesh, f"{what}: max |diff| after 10 steps {diff:.2e}")
        if W > 1:  # two all-to-alls per bucket per step, several buckets when tiny
            one_bucket = 2 * 10 * W
            assert int(t[1]) > one_bucket if ci % 4 == 1 else int(t[1]) == one_bucket, int(t[1])
    log(mesh, f"{tag}: {len(combos)} combinations OK")


def check_telemetry(opt, params, ref, ref_params, before, ns, nesterov: bool, what: str) -> None:
    """Muon's telemetry of its last step, the same on every rank, against the unsharded reference:
    the update's RMS, the momentum norm and the sampled matrix's orthogonality residual."""
    tel = opt.telemetry
    assert set(tel) == {"update_rms", "momentum_norm", "ortho_residual"}, tel.keys()
    assert all(isinstance(x, torch.Tensor) and x.ndim == 0 for x in tel.values()), tel
    numel = sum(q.numel() for q in ref_params)
    update_rms = math.sqrt(
        sum((q - b).square().sum().item() for q, b in zip(ref_params, before, strict=True)) / numel
    )
    bufs = [ref.state[q]["momentum_buffer"] for q in ref_params]
    momentum_norm = math.sqrt(sum(b.square().sum().item() for b in bufs))
    i = next(i for i, p in enumerate(params) if p is opt.plan[0].buckets[0].items[0].param)
    g = ref_params[i].grad
    residual = orthogonality_residual(ns(g.lerp(bufs[i], 0.95) if nesterov else bufs[i])).item()
    for key, expected, rtol in (
        ("update_rms", update_rms, RTOL),
        ("momentum_norm", momentum_norm, 1e-5),
        ("ortho_residual", residual, RTOL),
    ):
        assert abs(tel[key].item() - expected) <= rtol * expected, (what, key, tel[key].item(), expected)


def check_fsdp_backward(mesh, tag: str) -> None:
    """Gradients from a real FSDP2 forward/backward (reduce-scatter), compared with an unsharded copy."""
    model = make_model(1)
    ref_model = make_model(1)
    init = [p.detach().clone() for p in ref_model.parameters()]
    fully_shard(model, mesh=mesh)
    opt = Muon(model.parameters(), lr=LR, adjust_lr_fn="match_rms_adamw")
    ref = torch.optim.Muon(ref_model.parameters(), lr=LR, adjust_lr_fn="match_rms_adamw")

    for step in range(3):
        x = torch.randn(4, 20, generator=torch.Generator().manual_seed(step))
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).backward()
            o.step()
    ref_params = [q.detach() for q in ref_model.parameters()]
    d = assert_close_to_reference(list(model.parameters()), ref_params, init, "fsdp forward/backward")
    log(mesh, f"{tag} forward/backward: max |diff| after 3 steps {d:.2e}")


def check_torch_muon_uneven(mesh, tag: str) -> None:
    """torch.optim.Muon on uneven DTensor shards: report whether it crashes; ours must not."""
    shape = (10, 7)
    if shape[0] % mesh.size() == 0:
        return
    full = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(8))
    theirs = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    ours = nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    crashed = None
    try:
        theirs.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
        torch.optim.Muon([theirs], lr=LR).step()
    except Exception as e:  # noqa: BLE001 - we only report it
        crashed = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    ours.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    Muon([ours], lr=LR).step()
    ref = full.clone().requires_grad_()
    ref.grad = grad.clone()
    torch.optim.Muon([ref], lr=LR).step()
    d = assert_close_to_reference([ours], [ref.detach()], [full], "uneven")
    log(
        mesh,
        f"{tag} uneven {shape}: torch.optim.Muon on DTensor -> {crashed or 'no crash'}; ours OK ({d:.1e})",
    )


def check_dcp(mesh, tag: str, ckpt_dir: str) -> None:
    """Save model + optimizer after K steps with DCP, load into fresh objects, continue N steps:
    bitwise equal to the uninterrupted run. NorMuon on 3 and 4 ranks (uneven and empty shards of its
    per-row state), Muon on 1 and 2."""
    K, N = 3, 4
    variant = "normuon" if mesh.size() > 2 else "muon"
    kw = dict(lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", variant=variant)

    def build():
        model = make_model(2)
        fully_shard(model, mesh=mesh)
        return model, Muon(model.parameters(), **kw, bucket_numel=100)

    def run(model, opt, steps):
        params = list(model.parameters())
        for step in steps:
            set_sharded_grads(params, full_grads(step, 99))
            opt.step()
            opt.zero_grad()

    model, opt = build()
    run(model, opt, range(K))
    msd, osd = get_state_dict(model, opt)
    pg = mesh.get_group()
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir, process_group=pg)
    run(model, opt, range(K, K + N))
    expected = [p.full_tensor() for p in model.parameters()]

    model2, opt2 = build()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ckpt_dir, process_group=pg)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    keys = {"momentum_buffer", "second_moment"} if variant == "normuon" else {"momentum_buffer"}
    for p in model2.parameters():
        assert set(opt2.state[p]) == keys, opt2.state[p].keys()
        v = opt2.state[p].get("second_moment", p)
        assert isinstance(v, DTensor) and v.placements == p.placements and v.shape[0] == p.shape[0]
    run(model2, opt2, range(K, K + N))
    got = [p.full_tensor() for p in model2.parameters()]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    log(mesh, f"{tag} dcp save/load/resume: bitwise equal ({variant})")


def check_clip(mesh, tag: str) -> None:
    """muonrun.train.clip on FSDP2 (or HSDP) shards, uneven and empty ones included, against torch's
    clip_grad_norm_ on the full gradients: the same norm on every rank and the same clipped rows."""
    model = make_model(3)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    for max_norm in (1.0, 1e9, float("inf")):  # clips, does not clip, only measures
        grads = full_grads(0, 5)
        set_sharded_grads(params, grads)
        ref = [nn.Parameter(torch.zeros_like(g)) for g in grads]
        for q, g in zip(ref, grads, strict=True):
            q.grad = g.clone()
        expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        norm = clip_grad_norm(params, max_norm)
        assert not isinstance(norm, DTensor) and expected > 1.0, (norm, expected)
        torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
        for p, q in zip(params, ref, strict=True):
            torch.testing.assert_close(p.grad._local_tensor, local_part(q.grad, p), rtol=1e-6, atol=0)
    log(mesh, f"{tag} clip: norms and clipped shards match torch")


def check_local_adamw(mesh, tag: str) -> None:
    """muonrun's AdamW on FSDP2 (or HSDP) shards, uneven and empty ones included, against
    torch.optim.AdamW on the full tensors: the same rows after three steps (torch's default loop and
    the fused kernel), moments kept as DTensors (DCP), its telemetry (the same on every rank) equal
    to the reference's last step, and a gradient laid out unlike its parameter refused."""
    for fused in (None, True):
        model = make_model(4)
        ref = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        kw = dict(lr=0.01, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)
        opt, ref_opt = AdamW(params, **kw), torch.optim.AdamW(ref, **kw)
        opt.collect_telemetry = fused is None
        for step in range(3):
            grads = full_grads(step, 7)
            set_sharded_grads(params, grads)
            for q, g in zip(ref, grads, strict=True):
                q.grad = g.clone()
            before = [q.detach().clone() for q in ref]
            opt.step()
            ref_opt.step()
        if opt.collect_telemetry:
            assert set(opt.telemetry) == {"update_rms", "momentum_norm"}, opt.telemetry
            numel = sum(q.numel() for q in ref)
            update = [(q.detach() - b).square().sum() for q, b in zip(ref, before, strict=True)]
            momentum = [ref_opt.state[q]["exp_avg"].square().sum() for q in ref]
            torch.testing.assert_close(
                opt.telemetry["update_rms"], (sum(update) / numel).sqrt(), rtol=1e-5, atol=0
            )
            torch.testing.assert_close(
                opt.telemetry["momentum_norm"], sum(momentum).sqrt(), rtol=1e-5, atol=0
            )
        else:
            assert opt.telemetry == {}, opt.telemetry
        for p, q in zip(params, ref, strict=True):
            torch.testing.assert_close(p._local_tensor, local_part(q.detach(), p), rtol=1e-6, atol=1e-7)
            assert (
                isinstance(opt.state[p]["exp_avg"], DTensor)
                and opt.state[p]["exp_avg"].placements == p.placements
            )
            torch.testing.assert_close(
                opt.state[p]["exp_avg_sq"]._local_tensor, local_part(ref_opt.state[q]["exp_avg_sq"], p)
            )
    p = params[0]
    p.grad = DTensor.from_local(torch.ones(p.shape), p.device_mesh, [Replicate()] * p.device_mesh.ndim)
    try:
        AdamW([p]).step()
    except ValueError as e:
        assert "laid out as" in str(e), e
    else:
        raise AssertionError("a Replicate gradient of a Shard(0) parameter was stepped")
    log(mesh, f"{tag} adamw: local shards match torch")


def suite(mesh, ckpt_dir: str) -> None:
    tag = f"fsdp shard group of {mesh.size()}"
    check_equivalence(mesh, tag)
    check_fsdp_backward(mesh, tag)
    check_torch_muon_uneven(mesh, tag)
    check_dcp(mesh, tag, ckpt_dir)
    check_clip(mesh, tag)
    check_local_adamw(mesh, tag)


def main() -> None:
    ckpt_root = sys.argv[1]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    all_checks(ckpt_root, rank, dist.get_world_size())
    # Torch keeps the meshes (and their gloo groups and threads) alive past destroy_process_group, to die
    # in interpreter teardown, where they can abort the process: release_process_groups frees them now.
    destroy()
    assert gloo_threads(), "no gloo thread before the release: this check would prove nothing"
    release_process_groups()
    assert not gloo_threads(), gloo_threads()
    if rank == 0:
        print("MUON_WORKER_OK", flush=True)


def all_checks(ckpt_root: str, rank: int, world: int) -> None:
    if world == 4:
        # every rank takes part in creating every mesh (new_group is collective over the world)
        three, one = DeviceMesh("cpu", [0, 1, 2]), DeviceMesh("cpu", [3])
        suite(three if rank < 3 else one, os.path.join(ckpt_root, "three" if rank < 3 else "one"))
        dist.barrier()
        pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp_shard"))
        suite(pairs["dp_shard"], os.path.join(ckpt_root, f"pair{pairs.get_local_rank(0)}"))
        dist.barrier()
    suite(init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)), os.path.join(ckpt_root, "all"))
    if world == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        check_equivalence(mesh2d, "hsdp 2x2", ALL_COMBOS[::3])
        check_clip(mesh2d, "hsdp 2x2")
        check_local_adamw(mesh2d, "hsdp 2x2")


def gloo_threads() -> list[str]:
    return [name for t in Path("/proc/self/task").glob("*/comm") if "gloo" in (name := t.read_text().strip())]


if __name__ == "__main__":
    main()
