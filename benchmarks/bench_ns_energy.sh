#!/usr/bin/env bash
# Newton–Schulz's cost on a GPU at its power cap: step time, optimizer time, mean SM clock and power of
# each run, 1.5B on one GPU ([v]'s model and data), nvidia-smi sampled every 0.2 s beside it.
#   bash benchmarks/bench_ns_energy.sh OUT_DIR
# 1. AdamW, Muon and Muon with optimizer.muon.lr=0 (its weights never move), round-robin: whether Muon's
#    step outside the optimizer is longer, and whether the weights' values are why ([v4]).
# 2. Muon with benchmarks/ns_triton.py's upper-triangle products (about a third fewer Newton–Schulz
#    FLOPs, slower per FLOP than cuBLAS; benchmarks/ns_energy_hook), the same runs ([v5]).
# Env: REPEAT (2). Prints one line per run and each bench's table; OUT_DIR keeps the runs and smi.csv.
set -uo pipefail
out=${1:?usage: bench_ns_energy.sh OUT_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
run=(qwen2-adamw-fsdp2 data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0
  data.seq_len=2048 train.micro_batch_size=16 model.hf.hidden_size=1536 model.hf.intermediate_size=8960
  model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12 --steps 6 --warmup 4 --repeat "${REPEAT:-2}")
muon=optimizer.name=muon,optimizer.muon.gram_ns=true
( while true; do
    echo "$(date +%s.%N),$(nvidia-smi --query-gpu=clocks.sm,power.draw,clocks_throttle_reasons.active --format=csv,noheader,nounits)"
    sleep 0.2
  done ) >"$out/smi.csv" 2>/dev/null &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
python3 -m muonrun bench "${run[@]}" --variant adamw --variant "muon:$muon" --variant "muon-lr0:$muon,optimizer.muon.lr=0" \
  --out "$out/torch/bench.json" || echo "bench_ns_energy.sh: the first bench failed" >&2
MUONRUN_STUDY_PRODUCTS=triton PYTHONPATH="$here/ns_energy_hook${PYTHONPATH:+:$PYTHONPATH}" \
  python3 -m muonrun bench "${run[@]}" --variant "muon-triton:$muon" --out "$out/triton/bench.json" \
  || echo "bench_ns_energy.sh: the Triton bench failed" >&2
kill $sampler 2>/dev/null
python3 - "$out" 4 <<'PY'
import glob, json, statistics, sys
out, warmup = sys.argv[1], int(sys.argv[2])
samples = []
for line in open(f"{out}/smi.csv"):
    fields = [f.strip() for f in line.split(",")]
    try:
        samples.append((float(fields[0]), float(fields[1]), float(fields[2]), fields[3]))
    except (ValueError, IndexError):
        pass
for metrics in sorted(glob.glob(f"{out}/*/*/metrics.jsonl")):
    rows = [r for r in map(json.loads, open(metrics)) if "step_time" in r and r["step"] > warmup]
    if not rows:
        continue
    t0, t1 = rows[0]["time"] - rows[0]["step_time"], rows[-1]["time"]
    window = [s for s in samples if t0 <= s[0] <= t1]
    name = metrics.split("/")[-2]
    step = statistics.median(r["step_time"] * 1000 for r in rows)
    optim = statistics.median(r["optimizer_step_time"] * 1000 for r in rows)
    power = (f"SM clock {statistics.mean(s[1] for s in window):,.0f} MHz, {statistics.mean(s[2] for s in window):.0f} W,"
             f" throttle reasons {sorted({s[3] for s in window})}") if window else "no nvidia-smi samples"
    print(f"{name:<14} step {step:6.1f} ms  optimizer {optim:5.1f} ms  outside it {step - optim:6.1f} ms  {power}")
PY
