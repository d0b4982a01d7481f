#!/usr/bin/env bash
# Session 7, call 2: what Muon's extra time at 1.5B is made of. AdamW vs Muon+Gram vs Muon+Gram with
# ns_steps=0 (everything but Newton–Schulz: momentum, exchange, update), round-robin x2; then one
# profile of Muon+Gram split by kernel category (phase_split.py).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
M=train.micro_batch_size=16; G=optimizer.muon.gram_ns=true
echo "== bench 1.5b $(date +%T)"
BASELINES= STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant adamw:$M --variant muon-gram:optimizer.name=muon,$M,$G --variant muon-ns0:optimizer.name=muon,$M,optimizer.muon.ns_steps=0" \
  timeout 380 bash scripts/gpu_bench.sh $OUT/r19b 1.5b | grep -vE "^step|muonrun (versions|git)"
echo "== profile $(date +%T)"
BASELINES= STEPS=4 WARMUP=4 \
  VARIANTS="--variant prof-muon-gram:optimizer.name=muon,$M,$G,logging.profile=true --variant prof-adamw:$M,logging.profile=true" \
  timeout 150 bash scripts/gpu_bench.sh $OUT/r19b/prof 1.5b | grep -E "│"
for v in prof-muon-gram prof-adamw; do
  t=$(find $OUT/r19b/prof -path "*$v/profile/*" -name "*.json.gz" | head -1); echo "--- $v $t"
  for ph in optimizer forward_backward; do python3 phase_split.py "$t" $ph | tee -a $OUT/r19b/phase-split-$v.txt; done
done
echo "== done $(date +%T)"
tar czf $OUT/r19-call2.tgz --exclude="*.json.gz" -C $OUT r19b && rm -rf $OUT/r19b
