"""What a loader hands the trainer: a batch of windows as input ids and labels (the same windows
shifted by one), pinned for an asynchronous copy to the GPU when asked."""

from __future__ import annotations

import numpy as np
import torch

CHOICE_CHUNK = 4096  # mixtures: source choices are drawn in seeded chunks of this many windows


def to_batch(rows: np.ndarray, pin_memory: bool) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    batch = {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
    if pin_memory and torch.cuda.is_available():
        batch = {k: v.pin_memory() for k, v in batch.items()}
    return batch
