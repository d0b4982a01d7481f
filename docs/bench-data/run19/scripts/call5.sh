#!/usr/bin/env bash
# Session 7, call 5 (same warm machine as call 4): 1.5B checkpoint save with 4 writer threads per rank.
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
timeout 200 torchrun --standalone --nproc-per-node 2 scripts/bench_checkpoint.py qwen2-adamw-fsdp2 model.hf.hidden_size=1536 \
  model.hf.intermediate_size=8960 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12 \
  --writer-threads 4 --no-export --out /tmp/ckb 2>&1 | grep BENCH; rm -rf /tmp/ckb
