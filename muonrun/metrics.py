"""Metrics: tokens/s, MFU and memory, reduced across ranks only on logged steps, written by rank 0 to
OUTPUT_DIR/metrics.jsonl (and TensorBoard / Weights & Biases when asked) and shown on the console.

Between logged steps nothing waits for the GPU: losses stay on the device and are summed there; the
first row of each run (and of each resume) is `{"event": "start", ...}` with what `muonrun compare`
needs to label it. Try:

    muonrun pretrain tiny --nproc-per-node 1 train.max_steps=20 logging.log_interval=5 logging.console=plain
"""

from __future__ import annotations

import json
import platform
import re
import resource
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from muonrun.config import Config
from muonrun.console import make_view
from muonrun.distributed import Dist, HostCopy, all_reduce_max, all_reduce_mean, to_device
from muonrun.errors import UserError

# Dense (no sparsity) peak TFLOP/s per device from the vendors' datasheets: bf16 tensor cores, tf32 (fp32
# matmuls when torch allows TF32) and plain fp32. A row matches when all its tokens are in the device name
# (split on spaces and dashes); the first match wins, so the specific variants come before the generic ones.
PEAK_TFLOPS: list[tuple[tuple[str, ...], dict[str, float]]] = [
    (("GB200",), {"bf16": 2500.0, "tf32": 1250.0, "fp32": 80.0}),
    (("B200",), {"bf16": 2250.0, "tf32": 1125.0, "fp32": 75.0}),
    (("B100",), {"bf16": 1750.0, "tf32": 900.0, "fp32": 60.0}),
    (("GH200",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H200", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H200",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H100", "NVL"), {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (("H100", "PCIE"), {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("H100",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H800", "PCIE"), {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (("H800",), {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (("H20",), {"bf16": 148.0, "tf32": 74.0, "fp32": 44.0}),
    (("A100",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("A800",), {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (("L40S",), {"bf16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (("L40",), {"bf16": 181.05, "tf32": 90.5, "fp32": 90.5}),
    (("L4",), {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (("A10",), {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (("RTX", "4090"), {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (("MI325X",), {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (("MI300X",), {"bf16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    (("MI250X",), {"bf16": 383.0, "tf32": 95.7, "fp32": 95.7}),
]
_warned_devices: set[str] = set()


def matmul_precision(param_dtype: str, device_type: str) -> str:
    """Which column of PEAK_TFLOPS a run's matmuls use: `bf16`, `tf32` or `fp32` (mirrors parallelize's `auto`)."""
    if param_dtype == "bfloat16" or (param_dtype == "auto" and device_type == "cuda"):
        return "bf16"
    return "tf32" if torch.get_float32_matmul_precision() != "highest" else "fp32"


def lookup_peak_tflops(device_name: str, precision: str) -> float | None:
    """Peak dense TFLOP/s of a device named like torch.cuda.get_device_name(); None, with one warning per
    name, when the table does not know it (an invented number would make every MFU wrong)."""
    tokens = set(re.split(r"[\s\-_]+", device_name.upper()))
    for pattern, peaks in PEAK_TFLOPS:
        if tokens.issuperset(pattern):
            return peaks[precision]
    if device_name not in _warned_devices:
        _warned_devices.add(device_name)
        warnings.warn(
            f"Unknown device '{device_name}': MFU is not reported. Set logging.peak_tflops (its dense "
            f"{precision} TFLOP/s) to report it.",
            stacklevel=2,
        )
    return None


def library_versions() -> dict[str, str]:
    import transformers

    from muonrun import __version__

    versions = {
        "muonrun": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if torch.version.cuda and torch.cuda.is_available():
        versions["cuda"] = torch.version.cuda
        versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions


def gpu_names() -> list[str]:
    """The names of this node's visible GPUs (empty on a CPU machine)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def git_sha(*folders: Path | str) -> str | None:
    """HEAD of the first folder that is in a git repository (`-dirty` when it has uncommitted changes to
    tracked files); None when none is, or git is missing or slow. Never raises."""
    for folder in folders:
        try:
            sha = subprocess.run(
                ["git", "-C", str(folder), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=2,
                check=True,
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "-C", str(folder), "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=2
            ).returncode
        except (OSError, subprocess.SubprocessError):
            continue
        return sha + ("-dirty" if dirty == 1 else "")
    return None


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


def _numbers(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _tags(row: dict) -> dict[str, float]:
    """A train or eval row's numbers as TensorBoard / W&B tags: `train/loss`, `eval/loss`, `eval/ppl`, ..."""
    section = "eval" if "eval_loss" in row else "train"
    return {
        f"{section}/{k.removeprefix('eval_')}": v
        for k, v in _numbers(row).items()
        if k not in ("step", "time")
    }


class JsonlSink:
    """OUTPUT_DIR/metrics.jsonl: one JSON object per line, appended (a resumed run continues the file)."""

    def __init__(self, path: Path):
        self.file = open(path, "a")  # noqa: SIM115 - open for the whole run

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """OUTPUT_DIR/tensorboard: train rows under `train/`, eval rows under `eval/`, the start row as text."""

    def __init__(self, folder: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(
                "logging.tensorboard is true but tensorboard is not installed: pip install 'muonrun[tensorboard]' "
                "(or set logging.tensorboard=false)."
            ) from None
        self.writer = SummaryWriter(str(folder))

    def write(self, row: dict) -> None:
        if row.get("event") == "start":
            self.writer.add_text("run", "```\n" + json.dumps(row, indent=2) + "\n```", row["step"])
            return
        for tag, value in _tags(row).items():
            self.writer.add_scalar(tag, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run named after the muonrun run; its id is kept in the run folder for resumes."""

    def __init__(self, cfg: Config, out: Path):
        import wandb
        from omegaconf import OmegaConf

        id_file = out / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=cfg.logging.wandb_project,
            entity=cfg.logging.wandb_entity,
            name=cfg.name,
            id=run_id,
            resume="allow",
            dir=str(out),
            config=OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
        )
        # Log against our step, not W&B's own counter, so a resumed run may re-log steps after its checkpoint.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, row: dict) -> None:
        if row.get("event") == "start":
            self.run.summary.update({f"start/{k}": v for k, v in _numbers(row).items()})
            return
        self.run.log({"step": row["step"], **_tags(row)})

    def close(self) -> None:
        self.run.finish()


def _wandb_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


class Metrics:
    """What the trainer reports to: `start` once, `record` every step, `log_eval` after evaluations,
    `note` for messages, `close` at the end. Only rank 0 writes files; every rank joins the reductions."""

    def __init__(self, cfg: Config, d: Dist, flops_per_token: float, model=None):
        self.cfg = cfg
        self.dist = d
        self.model = model
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
            self.out.mkdir(parents=True, exist_ok=True)
            self.sinks.append(JsonlSink(self.out / "metrics.jsonl"))
            if cfg.logging.tensorboard:
                self.sinks.append(TensorBoardSink(self.out / "tensorboard"))
            if cfg.logging.wandb_project:
                if _wandb_installed():
                    self.sinks.append(WandbSink(cfg, self.out))
                else:
                    warnings.warn(
                        f"logging.wandb_project is '{cfg.logging.wandb_project}' but wandb is not installed "
                        "(pip install wandb); not logging to Weights & Biases.",
                        stacklevel=2,
                    )
            self.view = make_view(cfg.logging.console)
        elif cfg.logging.all_ranks:
            self.view = make_view("plain", prefix=f"[rank {d.rank}] ")
        self._start_step = 0
        self._t0 = time.perf_counter()
        self._pending: tuple | None = None
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
        self._loss_sum: torch.Tensor | None = None

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
            "tokens_per_step": self.tokens_per_step_per_rank * self.dist.world_size,
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
            from muonrun.model import count_params

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
            rows.append(
                ("parameters", f"{p['total']:,} ({p['embedding']:,} embedding, {p['non_embedding']:,} other)")
            )
        rows.append(("FLOPs/token", f"{self.flops_per_token:.3e} (train: forward + backward)"))
        o = c.optimizer
        opt = f"{o.name}: lr {o.lr:g}, weight decay {o.weight_decay:g}"
        if o.name == "muon":
            opt = f"muon: lr {o.muon.lr:g}, momentum {o.muon.momentum:g}, ns {o.muon.ns_steps}; AdamW lr {o.lr:g}"
        rows.append(("optimizer", opt))
        s = c.schedule
        rows.append(("schedule", f"{s.name}, warmup {s.warmup_steps}, min lr ratio {s.min_lr_ratio:g}"))
        t = c.train
        rows.append(
            (
                "batch",
                f"{t.micro_batch_size} seq x {t.grad_accum_steps} accum x {c.data.seq_len} tokens x "
                f"{self.dist.world_size} ranks = {info['tokens_per_step']:,} tokens/step; "
                f"{t.max_steps:,} steps = {info['tokens_per_step'] * t.max_steps:,} tokens",
            )
        )
        mesh = " x ".join(f"{k}={v}" for k, v in info["mesh"].items())
        rows.append(
            (
                "parallel",
                f"world {self.dist.world_size} (mesh {mesh}), {self.precision} matmuls, "
                f"activation checkpointing {c.parallel.activation_checkpointing}, compile {c.parallel.compile}",
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
    ) -> None:
        """Accumulate one step; on logged steps queue the cross-rank reductions and write the row at the
        next call (one step late), so that logging never makes the host wait for the GPU.
        `loss` and `grad_norm` are device tensors; `optimizer_time` (only when timed) returns the
        optimizer step's seconds once its events completed."""
        self._flush()
        self._window_steps += 1
        self._window_wait += data_wait
        if optimizer_time is not None:
            self._window_optimizer.append(optimizer_time)
        self._loss_sum = loss.detach() if self._loss_sum is None else self._loss_sum + loss.detach()
        if self.view is not None:
            self.view.advance(state.step)
        if not log:
            self._last_record = time.perf_counter()
            return
        now = time.perf_counter()
        device = loss.device
        mean = all_reduce_mean(
            torch.stack([self._loss_sum / self._window_steps, grad_norm.detach().float().to(device)])
        )
        memory = memory_numbers(self.dist.device)
        worst = all_reduce_max(to_device([self._window_wait, *memory.values()], device))
        reduced = HostCopy(torch.cat([mean, worst]))
        steps = self._window_steps
        step_time = (now - self._window_start - self._window_paused) / steps
        tps = self.tokens_per_step_per_rank / step_time
        row = {
            "step": state.step,
            "loss": None,
            "lr": optimizers[0].param_groups[0]["lr"],
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
        if len(optimizers) > 1:  # e.g. Muon + AdamW: each one's learning rate
            row.update({f"lr_{type(o).__name__.lower()}": o.param_groups[0]["lr"] for o in optimizers})
        timings = self._window_optimizer
        eta = None
        if done_steps := state.step - self._start_step:
            eta = (self.cfg.train.max_steps - state.step) * (now - self._t0) / done_steps
        self._pending = (row, reduced, list(memory), timings, steps, eta)
        self._reset_window(start=now)

    def _flush(self) -> None:
        """Write the row queued by the last logged step (its reductions finished long ago)."""
        if self._pending is None:
            return
        row, reduced, memory_keys, timings, steps, eta = self._pending
        self._pending = None
        loss, grad_norm, wait, *memory = reduced.values()
        row.update(
            loss=loss,
            grad_norm=grad_norm,
            data_wait_time=wait / steps,
            **dict(zip(memory_keys, memory, strict=True)),
        )
        if "alloc_retries" in row:
            row["alloc_retries"] = int(row["alloc_retries"])
        if timings:
            row["optimizer_step_time"] = sum(t() for t in timings) / len(timings)
        self._write(row)
        if self.view is not None:
            self.view.step(row, self.cfg.train.max_steps, eta)

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
        if self.view is not None:
            self.view.eval(row)

    def note(self, msg: str) -> None:
        self._flush()
        if self.view is not None:
            self.view.note(msg)

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
