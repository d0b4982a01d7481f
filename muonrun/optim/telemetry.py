"""Optimizer telemetry without host synchronisation: sums over local shards, made global by one small
``all_reduce`` per process group and step, returned as 0-d device tensors for the caller to read late.

Used by ``Muon`` and ``AdamW`` when their ``collect_telemetry`` is set; the keys they fill are in
their docstrings. Imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from muonrun import compat


def sum_of_squares(tensors: Sequence[Tensor]) -> Tensor | None:
    """Sum of the squares of every element of ``tensors`` (0-d fp32, one foreach kernel), or None."""
    if not tensors:
        return None
    return torch.stack(compat.foreach_norm(list(tensors))).float().square().sum()


class Sums:
    """Named 0-d terms of one step, keyed by the process group over which they are partial
    (``distributed.shard_group(p).group``; None: whole on every rank); ``total`` sums each group's terms,
    all-reduces them in one call per group and adds the groups up."""

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.names = tuple(names)
        self.device = device
        self._terms: dict[int, tuple[object, list[list[Tensor]]]] = {}

    def add(self, group, name: str, value: Tensor | None) -> None:
        if value is None:
            return
        _, terms = self._terms.setdefault(id(group), (group, [[] for _ in self.names]))
        terms[self.names.index(name)].append(value.float())

    def total(self) -> dict[str, Tensor]:
        total = torch.zeros(len(self.names), dtype=torch.float32, device=self.device)
        for group, terms in self._terms.values():
            part = torch.stack([torch.stack(t).sum() if t else total.new_zeros(()) for t in terms]).to(
                self.device
            )
            if group is not None:
                dist.all_reduce(part, group=group)
            total += part
        return dict(zip(self.names, total.unbind(0), strict=True))

    def telemetry(self, numel: int) -> dict[str, Tensor]:
        """``total`` as an optimizer reports it: ``update_rms`` (the ``update`` term over ``numel``
        elements), ``momentum_norm``, then every other term as summed."""
        total = self.total()
        update, momentum = total.pop("update"), total.pop("momentum")
        return {"update_rms": (update / numel).sqrt(), "momentum_norm": momentum.sqrt(), **total}
