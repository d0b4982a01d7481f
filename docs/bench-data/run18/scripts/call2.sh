#!/usr/bin/env bash
# Session 6, call 2: 0.5B preset, AdamW vs Muon vs Muon Gram NS (no sync, the preset default), round-robin x2;
# then the local-shard clip on the host-bound step (0.5B AdamW, micro-batch 8): HEAD vs 0b109d6 (torch's
# clip_grad_norm_), alternated new/old/new/old, one bench run each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
echo "== bench 0.5b $(date +%T)"
M=train.micro_batch_size=16; G=optimizer.muon.gram_ns=true
BASELINES= STEPS=10 WARMUP=5 REPEAT=2 \
  VARIANTS="--variant adamw:$M --variant muon:optimizer.name=muon,$M --variant muon-gram:optimizer.name=muon,$M,$G" \
  timeout 330 bash scripts/gpu_bench.sh $OUT/r18 0.5b | grep -vE "^step|muonrun (versions|git)"
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' data.seq_len=2048 train.micro_batch_size=8)
for i in 1 2; do
  for tree in new old; do
    echo "== clip $tree $i $(date +%T)"
    src=$PWD; [ $tree = old ] && src=$PWD/old
    (cd $src && export PYTHONPATH=/tmp/site:$src && python3 -c 'import muonrun.trainer as t; print(t.__file__)' &&
     timeout 100 python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" --steps 15 --warmup 5 \
      --variant adamw-mb8-$tree --out $OUT/r18/clip-$tree-$i/results.json 2>&1 | grep -E "│|clip")
  done
done
echo "== done $(date +%T)"
tar czf $OUT/r18-0.5b.tgz --exclude="*.json.gz" -C $OUT r18 && rm -rf $OUT/r18
