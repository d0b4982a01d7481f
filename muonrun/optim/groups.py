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
- ``experts``: stacked expert weights of a mixture-of-experts layer (3-D ``[E, out, in]`` parameters
  of a ``*Experts`` module, or ``[E, in, out]``: ``expert_layouts``): Muon orthogonalises each expert's
  matrices on its own. Their stacked biases (GPT-OSS's ``*_bias`` ``[E, out]``) are biases. The router
  (a ``*Router`` module's ``[E, H]`` weight) and the shared expert's gate (``shared_expert_gate``) are
  classifiers (``other``); the shared expert's Linears are hidden matrices like any other (``muon``);
- ``norm_bias``: norm weights, biases and every other parameter with fewer than 2 dims;
- ``other``: any remaining parameter with 2+ dims that is not a Linear weight (custom
  ``nn.Parameter`` matrices, conv kernels, matrices forced to AdamW by a pattern). AdamW, with decay.

Overrides: ``muon_patterns`` / ``adamw_patterns`` are fnmatch globs on parameter names without wrapper
prefixes (``clean_param_name``), e.g. ``"*.mlp.*"`` or ``"model.layers.0.*"``. A parameter matched by
``muon_patterns`` goes to ``muon`` (it must be 2-D); one matched by ``adamw_patterns`` leaves ``muon``
for its type's AdamW group (``other`` for a Linear weight). Matching both is an error. Frozen
parameters (``requires_grad=False``) are left out.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from torch import Tensor, nn

from muonrun.errors import UserError

__all__ = ["ExpertLayout", "ParamSplit", "clean_param_name", "split_params"]


def is_experts_module(module: nn.Module) -> bool:
    """A module holding stacked expert weights ([E, out, in] parameters): transformers names them
    `*Experts` (`Qwen2MoeExperts`, `MixtralExperts`, ...)."""
    return type(module).__name__.endswith("Experts")


@dataclass(frozen=True)
class ExpertLayout:
    """How a stacked expert parameter holds its experts' ``[out, in]`` matrices; a Muon param group of
    stacked experts carries it in its ``group_keys``."""

    matrices: int = 1  # per expert: 2 for a fused gate_up_proj (the gate's and the up projection's)
    transposed: bool = False
    """Stored ``[E, in, out]`` (GPT-OSS, Llama4, Aria), else ``[E, out, in]`` (Qwen2-MoE, Mixtral, DeepSeek)."""
    interleaved: bool = False  # a fused projection's matrices alternate along out (GPT-OSS: gate, up, ...)

    def matrix_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """``(out, in)`` of one matrix of a parameter (or local shard) of ``shape`` ``[E, a, b]``."""
        out, fan_in = (shape[2], shape[1]) if self.transposed else (shape[1], shape[2])
        return out // self.matrices, fan_in

    def matrices_of(self, T: Tensor) -> Tensor:
        """``T`` (shaped like the parameter or its local shard, ``[E', a, b]``) as a view ``[E', k, out,
        in]`` of its matrices: contiguous in the usual layout, strided in the others."""
        M = T.mT if self.transposed else T
        k = self.matrices
        if self.interleaved:
            return M.unflatten(1, (M.shape[1] // k, k)).transpose(1, 2)
        return M.unflatten(1, (k, M.shape[1] // k))

    @property
    def strided(self) -> bool:
        """Whether ``matrices_of`` gives a strided view (any layout but the usual one)."""
        return self.transposed or self.interleaved

    def group_keys(self) -> dict:
        return {
            "matrices_per_expert": self.matrices,
            "experts_transposed": self.transposed,
            "experts_interleaved": self.interleaved,
        }

    @classmethod
    def of_group(cls, group: dict) -> ExpertLayout:
        """The layout a param group of stacked experts declares (``group_keys``; the usual one by default)."""
        return cls(
            group["matrices_per_expert"],
            bool(group.get("experts_transposed", False)),
            bool(group.get("experts_interleaved", False)),
        )


def expert_layout(module: nn.Module, param_name: str) -> ExpertLayout:
    """The layout of the stacked parameter ``param_name`` of a ``*Experts`` module. transformers declares
    it on modules it wraps with ``use_experts_implementation`` (``is_transposed``, ``is_concatenated``);
    an undeclared one (Llama4's) is read from where its hidden size sits in ``down_proj`` or
    ``gate_up_proj``."""
    k = 2 if param_name.rsplit(".", 1)[-1] == "gate_up_proj" else 1  # ExpertLayout.matrices
    interleaved = k > 1 and getattr(module, "is_concatenated", True) is False
    return ExpertLayout(k, _stored_transposed(module), interleaved)


def _stored_transposed(module: nn.Module) -> bool:
    declared = getattr(module, "is_transposed", None)
    if declared is not None:
        return bool(declared)
    hidden = getattr(module, "hidden_dim", None) or getattr(module, "hidden_size", None)
    for name, out_is_hidden in (("down_proj", True), ("gate_up_proj", False)):
        p = getattr(module, name, None)
        if isinstance(p, Tensor) and p.ndim == 3 and p.shape[1] != p.shape[2] and hidden in p.shape[1:]:
            # [E, out, in]: the hidden size is down_proj's out (dim 1) and gate_up_proj's in (dim 2)
            return (p.shape[1] == hidden) != out_is_hidden
    return False


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
    expert_layouts: dict[str, ExpertLayout] = field(default_factory=dict)  # by name, for each in experts

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
        """Muon param groups for ``experts``: one per layout (``ExpertLayout.group_keys``), as first seen."""
        by_layout: dict[ExpertLayout, list] = {}
        for name, p in self.experts:
            by_layout.setdefault(self.expert_layouts[name], []).append(p)
        return [{"params": ps, **layout.group_keys()} for layout, ps in by_layout.items()]

    def names(self) -> dict[str, list[str]]:
        return {g: [n for n, _ in getattr(self, g)] for g in self.GROUPS}

    def numel(self) -> dict[str, int]:
        return {g: sum(p.numel() for _, p in getattr(self, g)) for g in self.GROUPS}


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
    """Split ``model``'s trainable parameters by the rules above, each into one group (one branch of the
    chain below). Raises UserError if a pattern forces a non-2-D parameter into Muon, a parameter
    matches both pattern lists, or a pattern matches no parameter."""
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
        if p.ndim == 3 and experts_module and (forced_muon or not forced_adamw):
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
