"""Muon on stacked experts under FSDP2, run by tests/test_moe.py under torch.distributed.run (gloo, CPU).

usage: moe_worker.py

Every rank builds the same expert stacks ([E, 2I, H] fused gate/up, [E, H, I] down; or GPT-OSS's and
Llama4's [E, in, out] layouts) and gradients from fixed seeds, shards a copy with ``fully_shard`` (dim 0:
whole experts per rank) and keeps a reference of every expert matrix as its own plain 2-D tensor: gate
rows, up rows and down of each expert. Plain Muon is compared with torch.optim.Muon on those matrices;
NorMuon, fp32 Newton–Schulz and the Gram form with its split restart with our Muon on them (itself
checked against torch and the paper in tests/test_muon.py). On 3 ranks the expert counts cover even
(3), uneven (5) and a rank holding no expert (2 and 4 experts: torch.chunk gives the last rank none).
Comparisons use each rank's own experts, without communication. Global rank 0 prints
``MOE_WORKER_OK`` at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from muonrun.distributed import destroy, release_process_groups
from muonrun.optim import Muon, NewtonSchulz, split_params
from muonrun.optim.groups import ExpertLayout
from muonrun.optim.newton_schulz import gram_iterations

H, INTER = 32, 8  # expert matrices 8 x 32 and 32 x 8: wide enough for the Gram form's split restart
LR = 0.05
RTOL = 0.02  # bf16: one ulp of a matrix's norm moves its update by ~0.4%; a wrong expert by 100%
RTOL_FP32 = 1e-4


class ToyExperts(nn.Module):
    """Stacked expert weights laid out as transformers' Qwen2MoeExperts ([E, 2I, H] gate then up, [E, H, I]),
    GptOssExperts ([E, H, 2I] gate and up interleaved, [E, I, H], declared) or Llama4TextExperts ([E, H, 2I]
    gate then up, [E, I, H], undeclared)."""

    def __init__(self, n: int, layout: str = "qwen2_moe"):
        super().__init__()
        transposed = layout != "qwen2_moe"
        self.hidden_size = H
        self.gate_up_proj = nn.Parameter(torch.empty((n, H, 2 * INTER) if transposed else (n, 2 * INTER, H)))
        self.down_proj = nn.Parameter(torch.empty((n, INTER, H) if transposed else (n, H, INTER)))
        if layout == "gpt_oss":  # what transformers' use_experts_implementation sets
            self.is_transposed, self.is_concatenated = True, False


class Toy(nn.Module):
    def __init__(self, counts: list[int], seed: int, layout: str = "qwen2_moe"):
        super().__init__()
        self.layers = nn.ModuleList(ToyExperts(n, layout) for n in counts)
        self.proj = nn.Linear(H, H, bias=False)  # a 2-D matrix next to them: the all-to-all path
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def expert_matrices(full: torch.Tensor, name: str, layout: str = "qwen2_moe") -> list[torch.Tensor]:
    """Every expert's [out, in] matrices of a full stacked tensor (or a rank's shard), as views: gate and
    up apart for gate_up_proj, read as each layout stores them."""
    k = 2 if name.endswith("gate_up_proj") else 1
    mats = []
    for e in full:
        w = e if layout == "qwen2_moe" else e.T  # [k * out, in]
        mats += [w[0::2], w[1::2]] if k == 2 and layout == "gpt_oss" else list(w.chunk(k, dim=0))
    return mats


class FromX(NewtonSchulz):
    """The Gram form restarting from X everywhere (Muon's restarts from its first Gram matrix where the
    matrix is 3 times wider than tall, as every expert matrix here is)."""

    def iterate(self, X, fold_eps=None, out=None):
        return gram_iterations(X, self.coefficients, fold_eps=fold_eps, out=out)


def full_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def run(
    mesh, counts, variant, ns_dtype, adjust_lr_fn, nesterov, weight_decay, fused, layout, gram, ref_split=None, steps=4
) -> float:
    """Step a sharded Toy and the per-matrix reference; return the worst relative error seen. ``fused``:
    the elementwise passes traced by dynamo (the backend runs its graph as it is), as on GPUs; ``layout``:
    the family whose expert layout the Toy copies; ``gram``: the Gram form with its split restart (the
    Muon presets' Newton–Schulz), on the stacks and on the reference's separate matrices alike
    (``ref_split``: the reference's split restart, where it differs)."""
    model = Toy(counts, seed=7, layout=layout)
    ref_model = Toy(counts, seed=7, layout=layout)
    fully_shard(model, mesh=mesh)
    split = split_params(model)
    assert [n for n, _ in split.experts] == [n for n, p in model.named_parameters() if p.ndim == 3], split
    assert [n for n, _ in split.muon] == ["proj.weight"], split.names()
    transposed, interleaved = layout != "qwen2_moe", layout == "gpt_oss"
    for n, _ in split.experts:
        two = n.endswith("gate_up_proj")
        expected = ExpertLayout(2 if two else 1, transposed, interleaved and two)
        assert split.expert_layouts[n] == expected, (n, split.expert_layouts[n])
    kw = dict(lr=LR, weight_decay=weight_decay, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = Muon(
        [{"params": [p for _, p in split.muon]}, *split.expert_groups()],
        variant=variant,
        ns_dtype=ns_dtype,
        gram=gram,
        **kw,
    )
    if fused:
        opt.compile_backend = "eager"
    ref_names, ref_params = [], []
    for n, p in ref_model.named_parameters():
        mats = [p.data] if p.ndim == 2 else expert_matrices(p.data, n, layout)
        ref_names += [n] * len(mats)
        ref_params += [nn.Parameter(m.clone()) for m in mats]
    if variant == "muon" and ns_dtype == torch.bfloat16 and not gram:
        ref = torch.optim.Muon(ref_params, **kw)
    else:
        iteration = {"gram": gram} if ref_split is not False else {"newton_schulz": FromX(gram=True)}
        ref = Muon(ref_params, variant=variant, ns_dtype=ns_dtype, **iteration, **kw)
    init = [p.detach().clone() for p in ref_params]
    for step in range(steps):
        grads = full_grads(ref_model, step)
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements)
        i = 0
        for n, p in ref_model.named_parameters():
            mats = [grads[n]] if p.ndim == 2 else expert_matrices(grads[n], n, layout)
            for m in mats:
                ref_params[i].grad = m.clone()
                i += 1
        opt.step()
        ref.step()
    assert opt._passes.compiled == fused, opt._passes.compiled
    worst = 0.0
    for n, p in model.named_parameters():
        if p.ndim != 3:
            continue
        local = p.to_local()
        c = -(-p.shape[0] // mesh.size())
        first = mesh.get_local_rank() * c  # this rank's first expert (torch.chunk layout)
        assert local.shape[0] == max(0, min(p.shape[0], first + c) - first), (n, tuple(local.shape))
        k = 2 if n.endswith("gate_up_proj") else 1
        if variant == "normuon":  # one entry per output neuron of each expert matrix, sharded like it
            v = opt.state[p]["second_moment"]
            assert tuple(v.shape) == (p.shape[0], k * (INTER if k == 2 else H)), (n, tuple(v.shape))
        for e in range(local.shape[0]):
            for j, mine in enumerate(expert_matrices(local[e : e + 1], n, layout)):
                r = next(i for i, rn in enumerate(ref_names) if rn == n) + (first + e) * k + j
                moved = (ref_params[r].detach() - init[r]).abs().max()
                err = ((mine - ref_params[r].detach()).abs().max() / moved).item()
                worst = max(worst, err)
    return worst


def telemetry_matches_what_the_step_did(opt, experts) -> None:
    """A step with telemetry over every rank's experts: the update's RMS and the momentum's norm equal
    what the step changed and holds, summed over the ranks here."""
    before = [p.to_local().clone() for p in experts]
    opt.collect_telemetry = True
    opt.step()
    sums = torch.zeros(2)
    for p, b in zip(experts, before, strict=True):
        sums[0] += (p.to_local() - b).square().sum()
        sums[1] += opt.state[p]["momentum_buffer"].to_local().square().sum()
    dist.all_reduce(sums)
    numel = sum(p.numel() for p in experts)
    assert sums[0] > 0, "the step changed nothing"
    assert torch.allclose(opt.telemetry["update_rms"], (sums[0] / numel).sqrt(), rtol=1e-4), opt.telemetry
    assert torch.allclose(opt.telemetry["momentum_norm"], sums[1].sqrt(), rtol=1e-4), opt.telemetry


def router_bias_is_the_same_on_every_rank(mesh) -> None:
    """A sharded Qwen2-MoE with the router bias, each rank its own tokens over two micro-batches: after
    the update every rank holds the same bias, the step the summed counts of all ranks call for."""
    from muonrun.config import ModelConfig
    from muonrun.features.router_bias import BIAS, COUNTS, RouterBias, attach, routers, update_biases
    from muonrun.model.causal_lm import CausalLMWithLoss
    from muonrun.model.build import build_hf_config, build_model, init_weights

    hf = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=16,
              shared_expert_intermediate_size=48)  # fmt: skip
    m = ModelConfig(architecture="qwen2_moe", hf=hf)
    lm = build_model(m, build_hf_config(m))
    attach(lm)
    model = CausalLMWithLoss(lm, 0, router_aux_loss_coef=0.01)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, 0, torch.device("cpu"), [RouterBias(None)])
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # every rank its own data
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 16), generator=gen)
        model(ids, ids).backward()
    found = routers(model)
    local = torch.stack([getattr(r, COUNTS) for r in found])
    everyone = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, local)
    assert not all(torch.equal(everyone[0], c) for c in everyone[1:]), "ranks saw the same routing"
    total = torch.stack(everyone).sum(0)
    assert torch.all(total.sum(-1) == dist.get_world_size() * 2 * 2 * 16 * 2)  # ranks x micro x tokens x k
    update_biases(found, 0.01)
    bias = torch.stack([getattr(r, BIAS) for r in found])
    assert torch.equal(bias, 0.01 * torch.sign(total.mean(-1, keepdim=True) - total))
    biases = [torch.empty_like(bias) for _ in range(dist.get_world_size())]
    dist.all_gather(biases, bias)
    assert all(torch.equal(biases[0], b) for b in biases[1:]), biases
    if dist.get_rank() == 0:
        print("router bias equal on every rank", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    counts = [2, 3, 4, 5]  # on 3 ranks: a rank with none (2 and 4), even (3), uneven (5)
    combos = [
        ("muon", torch.bfloat16, None, True, 0.1, False, "qwen2_moe"),
        ("muon", torch.bfloat16, "match_rms_adamw", False, 0.0, False, "qwen2_moe"),
        ("muon", torch.float32, "original", True, 0.1, False, "qwen2_moe"),
        ("normuon", torch.float32, "match_rms_adamw", True, 0.1, False, "qwen2_moe"),
        ("normuon", torch.bfloat16, None, False, 0.0, False, "qwen2_moe"),
        ("muon", torch.bfloat16, None, True, 0.1, True, "qwen2_moe"),
        ("normuon", torch.float32, None, True, 0.1, True, "qwen2_moe"),
        # [E, in, out]: "original" scales gate and down differently, NorMuon's rows are output neurons
        ("muon", torch.bfloat16, "original", True, 0.1, False, "gpt_oss"),
        ("normuon", torch.float32, "original", True, 0.1, True, "gpt_oss"),
        ("normuon", torch.float32, "original", False, 0.1, False, "llama4"),
    ]
    # the Gram form with its split restart on the stacks (every expert matrix is 4 times wider than tall)
    split_muon = ("muon", torch.bfloat16, "original", True, 0.1, False, "qwen2_moe")
    combos = [(*c, False) for c in combos] + [
        (*split_muon, True),
        ("normuon", torch.bfloat16, None, True, 0.1, True, "gpt_oss", True),
    ]
    for variant, ns_dtype, adjust, nesterov, wd, fused, layout, gram in combos:
        err = run(mesh, counts, variant, ns_dtype, adjust, nesterov, wd, fused, layout, gram)
        tol = RTOL if ns_dtype == torch.bfloat16 else RTOL_FP32
        what = f"{variant} {ns_dtype} adjust_lr_fn={adjust} nesterov={nesterov} wd={wd} fused={fused} {layout}"
        what += " gram, split restart" if gram else ""
        assert err <= tol, f"rank {dist.get_rank()}: {what}: expert matrices differ by {err:.2e} (> {tol})"
        if dist.get_rank() == 0:
            print(f"{what}: worst relative difference {err:.1e}", flush=True)
    # the split restart ran on the stacks: against a reference restarting from X they part (by rounding)
    from_x = run(mesh, counts, *split_muon, gram=True, ref_split=False)
    assert from_x > 0, f"rank {dist.get_rank()}: the stacks' split restart matched a restart from X exactly"

    # Experts alone exchange nothing: no all-to-all, and every rank orthogonalises only its own matrices.
    model = Toy(counts, seed=3)
    fully_shard(model, mesh=mesh)
    experts = [p for n, p in model.named_parameters() if p.ndim == 3]
    opt = Muon([{"params": experts, "matrices_per_expert": 1}], lr=LR)
    for p in experts:
        p.grad = distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
    opt.step()
    assert opt.stats["all_to_all"] == 0, opt.stats
    mine = sum(p.to_local().shape[0] for p in experts)
    assert opt.stats["orthogonalized"] == mine, (opt.stats, mine)
    telemetry_matches_what_the_step_did(opt, experts)
    # 2 experts on 3 ranks: the last rank holds none, and still joins the telemetry's all-reduce
    lone = Toy([2], seed=5)
    fully_shard(lone, mesh=mesh)
    stack = [p for p in lone.parameters() if p.ndim == 3]
    lone_opt = Muon([{"params": stack, "matrices_per_expert": 1}], lr=LR)
    for p in stack:
        p.grad = distribute_tensor(torch.ones(p.shape), p.device_mesh, p.placements)
    telemetry_matches_what_the_step_did(lone_opt, stack)
    # the NorMuon state lives with the expert rows: [E, out], sharded like the experts
    nor = Muon([{"params": experts, "matrices_per_expert": 1}], lr=LR, variant="normuon")
    nor.step()
    for p in experts:
        v = nor.state[p]["second_moment"]
        assert tuple(v.shape) == tuple(p.shape[:2]) and v.placements == p.placements, (v.shape, v.placements)
        assert v.to_local().shape[0] == p.to_local().shape[0]
    router_bias_is_the_same_on_every_rank(mesh)
    rank = dist.get_rank()
    destroy()
    release_process_groups()
    if rank == 0:
        print("MOE_WORKER_OK", flush=True)


if __name__ == "__main__":
    main()
