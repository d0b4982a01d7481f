"""Summarise a torch.profiler chrome trace: where each step's wall time goes on the GPU.

`logging.profile=true` writes OUTPUT_DIR/profile/timeline.txt with this summary, because the question
"why is this step slower" is about the timeline (idle gaps, exposed communication, which phase launched
the work), which the operator table cannot answer. Also usable by hand:

    python -m muonrun.observe.timeline OUTPUT_DIR/profile/trace.json.gz
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATEGORIES = {"cuda_runtime", "cuda_driver"}
PHASE_PREFIX = "muonrun."  # record_function labels the trainer puts around each phase of a step
MIN_GAP_US = 200.0
# CUDA calls in which the host waits for the GPU (a pageable host-to-device copy or `.item()` shows
# up as a stream synchronize inside the aten op that caused it)
SYNC_CALLS = {
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
}


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union `a` not covered by the union `b` (both sorted and disjoint)."""
    covered, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            covered += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return length(a) - covered


# Host-side regions that run once per wrapped module (layer) and step, whatever the module's size: in a
# small model they, not the GPU, set the step time. Their names carry the module or graph after the prefix.
PER_MODULE_REGIONS = ("FSDP::", "Torch-Compiled Region", "CompiledFunction")  # and CompiledFunctionBackward


def per_module_host_time(events: list[dict]) -> list[tuple[float, int, str]]:
    """(total µs, calls, region) of FSDP2's hooks and the compiled regions on the host, largest first;
    "FSDP::pre_forward (lm.model.layers.3)" and its siblings count as one region. Regions nest (a
    pre-forward hook holds its all-gather), so the rows do not add up."""
    groups: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in ("cpu_op", "user_annotation") or not e["name"].startswith(PER_MODULE_REGIONS):
            continue
        group = groups[re.sub(r"( \(.*\)| for .*|: \d+/\d+)$", "", e["name"])]
        group[0] += e["dur"]
        group[1] += 1
    return sorted(((t, n, key) for key, (t, n) in groups.items()), reverse=True)


def is_communication(name: str) -> bool:
    return "nccl" in name.lower()


def host_waits(events: list[dict], phase_at) -> list[tuple[float, int, str]]:
    """(total µs, calls, "[phase] innermost op") of every synchronize call, grouped, largest first."""
    ops_by_thread: dict = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops_by_thread[e.get("tid")].append(e)
    for ops in ops_by_thread.values():
        ops.sort(key=lambda e: e["ts"])
    starts = {tid: [e["ts"] for e in ops] for tid, ops in ops_by_thread.items()}
    groups: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("cat") not in LAUNCH_CATEGORIES or e["name"] not in SYNC_CALLS:
            continue
        ops, end = ops_by_thread.get(e.get("tid"), []), e["ts"] + e["dur"]
        # the innermost op containing the call: the latest-starting one that also ends after it
        i = bisect.bisect_right(starts.get(e.get("tid"), []), e["ts"]) - 1
        while i >= 0 and ops[i]["ts"] + ops[i]["dur"] < end:
            i -= 1
        # ProfilerStep#5, #6, ... are one place: drop the step number
        where = re.sub(r"#\d+$", "", ops[i]["name"]) if i >= 0 else e["name"]
        group = groups[f"[{phase_at(e['ts'])}] {where}"]
        group[0] += e["dur"]
        group[1] += 1
    return sorted(((t, n, key) for key, (t, n) in groups.items()), reverse=True)


