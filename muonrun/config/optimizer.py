"""The `optimizer` and `optimizer.muon` sections of the typed configuration (see `config.schema`):
one dataclass per section, a docstring under every field (the reference documentation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from muonrun.config.checks import at_least, not_negative
from muonrun.errors import UserError


@dataclass
class MuonConfig:
    lr: float = 0.02
    """Learning rate of the Muon (hidden matrix) parameters; the other parameters use optimizer.lr."""
    weight_decay: float | None = None
    """Decoupled weight decay for the Muon parameters. None: optimizer.weight_decay."""
    momentum: float = 0.95
    """Momentum coefficient."""
    nesterov: bool = True
    """Orthogonalize the Nesterov look-ahead instead of the momentum buffer."""
    ns_steps: int = 5
    """Newton–Schulz iterations (at least 1)."""
    ns_coefficients: Literal["default", "polar_express", "turbo"] = "default"
    """`default` (3.4445, -4.7750, 2.0315) every iteration; `polar_express` (per-iteration
    coefficients, arXiv:2505.16932: about half the default's distance to the polar factor at 5
    iterations); or `turbo`, Turbo-Muon's 4-iteration table for `ns_precondition=aol` with
    `ns_steps=4` (arXiv:2512.04632). A table shorter than `ns_steps` repeats its last row.
    `polar_express` with `ns_steps=4` saves one iteration but trains worse: somewhat larger updates
    (singular values up to about 1.6 instead of 1.2) and, over four seeds, a 1.5B loss 0.9% higher than the
    default's and the optimizer study's 0.5% (docs/performance.md [v10]); for studies only."""
    gram_ns: bool = False
    """Newton–Schulz on the Gram matrix (X X^T) for matrices at least 1.5x wider than tall, with one
    restart: the same iteration in exact arithmetic, about half the FLOPs on MLP-shaped matrices (40%
    fewer with `ns_split_restart=false`), as close to the exact polar factor in bf16 as the standard
    form, and the same loss curve. It pays where wide MLP matrices dominate the optimizer step
    (docs/performance.md). On in the Muon preset; off by default so that `muon` alone is
    torch.optim.Muon's iteration."""
    adjust_lr_fn: Literal["original", "match_rms_adamw", "spectral"] = "original"
    """LR scaling per matrix shape A x B: `original` lr*sqrt(max(1, A/B)); `match_rms_adamw`
    lr*0.2*sqrt(max(A, B)) (reuse AdamW's lr); `spectral` lr*sqrt(A/B)."""
    eps: float = 1e-7
    """Added to the Frobenius norm before Newton–Schulz."""
    variant: Literal["muon", "normuon"] = "muon"
    """`muon`, or `normuon` (NorMuon, arXiv:2510.05491): after Newton–Schulz, each row is divided by
    the root of an EMA of its mean square (`optimizer.muon.beta2`), then the matrix is rescaled to the
    Frobenius norm of an orthogonal one, so `adjust_lr_fn` applies as for Muon; with `match_rms_adamw`
    that is the paper's step 0.2 * lr * sqrt(A*B) / ||Ô||_F. Keeps one more fp32 number per matrix row."""
    beta2: float = 0.95
    """NorMuon's EMA coefficient for each row's second moment, in [0, 1) (unused by `muon`)."""
    ns_precondition: Literal["frobenius", "aol"] = "frobenius"
    """How Newton–Schulz scales its input: `frobenius` divides it by its Frobenius norm
    (torch.optim.Muon's); `aol` scales row i by (sum_j |(X X^T)_ij|)^(-1/2) (Turbo-Muon's AOL
    preconditioning, arXiv:2512.04632), read off the first iteration's own product. Its small
    singular values start 1.2-3x larger, which lets Turbo-Muon's 4-iteration table
    (`ns_coefficients=turbo`, `ns_steps=4`) stand in for 5 iterations: 20% fewer FLOPs in the
    standard form, 11% in the Gram form (whose restart costs the same either way). It trades
    closeness to the polar factor by spectrum: 2-3x closer on flat spectra, up to 1.7x farther on
    steep ones, where its updates are also smaller (docs/performance.md, per preset shape). It is
    not the default: at 1.5B, 300 steps of the presets' recipe trained to a loss 19% above the default
    iteration's. Use it to study Newton–Schulz, not to train."""
    fused: bool | None = None
    """Fewer passes over memory in Muon's step, the same arithmetic up to rounding: momentum,
    Nesterov look-ahead and the cast into the bf16 exchange buffer as one compiled kernel, weight
    decay and the update (with NorMuon's row factors) as another, the division of each owned matrix
    by its norm as a third (torch.compile). Pays most on one GPU, where Muon's own elementwise
    work is not shared across ranks; the first step compiles a few small kernels. None: on for
    GPUs, off on CPU (`true` there runs the same ops eagerly, and says so once)."""
    ns_fold_norm: bool = True
    """With `gram_ns`: read each wide matrix's Frobenius norm from the trace of its first Gram product
    (X X^T) and apply it to the small m x m products Newton–Schulz forms anyway (in fp32 math,
    rounded once), instead of dividing the whole matrix by it in a pass of its own. The same
    arithmetic up to where bf16 rounds; one pass fewer over Muon's largest matrices, where a rank
    holds them whole: one GPU, and stacked experts (docs/performance.md). Across several ranks the
    division already rides in the copy that reassembles each matrix."""
    ns_split_restart: bool = True
    """With `gram_ns`: the Gram form's restart (before its third iteration, where it rebuilds the Gram
    matrix so that bf16 rounding does not compound) starts from the first Gram matrix X X^T, kept in
    fp32 as two bf16 halves, and forms Q (X X^T) Q^T on the small m x m side, instead of Q X and its
    Gram matrix on the long side; the end applies the product of both polynomials to X. The same in
    exact arithmetic and as close to the polar factor (bf16 alone would not be: the halves are what
    make it work); 17-19% fewer Newton–Schulz FLOPs on matrices at least 3 times wider than tall (the
    MLP's), the others restart from X. It makes Newton–Schulz faster on the presets' MLP shapes and
    trains as the restart from X does (figures and the training check: docs/performance.md). On GPUs
    it compiles two small kernels at the first step; `false` restarts from X."""
    cuda_graph: bool | None = None
    """Replay Muon's step from a CUDA graph: everything after its momentum pass, for the matrices a
    GPU steps on its own (all of them on one GPU; stacked experts on any number), captured at the third
    step and replayed after, one launch instead of hundreds. It pays most where the host cannot keep
    ahead of the GPU (small models; `timeline.txt` of `logging.profile` shows it: a short lag, idle
    inside the optimizer's window); at the presets' sizes the host runs ahead anyway and the graph
    saves host time only. Matrices exchanged between GPUs and steps that log
    `logging.optimizer_telemetry` run eagerly. It keeps Muon's step buffers (2 bytes per matrix
    element) and temporaries allocated between steps. The same arithmetic, bit for bit with `fused`;
    figures in docs/performance.md. None: on for GPUs; on CPU there is nothing to capture."""
    ns_streams: int = 3
    """CUDA streams on which `cuda_graph` runs independent Newton–Schulz stacks side by side (each
    bucket's update after its stacks): one stack's products leave the GPU partly idle where they end,
    and another's kernels fill that. The same kernels on the same numbers, so the same results bit for
    bit; figures in docs/performance.md. 1: one stream. Without the graph, or on CPU, the stacks run
    one after another."""
    ns_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Dtype of Newton–Schulz and of its all-to-all exchange: `auto` is bfloat16 on GPUs (torch.optim.Muon's)
    and on CPUs with native bf16 matmuls (AVX512-BF16), float32 on other CPUs, where bf16 matmuls are
    several times slower (docs/performance.md)."""
    ns_products: Literal["auto", "torch", "quack"] = "auto"
    """How Newton–Schulz's matrix products run: `torch` (cuBLAS's bmm, torch.optim.Muon's); `quack`,
    quack's symmetric GEMM for the three products per iteration whose result is symmetric (X X^T,
    the polynomial in it and, in the Gram form, the products of polynomials): it computes the tiles on
    and above the diagonal and mirrors them, half those products' FLOPs, each entry the same
    bf16-input, fp32-accumulated dot product (`pip install 'muonrun[quack]'`, an NVIDIA GPU; matrices
    of side 512 and up, torch's below); the standard form's `a X + B X` also runs on quack, its
    `a X` added in the GEMM's epilogue instead of copied first, and on Hopper each product uses the
    tile shape measured fastest for it. It pays most where large matrices dominate: Newton–Schulz's
    time per model on one H200 is in docs/performance.md. `auto`: quack on Hopper GPUs where it is
    installed, torch's elsewhere. The first step compiles its kernels."""
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
        if self.eps <= 0:
            raise UserError(f"Config key 'optimizer.muon.eps' is {self.eps}; it must be positive.")
        if self.ns_steps < 1:  # zero iterations would train with unorthogonalized momentum as "Muon"
            raise UserError(
                f"Config key 'optimizer.muon.ns_steps' is {self.ns_steps}; Muon needs at least 1 Newton–Schulz "
                "iteration (5 is usual)."
            )
        if not 0.0 <= self.beta2 < 1.0:
            raise UserError(f"Config key 'optimizer.muon.beta2' is {self.beta2}; it must be in [0, 1).")
        at_least(1, **{"optimizer.muon.ns_streams": self.ns_streams})


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
