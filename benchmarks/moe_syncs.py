"""Where a training step makes the host wait for the GPU, or copies host memory to it: each place with its
Python stack, counted per step, on unlogged and logged steps apart.

Pass 1 runs steps in CUDA sync-debug mode ("warn": every synchronising call, e.g. `.item()`, a bool of a GPU
tensor, a copy from pageable memory, a data-dependent shape, warns from where it was made). Pass 2 profiles a
step with Python stacks and lists every operator that launched a host-to-device copy (pinned copies do not
wait, but each one is a host value the step needed on the device).

  python benchmarks/moe_syncs.py qwen2-moe-adamw-fsdp2 data.tokenizer=byte \\
      'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0
"""

from __future__ import annotations

import collections
import sys
import tempfile
import traceback
import warnings

import torch

from muonrun.config import load_config
from muonrun.distributed import destroy
from muonrun.train.trainer import Trainer

WARMUP, STEPS = 3, 4
OURS = ("/muonrun/", "/transformers/", "/torch/distributed/", "/torch/optim/", "/torch/nn/")


def where(frames) -> str:
    """The innermost frames of muonrun, transformers and torch's modules."""
    kept = [
        f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
        for f in frames
        if any(o in f.filename for o in OURS)
    ]
    return "\n      ".join(kept[-5:]) or "(no Python frame of ours)"


def main(preset: str, overrides: list[str]) -> None:
    out = tempfile.mkdtemp(prefix="moe_syncs_")
    cfg = load_config(
        preset,
        [f"output_dir={out}", "train.device=cuda", "checkpoint.interval=0", "logging.console=plain",
         "logging.log_interval=2", "train.max_steps=100", *overrides],
    )  # fmt: skip
    trainer = Trainer(cfg)

    def step() -> bool:
        log = trainer.logs(trainer.state.step + 1)
        loss, grad_norm, wait = trainer.train_step()
        trainer.state.step += 1
        telemetry = trainer.telemetry() if log else None
        trainer.metrics.record(
            trainer.state, loss, grad_norm, 1.0, wait, trainer.optimizers, log=log, telemetry=telemetry
        )
        return log

    try:
        trainer.metrics.start(trainer.state)
        for _ in range(WARMUP):
            step()
        torch.cuda.synchronize()

        # Pass 1: synchronising calls, from where they were made
        found: dict[bool, collections.Counter] = {False: collections.Counter(), True: collections.Counter()}
        current: list[str] = []
        shown = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message):
                current.append(
                    f"{str(message).splitlines()[0][:80]}\n      {where(traceback.extract_stack()[:-1])}"
                )
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        counts = {False: 0, True: 0}
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                for _ in range(STEPS):
                    current.clear()
                    log = step()
                    counts[log] += 1
                    found[log].update(current)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
        for log in (False, True):
            n = max(counts[log], 1)
            total = sum(found[log].values()) / n
            print(
                f"\n== {'logged' if log else 'unlogged'} steps ({counts[log]}): {total:.1f} synchronising calls per step"
            )
            for place, c in found[log].most_common():
                print(f"  {c / n:5.1f} x {place}")

        # Pass 2: operators that launched a host-to-device copy, with their Python stacks
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            step()
            torch.cuda.synchronize()
        copies = collections.Counter()
        for event in prof.events():
            kids = [k.name for k in event.cpu_children]
            if event.name in ("aten::copy_", "aten::_to_copy", "aten::to") and any(
                "Memcpy" in k or "cudaMemcpy" in k for k in kids
            ):
                stack = [s for s in (event.stack or []) if any(o in s for o in OURS)]
                copies["\n      ".join(stack[:5]) or "(no stack)"] += 1
        print(f"\n== host-to-device copies in one step: {sum(copies.values())}")
        for place, c in copies.most_common():
            print(f"  {c:4d} x {place}")
    finally:
        trainer.close()
        destroy()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
