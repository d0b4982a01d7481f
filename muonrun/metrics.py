"""Metrics: reduced across ranks only on logged steps, written to OUTPUT_DIR/metrics.jsonl and the console.

Between logged steps nothing waits for the GPU: losses stay on the device and are summed there.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

from muonrun.config import Config
from muonrun.distributed import Dist, all_reduce_max, all_reduce_mean

# Dense peak TFLOP/s per device (bf16 tensor cores; fp32 for CPU-free lookups is not meaningful).
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    """Peak dense bf16 TFLOP/s of `device`, from logging.peak_tflops or the table; None (with a warning) if unknown."""
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS.items():
        if key in name.replace("NVIDIA ", "").split():
            return value
    warnings.warn(f"Unknown GPU '{name}': MFU is not reported. Set logging.peak_tflops to enable it.", stacklevel=2)
    return None


class Metrics:
    def __init__(self, cfg: Config, d: Dist, flops_per_token: float, model=None):
        self.cfg = cfg
        self.dist = d
        self.flops_per_token = flops_per_token
        self.peak = peak_tflops(d.device, cfg.logging.peak_tflops)
        self.tokens_per_step_per_rank = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
        self.out = Path(cfg.output_dir)
        self.jsonl = None
        if d.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(self.out / "metrics.jsonl", "a")  # noqa: SIM115 - open for the whole run
        self._window_start = time.perf_counter()
        self._window_steps = 0
        self._window_wait = 0.0
        self._loss_sum: torch.Tensor | None = None

    def print(self, msg: str) -> None:
        if self.dist.is_main or self.cfg.logging.all_ranks:
            print(msg, flush=True)

    def note(self, msg: str) -> None:
        self.print(msg)

    def start(self, state) -> None:
        if state.step:
            self.print(f"Resumed at step {state.step} ({state.tokens_seen:,} tokens seen).")
        self._window_start = time.perf_counter()

    def record(self, state, loss, grad_norm, lr_mult, data_wait, optimizers, log: bool) -> None:
        self._window_steps += 1
        self._window_wait += data_wait
        self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
        if not log:
            return
        local = torch.stack([self._loss_sum / self._window_steps, grad_norm.float().to(loss.device)])
        loss_avg, grad_norm_v = all_reduce_mean(local).tolist()  # the one host sync per logged step
        wait = all_reduce_max(torch.tensor([self._window_wait], device=loss.device)).item()
        elapsed = time.perf_counter() - self._window_start
        step_time = elapsed / self._window_steps
        tps = self.tokens_per_step_per_rank / step_time
        row = {
            "step": state.step,
            "loss": loss_avg,
            "lr": optimizers[0].param_groups[0]["lr"],
            "lr_multiplier": lr_mult,
            "grad_norm": grad_norm_v,
            "tokens_seen": state.tokens_seen,
            "tokens_per_s": tps * self.dist.world_size,
            "tokens_per_s_per_device": tps,
            "mfu": (tps * self.flops_per_token / (self.peak * 1e12)) if self.peak else None,
            "step_time": step_time,
            "data_wait_time": wait / self._window_steps,
            "peak_mem_gib": (torch.cuda.max_memory_allocated(self.dist.device) / 2**30)
            if self.dist.device.type == "cuda"
            else None,
            "time": time.time(),
        }
        self._write(row)
        mfu = f" mfu {row['mfu'] * 100:.1f}%" if row["mfu"] is not None else ""
        self.print(
            f"step {state.step:>6}/{self.cfg.train.max_steps} | loss {loss_avg:.4f} | lr {row['lr']:.3e} | "
            f"grad {grad_norm_v:.3f} | {tps:,.0f} tok/s/dev{mfu} | {step_time * 1000:.0f} ms/step"
        )
        self._window_start, self._window_steps, self._window_wait, self._loss_sum = time.perf_counter(), 0, 0.0, None

    def log_eval(self, state, values: dict[str, float]) -> None:
        self._write({"step": state.step, "tokens_seen": state.tokens_seen, **values})
        self.print(f"eval  {state.step:>6} | " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def _write(self, row: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(row) + "\n")
            self.jsonl.flush()

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        sys.stdout.flush()
