"""The model as built for training: the attention kernel chosen per config, and (on a GPU) whole
training steps that never make the host wait for the GPU."""

from unittest import mock

import pytest
import torch

from muonrun.config import ModelConfig, load_config
from muonrun.model.attention import ATTENTION_NAME as MASK_FREE_SDPA
from muonrun.model.build import build_hf_config, build_model, init_weights

TINY_QWEN2 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def built(architecture: str, attn: str = "sdpa", **hf):
    m = ModelConfig(architecture=architecture, hf={**TINY_QWEN2, **hf}, attn_implementation=attn)
    hf_config = build_hf_config(m)
    model = build_model(m, hf_config).to_empty(device="cpu")
    init_weights(model, 0.02, seed=1, device=torch.device("cpu"))
    return model


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_mask_free_sdpa_is_causal_attention_without_the_packed_sequence_check(architecture):
    model = built(architecture)
    assert model.config._attn_implementation == MASK_FREE_SDPA
    assert all(layer.self_attn.config._attn_implementation == MASK_FREE_SDPA for layer in model.model.layers)
    # The reference builds its causal mask explicitly (eager), so a non-causal result would differ.
    reference = built(architecture, attn="eager")
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    import transformers.masking_utils as masking

    # This check turns a GPU tensor into a Python bool (a host sync) at every forward.
    with mock.patch.object(masking, "find_packed_sequence_indices", side_effect=AssertionError("called")):
        got = model(input_ids=ids, use_cache=False).logits
    want = reference(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "architecture, attn, hf",
    [
        ("qwen2", "eager", {}),  # eager needs the mask: None would mean no causality at all
        ("qwen2", "sdpa", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
        ("mistral", "sdpa", {"sliding_window": 8}),
    ],
)
def test_attention_that_needs_a_mask_keeps_transformers_mask_builder(architecture, attn, hf):
    assert built(architecture, attn, **hf).config._attn_implementation == attn


WIDE = ["model.hf.hidden_size=512", "model.hf.intermediate_size=1536"]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "preset, optimizer, extra",
    [
        ("tiny", "adamw", []),
        ("tiny", "muon", []),
        ("tiny", "muon", ["optimizer.muon.gram_ns=true"]),
        ("tiny", "muon", ["optimizer.muon.variant=normuon"]),  # its row factors ride in the update pass
        # matrices of 512 and more a side: quack's products where installed; the step launched kernel by
        # kernel (eager), and NorMuon's step replayed from its CUDA graph
        ("tiny", "muon", [*WIDE, "optimizer.muon.gram_ns=true", "optimizer.muon.eager=true"]),
        ("tiny", "muon", [*WIDE, "optimizer.muon.gram_ns=true", "optimizer.muon.variant=normuon"]),
        # the MoE presets' path: grouped-GEMM experts in compiled layers, balance loss, z-loss, router
        # bias; Muon's compiled passes on the experts
        (
            "tiny-moe",
            "muon",
            [
                "+model.hf.experts_implementation=grouped_mm",
                "parallel.compile=true",
                "train.router_z_loss_coef=0.001",
                "train.router_bias_update_rate=0.001",
                "logging.log_interval=2",
            ],
        ),
    ],
)
def test_training_steps_never_wait_for_the_gpu(tmp_path, preset, optimizer, extra):
    """Any host sync (a pageable copy, .item(), a bool of a GPU tensor) raises in sync-debug mode."""
    from muonrun.distributed import destroy
    from muonrun.train.trainer import Trainer

    overrides = [f"output_dir={tmp_path}", "train.device=cuda", f"optimizer.name={optimizer}", *extra]
    overrides += ["train.eval_interval=0", "checkpoint.interval=0", "logging.console=plain"]
    trainer = Trainer(load_config(preset, overrides))

    def step(log: bool) -> None:
        loss, grad_norm, wait = trainer.train_step(trainer.accum_steps())
        trainer.state.step += 1
        telemetry = trainer.telemetry() if log and trainer.logs(trainer.state.step) else None
        trainer.metrics.record(
            trainer.state, loss, grad_norm, 1.0, wait, trainer.optimizers, log=log, telemetry=telemetry
        )

    try:
        trainer.metrics.start(trainer.state)
        for _ in range(2):  # first launches of each kernel (lazy module loading) and Muon's plan check sync
            step(log=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with pytest.raises(RuntimeError, match="synchroniz"):
                torch.tensor([1.0], device="cuda")  # the detector works
            for log in (False, True, False, True):
                step(log)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if "optimizer.muon.gram_ns=true" in extra:  # the Gram form ran (tiny's MLP matrices are wide)
            assert trainer.optimizers[0].stats["gram"] > 0
    finally:
        trainer.close()
        destroy()


def test_a_loaded_config_made_shallower_or_deeper_builds_with_one_layer_type_per_layer(tmp_path):
    from transformers import Qwen2Config

    from muonrun.errors import UserError

    base = dict(
        hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=300
    )
    Qwen2Config(num_hidden_layers=4, **base).save_pretrained(tmp_path / "uniform")
    for depth in (2, 6):
        m = ModelConfig(name_or_path=str(tmp_path / "uniform"), hf={"num_hidden_layers": depth})
        hf = build_hf_config(m)
        assert hf.layer_types == ["full_attention"] * depth
        assert len(build_model(m, hf).model.layers) == depth
    mixed = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=2, **base
    )
    assert len(set(mixed.layer_types)) == 2
    mixed.save_pretrained(tmp_path / "mixed")
    with pytest.raises(UserError, match="model.hf.layer_types"):
        build_hf_config(ModelConfig(name_or_path=str(tmp_path / "mixed"), hf={"num_hidden_layers": 6}))
