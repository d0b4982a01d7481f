#!/usr/bin/env bash
# Session 5, call 3: is the no-sync Muon slowdown the caching allocator? alloc retries now logged;
# the same variants with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=train.micro_batch_size=16
V15="--variant muon:optimizer.name=muon,$M --variant muon-sync:optimizer.name=muon,$M,train.sync_each_step=true"
V7="--variant muon:optimizer.name=muon,train.sync_each_step=false --variant muon-sync:optimizer.name=muon,train.sync_each_step=true"
for alloc in default es; do
  [ $alloc = es ] && export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  echo "== 1.5b $alloc $(date +%T)"
  BASELINES= STEPS=10 WARMUP=5 VARIANTS="$V15" timeout 200 bash scripts/gpu_bench.sh $OUT/r17c/$alloc 1.5b | grep -vE "^step|muonrun (versions|git)"
done
echo "== 7b es $(date +%T)"
BASELINES= STEPS=8 WARMUP=4 VARIANTS="$V7" timeout 240 bash scripts/gpu_bench.sh $OUT/r17c/es 7b | grep -vE "^step|muonrun (versions|git)"
echo "== done $(date +%T)"
tar czf $OUT/r17c.tgz --exclude="*.json.gz" -C $OUT r17c && rm -rf $OUT/r17c
