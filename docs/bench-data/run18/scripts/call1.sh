#!/usr/bin/env bash
# Session 6, call 1: GPU tests (first GPU run of the Gram-NS and local-shard clip cases);
# 1.5B AdamW vs Muon (sync) vs Muon Gram NS (sync / no sync), round-robin, two repeats.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "== tests $(date +%T)"
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/gpu-tests.txt 2>&1
tail -4 $OUT/gpu-tests.txt
echo "== bench $(date +%T)"
M=train.micro_batch_size=16; S=train.sync_each_step=true; G=optimizer.muon.gram_ns=true
BASELINES= STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant adamw:$M --variant muon-sync:optimizer.name=muon,$M,$S --variant muon-gram-sync:optimizer.name=muon,$M,$S,$G --variant muon-gram:optimizer.name=muon,$M,$G" \
  timeout 400 bash scripts/gpu_bench.sh $OUT/r18 1.5b | grep -vE "^step|muonrun (versions|git)"
echo "== done $(date +%T)"
tar czf $OUT/r18-1.5b.tgz --exclude="*.json.gz" -C $OUT r18 && rm -rf $OUT/r18
