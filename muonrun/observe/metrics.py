"""Metrics: tokens/s, MFU and memory, reduced across ranks only on logged steps, written by rank 0 to
OUTPUT_DIR/metrics.jsonl (and TensorBoard / Weights & Biases when asked: muonrun/observe/sinks.py) and shown on
the console (muonrun/observe/console.py).

Between logged steps nothing waits for the GPU: losses stay on the device and are summed there; the
first row of each run (and of each resume) is `{"event": "start", ...}` with what `muonrun compare`
needs to label it. Try:

    muonrun pretrain tiny --nproc-per-node 1 train.max_steps=20 logging.log_interval=5 logging.console=plain
"""

from __future__ import annotations

import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from muonrun.config import Config
from muonrun.distributed import Dist, HostCopy, all_reduce_max, all_reduce_mean, to_device
from muonrun.observe.console import make_view, summary_rows
from muonrun.observe.environment import git_sha, gpu_names, library_versions
from muonrun.observe.mfu import lookup_peak_tflops, matmul_precision
from muonrun.observe.sinks import make_sinks
from muonrun.train.ramp import tokens_after


def memory_numbers(device: torch.device) -> dict[str, float]:
    """Peak memory since start: allocated by torch on a GPU, the process's peak resident set on CPU.
    On a GPU also the caching allocator's peak reservation and its cumulative retries: a retry frees
    every cached block and synchronizes the device, so a count that grows step after step means the
    allocator is thrashing: memory is nearly full."""
    if device.type != "cuda":
        return {"peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # Linux: KiB
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_mem_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
        "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }


def optimizer_lrs(optimizers) -> dict[str, float]:
    """`lr_<optimizer class>` for each optimizer when there are several (Muon + AdamW: `lr_muon`,
    `lr_adamw`): their first group's learning rate. Empty for a single optimizer (`lr` says it all)."""
    if len(optimizers) < 2:
        return {}
    return {f"lr_{type(o).__name__.lower()}": o.param_groups[0]["lr"] for o in optimizers}


def optimizer_telemetry(optimizers) -> dict[str, torch.Tensor]:
    """What each optimizer reported about its last step (`optimizer.telemetry`: 0-d device tensors, filled
    while its `collect_telemetry` is on), each key suffixed by the optimizer's class as in `lr_<class>`:
    `update_rms_muon`, `momentum_norm_adamw`, ..."""
    return {
        f"{key}_{type(o).__name__.lower()}": value
        for o in optimizers
        for key, value in (getattr(o, "telemetry", None) or {}).items()
    }


@dataclass
class PendingRow:
    """A logged step's row, written at the next step once its reductions (queued, not waited for) are done."""

    row: dict
    reduced: HostCopy
    """[mean loss, mean grad norm, then the MAX-reduced values named by `max_keys`] on the host."""
    max_keys: list[str]
    """Names of the MAX-reduced values after data wait: memory numbers, then telemetry."""
    optimizer_times: list[Callable[[], float]]
    steps: int
    """Steps in the logging window."""
    eta: float | None


def ramp_text(t) -> str:
    """The banner's words for train.batch_ramp (empty without one)."""
    r = t.batch_ramp
    if not r.tokens:
        return ""
    return (
        f"; ramped from {r.start_grad_accum_steps} accum over the first {r.tokens:,} tokens, "
        "lr x sqrt(batch / full batch)"
    )


class LossWindow:
    """This rank's loss summed over the steps since the last logged one, and their count. It is part of
    the rank's checkpoint state (rankR.pt), so the first row after a resume averages the same steps as an
    uninterrupted run's, bit for bit, even when the save fell between logged steps (a preemption). A
    rank's losses are its own: a resume on another number of ranks starts the window empty (the first
    row then averages the steps since the resume)."""

    optional = True
    """Checkpoints saved before the window was kept have none: their resume starts it empty."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        self.rank, self.world_size = rank, world_size
        self.sum: torch.Tensor | None = None
        self.steps = 0

    def add(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.sum = loss if self.sum is None else self.sum.to(loss.device) + loss
        self.steps += 1

    def take(self) -> tuple[torch.Tensor, int]:
        """The window's sum and step count, emptying it (a logged step)."""
        taken, self.sum, self.steps = (self.sum, self.steps), None, 0
        return taken

    def state_dict(self) -> dict:
        held = None if self.sum is None else self.sum.detach().cpu()
        return {"sum": held, "steps": self.steps, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, sd: dict) -> None:
        if (sd.get("rank"), sd.get("world_size")) == (self.rank, self.world_size):
            self.sum, self.steps = sd["sum"], int(sd["steps"])


class Metrics:
    """What the trainer reports to: `start` once, `record` every step, `log_eval` after evaluations,
    `note` for messages, `close` at the end. Only rank 0 writes files; every rank joins the reductions.
    `loss_window`: the logged loss's running sum, checkpointed by the trainer (a fresh one by default)."""

    def __init__(
        self, cfg: Config, d: Dist, flops_per_token: float, model=None, loss_window: LossWindow | None = None
    ):
        self.cfg = cfg
        self.dist = d
        self.model = model
        self.loss_window = loss_window or LossWindow(d.rank, d.world_size)
        self.flops_per_token = flops_per_token
        self.precision = matmul_precision(cfg.parallel.param_dtype, d.device.type)
        self.device_name = torch.cuda.get_device_name(d.device) if d.device.type == "cuda" else "cpu"
        if cfg.logging.peak_tflops:
            self.peak = cfg.logging.peak_tflops
        elif d.device.type == "cuda":
            self.peak = lookup_peak_tflops(self.device_name, self.precision)
        else:
            self.peak = None  # no table for CPUs; the banner says how to get MFU anyway
        self.tokens_per_step_per_rank = (
            cfg.train.micro_batch_size * cfg.train.grad_accum_steps * cfg.data.seq_len
        )
        self.out = Path(cfg.output_dir)
        self.sinks: list = []
        self.view = None
        if d.is_main:
            self.sinks = make_sinks(cfg, self.out)
            self.view = make_view(cfg.logging.console)
        elif cfg.logging.all_ranks:
            self.view = make_view("plain", prefix=f"[rank {d.rank}] ")
        self._start_step = 0
        self._tokens_mark = 0
        self._t0 = time.perf_counter()
        self._pending: PendingRow | None = None
        self._last_loss: float | None = None  # the latest logged loss and eval loss, for the summary
        self._last_eval_loss: float | None = None
        self._reset_window()

    def _reset_window(self, start: float | None = None) -> None:
        """A new step-time window from `start` (default now). A logged step's window ends at its `now`,
        taken before the row's reductions are queued, and the next one starts there: whatever the host
        spends after it (a wait for the GPU included) counts in the next step, never in none."""
        self._last_record = time.perf_counter()
        self._window_start = self._last_record if start is None else start
        self._window_steps = 0
        self._window_wait = 0.0
        self._window_paused = 0.0
        self._window_optimizer: list[Callable[[], float]] = []

    def tokens_at_max_steps(self, state) -> int:
        """The tokens seen when the run reaches train.max_steps: those seen so far (restored from the
        checkpoint, whatever world size saved it) plus the remaining steps at this launch's tokens/step."""
        remaining, t = max(0, self.cfg.train.max_steps - state.step), self.cfg.train
        per_micro_batch = self.tokens_per_step_per_rank * self.dist.dp_size // t.grad_accum_steps
        return tokens_after(remaining, state.tokens_seen, t.grad_accum_steps, t.batch_ramp, per_micro_batch)

    def run_info(self, state) -> dict:
        """The start row: how this run (or resume) was set up, for the banner, `compare` and later readers."""
        c = self.cfg
        info = {
            "event": "start",
            "time": time.time(),
            "name": c.name,
            "optimizer": c.optimizer.name,
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            "max_steps": c.train.max_steps,
            "tokens_per_step": self.tokens_per_step_per_rank * self.dist.dp_size,
            "tokens_at_max_steps": self.tokens_at_max_steps(state),
            "world_size": self.dist.world_size,
            "mesh": dict(zip(self.dist.mesh.mesh_dim_names, self.dist.mesh.shape, strict=True)),
            "flops_per_token": self.flops_per_token,
            "device": self.device_name,
            "precision": self.precision,
            "peak_tflops": self.peak,
            "gpus": gpu_names(),
            "versions": library_versions(),
            "git_sha": git_sha(self.out, Path(__file__).parent),
            "hostname": platform.node(),
            "output_dir": str(self.out),
        }
        if self.model is not None:
            from muonrun.model.build import count_params

            info["parameters"] = count_params(self.model)
        return info

    def banner_rows(self, info: dict) -> list[tuple[str, str]]:
        c = self.cfg
        rows = [("run", f"{c.name} -> {c.output_dir}")]
        hf = getattr(self.model, "config", None)
        if hf is not None:
            kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
            rows.append(
                (
                    "model",
                    f"{hf.model_type}: hidden {hf.hidden_size}, {hf.num_hidden_layers} layers, "
                    f"{hf.num_attention_heads} heads ({kv} kv), mlp {hf.intermediate_size}, vocab {hf.vocab_size}",
                )
            )
        if "parameters" in info:
            p = info["parameters"]
            text = f"{p['total']:,} ({p['embedding']:,} embedding, {p['non_embedding']:,} other)"
            if p["trainable"] < p["total"]:  # LoRA
                text += f", {p['trainable']:,} trainable ({p['trainable'] / p['total']:.2%})"
            rows.append(("parameters", text))
        rows.append(("FLOPs/token", f"{self.flops_per_token:.3e} (train: forward + backward)"))
        o = c.optimizer
        opt = f"{o.name}: lr {o.lr:g}, weight decay {o.weight_decay:g}"
        if o.name == "muon":
            form = "Gram" if o.muon.gram_ns else "standard"
            opt = f"muon: lr {o.muon.lr:g}, momentum {o.muon.momentum:g}, {form} Newton–Schulz; AdamW lr {o.lr:g}"
        rows.append(("optimizer", opt))
        s = c.schedule
        rows.append(("schedule", f"{s.name}, warmup {s.warmup_steps}, min lr ratio {s.min_lr_ratio:g}"))
        t = c.train
        total = f"{t.max_steps:,} steps = {info['tokens_at_max_steps']:,} tokens"
        if info["step"]:  # the steps before the resume may have run on another world size
            remaining = max(0, t.max_steps - info["step"])
            total += (
                f" ({info['tokens_seen']:,} seen by step {info['step']:,} + {remaining:,} steps x "
                f"{info['tokens_per_step']:,})"
            )
        rows.append(
            (
                "batch",
                f"{t.micro_batch_size} seq x {t.grad_accum_steps} accum x {c.data.seq_len} tokens x "
                f"{self.dist.dp_size} {'data-parallel ' if self.dist.tp > 1 else ''}ranks = "
                f"{info['tokens_per_step']:,} tokens/step; {total}" + ramp_text(t),
            )
        )
        mesh = " x ".join(f"{k}={v}" for k, v in info["mesh"].items())
        rows.append(
            (
                "parallel",
                f"world {self.dist.world_size} (mesh {mesh}), {self.precision} matmuls, "
                f"activation checkpointing {c.parallel.activation_checkpointing}, compiled layers "
                f"{c.parallel.compile}, compiled loss {c.parallel.compile_loss and self.dist.device.type == 'cuda'}",
            )
        )
        if info["gpus"]:
            names = sorted(set(info["gpus"]))
            rows.append(
                ("GPUs", ", ".join(f"{info['gpus'].count(n)} x {n}" for n in names) + " on rank 0's node")
            )
        else:
            rows.append(("device", self.device_name))
        if self.peak:
            rows.append(("peak", f"{self.peak:g} TFLOP/s per device ({self.precision}) for MFU"))
        else:
            rows.append(("peak", "unknown: MFU not reported (set logging.peak_tflops to report it)"))
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in info["versions"].items())))
        rows.append(("git", info["git_sha"] or "not a git checkout"))
        if info["step"]:
            rows.append(("resumed", f"at step {info['step']:,} ({info['tokens_seen']:,} tokens seen)"))
        return rows

    def start(self, state) -> None:
        self._start_step = state.step
        self._tokens_mark = state.tokens_seen  # tokens/s: the tokens of a logging window (a ramp varies them)
        if self.dist.is_main:
            info = self.run_info(state)
            self._write(info)
            self.view.banner(self.banner_rows(info))
        elif self.view is not None and state.step:
            self.view.note(f"Resumed at step {state.step} ({state.tokens_seen:,} tokens seen).")
        if self.view is not None:
            self.view.start(state.step, self.cfg.train.max_steps)
        self._t0 = time.perf_counter()
        self._reset_window()

    def record(
        self,
        state,
        loss,
        grad_norm,
        lr_mult,
        data_wait,
        optimizers,
        log: bool,
        optimizer_time: Callable[[], float] | None = None,
        telemetry: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Accumulate one step; on logged steps queue the cross-rank reductions and write the row at the
        next call (one step late), so that logging never makes the host wait for the GPU.
        `loss` and `grad_norm` are device tensors; `optimizer_time` (only when timed) returns the
        optimizer step's seconds once its events completed. `telemetry` (logged steps): more 0-d device
        tensors for the row, each a global value or this rank's maximum: reduced with MAX across ranks
        in the same collective as the memory numbers (every rank must pass the same keys)."""
        self._flush()
        self._window_steps += 1
        self._window_wait += data_wait
        if optimizer_time is not None:
            self._window_optimizer.append(optimizer_time)
        self.loss_window.add(loss)
        if self.view is not None:
            self.view.advance(state.step)
        if not log:
            self._last_record = time.perf_counter()
            return
        now = time.perf_counter()
        device = loss.device
        loss_sum, loss_steps = self.loss_window.take()
        mean = all_reduce_mean(torch.stack([loss_sum / loss_steps, grad_norm.detach().float().to(device)]))
        memory = memory_numbers(self.dist.device)
        extra = [v.detach().float().reshape(1).to(device) for v in (telemetry or {}).values()]
        worst = all_reduce_max(torch.cat([to_device([self._window_wait, *memory.values()], device), *extra]))
        reduced = HostCopy(torch.cat([mean, worst]))
        steps = self._window_steps
        step_time = (now - self._window_start - self._window_paused) / steps
        # per device: the window's tokens over every rank (the tp ranks of a data-parallel rank share a batch)
        tps = (state.tokens_seen - self._tokens_mark) / steps / self.dist.world_size / step_time
        self._tokens_mark = state.tokens_seen
        row = {
            "step": state.step,
            "loss": None,
            "lr": optimizers[0].param_groups[0]["lr"],
            **optimizer_lrs(optimizers),
            "lr_multiplier": lr_mult,
            "grad_norm": None,
            "tokens_seen": state.tokens_seen,
            "tokens_per_s": tps * self.dist.world_size,
            "tokens_per_s_per_device": tps,
            "mfu": tps * self.flops_per_token / (self.peak * 1e12) if self.peak else None,
            "step_time": step_time,
            "data_wait_time": None,
            "peak_mem_gib": None,
            "time": time.time(),
            "elapsed_s": now - self._t0,
        }
        timings = self._window_optimizer
        eta = None
        if done_steps := state.step - self._start_step:
            eta = (self.cfg.train.max_steps - state.step) * (now - self._t0) / done_steps
        self._pending = PendingRow(row, reduced, [*memory, *(telemetry or {})], timings, steps, eta)
        self._reset_window(start=now)

    def _flush(self) -> None:
        """Write the row queued by the last logged step (its reductions finished long ago)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        row = pending.row
        loss, grad_norm, wait, *worst = pending.reduced.values()
        row.update(
            loss=loss,
            grad_norm=grad_norm,
            data_wait_time=wait / pending.steps,
            **dict(zip(pending.max_keys, worst, strict=True)),
        )
        if "alloc_retries" in row:
            row["alloc_retries"] = int(row["alloc_retries"])
        if pending.optimizer_times:
            row["optimizer_step_time"] = sum(t() for t in pending.optimizer_times) / len(
                pending.optimizer_times
            )
        self._write(row)
        self._last_loss = row["loss"]
        if self.view is not None:
            self.view.step(row, self.cfg.train.max_steps, pending.eta)

    def flush(self) -> None:
        """Write the row the last logged step queued now, before a line that must follow it (its
        checkpoint's): reading it waits for that step's reductions, which a save waits for anyway."""
        self._flush()

    def log_eval(self, state, values: dict[str, float]) -> None:
        """An eval row. The evaluation ran since the last `record`; its time is kept out of step_time."""
        self._flush()
        eval_time = time.perf_counter() - self._last_record
        self._window_paused += eval_time
        row = {
            "step": state.step,
            "tokens_seen": state.tokens_seen,
            **values,
            "eval_time": eval_time,
            "time": time.time(),
        }
        self._write(row)
        self._last_eval_loss = values.get("eval_loss", self._last_eval_loss)
        if self.view is not None:
            self.view.eval(row)

    def note(self, msg: str) -> None:
        self._flush()
        if self.view is not None:
            self.view.note(msg)

    def summary(self, state, checkpoint: Path | None, exported: Path | None) -> None:
        """The run's last lines, on rank 0's view: where it ended, its final loss, this launch's time, its
        newest checkpoint and how to export it (`exported`: where checkpoint.export_at_end wrote it)."""
        self._flush()
        if not self.dist.is_main or self.view is None:
            return
        rows = summary_rows(
            state.step,
            self.cfg.train.max_steps,
            time.perf_counter() - self._t0,
            self._last_loss,
            self._last_eval_loss,
            None if checkpoint is None else str(checkpoint),
            None if exported is None else str(exported),
            self.cfg.output_dir,
            self.cfg.name,
        )
        self.view.summary(rows)

    def _write(self, row: dict) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        self._flush()
        if self.view is not None:
            self.view.close()
            self.view = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        sys.stdout.flush()
