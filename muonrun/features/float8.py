"""float8 training: the decoder layers' matmuls run in float8 (torchao), the weights stay as they are.

    muonrun pretrain qwen2-muon-fsdp2 parallel.float8=tensorwise --dry-run     # which layers it serves

torchao's `convert_to_float8_training` swaps chosen `nn.Linear` modules for `Float8Linear`, which
casts the input, the weight and the output gradient to float8 around each matmul (scales per tensor,
or per row with `rowwise`). The parameters keep their storage (fp32 masters, sharded by FSDP2, bf16
all-gathers), so AdamW and Muon (its Newton–Schulz included) are unchanged; only the GEMMs of the
forward and backward passes change precision.

Which layers: a float8 matmul pays only when it is big enough to amortise its casts. The rule is
torchao's own, from its H100 measurements of a single Linear's forward + backward
(torchao/float8 README, "performance"): both dims multiples of 16 (a float8 tensor-core requirement),
and for `tensorwise` not (in_features <= 4096 and out_features <= 1024); for `rowwise` out_features >
2048, in_features > 1024 and not (out_features <= 4096 and in_features <= 2048). The LM head is never
converted (muonrun's fused loss calls its weight directly, in bf16). Measured effects are in
docs/performance.md ("float8").
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from muonrun.config import Config
from muonrun.errors import UserError
from muonrun.features.protocol import Feature


def serves(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a Linear of this shape runs in float8 under `recipe` (the rule in the module docstring)."""
    N, K = out_features, in_features
    if N % 16 or K % 16:
        return False
    if recipe == "tensorwise":
        return not (K <= 4096 and N <= 1024)
    if recipe == "rowwise":
        return N > 2048 and K > 1024 and not (N <= 4096 and K <= 2048)
    raise ValueError(f"unknown float8 recipe {recipe!r}")


def chosen(model: nn.Module, recipe: str) -> dict[str, bool]:
    """{name: runs in float8} for every Linear of the model's decoder (the LM head excluded)."""
    holder = next((m for m in model.modules() if hasattr(m, "get_output_embeddings")), None)
    head = holder.get_output_embeddings() if holder is not None else None
    return {
        name: serves(m.out_features, m.in_features, recipe)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and m is not head
    }


def check_available(device_type: str) -> None:
    """float8 needs torchao and a GPU with float8 tensor cores (compute capability 8.9+: Ada, Hopper)."""
    import torch

    if device_type != "cuda" or not torch.cuda.is_available():
        raise UserError(
            "Config key 'parallel.float8' is set, but this run has no GPU: float8 matmuls need an NVIDIA GPU "
            "with compute capability 8.9 or newer (Ada, Hopper). Set parallel.float8=none on CPU."
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise UserError(
            f"Config key 'parallel.float8' is set, but {torch.cuda.get_device_name()} (compute capability "
            f"{major}.{minor}) has no float8 tensor cores; they start at 8.9 (Ada, Hopper). Set parallel.float8=none."
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError(
            "Config key 'parallel.float8' is set, but torchao is not installed: pip install 'muonrun[float8]'."
        ) from None


def apply_float8(model: nn.Module, recipe: str) -> int:
    """Swap the chosen Linear modules for torchao's Float8Linear (on the meta device, before compile
    and fully_shard, as torchtitan does). Returns how many were swapped."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    picked = {name for name, ok in chosen(model, recipe).items() if ok}
    convert_to_float8_training(
        model,
        config=Float8LinearConfig.from_recipe_name(recipe),
        module_filter_fn=lambda module, fqn: fqn in picked,
    )
    return len(picked)


def plan_row(model: nn.Module, recipe: str) -> str:
    """Which Linear layers run in float8, by shape."""
    picks = chosen(model, recipe)
    shapes = {name: (m.out_features, m.in_features) for name, m in model.named_modules() if name in picks}
    yes = Counter(shapes[n] for n, ok in picks.items() if ok)
    no = Counter(shapes[n] for n, ok in picks.items() if not ok)

    def fmt(counts):
        return ", ".join(f"{n} x {o}x{i}" for (o, i), n in sorted(counts.items())) or "none"

    return (
        f"{recipe}: {sum(yes.values())} of {len(picks)} decoder Linear layers run in float8 ({fmt(yes)}; "
        f"too small to gain, kept bf16: {fmt(no)}); the LM head stays bf16. Needs a GPU of compute "
        "capability 8.9+ and torchao"
    )


class Float8(Feature):
    """`parallel.float8`: torchao's float8 matmuls in the layers the rule above picks."""

    @staticmethod
    def wanted(cfg: Config) -> bool:
        return cfg.parallel.float8 != "none"

    def check(self, device_type: str) -> None:
        check_available(device_type)

    def convert(self, model: nn.Module) -> None:
        apply_float8(model, self.cfg.parallel.float8)

    def plan_rows(self, model: nn.Module) -> list[tuple[str, str]]:
        return [("float8", plan_row(model, self.cfg.parallel.float8))]
