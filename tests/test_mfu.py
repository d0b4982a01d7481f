"""MFU's two halves: training FLOPs per token (against a hand count and torch's FlopCounterMode) and the
peak TFLOP/s table (lookup by device name, unknown devices, which precision column a run uses)."""

from __future__ import annotations

import warnings

import pytest
import torch

from muonrun import log
from muonrun.observe.mfu import lookup_peak_tflops, matmul_precision


def test_flops_per_token_hand_count():
    from transformers import Qwen2Config

    from muonrun.model.build import flops_per_token

    h, layers, heads, kv, inter, vocab, seq = 64, 2, 4, 2, 160, 96, 32
    hf = Qwen2Config(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
    )
    head_dim = h // heads  # 16
    q_o = 2 * h * h  # 8192
    k_v = 2 * h * kv * head_dim  # 4096
    mlp = 3 * h * inter  # 30720
    matmul_params = layers * (q_o + k_v + mlp) + h * vocab  # 86016 + 6144 = 92160
    assert matmul_params == 92160
    # Forward: 2 FLOPs per weight per token, plus scores (QK^T) and values (AV), 2*seq*h each per layer,
    # halved by the causal mask; training is forward + backward = 3x forward.
    attention = layers * 2 * (2 * seq * h) / 2
    expected = 3 * (2 * matmul_params + attention)
    assert expected == 3 * (184320 + 8192) == 577536
    assert flops_per_token(hf, seq) == expected


def test_flops_per_token_matches_torch_flop_counter():
    """torch's FlopCounterMode on one forward + backward of the real model (eager attention, which counts
    the full seq x seq scores): equal to ours once the causal half of the attention FLOPs is added back."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM, Qwen2Config

    from muonrun.model.build import flops_per_token

    seq = 32
    hf = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="eager")
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.randint(0, 96, (1, seq))).logits.float().sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    attention_full = counts["aten.bmm"]
    assert flops_per_token(hf, seq) * seq == counter.get_total_flops() - attention_full / 2


@pytest.mark.parametrize(
    ("name", "precision", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp32", 60.0),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
        ("NVIDIA B200", "bf16", 2250.0),
        ("NVIDIA GH200 480GB", "bf16", 989.4),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L40", "bf16", 181.05),
        ("NVIDIA L4", "fp32", 30.3),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("AMD Instinct MI300X", "bf16", 1307.4),
    ],
)
def test_peak_table_lookup(name, precision, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lookup_peak_tflops(name, precision) == expected


def test_unknown_device_warns_once(monkeypatch, capsys):
    monkeypatch.setattr(log, "_said", set())
    assert lookup_peak_tflops("NVIDIA Quantum Q9", "bf16") is None
    assert lookup_peak_tflops("NVIDIA Quantum Q9", "bf16") is None
    err = capsys.readouterr().err
    assert (
        err.count("muonrun: WARNING: Unknown device 'NVIDIA Quantum Q9'") == 1
        and "logging.peak_tflops" in err
    )


def test_matmul_precision_follows_param_dtype():
    assert matmul_precision("auto", "cuda") == "bf16"
    assert matmul_precision("bfloat16", "cuda") == "bf16"
    assert matmul_precision("float32", "cuda") == "fp32"  # torch's default: no TF32
    assert matmul_precision("auto", "cpu") == "fp32"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert matmul_precision("float32", "cuda") == "tf32"
    finally:
        torch.set_float32_matmul_precision(previous)
