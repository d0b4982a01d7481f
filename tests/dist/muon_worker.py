"""Distributed Muon checks, run by tests/test_muon.py under torch.distributed.run (gloo, CPU).

usage: muon_worker.py CHECKPOINT_DIR

Every rank builds the same full matrices and gradients from fixed seeds, shards a copy with FSDP2's
``fully_shard`` and keeps an unsharded reference stepped with torch.optim.Muon (or, for
``adjust_lr_fn="spectral"`` which torch lacks, our Muon on plain tensors, itself checked against a
hand formula in test_muon.py). One launch runs all checks; rank 0 prints ``MUON_WORKER_OK`` at the end.
"""

from __future__ import annotations

import itertools
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from muonrun.optim.muon import Muon

# (out_features, in_features): parameter shape is (out, in). Includes repeated shapes (several
# owners per chunk, partial last chunk), rows not divisible by 3 or 4, fewer rows than ranks
# (3 x 5 at world 4 gives one rank an empty shard), tall, wide and square matrices.
SHAPES = [(8, 6)] * 5 + [(10, 7), (3, 5), (6, 16), (6, 16), (6, 16), (20, 4), (12, 12), (12, 12), (1, 9)]
LR = 0.05
# bf16 tolerance: the Frobenius norm that scales each Newton–Schulz input is a bf16 number whose
# rounding can differ by one ulp (2^-8) between memory layouts, which moves that matrix's update by
# ~0.4%. A misplaced row or a wrong scale moves it by 100%.
RTOL = 0.02

RANK = 0
WORLD = 1


T0 = time.perf_counter()


def log(msg: str) -> None:
    if RANK == 0:
        print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


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


def distribute_local(full: torch.Tensor, like: DTensor) -> DTensor:
    """The rows of ``full`` that this rank holds for the DTensor ``like`` (no communication)."""
    mesh = like.device_mesh
    local = full
    for md, pl in enumerate(like.placements):
        if isinstance(pl, Shard):
            local = list(torch.chunk(local, mesh.size(md), dim=0))
            r = mesh.get_local_rank(md)
            local = local[r] if r < len(local) else full.new_zeros(0, full.shape[1])
    return DTensor.from_local(
        local.clone(), mesh, like.placements, shape=like.shape, stride=like.stride(), run_check=False
    )


def reference_optimizer(params, **kw):
    if kw.get("adjust_lr_fn") == "spectral":
        return Muon(params, **kw)
    return torch.optim.Muon(params, **kw)


def max_diff(sharded, ref) -> float:
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(sharded, ref, strict=True))


def assert_close_to_reference(sharded, ref, init, what: str) -> None:
    """Per matrix: |ours - reference| <= RTOL * (how far the reference moved from init)."""
    for i, (p, q, q0) in enumerate(zip(sharded, ref, init, strict=True)):
        full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        diff = (full - q).abs().max().item()
        moved = (q - q0).abs().max().item()
        assert moved > 0 and diff <= RTOL * moved + 1e-7, (
            f"{what}: matrix {i} {tuple(q.shape)}: max |diff| {diff:.3e} vs moved {moved:.3e}"
        )


def ortho_total(opt: Muon, group=None) -> int:
    t = torch.tensor([opt.stats["orthogonalized"]], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


ALL_COMBOS = list(
    itertools.product([None, "original", "match_rms_adamw", "spectral"], [True, False], [0.0, 0.1])
)


def check_equivalence(mesh, tag: str, combos=ALL_COMBOS) -> None:
    """adjust_lr_fn x nesterov x weight decay combinations, 1 and 10 steps, vs the reference."""
    shard_dim = len(mesh.shape) - 1
    shard_group = mesh.get_group(shard_dim)
    for ci, (fn, nesterov, wd) in enumerate(combos):
        model = make_model()
        ref_params = [p.detach().clone() for p in model.parameters()]
        init = [p.clone() for p in ref_params]
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        kw = dict(lr=LR, weight_decay=wd, nesterov=nesterov, adjust_lr_fn=fn)
        # alternate one big bucket with many tiny ones (exercises the async prefetch pipeline)
        opt = Muon(params, **kw, bucket_numel=1 << 26 if ci % 2 == 0 else 200, prefetch=1 + ci % 3)
        ref = reference_optimizer(ref_params, **kw)
        for step in range(10):
            grads = full_grads(step, ci)
            set_sharded_grads(params, grads)
            for q, g in zip(ref_params, grads, strict=True):
                q.grad = g.clone()
            before = opt.stats["orthogonalized"]
            opt.step()
            ref.step()
            # every matrix orthogonalised exactly once per step in the shard group
            t = torch.tensor([opt.stats["orthogonalized"] - before], dtype=torch.int64)
            dist.all_reduce(t, group=shard_group)
            assert int(t.item()) == len(SHAPES), (tag, fn, int(t.item()))
            if step in (0, 9):
                what = f"{tag} fn={fn} nesterov={nesterov} wd={wd} step={step + 1}"
                assert_close_to_reference(params, ref_params, init, what)
        # state: one momentum buffer per matrix, a DTensor with the parameter's placements
        for p in params:
            buf = opt.state[p]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == p.placements and buf.shape == p.shape
        log(
            f"{tag} fn={fn} nesterov={nesterov} wd={wd}: max |diff| after 10 steps {max_diff(params, ref_params):.2e}"
        )
        if ci % 2 == 1:
            assert opt.stats["all_to_all"] > 2 * 10 or WORLD == 1 or mesh.size(shard_dim) == 1
    log(f"{tag}: {len(combos)} combinations OK")


def check_fsdp_backward(mesh) -> None:
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
    assert_close_to_reference(list(model.parameters()), ref_params, init, "fsdp forward/backward")
    log(f"fsdp forward/backward: max |diff| after 3 steps {max_diff(model.parameters(), ref_params):.2e}")


def check_torch_muon_uneven(mesh) -> None:
    """torch.optim.Muon on uneven DTensor shards: report whether it crashes; ours must not."""
    shape = (10, 7)
    if shape[0] % WORLD == 0:
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
    assert_close_to_reference([ours], [ref.detach()], [full], "uneven")
    d = (ours.full_tensor() - ref.detach()).abs().max().item()
    log(
        f"uneven {shape} at world {WORLD}: torch.optim.Muon on DTensor -> {crashed or 'no crash'}; ours OK ({d:.1e})"
    )


def check_dcp(mesh, ckpt_dir: str) -> None:
    """Save model + optimizer after K steps with DCP, load into fresh objects, continue N steps:
    bitwise equal to the uninterrupted run."""
    K, N = 3, 4
    kw = dict(lr=LR, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")

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
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
    run(model, opt, range(K, K + N))
    expected = [p.full_tensor() for p in model.parameters()]

    model2, opt2 = build()
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for p in model2.parameters():
        assert set(opt2.state[p]) == {"momentum_buffer"}, opt2.state[p].keys()
    run(model2, opt2, range(K, K + N))
    got = [p.full_tensor() for p in model2.parameters()]
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    log("dcp save/load/resume: bitwise equal")


def main() -> None:
    global RANK, WORLD
    ckpt_root = sys.argv[1]
    dist.init_process_group("gloo")
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))

    check_equivalence(mesh, f"fsdp world={WORLD}")
    check_fsdp_backward(mesh)
    check_torch_muon_uneven(mesh)
    check_dcp(mesh, os.path.join(ckpt_root, "dcp"))

    if WORLD == 4:
        mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        check_equivalence(mesh2d, "hsdp 2x2", ALL_COMBOS[::3])

    dist.barrier()
    log("MUON_WORKER_OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
