#!/usr/bin/env bash
# Session 7, call 4: checkpoint save throughput vs DCP writer threads per rank (FileSystemWriter thread_count),
# 0.5B AdamW preset (1, 8, 4, 1 threads) and 1.5B (1, 8); the disk's raw write speed for reference.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p $OUT/r19d
df -h /tmp | tee $OUT/r19d/disk.txt
dd if=/dev/zero of=/tmp/ddtest bs=1M count=8192 conv=fsync 2>&1 | tail -1 | tee -a $OUT/r19d/disk.txt; rm -f /tmp/ddtest
nproc | tee -a $OUT/r19d/disk.txt
ck() { timeout 200 torchrun --standalone --nproc-per-node 2 scripts/bench_checkpoint.py qwen2-adamw-fsdp2 "$@" \
  --no-export --out /tmp/ckb 2>&1 | grep BENCH | tee -a $OUT/r19d/bench.txt; rm -rf /tmp/ckb; }
A15="model.hf.hidden_size=1536 model.hf.intermediate_size=8960 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12"
for t in 1 8 4 1; do echo "== 0.5b threads $t $(date +%T)"; ck --writer-threads $t; done
for t in 1 8; do echo "== 1.5b threads $t $(date +%T)"; ck $A15 --writer-threads $t; done
echo "== done $(date +%T)"
