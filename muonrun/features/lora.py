"""LoRA adapters (peft) on a pretrained model: which modules get one, which parameters train, how the
adapters start, how a checkpoint names its base model, how the export merges them. The `LoRA` feature
(muonrun/features/__init__.py's protocol) is on when `model.lora.enabled`.

    muonrun pretrain qwen2-muon-lora-fsdp2        # adapters on Qwen2.5-0.5B, Muon for their A and B

peft's `inject_adapter_in_model` (what `get_peft_model` does underneath, without the wrapper) puts
its LoRA layers into the transformers model in place, so the model keeps its class and module tree:
the loss wrapper's `base_model` and LM head, FSDP2's per-layer units and the pretrained weights'
names are those of the plain model, with `.base_layer` and `.lora_A.default` / `.lora_B.default` in
the adapted layers. peft freezes every base parameter; `model.lora.train` unfreezes some in place
rather than through peft's `modules_to_save`, which trains a copy of a module (a copy of a tied
embedding would no longer be the LM head, and FSDP2 would shard both). `muonrun export` rebuilds the
same adapters with `peft.get_peft_model` to merge them into the base or to save them alone.
"""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

import torch
from torch import nn

from muonrun.config import Config, LoraSettings
from muonrun.errors import UserError
from muonrun.features.protocol import ExportJob, Feature

ADAPTER = "default"  # peft's name for the one adapter


