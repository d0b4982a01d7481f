#!/usr/bin/env bash
# Session 6, call 5: Gram vs standard Newton–Schulz quality, Muon preset (Qwen2-0.5B, micro-batch 16),
# 200 steps each on the stdlib bytes, same seed and data order; loss every 10 steps.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for v in standard gram; do
  echo "== $v $(date +%T)"
  extra=(); [ $v = gram ] && extra=(optimizer.muon.gram_ns=true)
  timeout 150 python3 -m muonrun pretrain qwen2-muon-fsdp2 data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' \
    data.seq_len=2048 train.eval_interval=0 train.max_steps=200 checkpoint.interval=0 checkpoint.save_at_end=false \
    logging.console=plain output_dir=$OUT/q/$v "${extra[@]}" 2>&1 | grep -E "^step +(10|50|100|150|200)/"
done
echo "== done $(date +%T)"
tar czf $OUT/q.tgz -C $OUT q && rm -rf $OUT/q
