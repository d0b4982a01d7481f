"""logging.profile writes the top operators of the profiled steps on rank 0 only."""

from types import SimpleNamespace

import torch

from muonrun.config import load_config
from muonrun.observe.profiling import ACTIVE, WAIT, WARMUP, StepProfiler, phase
from muonrun.observe.timeline import summarize


def run_steps(tmp_path, is_main: bool):
    cfg = load_config("tiny", [f"output_dir={tmp_path}", "logging.profile=true"])
    prof = StepProfiler(cfg, SimpleNamespace(is_main=is_main, device=torch.device("cpu")))
    x = torch.randn(64, 64)
    for _ in range(WAIT + WARMUP + ACTIVE + 1):
        with phase("forward_backward"):
            x = torch.mm(x, x).tanh()
        prof.step()
    prof.close()
    return tmp_path / "profile" / "ops.txt"


def test_rank0_writes_the_op_table(tmp_path):
    table = run_steps(tmp_path, is_main=True).read_text()
    assert f"{ACTIVE} steps after {WAIT + WARMUP}" in table and "aten::mm" in table
    timeline = (tmp_path / "profile" / "timeline.txt").read_text()
    assert f"{ACTIVE} profiled steps" in timeline and "forward_backward" in timeline
    assert (tmp_path / "profile" / "trace.json.gz").stat().st_size > 0


def kernel(name, ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def launch(ts, corr):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 1,
        "args": {"correlation": corr},
    }


def phase_rows(text: str) -> dict[str, list[str]]:
    """The timeline's by-phase table: phase -> CPU, GPU compute, communication, window, idle, lag."""
    return {
        line.split()[0]: line.split()[1:]
        for line in text.splitlines()
        if line.startswith("  ") and len(line.split()) == 7
    }


