"""QK-clip and the max attention logit (muonrun/features/qkclip.py): the measurement against materialized logits,
the per-head rescale with grouped-query attention, the bound on a model whose logits grow, compiled
layers, the config checks, and the telemetry in metrics.jsonl, TensorBoard and `muonrun compare`.
Under FSDP2 on 2 ranks, with AdamW and Muon through the trainer: tests/dist/qkclip_worker.py (slow).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from helpers import run_workers
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from muonrun.config import ModelConfig, load_config
from muonrun.errors import UserError
from muonrun.features import enabled, qkclip
from muonrun.features.qkclip import QKClip, causal_max_logit_matmul, check_measurable
from muonrun.model.build import build_hf_config, build_model, init_weights
from muonrun.model.causal_lm import CausalLMWithLoss

# 6 query heads over 2 key heads (groups of 3), head_dim 8, Qwen2's query and key biases
HF = dict(
    vocab_size=64,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
REFERENCE = "muonrun_test_materialized"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def materialized_max_logit(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The reference: every logit of every head materialized, the causal mask applied, the max taken."""
    group = query.shape[1] // key.shape[1]
    scores = query @ key.repeat_interleave(group, dim=1).transpose(-1, -2)
    seq = scores.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=scores.device).tril()
    return scores.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3)).float()


def reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """An attention function that records each head's max of the materialized logits, then runs SDPA."""
    module.reference_max = materialized_max_logit(query, key) * scaling
    return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, **kwargs)


AttentionInterface.register(REFERENCE, reference_attention)


