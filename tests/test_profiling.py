"""logging.profile writes the top operators of the profiled steps on rank 0 only."""

from types import SimpleNamespace

import torch

from muonrun.config import load_config, to_object
from muonrun.profiling import ACTIVE, WAIT, WARMUP, StepProfiler


def run_steps(tmp_path, is_main: bool):
    cfg = to_object(load_config("tiny", [f"output_dir={tmp_path}", "logging.profile=true"]))
    prof = StepProfiler(cfg, SimpleNamespace(is_main=is_main, device=torch.device("cpu")))
    x = torch.randn(64, 64)
    for _ in range(WAIT + WARMUP + ACTIVE + 1):
        x = torch.mm(x, x).tanh()
        prof.step()
    prof.close()
    return tmp_path / "profile" / "ops.txt"


def test_rank0_writes_the_op_table(tmp_path):
    table = run_steps(tmp_path, is_main=True).read_text()
    assert f"{ACTIVE} steps after {WAIT + WARMUP}" in table and "aten::mm" in table


def test_other_ranks_write_nothing(tmp_path):
    assert not run_steps(tmp_path, is_main=False).exists()
