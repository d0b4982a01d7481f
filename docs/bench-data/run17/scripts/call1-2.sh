#!/usr/bin/env bash
# Session 5, call 1: GPU tests; 0.5B AdamW vs Muon (new default) vs Muon with sync_each_step, baseline in the same call.
# Call 2 ran this with SIZE=1.5b and the pytest line disabled (sed on the device); the tar line was added after call 1.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "== tests $(date +%T)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/gpu-tests.txt 2>&1
tail -4 $OUT/gpu-tests.txt
echo "== bench $(date +%T)"
M=train.micro_batch_size=16
BASELINES=adamw BASELINE_EXTRA=--compile STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant adamw:$M --variant muon:optimizer.name=muon,$M --variant muon-sync:optimizer.name=muon,$M,train.sync_each_step=true" \
  timeout 420 bash scripts/gpu_bench.sh $OUT/r17 ${SIZE:-0.5b}
echo "== done $(date +%T)"
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
tar czf $OUT/r17-${SIZE:-0.5b}.tgz --exclude="*.json.gz" -C $OUT r17 && rm -rf $OUT/r17
