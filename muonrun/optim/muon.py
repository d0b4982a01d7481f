"""Muon: momentum + Newton–Schulz orthogonalisation, for plain tensors and FSDP2-sharded DTensors.

References
----------
- K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024),
  https://kellerjordan.github.io/posts/muon/ -- the algorithm, the quintic Newton–Schulz
  coefficients (3.4445, -4.7750, 2.0315) and the ``original`` lr scaling ``sqrt(max(1, A/B))``.
- J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training", arXiv:2502.16982 -- decoupled
  weight decay and the ``match_rms_adamw`` lr scaling ``0.2 * sqrt(max(A, B))``.
- N. Amsel et al., "The Polar Express: Optimal Matrix Sign Methods and Their Application to the
  Muon Algorithm", arXiv:2505.16932 -- per-iteration coefficients (``ns_coefficients="polar_express"``).
- K. Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv:2504.13074 -- the all-to-all
  "owner computes" layout used here for sharded parameters and the ``spectral`` lr scaling
  ``sqrt(A/B)``.

What Muon may touch
-------------------
Only the *hidden* 2-D weight matrices of a network (the Linear weights inside the transformer
blocks). Embeddings, the LM head (tied or not), norm weights, biases and every other 1-D tensor must
go to AdamW: see ``muonrun.optim.groups.split_params``. This module asserts that every parameter
it is given is 2-D, but cannot tell an embedding from a hidden matrix by itself.

Reference semantics
-------------------
With the same arguments and gradients, :class:`Muon` gives the parameters that
``torch.optim.Muon`` gives (up to bf16 rounding of the Newton–Schulz products)::

    buf.lerp_(grad, 1 - momentum)                           # B = mu*B + (1-mu)*G
    u = grad.lerp(buf, momentum) if nesterov else buf       # Nesterov look-ahead
    O = newton_schulz(u)                                    # bf16
    p.mul_(1 - lr * weight_decay)                           # decoupled weight decay
    p.add_(O, alpha=-adjust_lr(lr, adjust_lr_fn, p.shape))

Distributed algorithm (FSDP2 / HSDP)
------------------------------------
FSDP2 parameters are DTensors sharded on dim 0 (``torch.chunk`` layout: ``c = ceil(rows/W)`` rows per
rank, the last ranks may get fewer or none). Every matrix is orthogonalised exactly once per shard
group:

1. momentum / Nesterov run elementwise on each rank's local rows (``torch._foreach_*``);
2. same-shaped matrices are grouped, groups are packed into buckets ("megabatches"), and every
   matrix gets an owner rank, round-robin with a rotating start so the work is balanced;
3. one ``all_to_all_single`` per bucket sends every rank's rows of matrix j (bf16, padded to ``c``
   rows) to j's owner;
4. the owner reassembles its matrices, strips the padding and runs Newton–Schulz batched
   (``torch.baddbmm``) over all the matrices of one shape it owns;
5. a second ``all_to_all_single`` returns each rank its rows of the result, which it applies
   (weight decay + scaled update) to its local shard.

The collectives are asynchronous and pipelined: while bucket ``b`` is being orthogonalised, the
exchange for bucket ``b + prefetch`` is in flight. Traffic is about two bf16 copies of a rank's
shard. On an HSDP mesh ``(dp_replicate, dp_shard)`` the exchange runs over the ``Shard(0)`` mesh
dimension (gradients are already averaged over the replicate one). Any other placement (e.g. a
tensor-parallel ``Shard(1)``, ``Partial``) is rejected with a ``ValueError``.

Optimizer state is one ``momentum_buffer`` per matrix with the parameter's type and placement
(AdamW keeps two), present on every rank, so ``torch.distributed.checkpoint`` works unchanged.

Performance (measured, 2 x H200 NVLink, torch 2.11, NCCL; hidden matrices only, median step)
------------------------------------------------------------------------------------------
- Qwen2-0.5B (168 matrices, 358M params, 7.2 TFLOP of Newton–Schulz per step): 12.0 ms per step
  (torch-compatible arithmetic 13.5 ms); this rank's Newton–Schulz alone 7.0 ms; one GPU 19.5 ms.
- Qwen2-1.5B (196 matrices, 1.31B params, 44.8 TFLOP): 50.4 ms (compatible 55.5 ms); Newton–Schulz
  alone 37.5 ms at ~600 TFLOP/s; one GPU 91 ms.
The GPU profile is ~75% batched bf16 GEMMs (``bmm``), the rest memory-bound elementwise passes
(momentum lerps, the fp32 += bf16 update, reassembly); the all-to-alls (~0.8 ms each) run on NCCL's
stream under the GEMMs; host time to issue a step (5-12 ms) stays below the GPU time. Knobs:
``bucket_numel`` (2^28 best; small buckets cost host time), ``prefetch`` (little effect),
``torch_compatible_ns`` (+10%), ``ns_steps`` with ``ns_coefficients="polar_express"`` (3 steps cut
Newton–Schulz by 38%). ``tests/dist/muon_bench.py`` reproduces these numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from muonrun.distributed import local_tensor

try:  # torch built without distributed support
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = Shard = None  # type: ignore[assignment,misc]

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "Muon",
    "adjust_lr",
    "newton_schulz",
    "resolve_ns_coefficients",
]

DEFAULT_NS_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.775, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5

# Polar Express, 5 iterations, as published in modded-nanogpt (arXiv:2505.16932). These already carry
# the paper's safety factor; the input is normalised by ``1.02 * ||X||_F`` instead of ``||X||_F``.
POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_NORM_SCALE = 1.02

# Gram Newton–Schulz (``gram=True``): restart from the current X before this iteration, and use the
# Gram form only for matrices at least this much wider than tall (where it is cheaper; +20% on
# square ones). docs/benchmarks.md, "Cheaper Newton–Schulz": without a restart bf16 rounding in the
# Gram matrix compounds; with one before the third iteration the result is as close to the exact
# polar factor as the standard iteration.
GRAM_RESTART = 2
GRAM_MIN_ASPECT = 1.5

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral")

NSCoefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]] | str


# --------------------------------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------------------------------


def resolve_ns_coefficients(
    coefficients: NSCoefficients, steps: int
) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """Per-iteration ``(a, b, c)`` for ``steps`` iterations and the normalisation scale.

    ``coefficients`` is one ``(a, b, c)`` triple (used every iteration, as in torch.optim.Muon), a
    sequence of triples (one per iteration, the last one repeated if ``steps`` is longer), or the
    string ``"polar_express"``.
    """
    if steps < 0 or steps >= 100:
        raise ValueError(f"ns_steps must be in [0, 100), got {steps}")
    norm_scale = 1.0
    if isinstance(coefficients, str):
        if coefficients != "polar_express":
            raise ValueError(
                f"unknown ns_coefficients {coefficients!r} (expected a triple or 'polar_express')"
            )
        table: Sequence = POLAR_EXPRESS_COEFFICIENTS
        norm_scale = POLAR_EXPRESS_NORM_SCALE
    elif len(coefficients) == 3 and all(isinstance(x, (int, float)) for x in coefficients):
        table = [tuple(coefficients)]
    else:
        table = [tuple(t) for t in coefficients]
        if (not table and steps > 0) or any(len(t) != 3 for t in table):
            raise ValueError("ns_coefficients must be (a, b, c), a sequence of (a, b, c) or 'polar_express'")
    per_step = tuple(tuple(float(x) for x in table[min(i, len(table) - 1)]) for i in range(steps))
    return per_step, norm_scale  # type: ignore[return-value]


def newton_schulz(
    G: Tensor,
    steps: int = DEFAULT_NS_STEPS,
    coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    *,
    norm_scale: float | None = None,
    fold_identity: bool = False,
    gram: bool = False,
) -> Tensor:
    """Approximate the orthogonal polar factor ``U V^T`` of ``G = U S V^T`` in bf16.

    ``G`` is a matrix ``[rows, cols]`` or a stack ``[..., rows, cols]`` (every matrix normalised and
    iterated independently, in one batched matmul per product). Same arithmetic as torch.optim.Muon's
    ``_zeropower_via_newtonschulz``: cast to bf16, ``X /= max(||X||_F, eps)``, then per iteration
    ``A = X X^T; B = b A + c A A; X = a X + B X`` on the wide orientation. A tall matrix (``rows >
    cols``) is not transposed in memory: the same iteration is written ``A = X^T X; X = a X + X B^T``,
    so every tensor stays contiguous and cuBLAS reads the transposes for free.
    ``fold_identity=True`` evaluates ``a X + B X`` as ``(B + a I) X`` (see ``_ns_iterate``);
    ``gram=True`` iterates on the Gram matrix where that is cheaper (see ``_gram_iterate``).
    Returns a contiguous bf16 tensor of ``G``'s shape.
    """
    per_step, default_scale = resolve_ns_coefficients(coefficients, steps)
    scale = default_scale if norm_scale is None else norm_scale
    if G.ndim < 2:
        raise ValueError(f"newton_schulz needs a matrix or a stack of matrices, got shape {tuple(G.shape)}")
    rows, cols = G.shape[-2], G.shape[-1]
    X = G.to(torch.bfloat16).reshape(-1, rows, cols)
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    if scale != 1.0:
        norm = norm * scale
    X = X / norm.clamp(min=eps)  # new tensor: never writes into G
    return _iterate(X, per_step, fold_identity, gram).reshape(G.shape)


def _uses_gram(gram: bool, shape: Sequence[int], steps: int) -> bool:
    """Whether ``gram=True`` takes the Gram form for this matrix shape (where it is cheaper)."""
    m, n = sorted(shape[-2:])
    return gram and steps > 0 and n >= GRAM_MIN_ASPECT * m


def _iterate(
    X: Tensor, per_step: Sequence[tuple[float, float, float]], fold_identity: bool, gram: bool
) -> Tensor:
    """Newton–Schulz on a normalised stack: the Gram form where ``_uses_gram``, else the standard one."""
    if _uses_gram(gram, X.shape, len(per_step)):
        return _gram_iterate(X, per_step)
    return _ns_iterate(X, per_step, fold_identity)


def _ns_iterate(X: Tensor, per_step: Sequence[tuple[float, float, float]], fold_identity: bool) -> Tensor:
    """Newton–Schulz iterations on a normalised bf16 stack ``[k, rows, cols]`` (returns a new tensor).

    ``fold_identity=False`` computes ``a X + B X`` with ``baddbmm(X, B, X, beta=a)`` like
    torch.optim.Muon; being out of place, that first copies the full-size ``X`` into its output,
    every iteration. ``fold_identity=True`` computes ``(B + a I) X``: ``a`` goes onto the small
    Gram-sized matrix and no full-size copy is made. The results differ by where one bf16 rounding
    happens (the diagonal of ``B + a I`` is stored in bf16): about 2% of the output's norm, the same
    as torch's own output moves when its input moves by one bf16 ulp, and equally close to the
    exact polar factor.
    """
    tall = X.shape[-2] > X.shape[-1]
    for a, b, c in per_step:
        A = torch.bmm(X.mT, X) if tall else torch.bmm(X, X.mT)  # tall: the iteration on X^T
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        if fold_identity:
            B.diagonal(dim1=-2, dim2=-1).add_(a)
            X = torch.bmm(X, B.mT) if tall else torch.bmm(B, X)
        else:
            X = torch.baddbmm(X, X, B.mT, beta=a) if tall else torch.baddbmm(X, B, X, beta=a)
    return X.contiguous()


def _gram_iterate(
    X: Tensor, per_step: Sequence[tuple[float, float, float]], restart: int | None = GRAM_RESTART
) -> Tensor:
    """The same iterations on the Gram matrix of a normalised stack ``[k, rows, cols]``: on the wide
    orientation ``m x n`` (``m < n``), with ``R = X X^T`` and ``Q = I``, each iteration forms
    ``P = a I + b R + c R^2`` and updates ``Q <- P Q``, ``R <- P R P``; the result is ``Q X``. In exact
    arithmetic that is the standard iteration (every P is a polynomial in the first R, so they
    commute), but the n-sized products happen only at the start, at the restart (``X <- Q X``,
    ``R <- X X^T`` before iteration ``GRAM_RESTART``, which stops bf16 rounding in R from compounding)
    and at the end: 8 m^2 n + ~28 m^3 FLOPs for 5 iterations instead of 20 m^2 n + 10 m^3.
    ``restart=None`` never restarts (only for the numerics study, scripts/gram_ns_numerics.py)."""
    tall = X.shape[-2] > X.shape[-1]

    def gram(Y: Tensor) -> Tensor:
        return torch.bmm(Y.mT, Y) if tall else torch.bmm(Y, Y.mT)

    def apply(Q: Tensor, Y: Tensor) -> Tensor:  # Q X on the wide orientation
        return torch.bmm(Y, Q.mT) if tall else torch.bmm(Q, Y)

    R, Q = gram(X), None
    last = len(per_step) - 1
    for i, (a, b, c) in enumerate(per_step):
        if i == restart and Q is not None:
            X = apply(Q, X)
            R, Q = gram(X), None
        P = torch.baddbmm(R, R, R, beta=b, alpha=c)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        Q = P if Q is None else torch.bmm(P, Q)
        if i < last and i + 1 != restart:  # the next iteration needs R; a restart rebuilds it
            R = torch.bmm(torch.bmm(P, R), P)
    return apply(Q, X).contiguous()


def newton_schulz_flops(shape: Sequence[int], steps: int = DEFAULT_NS_STEPS, gram: bool = False) -> int:
    """Matmul FLOPs of ``newton_schulz`` on one ``rows x cols`` matrix: per iteration, on the wide
    orientation ``m x n`` (``m <= n``), ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2 m^2 n).
    With ``gram`` (where it applies): the products ``_gram_iterate`` makes."""
    m, n = sorted(shape[-2:])
    if not _uses_gram(gram, shape, steps):
        return steps * (4 * m * m * n + 2 * m**3)
    restart = steps > GRAM_RESTART
    flops = 2 * m * m * n * (2 + 2 * restart)  # X X^T, final Q X; restart: Q X and X X^T again
    for i in range(steps):
        fresh = i == 0 or (restart and i == GRAM_RESTART)  # Q = I: P Q costs nothing
        keeps_r = i < steps - 1 and i + 1 != GRAM_RESTART
        flops += 2 * m**3 * (1 + (not fresh) + 2 * keeps_r)
    return flops


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """Scale ``lr`` for a matrix of ``shape = (A, B)`` (A = rows = fan-out, B = cols = fan-in).

    - ``None`` or ``"original"`` (KellerJordan, torch's default): ``lr * sqrt(max(1, A / B))``
    - ``"match_rms_adamw"`` (Moonlight): ``lr * 0.2 * sqrt(max(A, B))``
    - ``"spectral"`` (dion's spectral-norm scaling): ``lr * sqrt(A / B)``
    """
    A, B = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral":
        ratio = math.sqrt(A / B)
    else:
        raise ValueError(f"unknown adjust_lr_fn {adjust_lr_fn!r}; expected one of {ADJUST_LR_FNS}")
    return lr * ratio


# --------------------------------------------------------------------------------------------------
# Sharding inspection
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ShardInfo:
    group: Any  # ProcessGroup of the Shard(0) mesh dim, or None when the full matrix is local
    world: int
    rank: int


_LOCAL = _ShardInfo(None, 1, 0)


def _shard_info(p: Tensor, name: str) -> _ShardInfo:
    """Where a parameter's rows live. Raises ValueError for any layout but (Replicate*, Shard(0))."""
    if DTensor is None or not isinstance(p, DTensor):
        return _LOCAL
    mesh = p.device_mesh
    shard_dims = []
    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is Shard and pl.dim == 0:
            shard_dims.append(mesh_dim)
            continue
        raise ValueError(
            f"Muon: parameter {name} has placements {p.placements} on mesh {mesh}; only FSDP/HSDP "
            "layouts (Replicate() and one Shard(0)) are supported. Tensor-parallel or partial "
            "placements are not."
        )
    if not shard_dims:
        return _LOCAL
    if len(shard_dims) > 1:
        raise ValueError(
            f"Muon: parameter {name} is sharded on dim 0 over several mesh dims {p.placements}; "
            "flatten them into one mesh dim."
        )
    md = shard_dims[0]
    world = mesh.size(md)
    if world == 1:
        return _LOCAL
    return _ShardInfo(mesh.get_group(md), world, mesh.get_local_rank(md))


def _chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)


def _local_rows(rows: int, world: int, rank: int) -> int:
    c = _chunk_rows(rows, world)
    return max(0, min(rows, (rank + 1) * c) - rank * c)


def _to_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


# --------------------------------------------------------------------------------------------------
# The plan: buckets, owners, offsets. Built once per set of parameters, identical on every rank.
# --------------------------------------------------------------------------------------------------


@dataclass
class _Item:
    param: Tensor
    group_index: int
    rows: int
    cols: int
    chunk: int  # rows per rank slab (ceil(rows / world)); == rows when local
    local_rows: int
    owner: int = 0
    offset: int = 0  # element offset of this rank's slab in the bucket's send/receive buffer


@dataclass
class _Owned:
    """Matrices of one shape that this rank owns in a bucket (one batched Newton–Schulz)."""

    rows: int
    cols: int
    chunk: int
    count: int
    offset: int  # element offset inside each source's segment of the owner buffer


@dataclass
class _Bucket:
    items: list[_Item]  # ordered by owner, then shape
    send_splits: list[int]
    recv_splits: list[int]
    send_numel: int
    recv_numel: int
    owned: list[_Owned]
    per_source: int  # elements per source in the owner buffer
    by_group: list[tuple[int, list[_Item]]] = field(default_factory=list)  # momentum, decay
    by_update: list[tuple[int, int, int, list[_Item]]] = field(default_factory=list)  # (group, rows, cols)
    padding: list[tuple[int, int]] = field(default_factory=list)  # send-buffer ranges to zero


@dataclass
class _Partition:
    shard: _ShardInfo
    ns: tuple  # (per-step coefficients, eps, norm_scale)
    device: torch.device
    buckets: list[_Bucket] = field(default_factory=list)


class Muon(torch.optim.Optimizer):
    """Muon for hidden 2-D matrices: plain tensors, FSDP2 (Shard(0)) and HSDP DTensors.

    Arguments mirror ``torch.optim.Muon`` (same defaults). Extra:

    - ``ns_coefficients`` may also be a sequence of per-iteration triples or ``"polar_express"``;
    - ``adjust_lr_fn`` also accepts ``"spectral"`` (``lr * sqrt(A/B)``);
    - ``process_group``: unused by the sharded path, which reads the shard group from each DTensor's
      device mesh; kept for API symmetry and checked to be consistent when given;
    - ``torch_compatible_ns`` (default True): evaluate Newton–Schulz with torch.optim.Muon's exact
      sequence of bf16 operations (bitwise equal to it on CPU). False folds ``a I`` into the
      Gram-sized polynomial instead, which saves one full-size copy per iteration (~10% of the
      Newton–Schulz time) but differs from torch by bf16 noise amplified to ~2-3% per step (see
      ``_ns_iterate``): opt in only after checking the training curves;
    - ``bucket_numel``: elements (full matrices) per communication/Newton–Schulz bucket: bigger
      buckets mean fewer, larger collectives and batched matmuls, smaller ones earlier overlap and
      less transient memory (about 4 bytes per element of a bucket on its owner);
    - ``prefetch``: how many buckets' all-to-alls are in flight ahead of the one being computed;
    - ``gram`` (default False): Newton–Schulz on the Gram matrix for matrices at least
      ``GRAM_MIN_ASPECT`` times wider than tall (``_gram_iterate``; the same in exact arithmetic,
      about 40% fewer FLOPs for MLP-shaped matrices, different bf16 rounding), the standard form
      for the others.

    ``self.stats`` counts, on this rank, matrices orthogonalised (``"orthogonalized"``, of which in
    the Gram form ``"gram"``) and
    all-to-all collectives issued (``"all_to_all"``), cumulatively over steps.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: NSCoefficients = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        process_group: Any = None,
        torch_compatible_ns: bool = True,
        bucket_numel: int = 1 << 28,
        prefetch: int = 2,
        gram: bool = False,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not _to_float(lr) >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if bucket_numel < 1 or prefetch < 1:
            raise ValueError("bucket_numel and prefetch must be >= 1")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        self.process_group = process_group
        self.bucket_numel = int(bucket_numel)
        self.prefetch = int(prefetch)
        self.torch_compatible_ns = bool(torch_compatible_ns)
        self.gram = bool(gram)
        self.stats = {"orthogonalized": 0, "gram": 0, "all_to_all": 0}
        self._plan: list[_Partition] | None = None
        self._plan_key: tuple | None = None
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    # -- validation --------------------------------------------------------------------------------

    def _param_name(self, gi: int, i: int, p: Tensor) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        base = names[i] if names and i < len(names) else f"param_groups[{gi}]['params'][{i}]"
        return f"{base} (shape {tuple(p.shape)})"

    def _check_group(self, gi: int, group: dict) -> None:
        if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
            raise ValueError(f"Adjust learning rate function {group['adjust_lr_fn']} is not supported")
        resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        for i, p in enumerate(group["params"]):
            name = self._param_name(gi, i, p)
            if p.ndim != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters whereas we found {name}. Embeddings, the LM head, "
                    "norms and biases belong to AdamW (see muonrun.optim.groups.split_params)."
                )
            if torch.is_complex(p):
                raise ValueError(f"Muon does not support complex parameters ({name})")
            info = _shard_info(p, name)
            if (
                self.process_group is not None
                and info.group is not None
                and info.world != dist.get_world_size(self.process_group)
            ):
                raise ValueError(f"{name}: its shard group differs from process_group")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "stats"):  # not during __init__
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
            self._plan = None

    # -- plan ----------------------------------------------------------------------------------------

    def _build_plan(self, active: list[tuple[int, int, Tensor]]) -> list[_Partition]:
        partitions: dict[tuple, _Partition] = {}
        shape_order: dict[tuple, dict[tuple[int, int], list[_Item]]] = {}
        for gi, i, p in active:
            group = self.param_groups[gi]
            info = _shard_info(p, self._param_name(gi, i, p))
            per_step, norm_scale = resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
            ns = (per_step, float(group["eps"]), norm_scale)
            key = (id(info.group), ns)
            if key not in partitions:
                partitions[key] = _Partition(info, ns, local_tensor(p).device)
                shape_order[key] = {}
            rows, cols = p.shape
            local = local_tensor(p)
            if info.world > 1:
                n_local = _local_rows(rows, info.world, info.rank)
                if local.shape[0] != n_local or local.shape[1] != cols:
                    raise ValueError(
                        f"{self._param_name(gi, i, p)}: local shard {tuple(local.shape)} is not the "
                        f"torch.chunk layout ({n_local} rows expected on shard rank {info.rank})"
                    )
                chunk = _chunk_rows(rows, info.world)
            else:
                n_local = chunk = rows
            item = _Item(p, gi, rows, cols, chunk, n_local)
            shape_order[key].setdefault((rows, cols), []).append(item)

        for key, part in partitions.items():
            W, me = part.shard.world, part.shard.rank
            # Split each shape group into pieces of a multiple of W matrices that fit the bucket size,
            # then pack pieces into buckets.
            buckets: list[list[_Item]] = []
            current: list[_Item] = []
            current_numel = 0
            counter = 0  # rotating owner start, so partial chunks don't all land on rank 0
            for (rows, cols), items in shape_order[key].items():
                size = rows * cols
                per_piece = max(W, (self.bucket_numel // max(size, 1)) // W * W)
                for s in range(0, len(items), per_piece):
                    piece = items[s : s + per_piece]
                    for j, it in enumerate(piece):
                        it.owner = (counter + j) % W
                    counter = (counter + len(piece)) % W
                    piece_numel = size * len(piece)
                    if current and current_numel + piece_numel > self.bucket_numel:
                        buckets.append(current)
                        current, current_numel = [], 0
                    current.extend(piece)
                    current_numel += piece_numel
            if current:
                buckets.append(current)

            for bitems in buckets:
                shapes = list(dict.fromkeys((it.rows, it.cols) for it in bitems))
                rank_of_shape = {s: k for k, s in enumerate(shapes)}
                # stable sort: by owner, then shape, keeping parameter order inside
                bitems = sorted(bitems, key=lambda it: (it.owner, rank_of_shape[(it.rows, it.cols)]))
                send_splits = [0] * W
                offset = 0
                for it in bitems:
                    it.offset = offset
                    n = it.chunk * it.cols
                    send_splits[it.owner] += n
                    offset += n
                per_source = send_splits[me]
                owned: list[_Owned] = []
                seg = 0
                for it in bitems:
                    if it.owner != me:
                        continue
                    if owned and (owned[-1].rows, owned[-1].cols) == (it.rows, it.cols):
                        owned[-1].count += 1
                    else:
                        owned.append(_Owned(it.rows, it.cols, it.chunk, 1, seg))
                    seg += it.chunk * it.cols
                bucket = _Bucket(
                    items=bitems,
                    send_splits=send_splits,
                    recv_splits=[per_source] * W,
                    send_numel=offset,
                    recv_numel=per_source * W,
                    owned=owned,
                    per_source=per_source,
                )
                by_group: dict[int, list[_Item]] = {}
                by_update: dict[tuple[int, int, int], list[_Item]] = {}
                for it in bitems:
                    by_group.setdefault(it.group_index, []).append(it)
                    by_update.setdefault((it.group_index, it.rows, it.cols), []).append(it)
                    if it.local_rows < it.chunk:  # zero rows: the owner's norm runs over whole slabs
                        bucket.padding.append(
                            (it.offset + it.local_rows * it.cols, it.offset + it.chunk * it.cols)
                        )
                bucket.by_group = list(by_group.items())
                bucket.by_update = [(g, r, c, its) for (g, r, c), its in by_update.items()]
                part.buckets.append(bucket)
        plan = list(partitions.values())
        self._verify_plan(plan)
        return plan

    def _verify_plan(self, plan: list[_Partition]) -> None:
        """Once per plan: check that every rank of each shard group built the same buckets.

        This is the only host synchronisation of the optimizer and runs only when the set of
        parameters with gradients changes (normally once, at the first step).
        """
        for part in plan:
            if part.shard.group is None:
                continue
            sig = [len(part.buckets)]
            for b in part.buckets:
                sig.append(len(b.items))
                sig.append(sum(it.rows * 1_000_003 + it.cols for it in b.items) % (1 << 30))
            h = 0
            for x in sig:
                h = (h * 1_000_000_007 + x) % (1 << 61)
            t = torch.tensor([h, -h], dtype=torch.int64, device=part.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=part.shard.group)
            if int(t[0]) != h or int(t[1]) != -h:
                raise RuntimeError(
                    "Muon: ranks of a shard group disagree on which parameters have gradients or on their "
                    "shapes; every rank must step the same matrices (a grad that is None on one rank must "
                    "be None on all)."
                )

    def _get_plan(self) -> list[_Partition]:
        active = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    active.append((gi, i, p))
        ns_config = tuple(
            (resolve_ns_coefficients(g["ns_coefficients"], g["ns_steps"]), float(g["eps"]))
            for g in self.param_groups
        )
        key = (tuple((gi, id(p)) for gi, _, p in active), ns_config)
        if self._plan is None or key != self._plan_key:
            self._plan = self._build_plan(active)
            self._plan_key = key
        return self._plan

    # -- step ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._get_plan()
        hyper = []
        for group in self.param_groups:
            hyper.append(
                (
                    _to_float(group["lr"]),
                    float(group["weight_decay"]),
                    float(group["momentum"]),
                    bool(group["nesterov"]),
                    group["adjust_lr_fn"],
                )
            )
        for part in plan:
            self._step_partition(part, hyper)
        return loss

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["momentum_buffer"] = buf
        return buf

    def _prepare(self, part: _Partition, bucket: _Bucket, hyper) -> Tensor:
        """Momentum on local rows; writes the bf16 slabs (padding rows zeroed) into the send buffer."""
        send = torch.empty(bucket.send_numel, dtype=torch.bfloat16, device=part.device)
        for gi, items in bucket.by_group:
            _, _, momentum, nesterov, _ = hyper[gi]
            bufs, grads, dsts = [], [], []
            for it in items:
                grad = it.param.grad
                if grad.is_sparse:
                    raise RuntimeError("Muon does not support sparse gradients")
                bufs.append(local_tensor(self._momentum_buffer(it.param)))
                grads.append(local_tensor(grad))
                dsts.append(
                    send[it.offset : it.offset + it.local_rows * it.cols].view(it.local_rows, it.cols)
                )
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            upd = torch._foreach_lerp(grads, bufs, momentum) if nesterov else bufs
            torch._foreach_copy_(dsts, upd)
        for lo, hi in bucket.padding:
            send[lo:hi].zero_()
        return send

    def _orthogonalize(self, part: _Partition, bucket: _Bucket, recv: Tensor) -> None:
        """Owner side: reassemble + normalise owned matrices from ``recv`` in one pass, Newton–Schulz,
        write the results back into ``recv`` in the same (padded, per-destination) layout."""
        W = part.shard.world
        per_step, eps, norm_scale = part.ns
        grid = recv.view(W, bucket.per_source)
        for own in bucket.owned:
            k, R, C, c = own.count, own.rows, own.cols, own.chunk
            slabs = grid[:, own.offset : own.offset + k * c * C].view(W, k, c, C)
            # padding rows are zero, so the norm over whole slabs is the matrix's Frobenius norm
            norm = torch.linalg.vector_norm(slabs, dim=(0, 2, 3))
            if norm_scale != 1.0:
                norm = norm * norm_scale
            norm = norm.clamp_(min=eps)
            if W == 1:
                X = slabs[0].div_(norm.view(k, 1, 1))  # in place: the buffer is ours
            else:
                full = torch.empty(k, W * c, C, dtype=torch.bfloat16, device=recv.device)
                torch.div(slabs.transpose(0, 1), norm.view(k, 1, 1, 1), out=full.view(k, W, c, C))
                X = full[:, :R]
            out = _iterate(X, per_step, not self.torch_compatible_ns, self.gram)
            if W * c == R:
                slabs.copy_(out.view(k, W, c, C).transpose(0, 1))
            else:
                nfull, rem = divmod(R, c)
                if nfull:
                    slabs[:nfull].copy_(out[:, : nfull * c].reshape(k, nfull, c, C).transpose(0, 1))
                if rem:
                    slabs[nfull, :, :rem].copy_(out[:, nfull * c :])
            self.stats["orthogonalized"] += k
            self.stats["gram"] += k * _uses_gram(self.gram, X.shape, len(per_step))

    def _apply(self, bucket: _Bucket, result: Tensor, hyper) -> None:
        """Weight decay and the scaled update on this rank's rows."""
        for gi, items in bucket.by_group:
            lr, wd = hyper[gi][0], hyper[gi][1]
            factor = 1 - lr * wd
            if factor != 1.0:
                torch._foreach_mul_([local_tensor(it.param) for it in items], factor)
        for gi, rows, cols, items in bucket.by_update:
            lr, fn = hyper[gi][0], hyper[gi][4]
            ps = [local_tensor(it.param) for it in items]
            us = [
                result[it.offset : it.offset + it.local_rows * it.cols].view(it.local_rows, it.cols)
                for it in items
            ]
            torch._foreach_add_(ps, us, alpha=-adjust_lr(lr, fn, (rows, cols)))

    def _step_partition(self, part: _Partition, hyper) -> None:
        W = part.shard.world
        pg = part.shard.group
        buckets = part.buckets
        if W == 1:
            for b in buckets:
                buf = self._prepare(part, b, hyper)
                self._orthogonalize(part, b, buf)
                self._apply(b, buf, hyper)
            return

        def launch_forward(b: _Bucket):
            send = self._prepare(part, b, hyper)
            recv = torch.empty(b.recv_numel, dtype=torch.bfloat16, device=part.device)
            work = dist.all_to_all_single(recv, send, b.recv_splits, b.send_splits, group=pg, async_op=True)
            self.stats["all_to_all"] += 1
            return send, recv, work

        inflight: dict[int, tuple] = {}
        for j in range(min(self.prefetch, len(buckets))):
            inflight[j] = launch_forward(buckets[j])
        returning: list[tuple] = []
        for j, b in enumerate(buckets):
            send, recv, work = inflight.pop(j)
            work.wait()
            self._orthogonalize(part, b, recv)
            # send buffer is free again (its forward exchange is complete): receive the results there
            back = dist.all_to_all_single(send, recv, b.send_splits, b.recv_splits, group=pg, async_op=True)
            self.stats["all_to_all"] += 1
            returning.append((b, send, recv, back))
            nxt = j + self.prefetch
            if nxt < len(buckets):
                inflight[nxt] = launch_forward(buckets[nxt])
            # apply what came back while later buckets are still in flight
            while len(returning) > 1:
                rb, rsend, _, rwork = returning.pop(0)
                rwork.wait()
                self._apply(rb, rsend, hyper)
        for rb, rsend, _, rwork in returning:
            rwork.wait()
            self._apply(rb, rsend, hyper)
