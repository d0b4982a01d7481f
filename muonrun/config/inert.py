"""Settings that do nothing on the device a run computes on: one warning line each, from the launcher
before any worker starts and from the dry run of a CPU plan (settings a CPU cannot run at all, such as
`parallel.float8` or `launch.backend=nccl`, are refused instead, by the same checks in both).

    muonrun pretrain tiny parallel.compile_loss=true --dry-run
    # muonrun: WARNING: parallel.compile_loss=true does nothing on the CPU: ...
"""

from __future__ import annotations

from collections.abc import Callable

from muonrun.config.schema import Config

# key: (whether the config sets it, why it does nothing on a CPU)
GPU_ONLY: dict[str, tuple[Callable[[Config], bool], str]] = {
    "parallel.compile_loss": (
        lambda c: c.parallel.compile_loss,
        "the compiled loss is a GPU pass over bf16 logits, and the CPU runs the eager loss",
    ),
    "optimizer.muon.eager": (
        lambda c: c.optimizer.name == "muon" and c.optimizer.muon.eager,
        "Muon's step runs kernel by kernel on the CPU anyway (no compiled passes, no CUDA graph there)",
    ),
}


def inert_settings(c: Config, device_type: str) -> list[str]:
    """One sentence per setting of `c` that does nothing on `device_type` (`cpu` or `cuda`)."""
    if device_type != "cpu":
        return []
    return [
        f"{key}=true does nothing on the CPU: {why}. Remove it, or run on GPUs."
        for key, (is_set, why) in GPU_ONLY.items()
        if is_set(c)
    ]


def warn_inert(c: Config, device_type: str) -> None:
    from muonrun import log

    for message in inert_settings(c, device_type):
        log.warning(message)
