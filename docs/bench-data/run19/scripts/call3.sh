#!/usr/bin/env bash
# Session 7, call 3: 7B architecture AdamW vs Muon vs Muon+Gram (the Muon preset's form now), one round;
# then AdamW on local shards at the 0.5B preset's micro-batch 16, HEAD vs bd49093, alternated twice more.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p $OUT/r19c
echo "== bench 7b $(date +%T)"
BASELINES= STEPS=8 WARMUP=4 \
  VARIANTS="--variant adamw --variant muon:optimizer.name=muon --variant muon-gram:optimizer.name=muon,optimizer.muon.gram_ns=true" \
  timeout 300 bash scripts/gpu_bench.sh $OUT/r19c 7b | grep -vE "^step|muonrun (versions|git)"
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' data.seq_len=2048 train.micro_batch_size=16)
for run in mb16-2 mb16-3; do
  for tree in new old; do
    echo "== adamw $tree $run $(date +%T)"
    src=$PWD; [ $tree = old ] && src=$PWD/old
    (cd $src && export PYTHONPATH=/tmp/site:$src && python3 -c 'import muonrun.optim.adamw' 2>/dev/null && echo "(has optim.adamw)";
     timeout 100 python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" --steps 15 --warmup 5 \
      --variant adamw-$run-$tree --out $OUT/r19c/adamw-$tree-$run/results.json 2>&1 | grep -E "│")
  done
done
echo "== done $(date +%T)"
tar czf $OUT/r19-call3.tgz --exclude="*.json.gz" -C $OUT r19c && rm -rf $OUT/r19c
