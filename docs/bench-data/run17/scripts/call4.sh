#!/usr/bin/env bash
# Session 5, call 4: sync_each_step as an explicit stream sync after the clip (new) vs the pageable
# copies of HEAD bdd9eaa (old, in old/), Muon at 1.5B and 7B; GPU tests first.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD
echo "== tests $(date +%T)"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/gpu-tests.txt 2>&1
tail -2 $OUT/gpu-tests.txt
M=train.micro_batch_size=16
NS="--variant muon:optimizer.name=muon,$M"
S="--variant muon-sync:optimizer.name=muon,$M,train.sync_each_step=true"
b() { # b new|old TAG SIZE STEPS WARMUP VARIANTS...
  local which=$1 tag=$2 size=$3 steps=$4 warm=$5; shift 5
  local src=$root; [ $which = old ] && src=$root/old
  echo "== $which $tag $size $(date +%T)"
  (cd $src && PYTHONPATH=/tmp/site:$src BASELINES= STEPS=$steps WARMUP=$warm VARIANTS="$*" \
     timeout 200 bash $root/scripts/gpu_bench.sh $OUT/r17d/$which-$tag $size 2>&1 | grep -E "^│")
}
b new 1 1.5b 10 5 $NS $S
b old 1 1.5b 10 5 $S
b new 2 1.5b 10 5 $S $NS
b new 3 7b 8 4 --variant muon-sync:optimizer.name=muon
b old 3 7b 8 4 --variant muon-sync:optimizer.name=muon
echo "== done $(date +%T)"
tar czf $OUT/r17d.tgz --exclude="*.json.gz" -C $OUT r17d && rm -rf $OUT/r17d
