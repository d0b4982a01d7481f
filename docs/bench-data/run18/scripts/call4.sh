#!/usr/bin/env bash
# Session 6, call 4: the step-time fix (a logged step's window ends at its clock read) and
# train.sync_each_step removed: GPU tests, then 1.5B AdamW vs Muon vs Muon Gram NS, round-robin x2.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "== tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/gpu-tests.txt 2>&1
tail -2 $OUT/gpu-tests.txt
echo "== bench $(date +%T)"
M=train.micro_batch_size=16; G=optimizer.muon.gram_ns=true
BASELINES= STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant adamw:$M --variant muon:optimizer.name=muon,$M --variant muon-gram:optimizer.name=muon,$M,$G" \
  timeout 380 bash scripts/gpu_bench.sh $OUT/r18d 1.5b | grep -vE "^step|muonrun (versions|git)"
echo "== done $(date +%T)"
tar czf $OUT/r18d.tgz --exclude="*.json.gz" -C $OUT r18d && rm -rf $OUT/r18d
