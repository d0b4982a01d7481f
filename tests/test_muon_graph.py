"""Muon's step replayed from a CUDA graph (on GPUs, ``muonrun.optim.local``): the same
arithmetic as the plain step while the learning rate changes every step, for dense matrices and
stacked experts, Muon and NorMuon; a new graph when the matrices or the state change. The CPU runs the
graph's path without capturing (the same buffers and scalars, eagerly); the GPU test captures."""

from __future__ import annotations

import pytest
import torch

from muonrun.optim import Muon
from muonrun.optim.local import StepGraph

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

SHAPES = [(16, 48), (40, 8), (24, 24), (16, 48), (8, 24)]
EXPERTS = (3, 32, 48)  # three experts, each a fused gate/up pair of 16 x 48 matrices
LRS = [0.05, 0.02, 0.04, 0.0, 0.03, 0.01, 0.05, 0.025]  # a schedule that changes every step, zero included


def make_params(device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(40)
    return [torch.randn(s, generator=g).to(device) for s in [*SHAPES, EXPERTS]]


def make_muon(params: list[torch.Tensor], graphed: bool, streams: int = 3, **kw) -> Muon:
    """Two dense groups with their own weight decay and lr scaling, and a group of stacked experts; the
    Gram form (its split restart on the 16 x 48 matrices and the experts, its norm folded)."""
    groups = [
        {"params": params[:3]},
        {"params": params[3:5], "weight_decay": 0.0, "adjust_lr_fn": "match_rms_adamw"},
        {"params": params[5:], "matrices_per_expert": 2},
    ]
    opt = Muon(groups, lr=LRS[0], weight_decay=0.1, gram=True, ns_dtype=torch.bfloat16, **kw)
    opt.graphs, opt.graph_streams = graphed, streams
    return opt


def step_all(opts: list[Muon], params: list[list[torch.Tensor]], step: int, telemetry: bool = False) -> None:
    g = torch.Generator().manual_seed(500 + step)
    grads = [torch.randn(p.shape, generator=g) for p in params[0]]
    for opt, ps in zip(opts, params, strict=True):
        for p, grad in zip(ps, grads, strict=True):
            p.grad = grad.to(p.device)
        for group in opt.param_groups:
            group["lr"] = LRS[step] * (2.0 if group.get("matrices_per_expert") else 1.0)
        opt.collect_telemetry = telemetry
        opt.step()


def assert_same(ours, ref, init, rtol):
    for p, q, q0 in zip(ours, ref, init, strict=True):
        moved = (q - q0).abs().max().item()
        assert moved > 0
        assert (p - q).abs().max().item() <= rtol * moved, tuple(p.shape)


@pytest.mark.parametrize("variant", ["muon", "normuon"])
def test_the_graphs_path_on_the_cpu_steps_as_the_plain_step(variant):
    """The graph's path (momentum into the graph's buffers, the rest reading the step's scalars from
    its tensor) against the plain step, with eager passes (within fp32 rounding: the update's scalars
    are a tensor there, host numbers in the plain step) and traced ones (the same kernels: equal).
    The learning rate changes every step, so stale scalars would show; a telemetry step runs eagerly
    in between; one graph object (the same buffers) serves every step."""
    init = make_params()
    for traced in (False, True):
        runs = {graphed: [p.clone() for p in init] for graphed in (False, True)}
        # the graphed one as GPU runs build it, on 3 streams: on a CPU it has none
        opts = {graphed: make_muon(ps, graphed, variant=variant) for graphed, ps in runs.items()}
        if traced:
            for opt in opts.values():
                opt.compile_backend = lambda gm, example_inputs: gm.forward
        graphs = []
        for step in range(len(LRS)):
            step_all(list(opts.values()), list(runs.values()), step, telemetry=step == 4)
            graphs.append(opts[True]._graph)
        assert opts[False]._graph is None
        assert graphs[0] is not None and all(g is graphs[0] for g in graphs), "one graph for every step"
        assert len(graphs[0].buffers) == 2  # one bucket of the dense matrices, one chunk of experts
        assert graphs[0].lanes.streams == []
        assert opts[True].stats == opts[False].stats
        assert (
            opts[True].telemetry.keys()
            == opts[False].telemetry.keys()
            == {
                "update_rms",
                "momentum_norm",
                "ortho_residual",
            }
        )
        if traced:
            for p, q in zip(runs[True], runs[False], strict=True):
                assert torch.equal(p, q)
        else:
            assert_same(runs[True], runs[False], init, rtol=1e-5)


def test_a_graph_is_made_anew_for_other_matrices_or_a_loaded_state():
    """A matrix without a gradient changes the step's units, a loaded state dict the state tensors'
    addresses: either gives a new graph (new buffers); the same matrices keep theirs."""
    ps = make_params()
    opt = make_muon(ps, graphed=True)
    step_all([opt], [ps], 0)
    first = opt._graph
    step_all([opt], [ps], 1)
    assert opt._graph is first
    ps[0].grad = None
    opt.step()
    assert opt._graph is not first and len(opt._graph.buffers) == len(first.buffers)
    second = opt._graph
    opt.load_state_dict(opt.state_dict())
    assert opt._graph is None
    step_all([opt], [ps], 2)
    assert opt._graph is not None and opt._graph is not second


@pytest.mark.gpu
def test_on_a_gpu_a_replayed_step_is_the_plain_step():
    """On a GPU the graph is captured after its warm-up steps and replayed: every step equal to the
    plain step's (the passes compiled in both), the lr changing every step, a telemetry step eager in
    the middle, for Muon and NorMuon (quack's products where installed), the split restart's compiled
    splits inside the graph; Muon's counters advance as if each step ran. Its stacks on three streams
    give the one-stream graph's steps bit for bit; ``eager`` makes no graph."""
    from muonrun.optim import NewtonSchulz
    from muonrun.optim.ns_quack import default_products

    ns = NewtonSchulz(gram=True, products=default_products("cuda"))
    init = make_params("cuda")
    kinds = {"plain": (False, 1), "graphed": (True, 1), "lanes": (True, 3)}
    for variant in ("muon", "normuon"):
        runs = {kind: [p.clone() for p in init] for kind in kinds}
        opts = {kind: make_muon(ps, *kinds[kind], variant=variant) for kind, ps in runs.items()}
        for opt in opts.values():
            opt.newton_schulz = ns
        captured_at = None
        for step in range(len(LRS)):
            step_all(list(opts.values()), list(runs.values()), step, telemetry=step == 6)
            if captured_at is None and opts["graphed"]._graph.graph is not None:
                captured_at = step
        assert captured_at == StepGraph.warmup_steps, captured_at
        assert len(opts["lanes"]._graph.lanes.streams) == 3 and opts["lanes"]._graph.graph is not None
        assert opts["graphed"].stats == opts["plain"].stats == opts["lanes"].stats
        assert opts["plain"].stats["orthogonalized"] > 0 and opts["plain"]._graph is None
        for p, q in zip(runs["lanes"], runs["graphed"], strict=True):
            assert torch.equal(p, q), (variant, tuple(p.shape))
        for p, q in zip(runs["graphed"], runs["plain"], strict=True):  # compiled passes read the same tensor
            assert torch.equal(p, q), (variant, tuple(p.shape))
    eager = Muon([p.clone() for p in init[:2]], eager=True)
    for p in eager.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    eager.step()
    assert eager._graph is None and not eager._passes.compiled


def test_a_resume_through_dcps_state_dict_helpers_continues_as_the_plain_step():
    """A checkpoint's way in and out (``torch.distributed.checkpoint.state_dict``, as muonrun's
    checkpointer calls it): the graphed Muon saved after three steps, loaded into a new one (whose
    graph the load drops) and stepped on, ends where the plain Muon does without stopping."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def model() -> nn.Module:
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(24, 48, bias=False), nn.Linear(48, 16, bias=False))

    def train(m: nn.Module, opt: Muon, steps: range) -> None:
        for step in steps:
            g = torch.Generator().manual_seed(700 + step)
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.param_groups[0]["lr"] = LRS[step]
            opt.step()
            opt.zero_grad(set_to_none=True)

    def muon(m: nn.Module, graphed: bool) -> Muon:
        opt = Muon(m.parameters(), lr=LRS[0], gram=True, variant="normuon")
        opt.graphs = graphed
        return opt

    init = [p.detach().clone() for p in model().parameters()]
    plain = model()
    train(plain, muon(plain, False), range(6))
    first = model()
    opt = muon(first, True)
    train(first, opt, range(3))
    saved = get_optimizer_state_dict(first, opt)
    resumed = model()
    resumed.load_state_dict(first.state_dict())
    opt = muon(resumed, True)
    train(resumed, opt, range(1))  # a graph made before the load, with the wrong state: dropped by it
    resumed.load_state_dict(first.state_dict())
    assert opt._graph is not None
    set_optimizer_state_dict(resumed, opt, saved)
    assert opt._graph is None
    train(resumed, opt, range(3, 6))
    # within fp32 rounding: the graph's update reads its scalars from a tensor, the plain one host numbers
    assert_same(list(resumed.parameters()), list(plain.parameters()), init, rtol=1e-5)
