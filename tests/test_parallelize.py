"""parallel.compile: every decoder layer runs the one compiled graph (none recompiles or falls back to eager)."""

import torch

from muonrun.config import load_config
from muonrun.data import build_tokenizer
from muonrun.model.build import build_hf_config, build_model, decoder_layers
from muonrun.model.causal_lm import CausalLMWithLoss
from muonrun.model.parallelize import apply_compile_and_checkpointing


def test_compiled_layers_share_one_graph():
    cfg = load_config("tiny", ["model.hf.num_hidden_layers=10"])  # > dynamo's recompile limit of 8
    hf_config = build_hf_config(cfg.model, build_tokenizer(cfg.data.tokenizer).vocab_size)
    with torch.device("cpu"):
        model = CausalLMWithLoss(build_model(cfg.model, hf_config), cfg.train.loss_chunk_tokens)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    layers = decoder_layers(model)
    apply_compile_and_checkpointing(
        layers, "none", True, backend="eager"
    )  # dynamo's guards are what is under test, not inductor
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = torch.randint(0, hf_config.vocab_size, (2, 16))
    model(ids, ids).backward()
    model(ids, ids).backward()
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] == 1, dict(stats)
    assert not torch._dynamo.utils.counters["recompiles"], dict(torch._dynamo.utils.counters["recompiles"])
    assert stats["calls_captured"] > 0


def test_checkpointed_layers_are_compiled_too():
    """With activation checkpointing every layer still runs compiled code, in forward and in the
    recompute (compiling a forward that calls `checkpoint` would silently leave it eager)."""
    from muonrun.model.parallelize import apply_compile_and_checkpointing

    calls = {"n": 0}

    def counting(gm, example_inputs):
        def run(*args):
            calls["n"] += 1
            return gm.forward(*args)

        return run

    for mode, runs_per_step in (("selective", 10 + 5), ("full", 10 + 10)):
        cfg = load_config("tiny", ["model.hf.num_hidden_layers=10"])
        hf_config = build_hf_config(cfg.model, build_tokenizer(cfg.data.tokenizer).vocab_size)
        model = CausalLMWithLoss(build_model(cfg.model, hf_config), cfg.train.loss_chunk_tokens)
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        apply_compile_and_checkpointing(decoder_layers(model), mode, compile=True, backend=counting)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        ids = torch.randint(0, hf_config.vocab_size, (2, 16))
        model(ids, ids).backward()
        calls["n"] = 0
        model(ids, ids).backward()
        # every layer's forward, plus the recomputed layers' forward again in backward
        assert calls["n"] == runs_per_step, (mode, calls["n"])
        assert not torch._dynamo.utils.counters["recompiles"], dict(
            torch._dynamo.utils.counters["recompiles"]
        )
