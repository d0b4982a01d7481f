"""Model construction: a transformers causal LM built on the meta device, its checks, init and FLOP count.

`muonrun pretrain tiny --dry-run` exercises `build_hf_config`, `build_model` and `flops_per_token`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from muonrun.config import ModelConfig
from muonrun.errors import UserError
from muonrun.model.attention import use_mask_free_sdpa
from muonrun.model.moe import (
    active_matmul_params,
    backbone,
    is_moe,
    is_router_module,
)
from muonrun.optim.groups import is_experts_module

if TYPE_CHECKING:
    from muonrun.features.protocol import Feature


def build_hf_config(m: ModelConfig, vocab_size: int | None = None):
    """The transformers config from `model.name_or_path` or `model.architecture`, with `model.hf` on top."""
    from transformers import CONFIG_MAPPING, AutoConfig

    extra = dict(m.hf)
    if m.name_or_path:
        try:
            hf = AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, **extra)
        except OSError as e:
            offline = os.environ.get("HF_HUB_OFFLINE") == "1"
            raise UserError(
                f"model.name_or_path '{m.name_or_path}' could not be loaded"
                f"{' (HF_HUB_OFFLINE=1 is set)' if offline else ''}: {str(e).splitlines()[0]} "
                "Point it at a local folder with a config.json, download it beforehand into the Hugging Face "
                "cache, or describe the architecture inline with model.architecture and model.hf."
            ) from None
        except ValueError as e:  # e.g. a repository whose code it would have to run
            raise UserError(
                f"model.name_or_path '{m.name_or_path}' cannot be used: {str(e).splitlines()[0]}"
            ) from None
        check_hf_keys(extra, type(hf), m)
        fit_layer_types(hf, extra, m.name_or_path)
    else:
        if m.architecture not in CONFIG_MAPPING:
            raise UserError(
                f"model.architecture '{m.architecture}' is not a transformers model type "
                f"(for example: qwen2, llama, mistral, qwen3)."
            )
        check_hf_keys(extra, CONFIG_MAPPING[m.architecture], m)
        try:
            hf = CONFIG_MAPPING[m.architecture](**extra)
        except Exception as e:  # transformers' own validators raise several types
            reason = " ".join(str(e).split())[:400] or type(e).__name__
            raise UserError(
                f"model.hf does not make a valid {m.architecture} config: {reason}. Fix the key under model.hf."
            ) from None
    if vocab_size is not None and hf.vocab_size < vocab_size:
        raise UserError(
            f"The tokenizer has {vocab_size} tokens but the model's vocab_size is {hf.vocab_size}; set "
            f"model.hf.vocab_size to at least {vocab_size}."
        )
    return hf


# Config keys that do not change what the weights compute: bookkeeping, generation and output options.
NOT_ARCHITECTURE = frozenset(
    {
        "_name_or_path", "architectures", "dtype", "torch_dtype", "transformers_version", "use_cache",
        "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
        "chunk_size_feed_forward", "is_encoder_decoder", "bos_token_id", "eos_token_id", "pad_token_id",
        "initializer_range", "_attn_implementation", "attn_implementation", "_commit_hash",
    }
)  # fmt: skip


def architecture_of(hf_config) -> dict:
    """The resolved transformers config as JSON values, less `NOT_ARCHITECTURE`: what every checkpoint
    records, so that resume and `checkpoint.init_from` refuse another model and export rebuilds the one
    trained even when `model.name_or_path`'s config.json (or transformers' defaults) changed since."""
    values = json.loads(hf_config.to_json_string(use_diff=False))
    return {k: v for k, v in values.items() if k not in NOT_ARCHITECTURE}


def fit_layer_types(hf, extra: dict, source: str) -> None:
    """Give a loaded config's per-layer `layer_types` the depth `model.hf.num_hidden_layers` asks for.

    transformers keeps the loaded list as it is when only the depth is overridden, and the model then
    fails to build (or silently builds with a list for another depth). A uniform list is extended or
    cut; a mixed one (sliding-window layers at chosen depths) cannot be guessed."""
    types = getattr(hf, "layer_types", None)
    if "num_hidden_layers" not in extra or "layer_types" in extra or types is None:
        return
    if len(types) == hf.num_hidden_layers:
        return
    if len(set(types)) > 1:
        raise UserError(
            f"model.hf.num_hidden_layers={hf.num_hidden_layers} changes the depth of '{source}', whose "
            f"{len(types)} layers mix attention types ({', '.join(sorted(set(types)))}); set "
            "model.hf.layer_types to a list with one entry per layer as well."
        )
    hf.layer_types = [types[0]] * hf.num_hidden_layers


def check_hf_keys(extra: dict, config_class: type, m: ModelConfig) -> None:
    """Every `model.hf` key must be one the architecture's config reads. transformers' configs accept
    any keyword and keep it, so a typo would be saved and exported and never used: a key still stored
    as-is after construction, which the default config does not have, was read by nobody (keys the
    config converts, like `rope_theta` into `rope_parameters`, are consumed and pass)."""
    try:
        kept = set(config_class(**extra).to_dict())
    except Exception:  # invalid values: reported with the key when the real config is built
        return
    default_config = config_class().to_dict()
    default = set(default_config)
    unknown = [k for k in extra if k in kept and k not in default and k not in m.hf_extra_keys]
    if unknown:
        import difflib

        key = unknown[0]
        # Suggestions include the keys of nested settings that the config takes at the top level too
        # (`rope_theta` goes into `rope_parameters`): those it consumes rather than keeps.
        nested = {
            k
            for v in default_config.values()
            if isinstance(v, dict)
            for k, value in v.items()
            if isinstance(k, str) and k not in config_class(**{k: value}).to_dict()
        }
        close = difflib.get_close_matches(key, sorted(default | nested), n=2)
        hint = f" Did you mean {' or '.join(repr('model.hf.' + c) for c in close)}?" if close else ""
        raise UserError(
            f"Config key 'model.hf.{key}' is not a setting of the {config_class.model_type} config.{hint} "
            f"If the model really reads it, list it in model.hf_extra_keys (model.hf_extra_keys=[{key}])."
        )


def check_positions(hf, seq_len: int) -> None:
    """A training window must fit the positions the model is built for: past max_position_embeddings
    rotary angles leave the range the model (and its rope scaling) is defined on, and attention's cost
    grows with the square of a length nobody meant."""
    limit = getattr(hf, "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UserError(
            f"Config key 'data.seq_len' is {seq_len}, longer than the model's max_position_embeddings of {limit} "
            "(model.hf / model.name_or_path): lower data.seq_len to at most that, or raise "
            "model.hf.max_position_embeddings for a model trained from scratch."
        )


@contextlib.contextmanager
def meta_safe_experts(model: nn.Module):
    """While the meta forward runs, experts compute with transformers' `batched_mm` (gathered weights and
    a batched matmul: no data-dependent shape, every op has a meta kernel). `grouped_mm`'s meta kernel
    demands bf16 of the float32 meta model, and the eager loop's `nonzero` has no meta kernel."""
    configs = {
        id(c): c
        for mod in model.modules()
        if (c := getattr(mod, "config", None)) is not None
        and getattr(c, "_experts_implementation", None) not in (None, "eager", "batched_mm")
    }
    saved = {k: c._experts_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._experts_implementation = "batched_mm"
        yield
    finally:
        for k, c in configs.items():
            c._experts_implementation = saved[k]


def check_model(
    m: ModelConfig,
    vocab_size: int | None = None,
    seq_len: int = 8,
    features: list[Feature] = (),
    router_z_loss_coef: float = 0.0,
) -> nn.Module:
    """Build the model on the meta device and run one forward there (shapes only, no memory, no
    GPU): an architecture that cannot run with these settings (query heads not a multiple of key/value
    heads, say) fails here, before any worker starts, naming the settings; so does a router z-loss
    (`train.router_z_loss_coef`) for a model without routers. Returns the meta model (its HF config is
    `.config`)."""
    hf = build_hf_config(m, vocab_size)
    check_positions(hf, seq_len)
    check_experts(hf)
    check_router_losses(router_z_loss_coef, hf)
    model = build_model(m, hf, features)
    decoder_layers(model)  # what the workers shard one by one
    with torch.device("meta"), meta_safe_experts(model):
        ids = torch.zeros(1, max(2, min(seq_len, 8)), dtype=torch.long)
        try:
            backbone(model)(input_ids=ids, use_cache=False)
        except NotImplementedError:
            return model  # an op without a meta kernel: nothing to learn here
        except RuntimeError as e:
            if "meta" in str(e):  # e.g. `.item()` in the model's own code: cannot run on meta
                return model
            settings = ", ".join(
                f"{k}={getattr(hf, k)}"
                for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
                if getattr(hf, k, None) is not None
            )
            raise UserError(
                f"The model settings (model.hf / model.name_or_path: {settings}) do not make a working "
                f'{hf.model_type}: a forward pass fails with "{str(e).splitlines()[0]}". Fix model.hf '
                "(for example, num_attention_heads must be a multiple of num_key_value_heads)."
            ) from None
    return model


def check_experts(hf) -> None:
    """A mixture of experts routes each token to `num_experts_per_tok` of its experts: no more than it has
    (the meta forward would fail on top-k with a message about attention settings)."""
    k = getattr(hf, "num_experts_per_tok", None)
    key = next(
        (n for n in ("num_experts", "n_routed_experts", "num_local_experts") if getattr(hf, n, None)), None
    )
    if isinstance(k, int) and key is not None and k < 1:
        raise UserError(
            f"Config key 'model.hf.num_experts_per_tok' is {k}: every token must go to at least one expert "
            f"(with {k}, no expert ever sees a token and the MoE layers output nothing). Set it to 1 or more."
        )
    if isinstance(k, int) and key is not None and k > getattr(hf, key):
        raise UserError(
            f"Config key 'model.hf.num_experts_per_tok' is {k}, more than the {getattr(hf, key)} experts "
            f"(model.hf.{key}); route each token to at most that many."
        )


def check_router_losses(router_z_loss_coef: float, hf_config) -> None:
    """The router z-loss needs routers: on a dense model `train.router_z_loss_coef` would do nothing."""
    if router_z_loss_coef > 0 and not is_moe(hf_config):
        raise UserError(
            f"Config key 'train.router_z_loss_coef' is {router_z_loss_coef}: it keeps a mixture of experts' "
            f"router logits small, and this model ({hf_config.model_type}) has no experts. Set it to 0, "
            "or train a mixture-of-experts model (the qwen2-moe presets)."
        )


def build_model(m: ModelConfig, hf_config, features: list[Feature] = ()) -> nn.Module:
    """The causal LM on the meta device (no memory is used until `init_weights`), as the enabled
    features adapt it (LoRA's adapters, say)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(
                hf_config,
                attn_implementation=m.attn_implementation,
                dtype=torch.float32,
                trust_remote_code=m.trust_remote_code,
            )
        except Exception as e:  # noqa: BLE001 (building from the user's settings: any failure is theirs)
            raise UserError(build_failure(m, hf_config, e)) from None
    use_mask_free_sdpa(model, m)
    for feature in features:
        feature.adapt(model)
    return model


def build_failure(m: ModelConfig, hf_config, e: Exception) -> str:
    """What a failed `AutoModelForCausalLM.from_config` says: another kind of model, an attention
    implementation this machine lacks, or settings the architecture cannot be built with."""
    first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    if "Unrecognized configuration class" in first:
        return (
            f"model.architecture '{m.architecture}' is not a causal language model (transformers' "
            "AutoModelForCausalLM does not build it); choose a decoder such as qwen2, llama or qwen2_moe."
        )
    if isinstance(e, (ValueError, ImportError)) and ("attn" in first or "attention" in first.lower()):
        return f"model.attn_implementation '{m.attn_implementation}' cannot be used: {first}"
    texts = [f"model.hf.{k} is the text {v!r}" for k, v in (m.hf or {}).items() if _number_text(v)]
    hint = f" ({'; '.join(texts)}, where a finite number belongs)" if texts else ""
    return (
        f"The model settings (model.hf / model.name_or_path) do not build a {hf_config.model_type}: "
        f"{type(e).__name__}: {first.rstrip('.')}{hint}. Fix model.hf (`muonrun config show` prints what is set)."
    )


def _number_text(value) -> bool:
    """A string that reads as a number ('nan', 'inf', '1e4'): what YAML leaves as text."""
    if not isinstance(value, str):
        return False
    try:
        float(value)
    except ValueError:
        return False
    return True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the model's own `_no_split_modules` class names."""
    names = {n for mod in model.modules() for n in (getattr(mod, "_no_split_modules", None) or [])}
    layers = [mod for mod in model.modules() if type(mod).__name__ in names]
    if not names:
        raise UserError(
            f"{type(model).__name__} declares no _no_split_modules, so muonrun cannot find its decoder "
            "layers to shard and compile one by one; use an architecture transformers declares them for."
        )
    if not layers:
        raise UserError(
            f"The model has no decoder layers ({', '.join(sorted(names))}): set model.hf.num_hidden_layers "
            "to at least 1."
        )
    return layers


def _seed_for(name: str, seed: int) -> int:
    """A per-parameter seed, so weights do not depend on the world size or the order of construction."""
    return seed * 1_000_003 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")


def _model_init(module: nn.Module, p_name: str, shape, std: float, gen, device) -> torch.Tensor:
    """The model's own rule for a parameter's initial value (see `init_weights`)."""
    if p_name == "bias" or (len(shape) == 1 and p_name != "weight"):
        return torch.zeros(shape, device=device)
    if len(shape) == 1:
        return torch.ones(shape, device=device)
    assert (
        isinstance(module, nn.Linear | nn.Embedding) or is_experts_module(module) or is_router_module(module)
    ), f"no init rule for {type(module).__name__}.{p_name}"
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(
    model: nn.Module, std: float, seed: int, device: torch.device, features: list[Feature] = ()
) -> None:
    """Initialise every parameter and buffer of a model that was just `to_empty()`-ed.

    Each full tensor is drawn from its own generator on `device` and each rank keeps its shard,
    so the weights are identical at any world size. A feature's own parameters (LoRA's A and B) as
    the feature says; Linear and embedding weights ~ N(0, std) (and so are an MoE's routers and stacked
    experts [E, out, in]: every expert's matrix ~ N(0, std)), biases 0, norm (1-D) weights 1.
    A feature's own buffers as the feature says; other buffers (rotary `inv_freq`) are rebuilt from the
    module's config.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    done: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in done:
                continue  # tied weights
            done.add(id(param))
            full_shape, name = param.shape, f"{mod_name}.{p_name}"
            gen = torch.Generator(device=device).manual_seed(_seed_for(name, seed))
            # A feature's own parameters first (LoRA's A and B), then the model's rules.
            full = next(
                (v for f in features if (v := f.init_parameter(name, full_shape, gen, device)) is not None),
                None,
            )
            if full is None:
                full = _model_init(module, p_name, full_shape, std, gen, device)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(full)
        buffers = {}
        for b_name, buf in module.named_buffers(recurse=False):  # a feature's own buffers first
            name = f"{mod_name}.{b_name}"
            value = next(
                (v for f in features if (v := f.init_parameter(name, buf.shape, None, device)) is not None),
                None,
            )
            if value is None:
                buffers[b_name] = buf
            else:
                buf.copy_(value.to(buf.device, buf.dtype))
        if buffers:
            assert hasattr(module, "config"), (
                f"no rule to initialise the buffers of {mod_name}: {list(buffers)}"
            )
            with torch.device("cpu"):
                fresh = type(module)(module.config)
            for b_name, buf in buffers.items():
                buf.copy_(getattr(fresh, b_name).to(buf.device, buf.dtype))


def count_params(model: nn.Module) -> dict[str, int]:
    """Parameter counts (tied weights once): total, embedding, the rest, and those that train."""
    unique = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() for p in unique)
    emb = model.get_input_embeddings().weight.numel()
    trainable = sum(p.numel() for p in unique if p.requires_grad)
    return {"total": total, "embedding": emb, "non_embedding": total - emb, "trainable": trainable}


def flops_per_token(hf_config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), counting every matmul.

    Matmul weights: per layer q,k,v,o and the 3 MLP matrices, plus the LM head; attention scores and
    values add 2 * 2 * seq_len * d_attn per layer in forward, halved because the mask is causal.
    Embedding lookups, norms and activations are not counted (as in PaLM/torchtitan MFU). A
    mixture-of-experts model counts the weights a token is routed through, not all it has: its top-k
    experts, the shared expert and the router (muonrun/model/moe.py `active_matmul_params`).
    """
    h = hf_config.hidden_size
    layers = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    inter = hf_config.intermediate_size
    attn_proj = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o and k, v
    mlp = layers * 3 * h * inter  # gate, up, down
    moe = active_matmul_params(hf_config)
    matmul_params = layers * attn_proj + (mlp if moe is None else moe) + h * hf_config.vocab_size
    attention = layers * 2 * 2 * seq_len * heads * head_dim / 2
    return 3 * (2 * matmul_params + attention)
