"""Sort a model's parameters into the ones Muon may touch and the ones AdamW must take.

Muon is for hidden 2-D matrices only (the Linear weights inside the decoder layers). Embeddings and
the LM head are 2-D too but are *not* hidden matrices, so the decision is made by module type and
name, never by ``ndim`` alone:

- ``muon``: weights of ``nn.Linear`` modules (2-D), except the output projection, a gate with one
  output (a Linear named ``gate`` or ``*_gate``: a scalar classifier) and an MoE router;
- ``embedding``: ``nn.Embedding`` / ``nn.EmbeddingBag`` weights (a tied LM head is the same
  Parameter and is listed here, once; ``ParamSplit.tied_lm_head`` is then True);
- ``lm_head``: the output projection's weight when it is not tied (found with
  ``model.get_output_embeddings()`` when the model has it, else by the module name ``lm_head``);
- ``experts``: stacked expert weights of a mixture-of-experts layer (3-D ``[E, out, in]``
  parameters of a ``*Experts`` module, or ``[E, in, out]``: ``expert_layouts``): Muon orthogonalises
  each expert's matrices on its own. Their stacked biases (GPT-OSS's ``*_bias`` ``[E, out]``) are biases.
  The router (a ``*Router`` module's ``[E, H]`` weight) and the shared expert's gate (a one-output
  Linear named ``shared_expert_gate``) are classifiers and go to ``other`` (AdamW); the shared expert's Linears are hidden
  matrices like any other (``muon``);
- ``norm_bias``: norm weights, biases and every other parameter with fewer than 2 dims;
- ``other``: any remaining parameter with 2+ dims that is not a Linear weight (custom
  ``nn.Parameter`` matrices, conv kernels, matrices forced to AdamW by a pattern). AdamW, with decay.

Overrides: ``muon_patterns`` / ``adamw_patterns`` are fnmatch globs on parameter names (with
wrapper prefixes such as ``_orig_mod.``, ``_checkpoint_wrapped_module.`` and
``_fsdp_wrapped_module.`` removed), e.g. ``"*.mlp.*"`` or ``"model.layers.0.*"``. A parameter
matched by ``muon_patterns`` goes to ``muon`` (it must be 2-D); one matched by ``adamw_patterns``
leaves ``muon`` for its type's AdamW group (``other`` for a Linear weight). Matching both is an
error. Frozen parameters (``requires_grad=False``) are left out.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import nn

from muonrun.errors import UserError
from muonrun.optim.experts import ExpertLayout, expert_layout, is_experts_module

__all__ = ["ParamSplit", "clean_param_name", "split_params"]

WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

Named = list[tuple[str, nn.Parameter]]


def clean_param_name(name: str) -> str:
    """Drop the path components that torch.compile, activation checkpointing and FSDP1 insert."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_COMPONENTS)


@dataclass
class ParamSplit:
    """(clean name, parameter) pairs per optimizer group; every trainable parameter exactly once."""

    muon: Named = field(default_factory=list)
    embedding: Named = field(default_factory=list)
    lm_head: Named = field(default_factory=list)
    experts: Named = field(default_factory=list)
    norm_bias: Named = field(default_factory=list)
    other: Named = field(default_factory=list)
    tied_lm_head: bool = False
    expert_layouts: dict[str, ExpertLayout] = field(default_factory=dict)
    """How each parameter in ``experts`` holds its matrices (``experts.ExpertLayout``), by name."""

    GROUPS = ("muon", "embedding", "lm_head", "experts", "norm_bias", "other")

    @property
    def adamw(self) -> Named:
        """Every non-Muon parameter."""
        return self.embedding + self.lm_head + self.other + self.norm_bias

    @property
    def adamw_decay(self) -> Named:
        """Non-Muon matrices (embedding, LM head, other): AdamW with weight decay."""
        return self.embedding + self.lm_head + self.other

    @property
    def adamw_no_decay(self) -> Named:
        """Norm weights and biases: AdamW without weight decay."""
        return self.norm_bias

    def expert_groups(self) -> list[dict]:
        """Muon param groups for ``experts``: one per layout (``experts.ExpertLayout.group_keys``), in the
        order the layouts first appear."""
        by_layout: dict[ExpertLayout, list] = {}
        for name, p in self.experts:
            by_layout.setdefault(self.expert_layouts[name], []).append(p)
        return [{"params": ps, **layout.group_keys()} for layout, ps in by_layout.items()]

    def names(self) -> dict[str, list[str]]:
        return {g: [n for n, _ in getattr(self, g)] for g in self.GROUPS}

    def numel(self) -> dict[str, int]:
        return {g: sum(p.numel() for _, p in getattr(self, g)) for g in self.GROUPS}

    def summary(self) -> str:
        counts = self.numel()
        parts = [f"{g} {len(getattr(self, g))} tensors / {counts[g]:,} params" for g in self.GROUPS]
        return "; ".join(parts) + ("; lm_head tied to embedding" if self.tied_lm_head else "")


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return bool(patterns) and any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def _output_embedding_weight(model: nn.Module) -> nn.Parameter | None:
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (NotImplementedError, AttributeError):
            head = None
        if head is not None and isinstance(getattr(head, "weight", None), nn.Parameter):
            return head.weight
    for name, module in model.named_modules():
        if clean_param_name(name).split(".")[-1] == "lm_head" and isinstance(
            getattr(module, "weight", None), nn.Parameter
        ):
            return module.weight
    return None


