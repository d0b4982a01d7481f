"""Mixture-of-experts (Qwen2-MoE): the model, its load-balancing loss and expert load, FLOPs over active
parameters, the optimizer split, Muon per expert matrix on gloo ranks (tests/dist/moe_worker.py).
`tiny-moe` end to end (exact resume, reshard on resume, the export transformers loads and generates
with): tests/test_expert_parallel.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import TINY_MOE, run_workers
from transformers.models.qwen2_moe.modeling_qwen2_moe import load_balancing_loss_func

from muonrun.config import ModelConfig
from muonrun.errors import UserError
from muonrun.features.router_bias import BIAS, COUNTS, RouterBias, attach, routers, update_biases
from muonrun.model.build import build_hf_config, build_model, flops_per_token, init_weights
from muonrun.model.causal_lm import CausalLMWithLoss
from muonrun.model.moe import active_matmul_params, expert_load, load_balancing_loss
from muonrun.optim import split_params

MOE = TINY_MOE


def moe_model(coef: float | None = 0.01, seed: int = 0, bias: bool = False) -> CausalLMWithLoss:
    m = ModelConfig(architecture="qwen2_moe", hf=dict(MOE))
    hf = build_hf_config(m)
    lm = build_model(m, hf)
    if bias:
        attach(lm)
    model = CausalLMWithLoss(lm, loss_chunk_tokens=0, router_aux_loss_coef=coef)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, seed, torch.device("cpu"), [RouterBias(None)] if bias else [])
    return model


def test_moe_model_initialises_every_expert_and_router_from_its_own_seed():
    model = moe_model()
    experts = model.lm.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (5, 32, 32) and tuple(experts.down_proj.shape) == (5, 32, 16)
    for p in (experts.gate_up_proj, experts.down_proj, model.lm.model.layers[0].mlp.gate.weight):
        assert 0.015 < p.std().item() < 0.025 and abs(p.mean().item()) < 0.005
    for e in range(4):  # every expert its own draw, not one repeated
        assert not torch.equal(experts.gate_up_proj[e], experts.gate_up_proj[e + 1])
    again = moe_model()
    assert torch.equal(
        again.lm.model.layers[1].mlp.experts.down_proj, model.lm.model.layers[1].mlp.experts.down_proj
    )


def test_the_loss_is_the_lm_loss_and_its_gradient_adds_the_router_balance():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with_aux, without = moe_model(coef=0.5), moe_model(coef=0.0)
    loss = with_aux(ids, ids)
    assert torch.equal(loss.detach(), without(ids, ids).detach())  # same value: the LM loss
    out = with_aux.lm.base_model(input_ids=ids, use_cache=False, output_router_logits=True)
    aux = torch.stack([load_balancing_loss_func((x,), 5, 2) for x in out.router_logits]).mean()  # per layer
    loss.backward()
    without(ids, ids).backward()
    router = [m.lm.model.layers[0].mlp.gate.weight.grad for m in (with_aux, without)]
    assert not torch.allclose(router[0], router[1])  # the balance term reaches the router
    values = with_aux.moe_telemetry()
    assert torch.allclose(values["aux_loss"], aux.detach())
    assert "expert_load_max_mean" not in values  # only watched (logged) steps pay for the load statistics
    with_aux.watch_experts = True
    with torch.no_grad():
        with_aux(ids, ids)
    assert with_aux.moe_telemetry() == {}  # evaluation: no aux loss, no statistics


def test_the_balance_loss_is_per_layer_so_layers_crowding_onto_different_experts_are_seen():
    """Layer 0 sends every token to experts {0, 1}, layer 1 to {2, 3}: pooled over layers (transformers'
    function) they look nearly balanced; per layer each is far from its balanced value k = 2."""
    hf = build_hf_config(ModelConfig(architecture="qwen2_moe", hf=dict(MOE)))
    noise = torch.randn(64, 5, generator=torch.Generator().manual_seed(0)) * 0.1
    crowd = [noise + torch.tensor([3.0, 3.0, 0.0, 0.0, 0.0]), noise + torch.tensor([0.0, 0.0, 3.0, 3.0, 0.0])]
    pooled = load_balancing_loss_func(tuple(crowd), 5, 2).item()
    per_layer = load_balancing_loss(tuple(crowd), hf).item()
    each = [load_balancing_loss_func((x,), 5, 2).item() for x in crowd]  # transformers' on one layer
    assert per_layer == pytest.approx(sum(each) / 2, rel=1e-5)
    assert per_layer > 1.5 * pooled and per_layer > 4.0, (per_layer, pooled)
    even = load_balancing_loss((torch.zeros(10, 5).index_fill_(1, torch.tensor([0, 1]), 0.0),), hf)
    assert even.item() == pytest.approx(2 * 5 * 0.2)  # ties: experts 0, 1 chosen, uniform probabilities


def test_router_z_loss_trains_and_is_logged_apart():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    model = moe_model(coef=0.0)
    model.router_z_loss_coef = 0.5
    loss = model(ids, ids)
    out = model.lm.base_model(input_ids=ids, use_cache=False, output_router_logits=True)
    z = torch.stack([torch.logsumexp(x, -1).square().mean() for x in out.router_logits]).mean()
    assert torch.equal(loss.detach(), moe_model(coef=0.0)(ids, ids).detach())
    assert torch.allclose(model.moe_telemetry()["z_loss"], z.detach())
    loss.backward()
    assert model.lm.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0  # the z-loss reaches the router


def test_expert_load_reports_the_busiest_expert_and_router_entropy():
    even = torch.zeros(8, 4)  # undecided router: entropy log 4, top-2 ties all on experts 0 and 1
    skewed = torch.tensor([[9.0, 0.0, 0.0, 0.0], [0.0, 9.0, 0.0, 0.0]] * 4)
    values = expert_load((even, skewed), top_k=1)
    assert values["router_entropy_0"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert values["expert_load_max_mean_1"].item() == pytest.approx(2.0)  # half the tokens each on 2 of 4
    assert values["expert_load_max_mean"].item() == pytest.approx(4.0)  # layer 0: all on expert 0
    assert values["router_entropy_1"].item() < 0.01


def test_flops_count_the_active_experts_only():
    hf = build_hf_config(ModelConfig(architecture="qwen2_moe", hf=dict(MOE)))
    active = active_matmul_params(hf)
    per_layer = 2 * 3 * 32 * 16 + 5 * 32 + 3 * 32 * 48 + 32  # top-2 experts, router, shared expert + gate
    assert active == 2 * per_layer
    all_experts = dict(MOE, num_experts_per_tok=5)
    more = flops_per_token(build_hf_config(ModelConfig(architecture="qwen2_moe", hf=all_experts)), 16)
    assert more - flops_per_token(hf, 16) == 3 * 2 * 2 * (3 * 3 * 32 * 16)  # 3 more experts, 2 layers
    dense = build_hf_config(ModelConfig(architecture="qwen2", hf={k: MOE[k] for k in list(MOE)[:6]}))
    assert active_matmul_params(dense) is None


def test_experts_go_to_muon_as_stacks_and_routers_and_gates_to_adamw():
    split = split_params(moe_model())
    names = split.names()
    assert names["experts"] == [
        f"lm.model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    ]
    assert "lm.model.layers.0.mlp.gate.weight" in names["other"]  # the router
    assert "lm.model.layers.0.mlp.shared_expert_gate.weight" in names["other"]
    assert "lm.model.layers.0.mlp.shared_expert.up_proj.weight" in names["muon"]
    assert not any("experts" in n for n in names["muon"] + names["other"])


def test_experts_stored_in_out_get_their_layout_and_train_with_muon(tmp_path):
    """GPT-OSS declares its experts [E, in, out] with gate and up interleaved; Llama4 declares nothing but
    stores them [E, in, out] too. The split names each stacked parameter's layout (what Muon reads its
    matrices through: tests/dist/moe_worker.py holds it to torch.optim.Muon per matrix), GPT-OSS's stacked
    biases go to AdamW without decay, and a GPT-OSS run trains with Muon on its experts and plans their
    Newton–Schulz in the dry run."""
    from transformers import AutoModelForCausalLM, GptOssConfig, Llama4TextConfig
    from typer.testing import CliRunner

    from muonrun.cli import app
    from muonrun.optim.groups import ExpertLayout

    assert set(split_params(moe_model()).expert_layouts.values()) == {ExpertLayout(2), ExpertLayout(1)}
    sizes = dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    )
    moe = dict(num_local_experts=4, num_experts_per_tok=2, vocab_size=128, intermediate_size=48)
    configs = {
        "gpt_oss": (GptOssConfig(**sizes, **moe), ExpertLayout(2, True, True)),
        "llama4": (Llama4TextConfig(**sizes, **moe, intermediate_size_mlp=96), ExpertLayout(2, True, False)),
    }
    for family, (config, gate_up) in configs.items():
        with torch.device("meta"):
            split = split_params(AutoModelForCausalLM.from_config(config))
        layouts = {n.rsplit(".", 1)[-1]: lay for n, lay in split.expert_layouts.items()}
        assert layouts == {"gate_up_proj": gate_up, "down_proj": ExpertLayout(1, True, False)}, family
        assert family != "gpt_oss" or any(
            n.endswith("experts.gate_up_proj_bias") for n in split.names()["norm_bias"]
        )

    class SquareExperts(torch.nn.Module):  # undeclared, I == H: down_proj cannot tell, gate_up_proj can
        def __init__(self, transposed: bool) -> None:
            super().__init__()
            self.hidden_size = 8
            self.gate_up_proj = torch.nn.Parameter(torch.empty((4, 8, 16) if transposed else (4, 16, 8)))
            self.down_proj = torch.nn.Parameter(torch.empty(4, 8, 8))

    from muonrun.optim.groups import expert_layout

    for transposed in (False, True):
        assert expert_layout(SquareExperts(transposed), "gate_up_proj") == ExpertLayout(2, transposed)

    config = tmp_path / "oss.yaml"
    config.write_text(
        "model: {architecture: gpt_oss, attn_implementation: eager, hf: {vocab_size: 320, hidden_size: 64, "
        "intermediate_size: 48, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, "
        "head_dim: 16, num_local_experts: 4, num_experts_per_tok: 2}}\n"
        "data: {sources: [{path: '${stdlib:}/json/*.py'}], tokenizer: byte, seq_len: 64}\n"
        "train: {max_steps: 3, device: cpu, eval_interval: 0}\nlogging: {console: plain, log_interval: 1}\n"
        f"optimizer: {{name: muon}}\noutput_dir: {tmp_path / 'run'}\n"
    )
    planned = CliRunner().invoke(app, ["pretrain", str(config), "--dry-run"])
    assert planned.exit_code == 0 and "params in Muon" in planned.output, planned.output
    trained = CliRunner().invoke(app, ["pretrain", str(config), "--nproc-per-node", "1"])
    assert trained.exit_code == 0, trained.output
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses


@pytest.mark.slow
def test_muon_on_experts_matches_torch_muon_per_expert_matrix():
    """One 3-rank gloo launch: 2, 3, 4 and 5 experts (a rank with none, even, uneven), Muon against
    torch.optim.Muon per expert matrix (gate and up apart), fp32 and NorMuon against our Muon on the
    separate matrices, the same with the fused passes traced, the Gram form with its split restart on the
    stacks, no all-to-all, NorMuon's v sharded like the experts; the router bias the same on every rank
    after its update."""

    out = run_workers(Path(__file__).parent / "dist" / "moe_worker.py", 3, timeout=600)
    assert "MOE_WORKER_OK" in out, out
    assert out.count("worst relative difference") == 12, out
    assert "router bias equal on every rank" in out, out


def test_lora_on_a_mixture_of_experts_is_refused_naming_the_key(tmp_path):
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from muonrun.cli import app

    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(
        build_hf_config(ModelConfig(architecture="qwen2_moe", hf=dict(MOE, num_hidden_layers=4)))
    ).save_pretrained(base)  # 4 layers like tiny-moe, whose model.hf applies on top
    result = CliRunner().invoke(
        app,
        ["pretrain", "tiny-moe", "model.lora.enabled=true", "model.init=pretrained", f"model.name_or_path={base}",
         "--dry-run"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "model.lora.enabled" in result.output and "mixture-of-experts" in result.output
    assert "Traceback" not in result.output


def test_compiled_moe_layers_give_the_eager_loss_and_router_balance_without_recompiling():
    """Per-layer compile (aot_eager: the graphs autograd runs, without inductor's build time) over the
    experts path transformers picks on CPU and the router-logit capture the balance loss reads."""
    from muonrun.model.build import decoder_layers
    from muonrun.model.parallelize import apply_compile_and_checkpointing

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    eager, compiled = moe_model(coef=0.5), moe_model(coef=0.5)
    apply_compile_and_checkpointing(decoder_layers(compiled), "none", True, backend="aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for _ in range(2):
        for m in (eager, compiled):
            m.zero_grad()
            m(ids, ids).backward()
    assert torch.allclose(compiled.moe_telemetry()["aux_loss"], eager.moe_telemetry()["aux_loss"])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4), name
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["calls_captured"] > 0
    assert not counters["recompiles"], dict(counters["recompiles"])
    # each layer is one graph, shared by both: the router logits are recorded without a graph break
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1


def test_console_and_compare_show_the_router_balance_and_expert_load():
    from muonrun.observe.console import step_fields
    from muonrun.tools.compare import Run, table_metrics, telemetry_summary

    row = {
        "step": 10, "loss": 3.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1.0, "tokens_per_s_per_device": 1.0,
        "step_time": 1.0, "data_wait_time": 0.0, "aux_loss": 2.0312, "expert_load_max_mean": 1.5,
        "router_entropy": 1.7,
    }  # fmt: skip
    fields = dict(step_fields(row, 20, None))
    assert fields["aux"] == "2.0312" and fields["load"] == "1.50x"
    assert "aux" not in dict(step_fields({**row, "aux_loss": None}, 20, None))  # a dense run shows neither
    run = Run(Path("r"), "r", "muon", [{**row, "step": 5, "expert_load_max_mean": 3.0}, row])
    summary = telemetry_summary(run)
    assert summary == {"aux_loss": 2.0312, "expert_load_max_mean": 1.5, "router_entropy": 1.7}
    keys = [k for k, _, _ in table_metrics([summary])]
    assert {"aux_loss", "expert_load_max_mean", "router_entropy"} <= set(keys)


def test_dry_run_plans_expert_newton_schulz_on_the_ranks_holding_the_experts():
    from muonrun.config import load_config
    from muonrun.optim.newton_schulz import newton_schulz_flops
    from muonrun.tools.plan import plan_summary

    s = plan_summary(load_config("tiny-moe", ["optimizer.muon.gram_ns=false"]), 4)
    per_expert = 4 * (2 * newton_schulz_flops((96, 128), 5) + newton_schulz_flops((128, 96), 5))  # 4 layers
    # 6 experts on 4 ranks in torch.chunk order: 2, 2, 2, 0
    assert s["expert_ns_flops_per_rank_step"] == [2 * per_expert, 2 * per_expert, 2 * per_expert, 0]
    assert s["muon_parameters"] > 4 * (6 * 3 * 128 * 96)  # the experts are in Muon, with the shared experts
    assert (
        plan_summary(load_config("tiny-moe", ["optimizer.name=adamw"]), 4)["expert_ns_flops_per_rank_step"]
        == [0] * 4
    )


def test_export_writes_the_hub_layout_of_experts_that_transformers_loads_back(tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from muonrun.checkpoint.export import hub_layout

    m = ModelConfig(architecture="qwen2_moe", hf=dict(MOE))
    hf = build_hf_config(m)
    model = AutoModelForCausalLM.from_config(hf)
    tensors = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    sd = hub_layout(tensors, model, hf)
    assert "model.layers.1.mlp.experts.4.gate_proj.weight" in sd and not any(
        k.endswith("gate_up_proj") for k in sd
    )
    fused = tensors["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(sd["model.layers.1.mlp.experts.4.up_proj.weight"], fused[4, 16:])
    save_file(
        {k: v.contiguous() for k, v in sd.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    hf.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.model.layers[1].mlp.experts.gate_up_proj, fused)
    assert torch.equal(
        loaded.model.layers[0].mlp.experts.down_proj, tensors["model.layers.0.mlp.experts.down_proj"]
    )


def test_a_router_that_is_a_linear_stays_on_adamw():
    """Some transformers versions make the router an nn.Linear `gate` beside the `experts`."""
    model = moe_model()
    block = model.lm.model.layers[0].mlp
    block.gate = torch.nn.Linear(32, 5, bias=False)
    names = split_params(model).names()
    assert "lm.model.layers.0.mlp.gate.weight" in names["other"]
    assert "lm.model.layers.0.mlp.gate.weight" not in names["muon"]


# -- auxiliary-loss-free balancing: the router bias ----------------------------------------------------------


def test_the_router_bias_changes_which_experts_run_but_not_their_gate_weights():
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    plain, biased = moe_model(), moe_model(bias=True)
    seen: dict[str, list] = {"plain": [], "biased": []}
    for key, m in (("plain", plain), ("biased", biased)):
        m.lm.model.layers[0].mlp.gate.register_forward_hook(
            lambda mod, a, out, key=key: seen[key].append(out)
        )
    with torch.no_grad():
        assert torch.equal(plain(ids, ids), biased(ids, ids))  # zero bias: the router's own choice
        getattr(biased.lm.model.layers[0].mlp.gate, BIAS)[4] = 1.0  # expert 4 into every token's top 2
        assert not torch.equal(plain(ids, ids), biased(ids, ids))
    logits, weights, chosen = seen["biased"][-1]
    assert (chosen == 4).any(-1).all()
    probs = torch.softmax(logits.float(), -1)
    assert torch.allclose(weights, probs.gather(-1, chosen))  # the gate: the unbiased probabilities
    assert not torch.equal(chosen, seen["plain"][-1][2])


def test_the_bias_moves_each_expert_by_the_rate_against_its_load_counted_once_per_forward():
    from muonrun.model.build import decoder_layers
    from muonrun.model.parallelize import apply_compile_and_checkpointing

    model = moe_model(bias=True)
    apply_compile_and_checkpointing(decoder_layers(model), "full", False)  # recompute runs the routers again
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    model(ids, ids).backward()
    with torch.no_grad():
        model(ids, ids)  # evaluation: not counted
    found = routers(model)
    counts = [getattr(r, COUNTS).clone() for r in found]
    assert all(c.sum().item() == 2 * 16 * 2 for c in counts), counts  # tokens x top-k, once each
    update_biases(found, 0.25)
    for r, c in zip(found, counts, strict=True):
        expected = 0.25 * torch.sign(c.mean() - c)
        assert torch.equal(getattr(r, BIAS), expected) and not getattr(r, COUNTS).any()
    assert {k for k in model.state_dict() if k.endswith(BIAS)} == {
        f"lm.model.layers.{i}.mlp.gate.{BIAS}" for i in range(2)
    }  # model state: checkpointed with the weights


def test_a_renormalising_router_is_followed_and_other_routers_or_dense_models_are_refused():
    class MixtralLikeRouter(torch.nn.Module):  # gate weights renormalised over the chosen experts
        def __init__(self, sigmoid: bool = False):
            super().__init__()
            self.weight, self.top_k, self.sigmoid = torch.nn.Parameter(torch.randn(5, 32)), 2, sigmoid

        def forward(self, x):
            logits = x @ self.weight.T
            scores = torch.sigmoid(logits) if self.sigmoid else torch.softmax(logits, -1)
            top, idx = scores.topk(2, -1)
            return logits, top / top.sum(-1, keepdim=True), idx

    m = ModelConfig(architecture="qwen2_moe", hf=dict(MOE))
    lm = build_model(m, build_hf_config(m))
    for layer in lm.model.layers:
        with torch.device("meta"):
            layer.mlp.gate = MixtralLikeRouter()
    assert all(r.muonrun_renormalise for r in attach(lm))
    lm.model.layers[1].mlp.gate = MixtralLikeRouter(sigmoid=True)
    with pytest.raises(UserError, match="train.router_bias_update_rate.*MixtralLikeRouter"):
        attach(lm)
    dense = ModelConfig(architecture="qwen2", hf={k: MOE[k] for k in list(MOE)[:6]})
    with pytest.raises(UserError, match="train.router_bias_update_rate.*has none"):
        attach(build_model(dense, build_hf_config(dense)))
