#!/usr/bin/env bash
# Speed study on one GPU host: the hand-glued baseline and muonrun variants side by side, one call.
#   bash scripts/gpu_bench.sh OUT_DIR [0.5b|1.5b|7b ...]
# Env: STEPS, WARMUP, REPEAT (runs per variant, round-robin), VARIANTS (muonrun bench --variant flags),
# BASELINES (default "adamw torch_muon"; empty for none), BASELINE_EXTRA (e.g. --compile).
# Data: the Python standard library's source with the byte tokenizer (on every machine, offline);
# the 151,936-way Qwen2 LM head is kept, so the arithmetic matches the Qwen2 presets.
set -uo pipefail
out=${1:?usage: gpu_bench.sh OUT_DIR [sizes...]}; shift
sizes=${*:-0.5b 1.5b}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
data=(data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0 data.seq_len=2048 train.micro_batch_size=8)
declare -A arch=(
  [0.5b]=""
  [1.5b]="model.hf.hidden_size=1536 model.hf.intermediate_size=8960 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12"
  [7b]="model.hf.hidden_size=3584 model.hf.intermediate_size=18944 model.hf.num_hidden_layers=28 model.hf.num_attention_heads=28 model.hf.num_key_value_heads=4 model.hf.tie_word_embeddings=false model.hf.vocab_size=152064 train.micro_batch_size=8 parallel.activation_checkpointing=selective"
)
for size in $sizes; do
  extra=${BASELINE_EXTRA:-}
  for opt in ${BASELINES-adamw torch_muon}; do
    torchrun --standalone --nproc-per-node "$ngpu" scripts/baseline_fsdp2.py --model "$size" --optimizer "$opt" \
      --out "$out/baseline.jsonl" $extra 2>&1 | grep -v Warning | tail -3
  done
  # shellcheck disable=SC2086
  python3 -m muonrun bench qwen2-adamw-fsdp2 "${data[@]}" ${arch[$size]} --steps "${STEPS:-10}" --warmup "${WARMUP:-5}" --repeat "${REPEAT:-1}" \
    ${VARIANTS:---variant adamw --variant muon:optimizer.name=muon} \
    --out "$out/bench-$size/results.json" 2>&1 | grep -vE "Warning|warn" | tail -25
done
