"""Muon: momentum + Newton–Schulz orthogonalisation, for plain tensors and FSDP2-sharded DTensors.

The papers behind the algorithm, its iteration, NorMuon and the lr scalings are listed in
``muonrun.optim.newton_schulz``; decoupled weight decay is Moonlight's (J. Liu et al., arXiv:2502.16982),
the exchange's "owner computes" layout Dion's (K. Ahn et al., arXiv:2504.13074).

Reference semantics
-------------------
With the same arguments and gradients, :class:`Muon` gives the parameters ``torch.optim.Muon`` gives
(up to bf16 rounding of the Newton–Schulz products)::

    buf.lerp_(grad, 1 - momentum)                           # B = mu*B + (1-mu)*G
    u = grad.lerp(buf, momentum) if nesterov else buf       # Nesterov look-ahead
    O = newton_schulz(u)                                    # in bf16
    p.mul_(1 - lr * weight_decay)                           # decoupled weight decay
    p.add_(O, alpha=-adjust_lr(lr, adjust_lr_fn, p.shape))

``variant="normuon"`` scales each row of ``O`` by NorMuon's factor (``normuon_row_scale``).

How a step runs
---------------
``Muon.step`` hands a ``step.MuonStep`` to the paths: matrices sharded over several ranks go to their
owner rank and back (``sharding`` plans, ``buckets`` runs each bucket and the exchange); a rank's own
matrices (one GPU; stacked experts, ``experts``) step in ``local``, from a CUDA graph on GPUs; the
elementwise passes compile on GPUs (``fused``). State, on every rank and laid out like the parameter
(so DCP saves and reshards it): ``momentum_buffer``; NorMuon: a fp32 ``second_moment`` per row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import Tensor

from muonrun.distributed import local_tensor, to_device
from muonrun.optim.buckets import step_exchanged
from muonrun.optim.experts import check_stacked, chunk_shape, create_state, expert_chunks
from muonrun.optim.fused import Passes
from muonrun.optim.groups import ExpertLayout
from muonrun.optim.local import STREAMS, StepGraph, buffer_for, local_units, step_local
from muonrun.optim.newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    Coefficients,
    NewtonSchulz,
    ns_dtype_for,
    per_step_coefficients,
)
from muonrun.optim.ns_quack import default_products
from muonrun.optim.sharding import (
    DEFAULT_BUCKET_NUMEL,
    ROW_VALUES,
    Entry,
    Partition,
    build_plan,
    shard_info,
)
from muonrun.optim.step import GroupSettings, MuonStep, UpdateScalars, check_group, to_float
from muonrun.optim.telemetry import Sums

__all__ = ["Muon"]

NS_DTYPES = (torch.bfloat16, torch.float32)
TORCH_NS_ARGS = {"ns_coefficients": DEFAULT_NS_COEFFICIENTS, "eps": DEFAULT_EPS, "ns_steps": DEFAULT_NS_STEPS}


class Muon(torch.optim.Optimizer):
    """Muon for hidden 2-D matrices (the Linear weights inside the transformer blocks; ``split_params``
    sends the rest to AdamW): plain tensors, FSDP2 (Shard(0)) and HSDP DTensors, and stacked experts.
    ``muonrun pretrain`` builds it with these defaults (``optim.build``).

    Arguments mirror ``torch.optim.Muon`` (same defaults and bf16 sequence; ``ns_coefficients`` may
    also be one triple per iteration; ``adjust_lr_fn`` also takes ``"spectral"``). Extra, keyword-only:

    - ``gram``: Newton–Schulz in its Gram form (``NewtonSchulz.gram``), the same training;
    - ``variant`` (per group): ``"muon"`` or ``"normuon"``, with ``beta2`` (the EMA of each row's second
      moment) and ``normuon_eps``;
    - ``newton_schulz``: the iteration itself, instead of ``ns_coefficients``, ``eps``, ``ns_steps``
      and ``gram`` (how a study tries another);
    - ``ns_dtype``: bf16 or fp32 for Newton–Schulz and the exchange (None: ``ns_dtype_for`` the device);
    - ``eager``: launch the GPU step kernel by kernel, for debugging;
    - ``bucket_numel``: full-matrix elements per bucket (``sharding._pack``; about 4 bytes of transient
      memory per element on its owner).

    Each parameter's shard group comes from its DTensor's mesh. ``self.stats`` counts matrices
    orthogonalised (``"orthogonalized"``, ``"gram"``) and all-to-alls issued. ``collect_telemetry``
    fills ``self.telemetry`` every step (``muonrun.optim.telemetry``): ``update_rms`` (what the step
    changed, decay included), ``momentum_norm``, ``ortho_residual`` (``orthogonality_residual`` of the
    first matrix orthogonalised).
    """

    prefetch = 2
    """Buckets whose forward all-to-all is in flight ahead of the one being orthogonalised (``buckets``):
    with two, bucket b+1's exchange runs under bucket b's Newton–Schulz; one gives no overlap; more only
    keep more buffers alive. Tests set it on an instance to exercise other pipeline depths."""

    collect_telemetry: bool = False  # set by the trainer

    compile_backend = None  # tests: a torch.compile backend (name or callable) for the passes on any device

    graphs: bool | None = None
    """Tests: None makes CUDA graphs where they apply (GPUs, not ``eager``); True also on a CPU (run
    eagerly there, through the graph's buffers and scalar tensor); False never."""

    graph_streams = STREAMS  # tests: the CUDA streams a graph runs its stacks on

    def __init__(
        self,
        params: Iterable,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Coefficients | Iterable[Coefficients] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        gram: bool = False,
        variant: str = "muon",
        beta2: float = 0.95,
        normuon_eps: float = 1e-8,
        newton_schulz: NewtonSchulz | None = None,
        ns_dtype: torch.dtype | None = None,
        eager: bool = False,
        bucket_numel: int = DEFAULT_BUCKET_NUMEL,
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
        if ns_dtype is not None and ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {NS_DTYPES}, got {ns_dtype}")
        torch_ns = {"ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps}
        if newton_schulz is not None and (gram or torch_ns != TORCH_NS_ARGS):
            raise ValueError(
                "pass the iteration as newton_schulz or as ns_coefficients/eps/ns_steps/gram, not both"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "adjust_lr_fn": adjust_lr_fn,
            "variant": variant,
            "beta2": beta2,
            "normuon_eps": normuon_eps,
            # set in a group of stacked experts (groups.ExpertLayout.group_keys)
            "matrices_per_expert": None,
            "experts_transposed": False,
            "experts_interleaved": False,
        }
        super().__init__(params, defaults)
        first = next((p for g in self.param_groups for p in g["params"]), None)
        device_type = local_tensor(first).device.type if first is not None else "cpu"
        if newton_schulz is None:
            coefficients = per_step_coefficients(ns_coefficients, ns_steps)
            newton_schulz = NewtonSchulz(coefficients, eps, gram, default_products(device_type))
        self.eager = bool(eager)
        if self.eager:
            newton_schulz = dataclasses.replace(newton_schulz, products=newton_schulz.products.eager())
        self.newton_schulz = newton_schulz
        self.ns_dtype = ns_dtype or ns_dtype_for(device_type)
        self.bucket_numel = int(bucket_numel)
        self.stats = {"orthogonalized": 0, "gram": 0, "all_to_all": 0}
        self.telemetry: dict[str, Tensor] = {}
        self._graph: StepGraph | None = None
        self._passes = Passes(compiled=False)
        self._plan: list[Partition] | None = None
        self._plan_key: tuple | None = None
        for gi, group in enumerate(self.param_groups):
            self._check_group(gi, group)

    def _param_name(self, gi: int, i: int, p: Tensor) -> str:
        names = self.param_groups[gi].get("param_names") if gi < len(self.param_groups) else None
        base = names[i] if names and i < len(names) else f"param_groups[{gi}]['params'][{i}]"
        return f"{base} (shape {tuple(p.shape)})"

    def _check_group(self, gi: int, group: dict) -> None:
        check_group(group)
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

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._graph = None  # new state tensors: new addresses

    @property
    def plan(self) -> list[Partition]:
        """The exchange plan of the last step (owners, buckets, offsets; ``sharding``)."""
        return self._plan or []

    def _get_plan(self, groups: list[GroupSettings]) -> list[Partition]:
        """The exchange plan of the matrices with gradients, rebuilt when they or a group's variant change."""
        active = [
            (gi, i, p)
            for gi, group in enumerate(self.param_groups)
            for i, p in enumerate(group["params"])
            if p.grad is not None and p.ndim == 2
        ]
        key = (tuple((gi, id(p)) for gi, _, p in active), tuple(s.normuon for s in groups))
        if self._plan is None or key != self._plan_key:
            row_state = ROW_VALUES * (4 // self.ns_dtype.itemsize)  # NorMuon: fp32 values, in buffer elements
            entries = [
                Entry(
                    gi,
                    self._param_name(gi, i, p),
                    p,
                    groups[gi].normuon,
                    cost=self.newton_schulz.flops(p.shape),
                    row_state=row_state if groups[gi].normuon else 0,
                )
                for gi, i, p in active
            ]
            self._plan = build_plan(entries, self.bucket_numel)
            self._plan_key = key
            stepped = [p for g in self.param_groups for p in g["params"] if p.grad is not None]  # experts too
            device = local_tensor(stepped[0]).device if stepped else None
            self._passes = Passes.choose(self.eager, device, self.compile_backend)
        return self._plan

    @torch.no_grad()
    def step(self, closure=None):
        """Performs a single optimization step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = [GroupSettings.of(group) for group in self.param_groups]
        if any(p.grad is not None and p.grad.is_sparse for g in self.param_groups for p in g["params"]):
            raise RuntimeError("Muon does not support sparse gradients")
        plan = self._get_plan(groups)
        stacked = [
            (gi, p)
            for gi, g in enumerate(self.param_groups)
            for p in g["params"]
            if p.ndim == 3 and p.grad is not None
        ]
        chunks = expert_chunks(stacked, self.bucket_numel)
        device = plan[0].device if plan else local_tensor(stacked[0][1]).device if stacked else None
        sums = None
        if self.collect_telemetry and device is not None:
            sums = Sums(("update", "momentum", "ortho_residual"), device)
        keys = [(gi, r, c) for part in plan for b in part.buckets for gi, r, c, _ in b.by_update]
        keys += [(c[0][0], *chunk_shape(groups, c)[1:]) for c in chunks]
        step = MuonStep(
            self.state,
            groups,
            self.newton_schulz,
            self.ns_dtype,
            self._passes,
            UpdateScalars.of(keys, groups),
            self.stats,
            sums,
            sample=plan[0].buckets[0].items[0] if sums is not None and plan else None,
        )
        units = local_units(step, plan, chunks)
        graph = self._graph_for(step, units, stacked, device)
        if graph is not None:
            graph.scalars.copy_(to_device(step.scalars.values, device))
            step.scalars.on_device = graph.scalars
        elif self._passes.compiled and step.scalars.values:
            step.scalars.on_device = to_device(step.scalars.values, device)
        for part in plan:
            if part.shard.world > 1:
                step_exchanged(step, part, self.prefetch)
        for chunk in chunks:
            if not chunk_shape(groups, chunk)[0]:
                create_state(step, chunk)
        step_local(step, units, graph)
        if sums is not None:
            numel = sum(it.rows * it.cols for part in plan for b in part.buckets for it in b.items)
            self.telemetry = sums.telemetry(numel + sum(p.numel() for _, p in stacked))
        return loss

    def _graph_for(self, step: MuonStep, units: list, stacked: list, device) -> StepGraph | None:
        """The CUDA graph that replays this step's local units (made anew for new matrices), or None:
        none to replay, a step that collects telemetry, ``eager``, or a CPU."""
        wanted = device is not None and device.type == "cuda" and not self.eager
        if not units or step.sums is not None or not (wanted if self.graphs is None else self.graphs):
            return None
        key = (self._plan_key, tuple((gi, id(p)) for gi, p in stacked))
        if self._graph is None or self._graph.key != key:
            buffers = [buffer_for(step, u) for u in units]
            self._graph = StepGraph(key, buffers, len(step.scalars.values), self.graph_streams)
        return self._graph
