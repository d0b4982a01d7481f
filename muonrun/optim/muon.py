"""Muon: momentum + Newton–Schulz orthogonalisation, for plain tensors and FSDP2-sharded DTensors.

References
----------
- K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024),
  https://kellerjordan.github.io/posts/muon/ -- the algorithm.
- J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training", arXiv:2502.16982 -- decoupled
  weight decay and the ``match_rms_adamw`` lr scaling.
- K. Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv:2504.13074 -- the all-to-all
  "owner computes" layout used here for sharded parameters.
- The Newton–Schulz variants (Polar Express coefficients, the Gram form) and the lr scalings are
  cited in ``muonrun.optim.newton_schulz``.

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
   matrix gets an owner rank, round-robin with a rotating start so the work is balanced
   (``muonrun.optim.sharding``);
3. one ``all_to_all_single`` per bucket sends every rank's rows of matrix j (bf16, padded to ``c``
   rows) to j's owner;
4. the owner reassembles its matrices, strips the padding and runs Newton–Schulz batched
   (``torch.baddbmm``) over all the matrices of one shape it owns;
5. a second ``all_to_all_single`` returns each rank its rows of the result, which it applies
   (weight decay + scaled update) to its local shard.

The collectives are asynchronous and pipelined: while bucket ``b`` is being orthogonalised, the
exchange for bucket ``b + 1`` is in flight. Traffic is about two bf16 copies of a rank's shard. On
an HSDP mesh ``(dp_replicate, dp_shard)`` the exchange runs over the ``Shard(0)`` mesh dimension
(gradients are already averaged over the replicate one). Any other placement (e.g. a
tensor-parallel ``Shard(1)``, ``Partial``) is rejected with a ``ValueError``.

Optimizer state is one ``momentum_buffer`` per matrix with the parameter's type and placement
(AdamW keeps two), present on every rank, so ``torch.distributed.checkpoint`` works unchanged.

Step times against AdamW are in docs/performance.md; ``torchrun --nproc-per-node N
tests/dist/muon_bench.py`` measures them on GPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from muonrun.distributed import local_tensor
from muonrun.optim.newton_schulz import (
    ADJUST_LR_FNS,
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    Coefficients,
    NSCoefficients,
    adjust_lr,
    ns_iterations,
    resolve_ns_coefficients,
    uses_gram_form,
)
from muonrun.optim.sharding import Bucket, Entry, Partition, build_plan, shard_info

__all__ = ["Muon"]


@dataclass(frozen=True)
class NSSettings:
    """How one param group's matrices are orthogonalised; matrices that share it batch together."""

    per_step: tuple[Coefficients, ...]
    norm_scale: float
    eps: float

    @classmethod
    def of(cls, group: dict) -> NSSettings:
        per_step, norm_scale = resolve_ns_coefficients(group["ns_coefficients"], group["ns_steps"])
        return cls(per_step, norm_scale, float(group["eps"]))


@dataclass(frozen=True)
class StepSettings:
    """One param group's hyperparameters, read once per step (the schedule may change ``lr``)."""

    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    adjust_lr_fn: str | None

    @classmethod
    def of(cls, group: dict) -> StepSettings:
        return cls(
            lr=_to_float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            nesterov=bool(group["nesterov"]),
            adjust_lr_fn=group["adjust_lr_fn"],
        )


