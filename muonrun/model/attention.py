"""muonrun's attention function: transformers' SDPA without the mask builder, with an observer hook.

SDPA is registered with transformers under a second name (`ATTENTION_NAME`), for which transformers
builds no attention masks. Our batches have no padding, no cache and no position ids, so for plain
causal attention transformers' mask builder returns None anyway (SDPA then runs with is_causal=True),
but first it checks the position ids for packed sequences with a Python bool: a host sync at the start
of every forward.

An attention module with an `OBSERVER` attribute hands it the query (RoPE applied) and the key (before
the grouped-query repeat) of every forward: `observer(module, query, key, scaling)`. QK-clip's largest
logit per head is measured there (muonrun/features/qkclip.py).
"""

from __future__ import annotations

from torch import nn

from muonrun.config import ModelConfig

ATTENTION_NAME = "muonrun_causal_sdpa"
"""The name muonrun's attention is registered under with transformers' AttentionInterface."""

OBSERVER = "muonrun_attention_observer"
"""The attention module attribute holding a function that sees each forward's query and key."""


def only_full_causal_attention(hf_config) -> bool:
    """True when every layer attends to all earlier tokens: no sliding window or chunked attention.
    A window of 0 is none: Qwen2-MoE's config stores 0 when `use_sliding_window` is off."""
    layer_types = getattr(hf_config, "layer_types", None) or []
    limits = (getattr(hf_config, k, None) for k in ("sliding_window", "attention_chunk_size"))
    return all(t == "full_attention" for t in layer_types) and all(v is None or v == 0 for v in limits)


def use_mask_free_sdpa(model: nn.Module, m: ModelConfig) -> None:
    """Switch a model built with sdpa to `ATTENTION_NAME` where that computes the same attention: only
    full causal attention, and a model that takes its kernel from transformers' AttentionInterface
    (others keep their own attention code and masks)."""
    if m.attn_implementation != "sdpa" or not only_full_causal_attention(model.config):
        return
    if not getattr(model, "_can_set_attn_implementation", lambda: False)():
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, causal_sdpa)
    model.set_attn_implementation(ATTENTION_NAME)


def causal_sdpa(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, after handing query and key to the module's observer, if any."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    observer = getattr(module, OBSERVER, None)
    if observer is not None:
        observer(module, query, key, kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