def is_adapter(name: str) -> bool:
    """A LoRA A or B weight (by parameter or module name)."""
    return ".lora_A." in f".{name}." or ".lora_B." in f".{name}."


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (`...q_proj.base_layer.weight` -> `...q_proj.weight`)."""
    return name.replace(".base_layer.", ".")


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def _linear_names(model: nn.Module) -> list[str]:
    head = model.get_output_embeddings()
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head}
    )


def target_names(model: nn.Module, s: LoraSettings) -> list[str]:
    """Full names of the modules that get an adapter; a UserError names an entry that matches no layer
    (a module holding weights) or that matches an embedding or the LM head."""
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    special = {model.get_input_embeddings(): "input embedding", model.get_output_embeddings(): "LM head"}
    chosen: set[str] = set()
    for pattern in s.target_modules:
        hits = [
            (n, m)
            for n, m in model.named_modules()
            if n and _matches(n, pattern) and next(m.parameters(recurse=False), None) is not None
        ]
        if not hits:
            raise UserError(
                f"Config key 'model.lora.target_modules' entry '{pattern}' matches no layer of the {kind} model. "
                f"Its linear layers are named {', '.join(_linear_names(model))}: give such a name, or a glob on "
                "the full module name (model.layers.1*.mlp.*)."
            )
        for name, module in hits:
            if module in special:
                raise UserError(
                    f"Config key 'model.lora.target_modules' entry '{pattern}' matches the {special[module]} "
                    f"'{name}', which takes no adapter here: train it fully with model.lora.train=['{name}.weight']."
                )
            chosen.add(name)
    return sorted(chosen)


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise UserError(
            "Config key 'model.lora.enabled' is true but peft is not installed: pip install 'muonrun[lora]'."
        ) from None


def peft_config(model: nn.Module, s: LoraSettings):
    """peft's LoraConfig for `model` (without adapters yet). Targets are given to peft as the modules'
    last names when those select exactly the chosen modules (a readable adapter_config.json), else as
    full names."""
    require_peft()
    from peft import LoraConfig

    chosen = target_names(model, s)
    last = sorted({n.rsplit(".", 1)[-1] for n in chosen})
    by_last = {n for n, _ in model.named_modules() if n and n.rsplit(".", 1)[-1] in last}
    return LoraConfig(
        r=s.rank,
        lora_alpha=s.alpha,
        lora_dropout=s.dropout,
        target_modules=last if by_last == set(chosen) else chosen,
        bias="none",
    )


def _trained_params(model: nn.Module, s: LoraSettings, targets: list[str]) -> list[nn.Parameter]:
    """The base parameters `model.lora.train` names (tied aliases included: `lm_head.weight` names a
    tied embedding too)."""
    adapted = set(targets)
    found: list[nn.Parameter] = []
    for pattern in s.train:
        hits = [
            (n, p)
            for n, p in model.named_parameters(remove_duplicate=False)
            if fnmatch.fnmatchcase(n, pattern)
        ]
        if not hits:
            names = [n for n, _ in model.named_parameters()]
            raise UserError(
                f"Config key 'model.lora.train' entry '{pattern}' matches no parameter of the model (they are named "
                f"like {', '.join(names[:2])}, ..., {names[-1]})."
            )
        for name, p in hits:
            if name.rsplit(".", 1)[0] in adapted:
                raise UserError(
                    f"Config key 'model.lora.train' entry '{pattern}' matches '{name}', a weight that "
                    "model.lora.target_modules gives an adapter: train it either way, not both."
                )
            found.append(p)
    return found


def apply_lora(model: nn.Module, s: LoraSettings) -> nn.Module:
    """Inject LoRA adapters into `model` in place (on the meta device before `init_weights`), freeze
    the rest but what `model.lora.train` names. Returns `model`."""
    config = peft_config(model, s)  # a UserError if peft is missing
    from peft import inject_adapter_in_model

    trained = _trained_params(model, s, target_names(model, s))
    kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    linear = ", ".join(_linear_names(model))
    try:
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise UserError(
            f"Config key 'model.lora.target_modules' ({', '.join(s.target_modules)}) selects modules of this "
            f"{kind} model that LoRA (peft) cannot adapt: {' '.join(str(e).split())[:300]} Name its linear "
            f"layers instead ({linear})."
        ) from None
    for p in trained:
        p.requires_grad_(True)
    return model


def adapter_init(name: str, shape: torch.Size, generator: torch.Generator, device) -> torch.Tensor | None:
    """peft's default start of a LoRA weight (`init_lora_weights=True`), or None for other weights:
    A as nn.Linear's own init (kaiming-uniform with a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B
    zero, so the adapted model starts as the base model."""
    if ".lora_B." in f".{name}":
        return torch.zeros(shape, device=device)
    if ".lora_A." in f".{name}":
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape, device=device).uniform_(-bound, bound, generator=generator)
    return None


def lora_flops_per_token(full: float, model: nn.Module) -> float:
    """Training FLOPs per token with adapters, from `model.flops_per_token`'s full-training count (3 x
    forward): a frozen matmul weight gets no weight gradient (2 FLOPs per weight and token fewer), an
    adapter adds 6 per weight and token (forward, input and weight gradients). For MFU."""
    frozen = adapters = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            if is_adapter(name):
                adapters += module.weight.numel()
            elif not module.weight.requires_grad:
                frozen += module.weight.numel()
    return full - 2 * frozen + 6 * adapters


class LoRA(Feature):
    """peft's adapters on the frozen pretrained model: injected into every build of the meta model,
    initialised as peft does, counted in FLOPs, the base model's fingerprint in every checkpoint, and
    merged (or written alone) by the export."""

    @staticmethod
    def wanted(cfg: Config) -> bool:
        return cfg.model.lora.enabled

    def check(self, device_type: str) -> None:
        require_peft()

    def adapt(self, model: nn.Module) -> None:
        from muonrun.model.moe import is_moe

        if is_moe(model.config):
            raise UserError(
                f"model.lora.enabled is true but {model.config.model_type} is a mixture-of-experts model: "
                "LoRA adapters on stacked expert weights are not supported. Set model.lora.enabled=false "
                "to train the whole model, or use a dense base model for LoRA."
            )
        apply_lora(model, self.cfg.model.lora)

    def init_parameter(self, name, shape, generator, device):
        return adapter_init(name, shape, generator, device)

    def pretrained_name(self, name: str) -> str | None:
        # The adapters are not in the base model's files; an adapted layer holds its pretrained weight
        # as `.base_layer.weight`.
        return None if is_adapter(name) else base_name(name)

    def flops_per_token(self, fpt: float, model: nn.Module) -> float:
        return lora_flops_per_token(fpt, model)

    def identity(self, d=None) -> dict[str, dict[str, str]]:
        from muonrun.model.hf import base_identity

        return {"base_model": base_identity(self.cfg.model.name_or_path, d)}

    def plan_rows(self, model: nn.Module) -> list[tuple[str, str]]:
        lo = self.cfg.model.lora
        total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        trained = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad)
        return [
            (
                "LoRA",
                f"rank {lo.rank} on {', '.join(lo.target_modules)}: {trained:,} parameters train "
                f"({trained / total:.2%}), the rest frozen in the compute dtype",
            )
        ]

    def export(self, job: ExportJob) -> dict[str, torch.Tensor] | Path:
        adapted = adapted_model(job.cfg, job.hf_config, job.checkpoint, job.tensors)
        if job.options.pop("adapter_only", False):
            adapted = adapted.to(getattr(torch, job.dtype))
            return _write_adapter(adapted, job)
        job.notes.append(f"LoRA adapters merged into `{job.cfg.model.name_or_path}`.")
        return adapted.merge_and_unload().state_dict()


def adapted_model(cfg, hf_config, checkpoint: Path, trained: dict[str, torch.Tensor]):
    """A LoRA run's base model (from its `model.name_or_path`, checked against the fingerprint the
    checkpoint recorded) with the checkpoint's adapters and other trained weights, as a peft model.
    Parameters `model.lora.train` trained become peft's `modules_to_save`, so an adapter folder carries
    them too (a tied embedding stays tied to the LM head)."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.utils.logging import disable_progress_bar

    require_peft()
    from peft import get_peft_model

    from muonrun.checkpoint import read_meta
    from muonrun.model.hf import base_identity

    base = cfg.model.name_or_path
    saved = read_meta(checkpoint).get("identity", {}).get("base_model", {})
    found = base_identity(base)
    if saved.get("fingerprint") != found["fingerprint"]:
        raise UserError(
            f"Checkpoint '{checkpoint}' holds LoRA adapters trained on '{saved.get('name_or_path')}' (fingerprint "
            f"{str(saved.get('fingerprint'))[:12]}), but '{base}' (model.name_or_path in its run's config.yaml) "
            f"now holds other weights (fingerprint {found['fingerprint'][:12]}): the export needs the base model "
            "the adapters were trained on."
        )
    disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        base, config=hf_config, dtype=torch.float32, trust_remote_code=cfg.model.trust_remote_code
    )
    config = peft_config(model, cfg.model.lora)
    config.modules_to_save = sorted({n.rsplit(".", 1)[0] for n in trained if not is_adapter(n)}) or None
    config.ensure_weight_tying = bool(
        config.modules_to_save and getattr(hf_config, "tie_word_embeddings", False)
    )
    with warnings.catch_warnings():  # peft asks the model for a property transformers renamed
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    params = dict(peft_model.named_parameters())
    for name, tensor in trained.items():
        module, _, leaf = name.rpartition(".")
        key = "base_model.model." + (
            name if is_adapter(name) else f"{module}.modules_to_save.{ADAPTER}.{leaf}"
        )
        if key not in params:
            raise UserError(
                f"Checkpoint '{checkpoint}' holds '{name}', which the LoRA model of its run's config.yaml lacks: "
                "its model.lora settings changed after the run."
            )
        with torch.no_grad():
            params[key].copy_(tensor)
    return peft_model


def _write_adapter(adapted, job: ExportJob) -> Path:
    """peft's adapter folder, the tokenizer beside it (unless the byte tokenizer), and a README."""
    cfg, out = job.cfg, job.out
    adapted.save_pretrained(out)
    if cfg.data.tokenizer != "byte":
        job.tokenizer.hf.save_pretrained(out)
    base = cfg.model.name_or_path
    (out / "README.md").write_text(
        f"# {cfg.name} (muonrun export: LoRA adapter)\n\n{job.header} The adapter of "
        f"`{base}`.\n\n{job.tokenizer_note}\n\n```python\nfrom peft import PeftModel\nfrom transformers import "
        f'AutoModelForCausalLM\n\nbase = AutoModelForCausalLM.from_pretrained("{base}")\n'
        f'model = PeftModel.from_pretrained(base, "{job.shown_as}")\n```\n'
    )
    return out
