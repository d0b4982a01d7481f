#!/usr/bin/env bash
# Session 7, call 1: GPU tests (first GPU run of AdamW on local shards); AdamW on local shards A/B on the
# host-bound step (0.5B AdamW, micro-batch 8): HEAD vs bd49093 (torch's AdamW on DTensors), alternated
# new/old/new/old, then once each at micro-batch 16 (the preset); profile 1.5B AdamW and Muon+Gram.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p $OUT/r19
echo "== tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/r19/gpu-tests.txt 2>&1
tail -2 $OUT/r19/gpu-tests.txt
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' data.seq_len=2048)
for run in mb8-1 mb8-2 mb16-1; do
  mb=${run%-*}; mb=${mb#mb}
  for tree in new old; do
    echo "== adamw $tree $run $(date +%T)"
    src=$PWD; [ $tree = old ] && src=$PWD/old
    (cd $src && export PYTHONPATH=/tmp/site:$src && python3 -c 'import muonrun.optim.adamw' 2>/dev/null && echo "(has optim.adamw)";
     timeout 100 python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" train.micro_batch_size=$mb --steps 15 --warmup 5 \
      --variant adamw-$run-$tree --out $OUT/r19/adamw-$tree-$run/results.json 2>&1 | grep -E "│")
  done
done
echo "== profile 1.5b $(date +%T)"
M=train.micro_batch_size=16; P=logging.profile=true
BASELINES= STEPS=4 WARMUP=4 \
  VARIANTS="--variant prof-adamw:$M,$P --variant prof-muon-gram:optimizer.name=muon,$M,optimizer.muon.gram_ns=true,$P" \
  timeout 200 bash scripts/gpu_bench.sh $OUT/r19/prof 1.5b | grep -vE "^step|muonrun (versions|git)"
find $OUT/r19/prof -name timeline.txt | while read f; do echo "--- $f"; head -60 "$f"; done
echo "== done $(date +%T)"
tar czf $OUT/r19-call1.tgz --exclude="*.json.gz" -C $OUT r19 && rm -rf $OUT/r19
