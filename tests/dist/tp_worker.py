"""Muon, clipping and telemetry on tensor-parallel layouts, run by tests/test_tensor_parallel.py under
torch.distributed.run (gloo, CPU, 4 ranks).

usage: tp_worker.py

Every rank builds the same full matrices and gradients from fixed seeds. A toy of column-wise and
row-wise Linear pairs (uneven sizes: rows not divisible by the tp or dp size, an empty FSDP shard) is
split with torch's `parallelize_module` over the "tp" axis and FSDP2's `fully_shard` over the others,
as muonrun's trainer does, on three meshes: tp 2 x dp 2, tp 4, and tp 2 with HSDP (2 replicas x 1
shard x tp 2). An unsharded copy is stepped by torch.optim.Muon (NorMuon: ``NorMuonReference``,
written from the paper), and each rank compares its own part, without communication, within the
bound the FSDP equivalence uses; muonrun's AdamW is compared with torch's the same way. Each matrix is orthogonalised once per job (``stats``), gradient
clipping equals torch's on the full gradients, and telemetry equals the reference's. A tiny Qwen3
(per-head q_norm/k_norm, which transformers' plan replicates with partial gradients) split by
muonrun's own ``parallelize`` on tp 2 x dp 2, with sequence parallelism between its blocks: after one
backward of the same batch, and the sum of the partial gradients, every rank's part of every gradient
equals the unsplit model's. Global rank 0
prints ``TP_WORKER_OK`` at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from muonrun.compat import local_shape_and_offset
from muonrun.distributed import destroy, dp_mesh, release_process_groups, tp_mesh
from muonrun.optim import AdamW, Muon
from muonrun.train.clip import clip_grad_norm
from tests.dist.muon_worker import LR, RTOL, NorMuonReference, reference_ns

# (hidden, inner) per pair: up [inner, hidden] column-wise, down [hidden, inner] row-wise. 10 rows over
# tp 4 leave chunks of 3, 3, 3, 1; 6 over tp 4 x dp: an empty FSDP shard; 7 columns over tp 2: 4 and 3.
PAIRS = [(6, 10), (7, 12), (6, 10)]
MESHES = {"tp 2 x dp 2": (2, 2), "tp 4": (1, 4), "tp 2 hsdp 2x1": (2, 1, 2)}


class Pair(nn.Module):
    def __init__(self, hidden: int, inner: int):
        super().__init__()
        self.up, self.down = nn.Linear(hidden, inner, bias=False), nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down(self.up(x[:, : self.up.in_features])).square().mean()


class Pairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Pair(h, i) for h, i in PAIRS)

    def forward(self, x):
        return sum(b(x) for b in self.blocks)


def build(shape) -> tuple[Pairs, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Pairs()
    full = [p.detach().clone() for p in model.parameters()]
    names = ("dp_replicate", "dp_shard", "tp")[-len(shape) :]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for block in model.blocks:
        parallelize_module(block, tp_mesh(mesh), {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh(mesh))
    fully_shard(model, mesh=dp_mesh(mesh))
    return model, full


def part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """The rectangle of ``full`` this rank holds for ``like``."""
    (rows, cols), (r0, c0) = local_shape_and_offset(like)
    return full[r0 : r0 + rows, c0 : c0 + cols]


def grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(o, i, generator=g) for h, i in PAIRS for o, i in ((i, h), (h, i))]


def set_grads(params, full) -> None:
    for p, g in zip(params, full, strict=True):
        p.grad = DTensor.from_local(
            part(g, p).clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
        )


def step_both(opt, params, ref_opt, ref, steps: int) -> None:
    """`steps` steps of ours on the split parameters and the reference on the full ones, same gradients."""
    for step in range(steps):
        g = grads(step)
        set_grads(params, g)
        for r, gi in zip(ref, g, strict=True):
            r.grad = gi.clone()
        opt.step()
        ref_opt.step()


def check(tag: str, shape, variant: str, nesterov: bool, wd: float, fn) -> None:
    model, full = build(shape)
    params = list(model.parameters())
    ref = [f.clone() for f in full]
    kw = dict(lr=LR, weight_decay=wd, nesterov=nesterov, adjust_lr_fn=fn)
    opt = Muon(params, variant=variant, ns_dtype=torch.bfloat16, **kw)
    opt.collect_telemetry = True
    if variant == "normuon":
        ref_opt = NorMuonReference(ref, reference_ns(False, False, torch.bfloat16), **kw)
    else:
        ref_opt = torch.optim.Muon(ref, **kw)
    step_both(opt, params, ref_opt, ref, steps=4)
    for i, (p, q, q0) in enumerate(zip(params, ref, full, strict=True)):
        mine, theirs = p._local_tensor, part(q, p)
        diff = (mine - theirs).abs().max().item() if mine.numel() else 0.0
        moved = (q - q0).abs().max().item()
        assert diff <= RTOL * moved + 1e-7, (
            f"{tag}: rank {dist.get_rank()} matrix {i}: {diff:.3e} vs {moved:.3e}"
        )
    done = torch.tensor([opt.stats["orthogonalized"]])
    dist.all_reduce(done)
    replicas = shape[0] if len(shape) == 3 else 1
    assert int(done) == 4 * len(params) * replicas, (tag, int(done))  # once per step, matrix and replica
    momentum = torch.stack([ref_opt.state[r]["momentum_buffer"].norm() for r in ref]).norm()
    torch.testing.assert_close(opt.telemetry["momentum_norm"], momentum, rtol=1e-4, atol=0)


def check_adamw(tag: str, shape) -> None:
    """muonrun's AdamW steps each rank's part of a tensor-parallel matrix as torch's steps the whole."""
    model, full = build(shape)
    params = list(model.parameters())
    ref = [f.clone() for f in full]
    opt, ref_opt = AdamW(params, lr=LR, weight_decay=0.1), torch.optim.AdamW(ref, lr=LR, weight_decay=0.1)
    step_both(opt, params, ref_opt, ref, steps=3)
    for i, (p, q) in enumerate(zip(params, ref, strict=True)):
        torch.testing.assert_close(
            p._local_tensor, part(q, p), rtol=1e-5, atol=1e-7, msg=f"{tag}: matrix {i}"
        )


