#!/usr/bin/env bash
# Session 4 A/B (temporary, not committed): old = HEAD before the change, new = working tree.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD
if [ "${TESTS:-1}" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_model.py -m gpu > $OUT/gpu-tests.txt 2>&1
  tail -4 $OUT/gpu-tests.txt
fi
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0 data.seq_len=2048)
ab() { # ab old|new ROUND PRESET VARIANT...
  local which=$1 round=$2 preset=$3; shift 3
  local src=$root; [ "$which" = old ] && src=$root/old
  echo "== $which round $round $(date +%T)"
  (cd "$src" && PYTHONPATH=/tmp/site:$src python3 -m muonrun bench "$preset" "${data[@]}" ${ARCH:-} --steps ${STEPS:-8} --warmup ${WARMUP:-4} \
     "$@" --out "$OUT/$which-r$round/results.json" 2>&1 | grep -vE "Warning|warn" | tail -7)
}
for r in ${ROUNDS:-1 2}; do
  for w in old new; do
    ab $w $r qwen2-adamw-fsdp2 --variant $w-mb8:train.micro_batch_size=8 --variant $w-mb16:train.micro_batch_size=16
  done
done
