#!/usr/bin/env bash
# Session 7, call 6, on nvidia-h200-x4 (4 x H200, lent late in the session; 5 minutes of device time were left):
# 1.5B AdamW vs Muon+Gram at micro-batch 16, one round, 6 steps after 3 warm-up.
# Run as one command line (after the wheel install); the rows were copied out of $OUT/r19e before it was removed.
export HF_HUB_OFFLINE=1
M=train.micro_batch_size=16
BASELINES= STEPS=6 WARMUP=3 VARIANTS="--variant adamw:$M --variant muon-gram:optimizer.name=muon,$M,optimizer.muon.gram_ns=true" \
  timeout 190 bash scripts/gpu_bench.sh $OUT/r19e 1.5b 2>&1 | grep -vE "^step" | tee $OUT/r19e-out.txt
