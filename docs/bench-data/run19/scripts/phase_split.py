"""Split one phase's GPU kernel time (rank 0's trace) into categories: python phase_split.py TRACE [PHASE]."""

import bisect
import sys
from collections import defaultdict
from pathlib import Path

from muonrun.timeline import DEVICE_CATEGORIES, LAUNCH_CATEGORIES, PHASE_PREFIX, load_events

CATEGORIES = [
    ("nccl", ("nccl",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "bmm")),
    ("foreach (multi_tensor_apply)", ("multi_tensor_apply",)),
    ("norm / reduce", ("reduce_kernel", "norm")),
    ("copy / cat", ("copy", "cat", "memcpy", "Memcpy", "memset", "Memset", "fill")),
    ("elementwise", ("elementwise",)),
]


def category(name: str) -> str:
    return next((c for c, keys in CATEGORIES if any(k in name for k in keys)), "other")


events = load_events(Path(sys.argv[1]))
want = sys.argv[2] if len(sys.argv) > 2 else "optimizer"
steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
n = max(len(steps), 1)
phases = sorted(
    (e["ts"], e["ts"] + e["dur"], e["name"][len(PHASE_PREFIX) :])
    for e in events
    if e.get("cat") == "user_annotation" and e["name"].startswith(PHASE_PREFIX)
)
starts = [p[0] for p in phases]


def phase_at(ts):
    i = bisect.bisect_right(starts, ts) - 1
    return phases[i][2] if i >= 0 and ts <= phases[i][1] else "other"


launch = {
    e["args"]["correlation"]: phase_at(e["ts"])
    for e in events
    if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})
}
by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
for e in events:
    if e.get("cat") in DEVICE_CATEGORIES and launch.get(e.get("args", {}).get("correlation")) == want:
        c = category(e["name"])
        by_cat[c] += e["dur"]
        by_name[c, e["name"][:100]] += e["dur"]
        count[c] += 1
print(f"[{want}] GPU kernel time by category, ms/step ({n} steps):")
for c, t in sorted(by_cat.items(), key=lambda kv: -kv[1]):
    print(f"  {t / 1e3 / n:8.2f}  {count[c] / n:7.1f} kernels  {c}")
print(f"  {sum(by_cat.values()) / 1e3 / n:8.2f}  total")
print("top kernels:")
for (c, name), t in sorted(by_name.items(), key=lambda kv: -kv[1])[:20]:
    print(f"  {t / 1e3 / n:8.2f}  {c:<14} {name}")