def make_model(seed: int = 1, qk_gain: float = 1.0, **hf) -> CausalLMWithLoss:
    m = ModelConfig(architecture="qwen2", hf={**HF, **hf})
    model = CausalLMWithLoss(build_model(m, build_hf_config(m)), 0)
    model.to_empty(device="cpu")
    init_weights(model, 0.02, seed, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in qkclip.attention_modules(model):
            for proj in (attn.q_proj, attn.k_proj):
                proj.weight.mul_(qk_gain)
                proj.bias.normal_(0.0, 0.5, generator=g)  # biases must scale with their rows
    return model


def attention_inputs(model: CausalLMWithLoss, batch: torch.Tensor) -> list[tuple[tuple, dict]]:
    """What each attention layer received in a forward of `batch` (hidden states, RoPE, ...)."""
    seen: list[tuple[tuple, dict]] = []
    hooks = [
        attn.register_forward_pre_hook(lambda _, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
        for attn in qkclip.attention_modules(model)
    ]
    model.eval()  # not counted by the tracker
    with torch.no_grad():
        model.lm.base_model(input_ids=batch, use_cache=False)
    model.train()
    for hook in hooks:
        hook.remove()
    return seen


def reference_max(model: CausalLMWithLoss, batch: torch.Tensor, inputs: list | None = None) -> torch.Tensor:
    """[layers, heads] max logits, materialized, of each attention layer on `inputs` (default: what it
    receives in a forward of `batch`): with the same inputs, a rescale of one layer does not move the
    next layer's logits through its input."""
    inputs = attention_inputs(model, batch) if inputs is None else inputs
    lm = model.lm
    lm.set_attn_implementation(REFERENCE)
    try:
        with torch.no_grad():
            for attn, (args, kwargs) in zip(qkclip.attention_modules(model), inputs, strict=True):
                attn(*args, **kwargs)
    finally:
        lm.set_attn_implementation("muonrun_causal_sdpa")
    return torch.stack([attn.reference_max for attn in qkclip.attention_modules(model)])


def ids(seed: int = 0, batch: int = 3, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, HF["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(2, 6, 2, 37, 8), (3, 4, 4, 64, 16), (1, 6, 1, 100, 32)])
def test_max_logit_is_the_largest_materialized_logit(shape, monkeypatch):
    batch, heads, kv_heads, seq, dim = shape
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(batch, heads, seq, dim, generator=g),
        torch.randn(batch, kv_heads, seq, dim, generator=g),
    )
    want = materialized_max_logit(q, k)
    assert torch.equal(causal_max_logit_matmul(q, k), want)  # fp32, one chunk: the same entry exactly
    monkeypatch.setattr(qkclip, "SCORES_PER_CHUNK", 5 * batch * heads * seq)  # chunks of 5 positions
    torch.testing.assert_close(causal_max_logit_matmul(q, k), want, rtol=1e-6, atol=0)
    # bf16 inputs: the fp32-accumulated logit rounded once to bf16
    qb, kb = q.bfloat16(), k.bfloat16()
    torch.testing.assert_close(
        causal_max_logit_matmul(qb, kb), materialized_max_logit(qb.float(), kb.float()), rtol=2**-8, atol=0
    )


def test_model_forward_measures_each_heads_largest_logit():
    """Through the model (RoPE, biases, GQA), over micro-batches (running max); eval is not counted."""
    model = make_model(qk_gain=5.0)
    tracker = QKClip(model, tau=None, device=torch.device("cpu"))
    first, second = ids(0), ids(1)
    model(first, first)
    model(second, second)
    want = torch.maximum(reference_max(model, first), reference_max(model, second))
    assert torch.equal(tracker.current, want)
    model.eval()
    model(ids(2, seq=40), ids(2, seq=40))
    assert torch.equal(tracker.current, want)


def expected_scales(current: torch.Tensor, tau: float, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: (query head scale, key head scale), written out head by head."""
    layers, heads = current.shape
    q_scale, k_scale = torch.ones(layers, heads), torch.ones(layers, heads // group)
    for layer in range(layers):
        gammas = [min(1.0, tau / s) for s in current[layer].tolist()]
        for g in range(heads // group):
            k_scale[layer, g] = math.sqrt(min(gammas[g * group : (g + 1) * group]))
            for h in range(g * group, (g + 1) * group):
                q_scale[layer, h] = gammas[h] / k_scale[layer, g]
    return q_scale, k_scale


def test_clip_scales_each_heads_logits_by_exactly_its_own_factor():
    """GQA: heads of one group clipped by different factors or not at all. The same batch's next forward
    has max logit exactly min(S, tau) per head, and the weights and biases moved by the expected scales."""
    model = make_model(qk_gain=5.0)
    tracker = QKClip(model, tau=1.0, device=torch.device("cpu"))
    batch = ids()
    model(batch, batch)
    before = tracker.current.clone()
    tau = before.flatten().median().item()  # about half the heads clip
    tracker.tau = tau
    old = {n: p.detach().clone() for n, p in model.named_parameters() if "q_proj" in n or "k_proj" in n}
    inputs = attention_inputs(model, batch)
    tracker.after_step()
    clipped = (before > tau).sum().item()
    assert 0 < clipped < before.numel() and tracker.clipped.item() == clipped
    torch.testing.assert_close(reference_max(model, batch, inputs), before.clamp(max=tau), rtol=1e-5, atol=0)
    q_scale, k_scale = expected_scales(before, tau, group=3)
    for name, p in model.named_parameters():
        if name in old:
            layer = int(name.split("layers.")[1].split(".")[0])
            scale = (q_scale if "q_proj" in name else k_scale)[layer].repeat_interleave(8)
            want = old[name] * (scale[:, None] if p.ndim == 2 else scale)
            torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0)
    # a fresh window: the next step's measurement starts from nothing
    assert torch.isneginf(tracker.current).all()


def train(tau: float | None, steps: int = 40):
    """AdamW at a high lr on one fixed batch: the attention logits grow step after step."""
    model = make_model()
    tracker = QKClip(model, tau=tau, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.0)
    batch = ids(batch=4, seq=32)
    measured, identities = [], []
    for _ in range(steps):
        model(batch, batch.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad()
        step_max = tracker.current.clone()
        inputs = attention_inputs(model, batch)
        updated = reference_max(model, batch, inputs)  # after the update, before the clip
        measured.append(step_max)
        tracker.after_step()
        if tau is not None:  # each layer's logits on the same inputs: every head scaled by its own gamma
            gamma = (tau / step_max).clamp(max=1.0)
            identities.append((reference_max(model, batch, inputs), gamma * updated))
    return torch.stack(measured), identities


def test_qk_clip_bounds_the_logit_of_a_model_that_grows_it():
    """K2's recipe clips with the logits measured in the step's forward, before that step's update: the
    next forward's logits exceed tau by what the update added, and the clip pulls them back each step."""
    tau = 3.0
    free, _ = train(None)
    clipped, identities = train(tau)
    assert free.max() > 3 * tau  # without the clip the logits keep growing
    assert clipped.max() < 1.6 * tau and clipped[-10:].max() < 1.25 * tau
    # the clip itself is exact: on the same inputs each head's logits are gamma * (after the update)
    for got, want in identities:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_layers_measure_the_same_and_share_one_graph():
    from muonrun.model.build import decoder_layers
    from muonrun.model.parallelize import apply_compile_and_checkpointing

    eager, compiled = make_model(qk_gain=5.0), make_model(qk_gain=5.0)
    trackers = [QKClip(m, tau=None, device=torch.device("cpu")) for m in (eager, compiled)]
    apply_compile_and_checkpointing(
        decoder_layers(compiled), "none", True, backend="aot_eager"
    )  # functionalizes the in-place max
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed in (0, 1):
        for model in (eager, compiled):
            model(ids(seed), ids(seed)).backward()
    torch.testing.assert_close(trackers[1].current, trackers[0].current, rtol=1e-6, atol=0)
    assert torch.isfinite(trackers[1].current).all()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["recompiles"]


def test_settings_that_cannot_work_are_user_errors():
    with pytest.raises(UserError, match="train.qk_clip.tau.*positive"):
        load_config("tiny", ["train.qk_clip.tau=0"])
    m = ModelConfig(architecture="qwen2", hf=HF, attn_implementation="eager")
    with pytest.raises(UserError, match="logging.max_attention_logit.*attn_implementation=sdpa"):
        check_measurable(build_model(m, build_hf_config(m)), None)
    qk_norm = dict(HF, head_dim=8)
    m = ModelConfig(architecture="qwen3", hf=qk_norm)
    with pytest.raises(UserError, match="q_norm/k_norm"):
        check_measurable(build_model(m, build_hf_config(m)), 100.0)
    # measuring alone is fine there
    assert check_measurable(build_model(m, build_hf_config(m)), None)
    # the feature checks on every build of the model, before any worker starts
    c = load_config("tiny", ["train.qk_clip.tau=50", "model.attn_implementation=eager"])
    with pytest.raises(UserError, match="train.qk_clip.tau.*attn_implementation=sdpa"):
        build_model(c.model, build_hf_config(c.model), enabled(c))
    assert [f.name for f in enabled(c)] == ["qk_clip"]
    assert enabled(load_config("tiny", [])) == []


def test_telemetry_in_metrics_tensorboard_and_compare(tmp_path, capsys, world_of_one):
    """Rows carry the values passed to `record` (MAX-reduced with the memory numbers), TensorBoard files
    them under attention/ and optimizer/, and `compare` adds rows for them."""
    from muonrun.distributed import Dist
    from muonrun.observe.metrics import Metrics, optimizer_telemetry
    from muonrun.tools.compare import compare

    d = Dist(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), mesh=world_of_one)
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    cfg = load_config(
        "tiny",
        [f"output_dir={tmp_path / 'run'}", "logging.console=plain", f"logging.tensorboard={tensorboard}"],
    )

    class Stub(torch.optim.SGD):  # the interface every muonrun optimizer offers
        telemetry = {"update_rms": torch.tensor(0.25), "momentum_norm": torch.tensor(3.0)}

    opts = [Stub([torch.zeros(1, requires_grad=True)], lr=0.1)]
    assert set(optimizer_telemetry(opts)) == {"update_rms_stub", "momentum_norm_stub"}
    model = make_model(qk_gain=5.0)
    tracker = QKClip(model, tau=0.5, device=torch.device("cpu"))
    m = Metrics(cfg, d, flops_per_token=1.0)

    class State:
        step, tokens_seen = 0, 0

    state = State()
    m.start(state)
    for step in (1, 2):
        model(ids(step), ids(step))
        tracker.after_step()
        state.step, state.tokens_seen = step, step * 10
        telemetry = {**optimizer_telemetry(opts), **tracker.telemetry()} if step == 2 else None
        m.record(
            state, torch.tensor(1.0), torch.tensor(0.5), 1.0, 0.0, opts, log=step == 2, telemetry=telemetry
        )
    m.close()
    rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
    row = rows[-1]
    assert row["update_rms_stub"] == 0.25 and row["momentum_norm_stub"] == 3.0
    assert row["max_attention_logit"] == max(row["max_attention_logit_0"], row["max_attention_logit_1"]) > 0.5
    assert row["qk_clipped_heads"] > 0 and math.isfinite(row["loss"])

    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(Path(cfg.output_dir) / "tensorboard"))
        events.Reload()
        tags = set(events.Tags()["scalars"])
        assert {"attention/max_attention_logit", "attention/max_attention_logit_1"} <= tags
        assert {"attention/qk_clipped_heads", "optimizer/update_rms_stub", "train/loss"} <= tags

    baseline = tmp_path / "baseline"
    baseline.mkdir()
    (baseline / "metrics.jsonl").write_text(
        json.dumps({"step": 2, "loss": 1.5, "tokens_seen": 20, "time": 1.0, "step_time": 1.0}) + "\n"
    )
    table = compare([Path(cfg.output_dir), baseline], tmp_path / "cmp.png", smoothing=0.0)
    assert table[0]["max_attention_logit"] == row["max_attention_logit"]
    assert table[0]["update_rms_stub"] == 0.25 and "update_rms_stub" not in table[1]
    md = (tmp_path / "cmp.md").read_text()
    assert "| max attention logit |" in md and "| heads QK-clipped |" in md and "update RMS, stub" in md


@pytest.mark.slow
def test_fsdp2_on_two_ranks_with_adamw_and_muon(tmp_path):
    """One launch (tests/dist/qkclip_worker.py): heads straddling the shards, the measured max against
    materialized logits, the clip on the gathered weights, and real runs' telemetry rows."""

    out = run_workers(Path(__file__).parent / "dist" / "qkclip_worker.py", 2, str(tmp_path), timeout=300)
    assert "QKCLIP_WORKER_OK" in out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_is_the_largest_materialized_logit(dtype):
    """fp32 sums of the same (exact) products: equal up to summation order. Queries in the model's
    [batch, seq, heads, dim] memory layout; lengths that are not a multiple of the tiles."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for batch, heads, kv_heads, seq, dim in [(2, 14, 2, 300, 64), (1, 4, 4, 129, 80), (3, 6, 1, 1000, 128)]:
        q = torch.randn(batch, seq, heads, dim, device="cuda", generator=g).to(dtype).transpose(1, 2)
        k = torch.randn(batch, seq, kv_heads, dim, device="cuda", generator=g).to(dtype).transpose(1, 2)
        want = materialized_max_logit(q.double(), k.double()).float()
        torch.testing.assert_close(qkclip.causal_max_logit(q, k), want, rtol=1e-5, atol=1e-5)
    # every logit negative: positions past the end of the last tile must not count as logits of 0
    q, k = (
        -torch.ones(1, 2, 130, 64, device="cuda", dtype=dtype),
        torch.ones(1, 1, 130, 64, device="cuda", dtype=dtype),
    )
    assert qkclip.causal_max_logit(q, k).tolist() == [-64.0, -64.0]


@pytest.mark.gpu
def test_compiled_training_steps_with_qk_clip_never_wait_for_the_gpu(tmp_path):
    """The kernel inside compiled layers (one graph, no break), the clip and the telemetry: no host sync."""
    from muonrun.distributed import destroy
    from muonrun.train.trainer import Trainer

    overrides = [
        f"output_dir={tmp_path}",
        "train.device=cuda",
        "optimizer.name=muon",
        "parallel.compile=true",
    ]
    overrides += ["train.qk_clip.tau=1.0", "logging.optimizer_telemetry=true", "logging.log_interval=2"]
    overrides += ["train.eval_interval=0", "checkpoint.interval=0", "checkpoint.save_at_end=false"]
    overrides += ["logging.console=plain", "train.max_steps=8"]
    trainer = Trainer(load_config("tiny", overrides))
    torch._dynamo.utils.counters.clear()

    def step(log: bool) -> None:
        loss, grad_norm, wait = trainer.train_step(trainer.accum_steps())
        trainer.state.step += 1
        telemetry = trainer.telemetry() if log else None
        trainer.metrics.record(
            trainer.state, loss, grad_norm, 1.0, wait, trainer.optimizers, log=log, telemetry=telemetry
        )

    try:
        trainer.metrics.start(trainer.state)
        for _ in range(2):
            step(log=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for log in (False, True, False, True):
                step(log)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not torch._dynamo.utils.counters["graph_break"], dict(
            torch._dynamo.utils.counters["graph_break"]
        )
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
        trainer.metrics.close()
        rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        last = rows[-1]
        assert last["qk_clipped_heads"] >= 0 and math.isfinite(last["max_attention_logit"])
        assert math.isfinite(last["update_rms_muon"]) and math.isfinite(last["ortho_residual_muon"])
    finally:
        trainer.close()
        destroy()
