#!/usr/bin/env bash
# Session 5, call 5 (temporary hook MUONRUN_SYNC_AT, not committed): where must the host wait? 1.5B Muon.
# Call 6: the same with MUONRUN_SYNC_AT=device (torch.cuda.synchronize(device) after the clip), STEPS=6 WARMUP=3.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S="--variant muon-sync:optimizer.name=muon,train.micro_batch_size=16,train.sync_each_step=true"
for at in device; do
  echo "== sync at $at $(date +%T)"
  MUONRUN_SYNC_AT=$at BASELINES= STEPS=6 WARMUP=3 VARIANTS="$S" timeout 100 bash scripts/gpu_bench.sh $OUT/r17e/$at 1.5b 2>&1 | grep -E "^│"
done
tar czf $OUT/r17e.tgz --exclude="*.json.gz" -C $OUT r17e && rm -rf $OUT/r17e