def _scalar_gate(name: str, p: nn.Parameter) -> bool:
    """A gate with one output (Qwen2-MoE's `shared_expert_gate`): a classifier, not a hidden matrix. By
    name as well as shape: a LoRA A of rank 1 also has one row, and it is a hidden matrix."""
    module_name = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    return p.shape[0] == 1 and (module_name == "gate" or module_name.endswith("_gate"))


def split_params(
    model: nn.Module,
    muon_patterns: Iterable[str] | None = None,
    adamw_patterns: Iterable[str] | None = None,
) -> ParamSplit:
    """Split ``model``'s trainable parameters into Muon / embedding / LM head / norm+bias / other.

    Raises UserError if a pattern forces a non-2-D parameter into Muon or a parameter matches both
    pattern lists, ValueError if the split does not hold every trainable parameter exactly once.
    """
    muon_patterns = list(muon_patterns or [])
    adamw_patterns = list(adamw_patterns or [])

    # Which module owns each parameter (first owner wins, like named_parameters' deduplication).
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) not in owner:
                owner[id(p)] = module
    embedding_ids = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.weight is not None
    }
    # An MoE block's router (its `gate` next to its `experts`) is a classifier, a Linear in some versions.
    router_ids = {
        id(m.gate.weight)
        for m in model.modules()
        if isinstance(getattr(m, "experts", None), nn.Module)
        and is_experts_module(m.experts)
        and isinstance(getattr(getattr(m, "gate", None), "weight", None), nn.Parameter)
    }
    head = _output_embedding_weight(model)
    head_id = id(head) if head is not None else None

    split = ParamSplit(tied_lm_head=head_id is not None and head_id in embedding_ids)
    named = [(clean_param_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    for name, p in named:
        module = owner.get(id(p))
        forced_muon = _matches(name, muon_patterns)
        forced_adamw = _matches(name, adamw_patterns)
        if forced_muon and forced_adamw:
            raise UserError(
                f"Parameter {name} matches both optimizer.muon.muon_patterns and optimizer.muon.adamw_patterns "
                f"(muon_patterns {muon_patterns}, adamw_patterns {adamw_patterns}): each parameter goes to one "
                "optimizer. Narrow one of the two lists so that it no longer matches it."
            )
        experts_module = module is not None and is_experts_module(module)
        if forced_muon and p.ndim == 3 and experts_module:
            split.experts.append((name, p))
            split.expert_layouts[name] = expert_layout(module, name)
        elif forced_muon:
            if p.ndim != 2:
                raise UserError(
                    f"optimizer.muon.muon_patterns {muon_patterns} matches {name}, of shape {tuple(p.shape)}: "
                    "Muon steps 2-D matrices (and stacked experts) only. Narrow the pattern so that it matches "
                    "matrices alone (e.g. '*proj.weight'); vectors such as norms and biases stay on AdamW."
                )
            split.muon.append((name, p))
        elif id(p) in embedding_ids:
            split.embedding.append((name, p))
        elif id(p) == head_id:
            split.lm_head.append((name, p))
        elif p.ndim < 2 or (experts_module and p.ndim == 2 and name.endswith("_bias")):  # GPT-OSS's [E, out]
            split.norm_bias.append((name, p))
        elif p.ndim == 3 and experts_module and not forced_adamw:
            split.experts.append((name, p))
            split.expert_layouts[name] = expert_layout(module, name)
        elif (
            isinstance(module, nn.Linear)
            and p is module.weight
            and p.ndim == 2
            and not _scalar_gate(name, p)
            and id(p) not in router_ids
            and not forced_adamw
        ):
            split.muon.append((name, p))
        else:
            split.other.append((name, p))

    _check_complete(split, named)
    for key, patterns in (("muon_patterns", muon_patterns), ("adamw_patterns", adamw_patterns)):
        unused = [pat for pat in patterns if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named)]
        if unused:  # a typo would otherwise leave the split as it was, without a word
            examples = ", ".join(n for n, p in named if p.ndim == 2)[:160] or "none"
            raise UserError(
                f"optimizer.muon.{key} {unused} match no trainable parameter of this model, whose names look "
                f"like {examples}... Fix the pattern (fnmatch wildcards, e.g. '*self_attn.q_proj.weight') or "
                "drop it."
            )
    return split


def _check_complete(split: ParamSplit, named: Named) -> None:
    seen: dict[int, list[str]] = {}
    for group in ParamSplit.GROUPS:
        for _, p in getattr(split, group):
            seen.setdefault(id(p), []).append(group)
    missing = [n for n, p in named if id(p) not in seen]
    duplicated = [f"{n} ({', '.join(seen[id(p)])})" for n, p in named if len(seen.get(id(p), [])) > 1]
    expected = {id(p) for _, p in named}
    extra = [n for g in ParamSplit.GROUPS for n, p in getattr(split, g) if id(p) not in expected]
    if missing or duplicated or extra:
        raise ValueError(
            "parameter split is not a partition: "
            f"missing {missing or 'none'}; in several groups {duplicated or 'none'}; unknown {extra or 'none'}"
        )