def test_timeline_splits_compute_communication_and_idle():
    """One 10 ms step: compute 0-4 ms, NCCL 3-6 ms (2 ms of it exposed), idle 6-8, compute 8-10."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#5", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "user_annotation", "name": "muonrun.forward_backward", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "muonrun.optimizer", "ts": 10, "dur": 5},
        launch(1, 1),
        launch(2, 2),
        launch(11, 3),
        kernel("sm90_gemm", 0, 4_000, 1),
        kernel("ncclDevKernel_AllToAll", 3_000, 3_000, 2),
        kernel("newton_schulz_gemm", 8_000, 2_000, 3),
    ]
    text = summarize(events)
    assert "GPU window 10.0 ms/step: compute busy 6.0, communication busy 3.0 (exposed" in text
    assert "exposed, no compute beside it: 2.0), idle 2.0 ms/step" in text
    assert "2.00 ms, then [optimizer] newton_schulz_gemm" in text
    assert (
        "    2.00  [optimizer] newton_schulz_gemm" in text
        and "    4.00  [forward_backward] sm90_gemm" in text
    )
    rows = phase_rows(text)
    # GPU compute, communication, window (first kernel's start to last one's end), idle inside it, and
    # the lag from the host entering the phase to the GPU starting it
    assert rows["forward_backward"][1:] == ["4.00", "3.00", "6.00", "0.00", "0.00"]
    assert rows["optimizer"][1:] == ["2.00", "0.00", "2.00", "0.00", "7.99"]
    assert (
        "host waits for the GPU" in text
        and text.split("host waits for the GPU")[1].split("\n")[1] == "  none"
    )


def test_timeline_gives_each_phase_its_gpu_window_and_the_idle_inside_it():
    """The optimizer launches kernels at 0-2 and 5-6 ms; a kernel launched before profiling began runs
    at 3-4 ms, so the optimizer's 6 ms window is idle for 2 (the GPU waiting on its launches); the
    forward's one kernel at 7-9 ms has a 2 ms window with nothing idle, begun 6.99 ms after the host
    entered the phase (the host ran ahead)."""
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "user_annotation", "name": "muonrun.optimizer", "ts": 0, "dur": 5},
        {"ph": "X", "cat": "user_annotation", "name": "muonrun.forward_backward", "ts": 10, "dur": 5},
        launch(1, 1),
        launch(2, 2),
        launch(11, 3),
        kernel("ns_gemm", 0, 2_000, 1),
        kernel("update", 5_000, 1_000, 2),
        kernel("earlier", 3_000, 1_000, 99),
        kernel("sm90_gemm", 7_000, 2_000, 3),
    ]
    rows = phase_rows(summarize(events))
    assert rows["optimizer"][1:] == ["3.00", "0.00", "6.00", "2.00", "0.00"]
    assert rows["forward_backward"][1:] == ["2.00", "0.00", "2.00", "0.00", "6.99"]
    # launched before the profile began: compute, but no window of its own
    assert rows["other"][1:] == ["1.00", "0.00", "0.00", "0.00", "0.00"]


def test_timeline_sums_the_host_time_of_fsdp_hooks_and_compiled_regions_over_the_layers():
    """What makes a small model host-bound: per-layer hooks and compiled-graph calls, one row each."""
    host = [
        ("FSDP::pre_forward (lm.model.layers.0)", 0, 1_000),
        ("FSDP::pre_forward (lm.model.layers.1)", 2_000, 3_000),
        ("FSDP::backward_prefetch for lm.model.layers.0", 6_000, 200),
        ("Torch-Compiled Region: 0/0", 1_000, 500),
        ("aten::mm", 1_100, 100),
    ]
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "ts": 0, "dur": 10_000},
        {"ph": "X", "cat": "user_annotation", "name": "muonrun.forward_backward", "ts": 0, "dur": 9_000},
        launch(1, 1),
        kernel("sm90_gemm", 10, 2_000, 1),
    ] + [{"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur} for name, ts, dur in host]
    section = summarize(events).split("host time in FSDP2's hooks and compiled regions")[1].split("\n\n")[0]
    assert section.splitlines()[1:] == [
        "      4.00 ms    2.0 calls  FSDP::pre_forward",
        "      0.50 ms    1.0 calls  Torch-Compiled Region",
        "      0.20 ms    1.0 calls  FSDP::backward_prefetch",
    ]


def test_timeline_names_where_the_host_waited():
    """A pageable host-to-device copy (stream synchronize inside aten::copy_, in the agree phase) and
    an `.item()` in the forward, on two steps: grouped by phase and innermost op, largest first."""
    events = [kernel("gemm", 0, 20_000, 1)]
    for step, t0 in ((5, 0), (6, 10_000)):
        events += [
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "ts": t0,
                "dur": 10_000,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "muonrun.forward_backward",
                "ts": t0,
                "dur": 4_000,
                "tid": 1,
            },
            {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": t0 + 100, "dur": 600, "tid": 1},
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": "aten::_local_scalar_dense",
                "ts": t0 + 110,
                "dur": 500,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaStreamSynchronize",
                "ts": t0 + 120,
                "dur": 400,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": "muonrun.agree",
                "ts": t0 + 5_000,
                "dur": 3_000,
                "tid": 1,
            },
            {"ph": "X", "cat": "cpu_op", "name": "aten::to", "ts": t0 + 5_010, "dur": 2_900, "tid": 1},
            {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": t0 + 5_020, "dur": 2_800, "tid": 1},
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaMemcpyAsync",
                "ts": t0 + 5_030,
                "dur": 10,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaStreamSynchronize",
                "ts": t0 + 5_050,
                "dur": 2_700,
                "tid": 1,
            },
            {
                "ph": "X",
                "cat": "cuda_runtime",
                "name": "cudaEventSynchronize",
                "ts": t0 + 9_000,
                "dur": 5,
                "tid": 1,
            },
        ]
    waits = summarize(events).split("host waits for the GPU")[1].splitlines()[1:4]
    assert [" ".join(line.split()) for line in waits] == [
        "2.70 ms 1.0 calls [agree] aten::copy_",
        "0.40 ms 1.0 calls [forward_backward] aten::_local_scalar_dense",
        "0.01 ms 1.0 calls [other] ProfilerStep",
    ]


def test_other_ranks_write_nothing(tmp_path):
    assert not run_steps(tmp_path, is_main=False).exists()


def test_the_config_knows_the_last_profiled_step_and_warns_of_a_run_too_short_for_it(capsys):
    from muonrun.config.load import PROFILED_THROUGH

    assert PROFILED_THROUGH == WAIT + WARMUP + ACTIVE
    load_config("tiny", ["logging.profile=true", f"train.max_steps={PROFILED_THROUGH - 1}"])
    assert "no profile will be written" in capsys.readouterr().err
    load_config("tiny", ["logging.profile=true", f"train.max_steps={PROFILED_THROUGH}"])
    assert "no profile" not in capsys.readouterr().err
