#!/usr/bin/env bash
# Newton–Schulz's cost on a GPU at its power cap: step time, optimizer time, mean SM clock and power of
# each run, 1.5B on one GPU ([v]'s model and data), nvidia-smi sampled beside it (bench_power.sh).
#   bash benchmarks/bench_ns_energy.sh OUT_DIR
# 1. AdamW, Muon and Muon with optimizer.muon.lr=0 (its weights never move), round-robin: whether Muon's
#    step outside the optimizer is longer, and whether the weights' values are why ([v4]).
# 2. Muon with benchmarks/ns_triton.py's upper-triangle products (about a third fewer Newton–Schulz
#    FLOPs, slower per FLOP than cuBLAS; benchmarks/ns_energy_hook), the same runs ([v5]).
# Env: REPEAT (2). Prints each bench's table and one line per run; OUT_DIR/{torch,triton} keep the runs.
set -uo pipefail
out=${1:?usage: bench_ns_energy.sh OUT_DIR}
here=$(cd "$(dirname "$0")" && pwd)
run=(qwen2-adamw-fsdp2 data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0
  data.seq_len=2048 train.micro_batch_size=16 model.hf.hidden_size=1536 model.hf.intermediate_size=8960
  model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12 --steps 6 --warmup 4 --repeat "${REPEAT:-2}")
muon=optimizer.name=muon,optimizer.muon.gram_ns=true
bash "$here/bench_power.sh" "$out/torch" "${run[@]}" --variant adamw --variant "muon:$muon" \
  --variant "muon-lr0:$muon,optimizer.muon.lr=0" || echo "bench_ns_energy.sh: the first bench failed" >&2
MUONRUN_STUDY_PRODUCTS=triton PYTHONPATH="$here/ns_energy_hook${PYTHONPATH:+:$PYTHONPATH}" \
  bash "$here/bench_power.sh" "$out/triton" "${run[@]}" --variant "muon-triton:$muon" \
  || echo "bench_ns_energy.sh: the Triton bench failed" >&2
