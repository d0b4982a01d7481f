"""The `optimizer` and `optimizer.muon` sections of the typed configuration (see `config.schema`):
one dataclass per section, a docstring under every field (the reference documentation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from muonrun.config.checks import not_negative
from muonrun.errors import UserError


@dataclass
class MuonConfig:
    lr: float = 0.02
    """Learning rate of the Muon (hidden matrix) parameters; the other parameters use optimizer.lr.
    0.02 suits the `original` shape scaling; with `match_rms_adamw`, AdamW's learning rate."""
    weight_decay: float | None = None
    """Decoupled weight decay for the Muon parameters. None: optimizer.weight_decay."""
    momentum: float = 0.95
    """Momentum coefficient, in [0, 1)."""
    nesterov: bool = True
    """Orthogonalize the Nesterov look-ahead instead of the momentum buffer (torch.optim.Muon's default)."""
    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral"] = "original"
    """LR scaling per matrix shape A x B: `original` lr*sqrt(max(1, A/B)) (KellerJordan's); `match_rms_adamw`
    lr*0.2*sqrt(max(A, B)) (Moonlight's: updates with AdamW's RMS, so Muon can share AdamW's lr and weight
    decay); `spectral` lr*sqrt(A/B)."""
    gram_ns: bool = False
    """Newton–Schulz in its Gram form (on X X^T) for matrices at least 1.5x wider than tall: the same
    iteration in exact arithmetic, as close to the polar factor in bf16, about half the FLOPs on
    MLP-shaped matrices, and the same loss curve (docs/performance.md). On in the Qwen2 Muon presets; off
    by default, so that `muon` alone is torch.optim.Muon's iteration."""
    variant: Literal["muon", "normuon"] = "muon"
    """`muon`, or `normuon` (NorMuon, arXiv:2510.05491): after Newton–Schulz, each row is divided by
    the root of an EMA of its mean square (`optimizer.muon.beta2`), then the matrix is rescaled to the
    Frobenius norm of an orthogonal one, so `adjust_lr_fn` applies as for Muon; with `match_rms_adamw`
    that is the paper's step 0.2 * lr * sqrt(A*B) / ||Ô||_F. Keeps one more fp32 number per matrix row."""
    beta2: float = 0.95
    """NorMuon's EMA coefficient for each row's second moment, in [0, 1) (unused by `muon`)."""
    eager: bool = False
    """Launch Muon's GPU step kernel by kernel: no compiled elementwise passes, no CUDA graph. The same
    arithmetic up to rounding and slower; for debugging a GPU step (on CPU it changes nothing)."""
    muon_patterns: list[str] = field(default_factory=list)
    """Parameter-name globs (fnmatch, e.g. `*self_attn.q_proj.weight`) forced into Muon: each must match
    a trainable parameter, and only 2-D ones (or stacked experts)."""
    adamw_patterns: list[str] = field(default_factory=list)
    """Parameter-name globs forced into AdamW; each must match a trainable parameter, none one that
    `muon_patterns` matches too."""

    def __post_init__(self) -> None:
        not_negative(**{"optimizer.muon.lr": self.lr})
        if self.weight_decay is not None:
            not_negative(**{"optimizer.muon.weight_decay": self.weight_decay})
        if not 0.0 <= self.momentum < 1.0:  # at 1 or more the momentum buffer grows without bound
            raise UserError(f"Config key 'optimizer.muon.momentum' is {self.momentum}; it must be in [0, 1).")
        if not 0.0 <= self.beta2 < 1.0:
            raise UserError(f"Config key 'optimizer.muon.beta2' is {self.beta2}; it must be in [0, 1).")


# Keys that have left `optimizer.muon`: each is how Muon runs now, or a study lever that a study passes
# as its own iteration (`Muon(newton_schulz=...)`). A config that sets one is refused naming what to do;
# a checkpoint's saved config that holds one loads without it.
RETIRED_MUON_KEYS = {
    "fused": "Muon's elementwise passes are compiled on GPUs; `optimizer.muon.eager=true` turns that off",
    "cuda_graph": "Muon's step replays from a CUDA graph on GPUs; `optimizer.muon.eager=true` turns that off",
    "ns_streams": "the CUDA graph runs its stacks on three streams",
    "ns_fold_norm": "the Gram form always reads the norm off its first product where a rank holds a matrix whole",
    "ns_split_restart": "the Gram form always restarts from its first Gram matrix where that is cheaper",
    "ns_products": "quack's symmetric GEMM is used on Hopper GPUs where quack-kernels is installed",
    "ns_dtype": "Newton–Schulz runs in bf16 on GPUs and fp32 on CPUs without native bf16 matmuls",
    "ns_steps": "Muon runs torch.optim.Muon's 5 iterations; a study passes its own (Muon(newton_schulz=...))",
    "ns_coefficients": "Muon runs torch.optim.Muon's coefficients; a study passes its own (Muon(newton_schulz=...))",
    "ns_precondition": "AOL preconditioning trained worse; a study passes its own iteration (Muon(newton_schulz=...))",
    "eps": "Muon uses torch.optim.Muon's 1e-7",
}


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """`adamw`, or `muon` (Muon for hidden matrices, AdamW for embeddings, LM head, norms and biases)."""
    lr: float = 3e-4
    """Peak learning rate of AdamW (with `muon`: of the embeddings, LM head, norms and biases)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW (norms and biases are never decayed)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: bool | None = None
    """Fused AdamW kernel. None: on for GPUs, off on CPU."""
    muon: MuonConfig = field(default_factory=MuonConfig)
    """Muon settings (used when name is `muon`)."""

    def __post_init__(self) -> None:
        not_negative(**{"optimizer.lr": self.lr, "optimizer.weight_decay": self.weight_decay})
        if self.eps <= 0:
            raise UserError(f"Config key 'optimizer.eps' is {self.eps}; it must be positive.")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise UserError(
                f"Config key 'optimizer.betas' is {list(self.betas)}; give two numbers in [0, 1)."
            )
