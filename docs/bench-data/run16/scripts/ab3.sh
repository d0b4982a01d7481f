#!/usr/bin/env bash
# Session 4, second call (temporary): profiles of the new 0.5B step; 7B old vs new, AdamW and Muon.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
root=$PWD
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0 data.seq_len=2048)
b7="model.hf.hidden_size=3584 model.hf.intermediate_size=18944 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=28 model.hf.num_key_value_heads=4 model.hf.tie_word_embeddings=false model.hf.vocab_size=152064 train.micro_batch_size=8 parallel.activation_checkpointing=selective"
bench() { # bench old|new NAME STEPS WARMUP [overrides...] -- variants
  local which=$1 name=$2 steps=$3 warmup=$4; shift 4
  local src=$root; [ "$which" = old ] && src=$root/old
  echo "== $which $name $(date +%T)"
  (cd "$src" && PYTHONPATH=/tmp/site:$src python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" "$@" --steps $steps --warmup $warmup \
     --out "$OUT/r17/$name/results.json" 2>&1 | grep -vE "Warning|warn" | tail -7)
}
bench old prof7-old 4 4 $b7 --variant prof-old-muon:optimizer.name=muon,logging.profile=true
bench new prof7-new 4 4 $b7 --variant prof-new-muon:optimizer.name=muon,logging.profile=true
cd $OUT && tar czf r17.tgz --exclude="*.json.gz" --exclude="*.pt.trace.json" r17 && rm -rf r17