def _to_float(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


class Muon(torch.optim.Optimizer):
    """Muon for hidden 2-D matrices: plain tensors, FSDP2 (Shard(0)) and HSDP DTensors.

    Arguments mirror ``torch.optim.Muon`` (same defaults, the same bf16 Newton–Schulz sequence).
    Extra:

    - ``ns_coefficients`` may also be a sequence of per-iteration triples or ``"polar_express"``;
    - ``adjust_lr_fn`` also accepts ``"spectral"`` (``lr * sqrt(A/B)``);
    - ``bucket_numel``: elements (full matrices) per communication/Newton–Schulz bucket: bigger
      buckets mean fewer, larger collectives and batched matmuls (small ones cost host time),
      smaller ones earlier overlap and less transient memory (about 4 bytes per element of a
      bucket on its owner);
    - ``gram`` (default False): Newton–Schulz on the Gram matrix for matrices at least
      ``GRAM_MIN_ASPECT`` times wider than tall (``gram_iterations``: the same in exact arithmetic,
      about 40% fewer FLOPs for MLP-shaped matrices, different bf16 rounding), the standard form
      for the others.

    The shard group of each parameter comes from its DTensor's device mesh; no process group is
    passed. ``self.stats`` counts, on this rank, matrices orthogonalised (``"orthogonalized"``, of
    which in the Gram form ``"gram"``) and all-to-all collectives issued (``"all_to_all"``),
    cumulatively over steps.
    """

    prefetch = 2
    """Buckets whose forward all-to-all is in flight ahead of the one being orthogonalised. With two,
    bucket b+1's exchange is queued before bucket b's Newton–Schulz and runs under it; one would
    queue it after, with no overlap; more only keep more buckets' buffers alive. Tests set it on an
    instance to exercise other pipeline depths."""

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
        bucket_numel: int = 1 << 28,
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
        if bucket_numel < 1:
            raise ValueError("bucket_numel must be >= 1")
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
        self.bucket_numel = int(bucket_numel)
        self.gram = bool(gram)
        self.stats = {"orthogonalized": 0, "gram": 0, "all_to_all": 0}
        self._plan: list[Partition] | None = None
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
            shard_info(p, name)  # raises for layouts other than FSDP/HSDP

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "stats"):  # not during __init__
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
            self._plan = None

    # -- plan ----------------------------------------------------------------------------------------

    def _get_plan(self) -> list[Partition]:
        """The exchange plan for the matrices that have gradients, rebuilt only when that set or a
        group's Newton–Schulz settings change."""
        ns = tuple(NSSettings.of(g) for g in self.param_groups)
        active = [
            (gi, i, p)
            for gi, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is not None
        ]
        key = (tuple((gi, id(p)) for gi, _, p in active), ns)
        if self._plan is None or key != self._plan_key:
            entries = [Entry(gi, self._param_name(gi, i, p), p, ns[gi]) for gi, i, p in active]
            self._plan = build_plan(entries, self.bucket_numel)
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
        settings = [StepSettings.of(group) for group in self.param_groups]
        for part in plan:
            self._step_partition(part, settings)
        return loss

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["momentum_buffer"] = buf
        return buf

    def _prepare(self, part: Partition, bucket: Bucket, settings: Sequence[StepSettings]) -> Tensor:
        """Momentum on local rows; writes the bf16 slabs (padding rows zeroed) into the send buffer."""
        send = torch.empty(bucket.send_numel, dtype=torch.bfloat16, device=part.device)
        for gi, items in bucket.by_group:
            momentum, nesterov = settings[gi].momentum, settings[gi].nesterov
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

    def _newton_schulz(self, X: Tensor, per_step: Sequence[Coefficients]) -> Tensor:
        """Newton–Schulz on a normalised stack of owned matrices: torch.optim.Muon's bf16 sequence,
        or the Gram form where ``gram`` takes it. Tests override it to step with another evaluation."""
        return ns_iterations(X, per_step, gram=self.gram)

    def _orthogonalize(self, part: Partition, bucket: Bucket, recv: Tensor) -> None:
        """Owner side: reassemble + normalise owned matrices from ``recv`` in one pass, Newton–Schulz,
        write the results back into ``recv`` in the same (padded, per-destination) layout."""
        W = part.shard.world
        ns: NSSettings = part.ns  # type: ignore[assignment]
        grid = recv.view(W, bucket.per_source)
        for own in bucket.owned:
            k, R, C, c = own.count, own.rows, own.cols, own.chunk
            slabs = grid[:, own.offset : own.offset + k * c * C].view(W, k, c, C)
            # padding rows are zero, so the norm over whole slabs is the matrix's Frobenius norm
            norm = torch.linalg.vector_norm(slabs, dim=(0, 2, 3))
            if ns.norm_scale != 1.0:
                norm = norm * ns.norm_scale
            norm = norm.clamp_(min=ns.eps)
            if W == 1:
                X = slabs[0].div_(norm.view(k, 1, 1))  # in place: the buffer is ours
            else:
                full = torch.empty(k, W * c, C, dtype=torch.bfloat16, device=recv.device)
                torch.div(slabs.transpose(0, 1), norm.view(k, 1, 1, 1), out=full.view(k, W, c, C))
                X = full[:, :R]
            out = self._newton_schulz(X, ns.per_step)
            if W * c == R:
                slabs.copy_(out.view(k, W, c, C).transpose(0, 1))
            else:
                nfull, rem = divmod(R, c)
                if nfull:
                    slabs[:nfull].copy_(out[:, : nfull * c].reshape(k, nfull, c, C).transpose(0, 1))
                if rem:
                    slabs[nfull, :, :rem].copy_(out[:, nfull * c :])
            self.stats["orthogonalized"] += k
            self.stats["gram"] += k * (self.gram and uses_gram_form(X.shape, len(ns.per_step)))

    def _apply(self, bucket: Bucket, result: Tensor, settings: Sequence[StepSettings]) -> None:
        """Weight decay and the scaled update on this rank's rows."""
        for gi, items in bucket.by_group:
            factor = 1 - settings[gi].lr * settings[gi].weight_decay
            if factor != 1.0:
                torch._foreach_mul_([local_tensor(it.param) for it in items], factor)
        for gi, rows, cols, items in bucket.by_update:
            s = settings[gi]
            ps = [local_tensor(it.param) for it in items]
            us = [
                result[it.offset : it.offset + it.local_rows * it.cols].view(it.local_rows, it.cols)
                for it in items
            ]
            torch._foreach_add_(ps, us, alpha=-adjust_lr(s.lr, s.adjust_lr_fn, (rows, cols)))

    def _step_partition(self, part: Partition, settings: Sequence[StepSettings]) -> None:
        """All buckets of one partition: exchange, orthogonalise and apply, pipelined."""
        W = part.shard.world
        pg = part.shard.group
        buckets = part.buckets
        if W == 1:
            for b in buckets:
                buf = self._prepare(part, b, settings)
                self._orthogonalize(part, b, buf)
                self._apply(b, buf, settings)
            return

        def launch_forward(b: Bucket):
            send = self._prepare(part, b, settings)
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
                self._apply(rb, rsend, settings)
        for rb, rsend, _, rwork in returning:
            rwork.wait()
            self._apply(rb, rsend, settings)
