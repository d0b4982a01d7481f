"""`logging.profile=true`: torch.profiler over a few steady-state steps on rank 0.

Writes OUTPUT_DIR/profile/ops.txt (operators and kernels by self device time), trace.json.gz (the
timeline, for Perfetto) and timeline.txt (its summary: muonrun/observe/timeline.py) so a speed question
starts from a measurement:  muonrun bench qwen2-adamw-fsdp2 --variant p:logging.profile=true
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from muonrun.config import Config
from muonrun.distributed import Dist
from muonrun.observe.timeline import PHASE_PREFIX, load_events, summarize

WAIT, WARMUP, ACTIVE = 4, 1, 3  # steps skipped, warmed up, recorded (config.load.PROFILED_THROUGH: their sum)


def phase(name: str) -> torch.profiler.record_function:
    """Label one phase of the training step in the profile (a few microseconds when not profiling)."""
    return torch.profiler.record_function(PHASE_PREFIX + name)


class StepProfiler:
    def __init__(self, cfg: Config, d: Dist):
        self.prof = None
        if not (cfg.logging.profile and d.is_main):
            return
        self.out = Path(cfg.output_dir) / "profile"
        self.sort_key = "self_cuda_time_total" if d.device.type == "cuda" else "self_cpu_time_total"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if d.device.type == "cuda" else [])
        self.prof = profile(
            activities=activities,
            schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=self._write,
        )
        self.prof.__enter__()

    def _write(self, prof) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        table = prof.key_averages().table(sort_by=self.sort_key, row_limit=40, max_name_column_width=80)
        (self.out / "ops.txt").write_text(f"{ACTIVE} steps after {WAIT + WARMUP}, rank 0\n{table}\n")
        trace = self.out / "trace.json.gz"
        prof.export_chrome_trace(str(trace))
        (self.out / "timeline.txt").write_text(summarize(load_events(trace)))

    def step(self) -> None:
        if self.prof is not None:
            self.prof.step()

    def close(self) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)
            self.prof = None
            if torch.cuda.is_available():
                torch.cuda.synchronize()
