#!/usr/bin/env bash
# The optimizer study in one command: a learning-rate sweep of AdamW, Muon and NorMuon on the study
# presets (same tokens, data order and seed within a seed), then `muonrun compare` of the best of each.
#   bash scripts/study.sh OUT_DIR            (GPU host)
#   STUDY=study-moe bash scripts/study.sh OUT_DIR   (the mixture-of-experts study)
# Knobs (environment): STUDY (the presets' prefix: STUDY-adamw, STUDY-muon, STUDY-normuon; default
# study), ADAMW_LRS, MUON_LRS, NORMUON_LRS (an empty list skips that optimizer), SEEDS (train.seed
# values, each sweep point runs once per seed), STEPS (train.max_steps; default the presets'), GPUS (how many
# GPUs), JOBS (how many runs at once, spread over the GPUs; more than GPUS shares a GPU between runs,
# which keeps a big GPU busy while another run starts or evaluates), EXTRA (overrides for every run),
# DOWNSTREAM (1, the default: every run also scores the multiple-choice tasks that muonrun.eval.text_tasks
# makes from the held-out model folders m*-n* into OUT_DIR/tasks, docs/evals.md; 0: the loss alone).
# The best learning rate of each optimizer is the one with the lowest final eval loss averaged over
# the seeds; the comparison shows the lowest seed's run at that learning rate.
set -euo pipefail
out=${1:?usage: study.sh OUT_DIR}
study=${STUDY:-study}
adamw_lrs=${ADAMW_LRS-1e-3 5e-4 2e-3}
muon_lrs=${MUON_LRS-0.01 0.005 0.02}
normuon_lrs=${NORMUON_LRS-0.01 0.005 0.02}
seeds=${SEEDS:-42}
steps=${STEPS:+train.max_steps=$STEPS}
gpus=${GPUS:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
jobs_at_once=${JOBS:-$gpus}
extra=${EXTRA:-}
mkdir -p "$out"
rm -f "$out/failed.txt"
tasks=()
if [[ ${DOWNSTREAM:-1} == 1 ]]; then
  held_out="$(python3 -c 'import pathlib, transformers; print(pathlib.Path(transformers.__file__).parent)')/models/[m-n]*/*.py"
  python3 -m muonrun.eval.text_tasks "$held_out" "$out/tasks" --examples 500
  tasks=("eval.tasks=[{name: ending, path: $out/tasks/ending.jsonl},{name: last_word, path: $out/tasks/last_word.jsonl}]")
fi

# Interleaved (AdamW, Muon, NorMuon at each list position in turn), so runs that go together finish
# together: list the learning rates you trust most first.
read -ra adamw <<<"$adamw_lrs"
read -ra muon <<<"$muon_lrs"
read -ra normuon <<<"$normuon_lrs"
longest=$(( ${#adamw[@]} > ${#muon[@]} ? ${#adamw[@]} : ${#muon[@]} ))
longest=$(( longest > ${#normuon[@]} ? longest : ${#normuon[@]} ))
jobs=()
for seed in $seeds; do
  for ((k = 0; k < longest; k++)); do
    [[ -n ${adamw[k]:-} ]] && jobs+=("$study-adamw adamw-lr${adamw[k]}-seed$seed optimizer.lr=${adamw[k]} train.seed=$seed")
    [[ -n ${muon[k]:-} ]] && jobs+=("$study-muon muon-lr${muon[k]}-seed$seed optimizer.muon.lr=${muon[k]} train.seed=$seed")
    [[ -n ${normuon[k]:-} ]] && jobs+=("$study-normuon normuon-lr${normuon[k]}-seed$seed optimizer.muon.lr=${normuon[k]} train.seed=$seed")
  done
done

i=0
failed=()
for job in "${jobs[@]}"; do
  read -r preset name overrides <<<"$job"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$((i % gpus)) python3 -m muonrun pretrain "$preset" $overrides $extra "${tasks[@]}" "name=$name" \
    "output_dir=$out/$name" $steps logging.console=plain --nproc-per-node 1 \
    >"$out/$name.log" 2>&1 || echo "$name" >>"$out/failed.txt" &
  i=$((i + 1))
  while (($(jobs -rp | wc -l) >= jobs_at_once)); do wait -n || true; done  # a pool: the next starts when one ends
done
wait
if [[ -s $out/failed.txt ]]; then
  mapfile -t failed <"$out/failed.txt"
  for name in "${failed[@]}"; do echo "study.sh: run $name failed; its log: $out/$name.log" >&2; done
fi

# Best learning rate of each optimizer by final eval loss (mean over seeds), then the comparison.
best=$(python3 - "$out" <<'PY'
import collections, json, pathlib, re, statistics, sys
out = pathlib.Path(sys.argv[1])
finals = collections.defaultdict(dict)  # (optimizer, lr) -> {seed: final eval loss}
for metrics in sorted(out.glob("*/metrics.jsonl")):
    match = re.fullmatch(r"(\w+)-lr(.+)-seed(\d+)", metrics.parent.name)
    evals = [json.loads(line).get("eval_loss") for line in metrics.read_text().splitlines()]
    evals = [e for e in evals if e is not None]
    if match and evals:
        finals[match[1], match[2]][int(match[3])] = evals[-1]
best = {}
for (opt, lr), by_seed in sorted(finals.items()):
    mean = statistics.fmean(by_seed.values())
    print(f"{opt} lr {lr}: final eval loss {mean:.4f} (seeds {sorted(by_seed)})", file=sys.stderr)
    if opt not in best or mean < best[opt][0]:
        best[opt] = (mean, out / f"{opt}-lr{lr}-seed{min(by_seed)}")
print(" ".join(str(best[k][1]) for k in ("adamw", "muon", "normuon") if k in best))
PY
)
# shellcheck disable=SC2086
python3 -m muonrun compare $best --out "$out/compare.png"
# A failed run is not part of the comparison: say so in the exit status too.
if ((${#failed[@]})); then exit 1; fi
