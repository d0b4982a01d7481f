"""Expert parallelism's dispatch and Muon on expert-parallel experts, run by tests/test_expert_parallel.py
under torch.distributed.run (gloo, CPU, 4 ranks: 2 expert-parallel ranks x 2 FSDP ranks).

usage: ep_worker.py

A Qwen2-MoE experts module (8 experts) is split over ep 2 and FSDP-sharded over the other 2 ranks, as
muonrun's trainer does (`apply_expert_parallel`, `fully_shard`); every rank keeps an unsplit copy. Each
rank routes its own tokens (uneven splits: a skewed routing; then every token of every rank to the first
rank's experts, so the other ep rank receives none) and checks, on its own tokens, that the output and
the gradients of its inputs and routing weights equal the unsplit module's, and that the experts'
gradients, once FSDP2 has reduced them, equal the mean over the 4 ranks of the unsplit module's. Then
Muon steps the split experts and torch.optim.Muon each expert matrix of the unsplit copy (with those
mean gradients): the same matrices, within the bf16 bound of the FSDP equivalence; muonrun's AdamW
steps each rank's rows as torch's AdamW steps the unsplit copy. A Llama4 MoE block (experts that take
tokens pre-sorted and scale their inputs by the router's scores, run densely by transformers) split the
same way dispatches its top-k pairs alone: output, input and router gradients equal the unsplit
block's, the experts' reduced gradients the mean over the ranks. Global rank 0 prints ``EP_WORKER_OK``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import Qwen2MoeConfig
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

from muonrun.compat import local_shape_and_offset
from muonrun.distributed import destroy, release_process_groups
from muonrun.model.expert_parallel import apply_expert_parallel
from muonrun.optim import AdamW, Muon
from muonrun.optim.groups import ExpertLayout
from tests.dist.muon_worker import LR, RTOL

EXPERTS, HIDDEN, INNER, TOKENS, TOP_K = 8, 16, 6, 10, 2


class Holder(nn.Module):
    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts
        self.config = experts.config

    def forward(self, h, idx, w):
        return self.experts(h, idx, w)


def build() -> tuple[Holder, Qwen2MoeExperts]:
    config = Qwen2MoeConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INNER, num_experts=EXPERTS, num_experts_per_tok=TOP_K
    )
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    experts = Qwen2MoeExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    reference = Qwen2MoeExperts(copy.deepcopy(config))  # its own config: expert parallelism changes one
    reference.load_state_dict(experts.state_dict())
    return Holder(experts), reference


def routing(rank: int, skew: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    h = torch.randn(TOKENS, HIDDEN, generator=g)
    if skew:  # every pair to experts 0-3, which the first ep rank holds
        idx = torch.stack([torch.randperm(4, generator=g)[:TOP_K] for _ in range(TOKENS)])
    else:  # uneven: low experts far more often
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(TOKENS)]) // (
            1 + rank % 2
        )
        idx[:, 1] = torch.where(idx[:, 1] == idx[:, 0], (idx[:, 0] + 1) % EXPERTS, idx[:, 1])
    w = torch.rand(TOKENS, TOP_K, generator=g)
    return h, idx, w


def check(skew: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    holder, reference = build()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    apply_expert_parallel(holder, mesh["ep"])
    fully_shard(holder.experts, mesh=mesh["efsdp"])
    h, idx, w = routing(rank, skew)
    out_grad = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(99 + rank))
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()
    out = holder(hs, idx, ws)
    (out * out_grad).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref_out = reference(hr, idx, wr)
    (ref_out * out_grad).sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hs.grad, hr.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ws.grad, wr.grad, rtol=1e-5, atol=1e-6)
    received = holder.experts.muonrun_ep.received
    if skew:
        assert (received == [0]) == (mesh["ep"].get_local_rank() == 1), (rank, received)
    # the experts' reduced gradients: the mean over every rank of the unsplit module's
    for p, q in zip(holder.experts.parameters(), reference.parameters(), strict=True):
        full = q.grad.clone()
        dist.all_reduce(full)
        full /= world
        (rows, *_), (r0, *_) = local_shape_and_offset(p)
        torch.testing.assert_close(p.grad._local_tensor, full[r0 : r0 + rows], rtol=1e-5, atol=1e-6)
        q.grad = full
    # AdamW on the split experts against torch's on the unsplit copy (elementwise: each rank its rows);
    # the split experts are put back as they were for Muon
    named = dict(holder.experts.named_parameters())
    saved = {n: p._local_tensor.detach().clone() for n, p in named.items()}
    AdamW(list(named.values()), lr=LR, weight_decay=0.1).step()
    ref_adamw = {n: q.detach().clone().requires_grad_() for n, q in reference.named_parameters()}
    for n, q in reference.named_parameters():
        ref_adamw[n].grad = q.grad.clone()
    torch.optim.AdamW(list(ref_adamw.values()), lr=LR, weight_decay=0.1).step()
    for n, p in named.items():
        (rows, *_), (r0, *_) = local_shape_and_offset(p)
        want = ref_adamw[n].detach()[r0 : r0 + rows]
        torch.testing.assert_close(p._local_tensor, want, rtol=1e-5, atol=1e-7, msg=f"AdamW {n}")
        with torch.no_grad():
            p._local_tensor.copy_(saved[n])
    # Muon on the split experts against torch.optim.Muon on each expert matrix of the unsplit copy
    layouts = {
        "gate_up_proj": ExpertLayout(2).group_keys(),
        "down_proj": ExpertLayout(1).group_keys(),
    }
    opt = Muon(
        [{"params": [named[n]], **keys} for n, keys in layouts.items()], lr=LR, ns_dtype=torch.bfloat16
    )
    opt.step()
    before = {n: q.detach().clone() for n, q in reference.named_parameters()}
    for n, q in reference.named_parameters():
        k = 2 if n == "gate_up_proj" else 1
        for e in range(EXPERTS):
            for m in range(k):
                rows = slice(m * q.shape[1] // k, (m + 1) * q.shape[1] // k)
                mat = q.data[e, rows].clone().requires_grad_()
                mat.grad = q.grad[e, rows].clone()
                torch.optim.Muon([mat], lr=LR).step()
                q.data[e, rows] = mat.detach()
    for n, p in named.items():
        q, q0 = dict(reference.named_parameters())[n], before[n]
        (rows, *_), (r0, *_) = local_shape_and_offset(p)
        mine, theirs = p._local_tensor, q.detach()[r0 : r0 + rows]
        moved = (theirs - q0[r0 : r0 + rows]).abs().max().item()
        diff = (mine - theirs).abs().max().item()
        assert moved > 0 and diff <= RTOL * moved + 1e-7, (n, rank, diff, moved)


def check_llama4() -> None:
    """A Llama4 MoE block under ep 2 x efsdp 2 against the unsplit block, on each rank's own tokens."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(
        hidden_size=HIDDEN, intermediate_size=8, num_local_experts=EXPERTS // 2, num_experts_per_tok=TOP_K
    )
    torch.manual_seed(0)
    block = Llama4TextMoe(config)
    for p in block.parameters():
        nn.init.normal_(p, std=0.2)
    reference = copy.deepcopy(block)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    apply_expert_parallel(block, mesh["ep"])
    fully_shard(block.experts, mesh=mesh["efsdp"])
    h = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(20 + dist.get_rank()))
    mine, theirs = h.clone().requires_grad_(), h.clone().requires_grad_()
    out, logits = block(mine)
    ref_out, ref_logits = reference(theirs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, ref_logits)
    (out.square().sum() + logits.sum()).backward()
    (ref_out.square().sum() + ref_logits.sum()).backward()
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-6)
    ref_params = dict(reference.named_parameters())
    for name, p in block.named_parameters():
        want = ref_params[name].grad.clone()
        if name.startswith("experts."):  # FSDP2 and the dispatch: the mean over every rank
            dist.all_reduce(want)
            want /= dist.get_world_size()
            (rows, *_), (r0, *_) = local_shape_and_offset(p)
            want, got = want[r0 : r0 + rows], p.grad._local_tensor
        else:
            got = p.grad
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def main() -> None:
    dist.init_process_group("gloo")
    check_llama4()
    if dist.get_rank() == 0:
        print("llama4 block at ep 2 x efsdp 2: dispatch and gradients OK", flush=True)
    for skew in (False, True):
        check(skew)
        if dist.get_rank() == 0:
            what = "every token to one ep rank's experts" if skew else "uneven splits"
            print(f"ep 2 x efsdp 2, {what}: dispatch, gradients, AdamW and Muon OK", flush=True)
    if dist.get_rank() == 0:
        print("EP_WORKER_OK", flush=True)
    destroy()
    release_process_groups()


if __name__ == "__main__":
    main()
