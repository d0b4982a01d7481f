"""Muon: momentum + Newton–Schulz orthogonalisation, for plain tensors and FSDP2-sharded DTensors.

References
----------
- K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (blog, 2024),
  https://kellerjordan.github.io/posts/muon/ -- the algorithm.
- J. Liu et al. (Moonshot AI), "Muon is Scalable for LLM Training", arXiv:2502.16982 -- decoupled
  weight decay and the ``match_rms_adamw`` lr scaling.
- K. Ahn et al., "Dion: Distributed Orthonormalized Updates", arXiv:2504.13074 -- the all-to-all
  "owner computes" layout used here for sharded parameters.
- Z. Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv:2510.05491 -- the
  ``variant="normuon"`` per-row normalisation (``newton_schulz.normuon_normalize``).
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
``torch.optim.Muon`` gives (up to bf16 rounding of the Newton–Schulz products; with
``ns_dtype=torch.float32``, torch's sequence in fp32)::

    buf.lerp_(grad, 1 - momentum)                           # B = mu*B + (1-mu)*G
    u = grad.lerp(buf, momentum) if nesterov else buf       # Nesterov look-ahead
    O = newton_schulz(u)                                    # in ns_dtype: bf16
    p.mul_(1 - lr * weight_decay)                           # decoupled weight decay
    p.add_(O, alpha=-adjust_lr(lr, adjust_lr_fn, p.shape))

``variant="normuon"`` (NorMuon) replaces ``O`` by ``normuon_normalize(O, v, beta2, normuon_eps)``:
each row divided by the root of an EMA ``v`` of its mean square, then the matrix rescaled to the
Frobenius norm ``sqrt(min(A, B))`` of an orthogonal one; with ``adjust_lr_fn="match_rms_adamw"`` the
step is the paper's ``0.2 * lr * sqrt(A B) / ||Ô||_F * Ô``. The owner computes one fp32 factor per
row from the rows' sums of squares (``normuon_row_scale``) and sends it back with the rows' ``v``; each
rank applies it to its rows of ``O`` in fp32 inside the decay-and-update pass (``O`` itself is never
rescaled in memory).

Distributed algorithm (FSDP2 / HSDP)
------------------------------------
Every matrix is orthogonalised exactly once per shard group: momentum runs on each rank's local rows,
one all-to-all per bucket of same-shaped matrices sends the rows to the matrix's owner rank (owners
balanced by Newton–Schulz FLOPs), the owner runs Newton–Schulz batched, a second all-to-all returns
the rows, and each rank applies its update; ``muonrun.optim.sharding`` gives the steps in full.
Any placement but FSDP2's ``Shard(0)`` (and HSDP's replicate dimension) is rejected.

Stacked experts (mixture of experts)
------------------------------------
A 3-D ``[E, out, in]`` parameter in a param group with ``matrices_per_expert`` set is a batch of
expert matrices, each orthogonalised on its own on the rank that holds the expert, with no exchange
(``muonrun.optim.experts`` says how; ``experts_transposed`` and ``experts_interleaved`` describe the
``[E, in, out]`` layouts of GPT-OSS and Llama4, ``experts.ExpertLayout``; other 3-D parameters are
refused).

Optimizer state is one ``momentum_buffer`` per matrix with the parameter's type and placement
(AdamW keeps two), and for NorMuon a ``second_moment`` (fp32, one entry per row, a 1-D DTensor with
the parameter's mesh and placements, so each rank holds its rows' entries), present on every rank,
so ``torch.distributed.checkpoint`` saves and reshards them unchanged.

Step times against AdamW are in docs/performance.md; ``torchrun --nproc-per-node N
tests/dist/muon_bench.py`` measures them on GPUs, ``muonrun bench tiny`` on CPUs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from muonrun import compat
from muonrun.distributed import local_tensor, to_device
from muonrun.optim.exchange import step_exchanged
from muonrun.optim.experts import (
    ExpertLayout,
    check_stacked,
    chunk_shape,
    expert_chunks,
    expert_rows_like,
    step_stacked,
)
from muonrun.optim.fused import Passes, with_row_factors
from muonrun.optim.graphed import NO_LANES, Lanes, StepGraph
from muonrun.optim.local import buffer_for, finish, finish_all, local_units, start
from muonrun.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    Coefficients,
    NSCoefficients,
    adjust_lr,
    ns_iterations,
)
from muonrun.optim.ns_products import Products
from muonrun.optim.owner import orthogonalize_stack
from muonrun.optim.settings import NSSettings, StepSettings, UpdateScalars, check_settings, to_float
from muonrun.optim.sharding import (
    DEFAULT_BUCKET_NUMEL,
    Bucket,
    Entry,
    Partition,
    build_plan,
    owner_cost,
    rows_like,
    shard_info,
)
from muonrun.optim.telemetry import Sums, sum_of_squares

__all__ = ["Muon"]


NS_DTYPES = (torch.bfloat16, torch.float32)


class Muon(torch.optim.Optimizer):
    """Muon for hidden 2-D matrices: plain tensors, FSDP2 (Shard(0)) and HSDP DTensors.

    Arguments mirror ``torch.optim.Muon`` (same defaults, the same bf16 Newton–Schulz sequence).
    Extra:

    - ``ns_coefficients`` may also be a sequence of per-iteration triples or ``"polar_express"``;
    - ``adjust_lr_fn`` also accepts ``"spectral"`` (``lr * sqrt(A/B)``);
    - ``bucket_numel``: elements (full matrices) per communication/Newton–Schulz bucket: bigger ones
      mean fewer, larger collectives and batched matmuls (small ones cost host time), smaller ones
      earlier overlap and less transient memory (about 4 bytes per element of a bucket on its owner);
    - ``gram`` (default False): Newton–Schulz on the Gram matrix for matrices at least
      ``GRAM_MIN_ASPECT`` times wider than tall (``gram_iterations``: the same in exact arithmetic,
      about 40% fewer FLOPs for MLP-shaped matrices, different bf16 rounding), the standard form
      for the others;
    - ``variant`` (per param group): ``"muon"``, or ``"normuon"`` (NorMuon, see the module
      docstring) with ``beta2``, the EMA coefficient of each row's second moment, and
      ``normuon_eps``, added to its root;
    - ``ns_dtype``: ``torch.bfloat16`` (torch's) or ``torch.float32``, for Newton–Schulz and the
      exchange (``newton_schulz.ns_dtype_for`` says which is faster where; docs/performance.md);
    - ``precondition`` (per param group): ``"frobenius"`` (torch's) or ``"aol"``, Turbo-Muon's row
      scaling taken from the first Gram product (``newton_schulz.Scaling``), meant for the shorter
      ``ns_coefficients="turbo"`` table;
    - ``fused`` (default False): the momentum, Nesterov look-ahead and cast into the exchange
      buffer as one compiled pass, the decay and update (with NorMuon's row factors) as another,
      the owner's division by the norm as a third (``muonrun.optim.fused``; compiled on GPUs, the
      same ops run eagerly elsewhere): fewer passes over memory, the same arithmetic up to rounding;
    - ``products``: how Newton–Schulz's matrix products are evaluated (an ``ns_products.Products``;
      None: torch's ``bmm``), e.g. ``ns_quack.QuackProducts``, whose symmetric products compute
      one triangle (``optim.build.products_for`` picks one by name);
    - ``fold_norm`` (default False): a Gram-form stack held whole (one rank in the shard group;
      stacked experts) takes its Frobenius norm from the trace of its first Gram product, applied to
      the ``m x m`` products (``newton_schulz.Scaling``), not in a pass over the ``m x n`` matrices;
    - ``cuda_graph`` (default False): what a rank steps on its own after the momentum pass replayed
      from a CUDA graph (``muonrun.optim.graphed``): one launch instead of hundreds, for models whose
      host cannot keep ahead of the GPU; eager on a CPU;
    - ``ns_streams`` (default 1): CUDA streams on which the graph runs its independent Newton–Schulz
      stacks, and each bucket's update after its stacks, side by side (``graphed.Lanes``): the
      same results, the GPU's idle ends of one stack's products filled by another's;
    - ``split_restart`` (default False): with ``gram``, the Gram form restarts from its first Gram
      matrix kept in fp32 (``gram_iterations``' ``split_restart``) where that costs fewer FLOPs
      (``uses_split_restart``): the same in exact arithmetic, different rounding;

    The shard group of each parameter comes from its DTensor's device mesh; no process group is
    passed. ``self.stats`` counts, on this rank, matrices orthogonalised (``"orthogonalized"``, of
    which in the Gram form ``"gram"``) and all-to-all collectives issued (``"all_to_all"``),
    cumulatively over steps.

    Telemetry: with ``collect_telemetry = True`` every ``step()`` fills ``self.telemetry`` with 0-d
    fp32 tensors on the parameters' device, global over the shard group (one ``all_reduce`` of three
    numbers per step, no host synchronisation; read them late): ``update_rms``, the RMS of what the
    step changed (weight decay included) over all the matrices it stepped; ``momentum_norm``, the L2
    norm of all the momentum buffers after the step; ``ortho_residual``, ``||O O^T - I||_F / sqrt(m)``
    (``orthogonality_residual``) of the Newton–Schulz result of the first matrix its owner
    orthogonalises in the step.
    """

    prefetch = 2
    """Buckets whose forward all-to-all is in flight ahead of the one being orthogonalised: with two,
    bucket b+1's exchange runs under bucket b's Newton–Schulz; one gives no overlap; more only keep
    more buffers alive. Tests set it on an instance to exercise other pipeline depths."""

    collect_telemetry: bool = False
    """Fill ``self.telemetry`` during ``step()`` (see the class docstring); set by the trainer."""

    compile_backend = None
    """With ``fused``: a torch.compile backend (name or callable) for its passes on any device (tests)."""

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
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
        gram: bool = False,
        variant: str = "muon",
        beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        ns_dtype: torch.dtype = torch.bfloat16,
        precondition: str = "frobenius",
        fused: bool = False,
        products: Products | None = None,
        fold_norm: bool = False,
        cuda_graph: bool = False,
        ns_streams: int = 1,
        split_restart: bool = False,
    ) -> None:
        if isinstance(lr, Tensor) and lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if not to_float(lr) >= 0.0:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if bucket_numel < 1:
            raise ValueError("bucket_numel must be >= 1")
        if ns_streams < 1:
            raise ValueError("ns_streams must be >= 1")
        if ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype}")
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "variant": variant,
            "beta2": beta2,
            "normuon_eps": normuon_eps,
            "precondition": precondition,
            # set in a group of stacked experts (experts.ExpertLayout): 1, or 2 for gate_up_proj; and
            # whether they are stored [E, in, out], and with a fused projection's matrices interleaved
            "matrices_per_expert": None,
            "experts_transposed": False,
            "experts_interleaved": False,
        }
        super().__init__(params, defaults)
        self.bucket_numel = int(bucket_numel)
        self.gram = bool(gram)
        self.ns_dtype = ns_dtype
        self.fused = bool(fused)
        self.products = products
        self.fold_norm = bool(fold_norm and gram)  # only the Gram form reads the norm off its products
        self.split_restart = bool(split_restart and gram)
        self.cuda_graph = bool(cuda_graph)
        self.ns_streams = int(ns_streams)
        self._graph: StepGraph | None = None
        self.register_load_state_dict_post_hook(Muon._drop_graph)  # new state tensors: new addresses
        self._passes = Passes(compiled=False)
        self.stats = {"orthogonalized": 0, "gram": 0, "all_to_all": 0}
        self.telemetry: dict[str, Tensor] = {}
        self._sums: Sums | None = None  # this step's telemetry terms, while collecting
        self._plan: list[Partition] | None = None
        self._plan_key: tuple | None = None
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    def _param_name(self, gi: int, i: int, p: Tensor) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        base = names[i] if names and i < len(names) else f"param_groups[{gi}]['params'][{i}]"
        return f"{base} (shape {tuple(p.shape)})"

    def _check_group(self, gi: int, group: dict) -> None:
        check_settings(group)
        for i, p in enumerate(group["params"]):
            name = self._param_name(gi, i, p)
            if p.ndim == 3 and group["matrices_per_expert"]:  # stacked experts
                check_stacked(p, ExpertLayout.of_group(group), name)
            elif p.ndim != 2:
                raise ValueError(
                    f"Muon only supports 2D parameters (and 3D stacked experts) whereas we found {name}. "
                    "Embeddings, the LM head, norms and biases belong to AdamW (see "
                    "muonrun.optim.groups.split_params)."
                )
            if torch.is_complex(p):
                raise ValueError(f"Muon does not support complex parameters ({name})")
            shard_info(p, name)  # raises for layouts other than FSDP/HSDP

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "stats"):  # not during __init__
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
            self._plan = None

    def _drop_graph(self) -> None:
        self._graph = None

    def _get_plan(self) -> list[Partition]:
        """The exchange plan for the matrices that have gradients, rebuilt only when that set or a
        group's Newton–Schulz settings change."""
        ns = tuple(NSSettings.of(g) for g in self.param_groups)
        active = [
            (gi, i, p)
            for gi, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is not None and p.ndim == 2
        ]
        key = (tuple((gi, id(p)) for gi, _, p in active), ns, self.ns_dtype, self.gram)
        if self._plan is None or key != self._plan_key:
            # NorMuon: two fp32 per row (v, and the row factor coming back), in exchange elements
            row_state = 2 * (4 // self.ns_dtype.itemsize)
            halves = self.products is not None and self.products.halves_symmetric  # as the dry-run counts
            entries = [
                Entry(
                    gi,
                    self._param_name(gi, i, p),
                    p,
                    ns[gi],
                    cost=owner_cost(p.shape, len(ns[gi].per_step), self.gram, halves, self.split_restart),
                    row_state=row_state if ns[gi].normuon else 0,
                )
                for gi, i, p in active
            ]
            self._plan = build_plan(entries, self.bucket_numel)
            self._plan_key = key
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]  # experts too
            device = local_tensor(stepped[0]).device if stepped else None
            self._passes = Passes.choose(self.fused, device, self.compile_backend)
        return self._plan

    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._get_plan()
        settings = [StepSettings.of(group) for group in self.param_groups]
        stacked = [
            (gi, p)
            for gi, g in enumerate(self.param_groups)
            for p in g["params"]
            if p.ndim == 3 and p.grad is not None
        ]
        chunks = expert_chunks(stacked, self.bucket_numel)
        device = plan[0].device if plan else local_tensor(stacked[0][1]).device if stacked else None
        if self.collect_telemetry and device is not None:
            self._sums = Sums(("update", "momentum", "ortho_residual"), device)
        keys = [(gi, r, c) for part in plan for b in part.buckets for gi, r, c, _ in b.by_update]
        scalars = UpdateScalars.of(keys + [(c[0][0], *chunk_shape(self, c)[1:]) for c in chunks], settings)
        # What a rank steps on its own (one-rank shard groups, stacked experts it holds), in units that
        # each start from a momentum pass into a buffer: the part a CUDA graph may replay.
        units = local_units(self, plan, chunks)
        graph = None
        if self.cuda_graph and units and self._sums is None:  # made anew for new matrices or settings
            key = (self._plan_key, tuple((gi, id(p)) for gi, p in stacked))
            if self._graph is None or self._graph.key != key:
                buffers = [buffer_for(self, u) for u in units]
                self._graph = StepGraph(key, buffers, len(scalars.values), self.ns_streams)
            graph = self._graph
        if graph is not None:
            graph.scalars.copy_(to_device(scalars.values, device))
            scalars.on_device = graph.scalars
        elif self._passes.compiled and scalars.values:
            scalars.on_device = to_device(scalars.values, device)
        for part in plan:
            if part.shard.world > 1:
                step_exchanged(self, part, settings, scalars)
        for chunk in chunks:
            if not chunk_shape(self, chunk)[0]:
                step_stacked(self, chunk, settings[chunk[0][0]], scalars)  # its state and telemetry only
        if graph is None:
            for unit in units:
                finish(self, unit, start(self, unit, settings), settings, scalars)
        else:
            for unit, buf in zip(units, graph.buffers, strict=True):
                start(self, unit, settings, buf)
            graph.run(
                lambda: finish_all(self, units, graph.buffers, settings, scalars, graph.lanes), self.stats
            )
        if self._sums is not None:
            total, self._sums = self._sums.total(), None
            numel = sum(it.rows * it.cols for part in plan for b in part.buckets for it in b.items)
            numel += sum(p.numel() for _, p in stacked)
            self.telemetry = {
                "update_rms": (total["update"] / numel).sqrt(),
                "momentum_norm": total["momentum"].sqrt(),
                "ortho_residual": total["ortho_residual"],
            }
        return loss

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["momentum_buffer"]

    def _second_moment(self, p: Tensor, layout: ExpertLayout | None = None) -> Tensor:
        """NorMuon's per-row EMA of the mean square of the Newton–Schulz result (fp32, rows of p; a
        stacked expert parameter's [E, k * out] for its ``layout``, laid out like its experts)."""
        state = self.state[p]
        if "second_moment" not in state:
            state["second_moment"] = expert_rows_like(p, layout) if p.ndim == 3 else rows_like(p)
        return state["second_moment"]

    def _prepare(
        self, part: Partition, bucket: Bucket, settings: Sequence[StepSettings], send: Tensor | None = None
    ) -> Tensor:
        """Momentum on local rows; writes the slabs (padding zeroed, NorMuon's v appended) to send, into
        ``send`` (None: a new buffer), which it returns."""
        if send is None:
            send = torch.empty(bucket.send_numel, dtype=self.ns_dtype, device=part.device)
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
            self._passes.momentum((id(bucket), gi), bufs, grads, dsts, momentum, nesterov)
            if self._sums is not None:
                self._sums.add(part.shard.group, "momentum", sum_of_squares(bufs))
        if part.ns.normuon:  # type: ignore[attr-defined]
            vs = [local_tensor(self._second_moment(it.param)) for it in bucket.items]
            compat.foreach_copy_([it.state_view(send) for it in bucket.items], vs)
        for lo, hi in bucket.padding:
            send[lo:hi].zero_()
        return send

    def _newton_schulz(self, X: Tensor, per_step: Sequence[Coefficients], **kw) -> Tensor:
        """Newton–Schulz on a stack of owned matrices (``ns_iterations``: ``scaling``, ``out``):
        torch.optim.Muon's sequence, or the Gram form where ``gram`` takes it, its products evaluated
        by ``self.products``. Tests override it to step with another evaluation."""
        products = None if self.products is None else [self.products] * len(per_step)
        return ns_iterations(
            X, per_step, gram=self.gram, products=products, split_restart=self.split_restart, **kw
        )

    def _orthogonalize(self, part: Partition, bucket: Bucket, recv: Tensor, lanes: Lanes = NO_LANES) -> None:
        """Owner side: reassemble + normalise owned matrices from ``recv`` in one pass, Newton–Schulz
        (NorMuon: and its normalisation), write the results back into ``recv`` in the same (padded,
        per-destination) layout. Each stack runs on a lane of ``lanes`` (``graphed.Lanes``; the CUDA
        graph's streams on one GPU)."""
        W = part.shard.world
        grid = recv.view(W, bucket.per_source)
        sample = part.buckets[0].items[0] if self._sums is not None and part is self._plan[0] else None
        for own in bucket.owned:
            with lanes.lane():  # independent stacks: side by side on the graph's CUDA streams
                orthogonalize_stack(self, part, own, grid, sample)

    def _apply(
        self,
        part: Partition,
        bucket: Bucket,
        result: Tensor,
        settings: Sequence[StepSettings],
        scalars: UpdateScalars,
    ) -> None:
        """Weight decay and the scaled update on this rank's rows (``scalars``: the step's
        ``UpdateScalars``; NorMuon: and the new v)."""
        views = {
            id(it): result[it.offset : it.offset + it.local_rows * it.cols].view(it.local_rows, it.cols)
            for it in bucket.items
        }
        normuon = part.ns.normuon  # type: ignore[attr-defined]
        factors = {id(it): it.state_view(result, 1) for it in bucket.items} if normuon else {}
        if self._sums is not None:  # what the step changes, before it changes it
            deltas = []
            for gi, rows, cols, items in bucket.by_update:
                s = settings[gi]
                d = compat.foreach_mul([local_tensor(it.param) for it in items], -s.lr * s.weight_decay)
                alpha = -adjust_lr(s.lr, s.adjust_lr_fn, (rows, cols))
                us = [views[id(it)] for it in items]
                if normuon:
                    us = with_row_factors(us, [factors[id(it)] for it in items])
                compat.foreach_add_(d, us, alpha=alpha)
                deltas += d
            self._sums.add(part.shard.group, "update", sum_of_squares(deltas))
        params, updates, slots = [], [], []
        for gi, rows, cols, items in bucket.by_update:
            params += [local_tensor(it.param) for it in items]
            updates += [views[id(it)] for it in items]
            slots += [scalars.slots[(gi, rows, cols)]] * len(items)
        row_factors = [factors[id(it)] for *_, items in bucket.by_update for it in items] if normuon else None
        self._passes.decay_and_update((id(bucket),), params, updates, scalars.passed, slots, row_factors)
        if normuon:
            vs = [local_tensor(self._second_moment(it.param)) for it in bucket.items]
            compat.foreach_copy_(vs, [it.state_view(result) for it in bucket.items])