def check_clip(tag: str, shape) -> None:
    model, full = build(shape)
    params = list(model.parameters())
    g = grads(7)
    set_grads(params, g)
    ref = [f.clone().requires_grad_() for f in full]
    for r, gi in zip(ref, g, strict=True):
        r.grad = gi.clone()
    norm = clip_grad_norm(params, 1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad._local_tensor, part(r.grad, p), rtol=1e-5, atol=1e-7)


def check_model_grads() -> None:
    """muonrun's parallelize on a tiny Qwen3 at tp 2 x dp 2: the layers' norms run on half the sequence
    (sequence parallelism), and the gradients of one backward equal the unsplit model's on every rank's
    part, q_norm/k_norm's once their tp parts are summed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from muonrun.config import load_config
    from muonrun.model.causal_lm import CausalLMWithLoss
    from muonrun.model.parallelize import parallelize

    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = CausalLMWithLoss(Qwen3ForCausalLM(config), loss_chunk_tokens=0)
    full = CausalLMWithLoss(Qwen3ForCausalLM(config), loss_chunk_tokens=0)
    full.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    full(ids, ids).backward()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    partial = parallelize(model, mesh, load_config("tiny", ["parallel.compile=false"]).parallel, "cpu")
    assert len(partial.modules) == 2 * 2, partial.modules  # q_norm and k_norm of each layer
    seen = []  # sequence parallelism: the norms between the blocks see the tp rank's share of the sequence
    for layer in model.lm.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.register_forward_hook(
                lambda m, args, out: seen.append((args[0].placements, out.to_local().shape))
            )
    model(ids, ids).backward()
    assert seen == [((Shard(1),), (2, 8, 32))] * 4, seen
    partial.sum_()
    expected = dict(full.named_parameters())
    for name, p in model.named_parameters():
        shape, offset = local_shape_and_offset(p.grad)
        whole = expected[name].grad[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        torch.testing.assert_close(p.grad.to_local(), whole, rtol=1e-4, atol=1e-6, msg=name)


def main() -> None:
    dist.init_process_group("gloo")
    check_model_grads()
    if dist.get_rank() == 0:
        print("qwen3 at tp 2 x dp 2: gradients OK", flush=True)
    for tag, shape in MESHES.items():
        combos = [
            ("muon", True, 0.1, None),
            ("muon", False, 0.0, "match_rms_adamw"),
            ("normuon", True, 0.1, "original"),
        ]
        for variant, nesterov, wd, fn in combos:
            check(tag, shape, variant, nesterov, wd, fn)
        check_adamw(tag, shape)
        check_clip(tag, shape)
        if dist.get_rank() == 0:
            print(f"{tag}: {len(combos)} combinations, AdamW and clip OK", flush=True)
    if dist.get_rank() == 0:
        print("TP_WORKER_OK", flush=True)
    destroy()
    release_process_groups()


if __name__ == "__main__":
    main()