def summarize(events: list[dict]) -> str:
    steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    phases = sorted(
        (
            (e["ts"], e["ts"] + e["dur"], e["name"][len(PHASE_PREFIX) :])
            for e in events
            if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)
        ),
    )
    phase_starts = [p[0] for p in phases]

    def instance_at(ts: float) -> int | None:
        i = bisect.bisect_right(phase_starts, ts) - 1
        return i if i >= 0 and ts <= phases[i][1] else None

    def phase_at(ts: float) -> str:
        i = instance_at(ts)
        return "other" if i is None else phases[i][2]

    launch_instance = {
        e["args"]["correlation"]: instance_at(e["ts"])
        for e in events
        if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
    }

    def instance_of(kernel: dict) -> int | None:
        return launch_instance.get(kernel.get("args", {}).get("correlation"))

    def launched_in(kernel: dict) -> str:
        i = instance_of(kernel)
        return "other" if i is None else phases[i][2]

    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    lines = [f"{len(steps)} profiled steps (rank 0)"]
    if steps:
        wall = sum(e["dur"] for e in steps) / len(steps)
        lines.append(f"mean step wall time (CPU): {wall / 1e3:.1f} ms")
    cpu = defaultdict(float)
    for start, end, name in phases:
        cpu[name] += end - start
    if not device:
        lines.append("no device activity recorded (CPU run)")
        lines += [f"  {name:<20} CPU {t / 1e3 / max(len(steps), 1):8.2f} ms/step" for name, t in cpu.items()]
        return "\n".join(lines) + "\n"

    n = max(len(steps), 1)
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in device if not is_communication(e["name"])])
    comm = union([(e["ts"], e["ts"] + e["dur"]) for e in device if is_communication(e["name"])])
    busy = union(compute + comm)
    span = device[-1]["ts"] + device[-1]["dur"] - device[0]["ts"]
    lines += [
        f"GPU window {span / 1e3 / n:.1f} ms/step: compute busy {length(compute) / 1e3 / n:.1f}, "
        f"communication busy {length(comm) / 1e3 / n:.1f} (exposed, no compute beside it: "
        f"{subtract(comm, compute) / 1e3 / n:.1f}), idle {(span - length(busy)) / 1e3 / n:.1f} ms/step",
        "",
        "by phase (launched inside record_function 'muonrun.<phase>'), per step; its GPU window runs from its",
        "first kernel's start to its last one's end; idle is the window's time with no stream busy, the GPU",
        "waiting on the host's launches (the profiler slows the host: an upper bound for an unprofiled run); lag",
        "is how long after the host entered the phase the GPU began it (large: the host runs ahead, launches queue)",
        f"  {'phase':<20} {'CPU ms':>9} {'GPU compute ms':>15} {'GPU comm ms':>12} {'window ms':>10} {'idle ms':>8}"
        f" {'lag ms':>8}",
    ]
    gpu_compute, gpu_comm = defaultdict(float), defaultdict(float)
    extent: dict[int, list[float]] = {}  # phase instance -> [first kernel start, last kernel end]
    for e in device:
        (gpu_comm if is_communication(e["name"]) else gpu_compute)[launched_in(e)] += e["dur"]
        i = instance_of(e)
        if i is not None:
            lo_hi = extent.setdefault(i, [e["ts"], e["ts"] + e["dur"]])
            lo_hi[1] = max(lo_hi[1], e["ts"] + e["dur"])
    window, idle, lag = defaultdict(float), defaultdict(float), defaultdict(float)
    for i, (lo, hi) in extent.items():
        window[phases[i][2]] += hi - lo
        idle[phases[i][2]] += subtract([(lo, hi)], busy)
        lag[phases[i][2]] += lo - phases[i][0]
    for name in sorted(set(cpu) | set(gpu_compute) | set(gpu_comm), key=lambda k: -gpu_compute[k]):
        lines.append(
            f"  {name:<20} {cpu[name] / 1e3 / n:9.2f} {gpu_compute[name] / 1e3 / n:15.2f} "
            f"{gpu_comm[name] / 1e3 / n:12.2f} {window[name] / 1e3 / n:10.2f} {idle[name] / 1e3 / n:8.2f}"
            f" {lag[name] / 1e3 / n:8.2f}"
        )
    regions = per_module_host_time(events)
    lines += [
        "",
        "host time in FSDP2's hooks and compiled regions (per wrapped module, whatever its size; nested), per step:",
    ]
    lines += [
        f"  {t / 1e3 / n:8.2f} ms  {calls / n:5.1f} calls  {name[:90]}" for t, calls, name in regions[:8]
    ]
    if not regions:
        lines.append("  none")
    waits = host_waits(events, phase_at)
    lines += ["", "host waits for the GPU (synchronize calls, by phase and the op that made them), per step:"]
    lines += [
        f"  {t / 1e3 / n:8.2f} ms  {calls / n:5.1f} calls  {where[:90]}" for t, calls, where in waits[:10]
    ]
    if not waits:
        lines.append("  none")
    gaps = []
    for before, after in zip(busy, busy[1:], strict=False):
        if after[0] - before[1] >= MIN_GAP_US:
            gaps.append((after[0] - before[1], before[1], after[0]))
    starts = [e["ts"] for e in device]
    lines += ["", f"largest idle gaps (all streams idle >= {MIN_GAP_US / 1e3:.1f} ms), {len(gaps)} in all:"]
    for gap, _, resume in sorted(gaps, reverse=True)[:12]:
        nxt = device[bisect.bisect_left(starts, resume)]
        lines.append(f"  {gap / 1e3:7.2f} ms, then [{launched_in(nxt)}] {nxt['name'][:90]}")
    # By launching phase too: "which kernels make the optimizer step slow" is the usual question.
    kernels = defaultdict(float)
    for e in device:
        kernels[launched_in(e), e["name"][:90]] += e["dur"]
    lines += ["", "top device kernels, [launching phase], ms/step:"]
    lines += [
        f"  {t / 1e3 / n:8.2f}  [{phase}] {name}"
        for (phase, name), t in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(summarize(load_events(Path(sys.argv[1]))), end="")
