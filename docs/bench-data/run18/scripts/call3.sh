#!/usr/bin/env bash
# Session 6, call 3: which pageable copy makes Muon at 1.5B faster with train.sync_each_step=true?
# Temporary hook (not committed, see hooks.md): a variant whose name holds "synca" keeps only the
# agreement's copy (before the optimizer step, every step); "syncm" keeps only the metrics' copy (after
# the step's loss all-reduce, on logged steps = every step in bench). muon = no copy, muon-sync = both.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
grep -n "HOOK" muonrun/*.py
M=train.micro_batch_size=16; S=train.sync_each_step=true
BASELINES= STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant muon:optimizer.name=muon,$M --variant muon-sync:optimizer.name=muon,$M,$S --variant muon-synca:optimizer.name=muon,$M,$S --variant muon-syncm:optimizer.name=muon,$M,$S" \
  timeout 420 bash scripts/gpu_bench.sh $OUT/r18c 1.5b | grep -vE "^step|muonrun (versions|git)"
echo "== done $(date +%T)"
tar czf $OUT/r18c.tgz --exclude="*.json.gz" -C $OUT r18c && rm -rf $OUT/r18c
