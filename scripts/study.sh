#!/usr/bin/env bash
# The AdamW-vs-Muon study in one command: a learning-rate sweep of each optimizer on the study
# presets (same tokens, seed and data order), then `muonrun compare` of the best of each.
#   bash scripts/study.sh OUT_DIR            (GPU host; runs two sweeps at a time, one per GPU)
# Knobs (environment): ADAMW_LRS, MUON_LRS, STEPS (train.max_steps), GPUS (how many run at once).
set -euo pipefail
out=${1:?usage: study.sh OUT_DIR}
adamw_lrs=${ADAMW_LRS:-5e-4 1e-3 2e-3 4e-3}
muon_lrs=${MUON_LRS:-0.005 0.01 0.02 0.04}
steps=${STEPS:-1000}
gpus=${GPUS:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
mkdir -p "$out"

jobs=()
for lr in $adamw_lrs; do jobs+=("study-adamw adamw-lr$lr optimizer.lr=$lr"); done
for lr in $muon_lrs; do jobs+=("study-muon muon-lr$lr optimizer.muon.lr=$lr"); done

i=0
for job in "${jobs[@]}"; do
  read -r preset name override <<<"$job"
  # One worker per GPU: the sweep points run side by side instead of one after another.
  CUDA_VISIBLE_DEVICES=$((i % gpus)) python3 -m muonrun pretrain "$preset" "$override" "name=$name" \
    "output_dir=$out/$name" "train.max_steps=$steps" logging.console=plain --nproc-per-node 1 \
    >"$out/$name.log" 2>&1 &
  i=$((i + 1))
  if ((i % gpus == 0)); then wait; fi
done
wait

# Best of each optimizer by final eval loss, then the comparison plot and table.
best=$(python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
best = {}
for run in sorted(out.iterdir()):
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").is_file() else []
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    if not evals:
        continue
    opt = run.name.split("-lr")[0]
    print(f"{run.name}: final eval loss {evals[-1]:.4f}", file=sys.stderr)
    if opt not in best or evals[-1] < best[opt][0]:
        best[opt] = (evals[-1], run)
print(" ".join(str(best[k][1]) for k in sorted(best)))
PY
)
# shellcheck disable=SC2086
python3 -m muonrun compare $best --out "$out/compare.png"
