#!/usr/bin/env bash
# `muonrun bench` with nvidia-smi sampled beside it (every 0.1 s: SM clock, power, throttle reasons,
# temperature), and one line per run: median step and optimizer time after the warm-up, the step outside
# the optimizer, and the GPU's mean clock and power over the measured steps. What shows whether a GPU runs
# at its power cap (throttle reason 0x4, SW power cap) and what Muon's products cost the rest of the step.
#   bash benchmarks/bench_power.sh OUT_DIR CONFIG [OVERRIDES] [--warmup N] --variant ... [bench options]
# The bench writes OUT_DIR/bench.json and a folder per run; OUT_DIR/smi.csv keeps the samples.
# docs/performance.md: rows S1 and S2.
set -uo pipefail
out=${1:?usage: bench_power.sh OUT_DIR CONFIG [bench arguments]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
warmup=
args=("$@")
for i in "${!args[@]}"; do
  [[ ${args[$i]} == --warmup ]] && warmup=${args[$((i + 1))]}
  [[ ${args[$i]} == --warmup=* ]] && warmup=${args[$i]#--warmup=}
done
if [[ -z $warmup ]]; then  # none given: pass one, so the steps dropped below are the ones the bench drops
  warmup=5
  set -- "$@" --warmup "$warmup"
fi
( while true; do
    echo "$(date +%s.%N),$(nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active,temperature.gpu --format=csv,noheader,nounits)"
    sleep 0.1
  done ) >"$out/smi.csv" 2>/dev/null &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
python3 -m muonrun bench "$@" --out "$out/bench.json"
code=$?
kill $sampler 2>/dev/null
python3 - "$out" "$warmup" <<'PY'
import glob, json, statistics, sys
out, warmup = sys.argv[1], int(sys.argv[2])
samples = []  # (time, SM MHz, W, throttle reasons, C)
for line in open(f"{out}/smi.csv"):
    fields = [f.strip() for f in line.split(",")]
    try:
        samples.append((float(fields[0]), float(fields[1]), float(fields[2]), fields[3], float(fields[4])))
    except (ValueError, IndexError):
        pass
for metrics in sorted(glob.glob(f"{out}/*/metrics.jsonl")):
    rows = [r for r in map(json.loads, open(metrics)) if "step_time" in r and r["step"] > warmup]
    if not rows:
        continue
    t0, t1 = rows[0]["time"] - rows[0]["step_time"], rows[-1]["time"]
    window = [s for s in samples if t0 <= s[0] <= t1]
    name = metrics.split("/")[-2]
    step = statistics.median(r["step_time"] * 1000 for r in rows)
    optim = statistics.median(r.get("optimizer_step_time", 0.0) * 1000 for r in rows)
    gpu = (
        f"SM {statistics.mean(s[1] for s in window):,.0f} MHz, {statistics.mean(s[2] for s in window):.0f} W, "
        f"{statistics.mean(s[4] for s in window):.0f} C, throttle reasons {sorted({s[3] for s in window})}"
        if window else "no nvidia-smi samples"
    )
    print(f"{name:<16} step {step:6.1f} ms  optimizer {optim:5.1f} ms  outside it {step - optim:6.1f} ms  {gpu}")
PY
exit $code
