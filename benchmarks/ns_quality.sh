#!/usr/bin/env bash
# Does Muon with the current Newton–Schulz defaults (or a CANDIDATE lever) train as the reference
# evaluation does? One GPU.
#   bash benchmarks/ns_quality.sh OUT_DIR                        one seed (42)
#   SEEDS="42 43 44 45" bash benchmarks/ns_quality.sh OUT_DIR    each seed into OUT_DIR/seed-S, then the means
#   RUNS= bash benchmarks/ns_quality.sh OUT_DIR [OUT_DIR...]     compare runs already made, one folder per seed
# 1. A 1.5B Qwen2 (the presets' recipe: qwen2-muon-fsdp2 with the 1.5B shape of scripts/gpu_bench.sh,
#    byte data on the Python standard library, seq 2048, micro-batch 8), 300 steps: the reference
#    evaluation twice (REFERENCE: unfused step, torch's products, the norm divided by its own pass, the
#    Gram form's restart from X, no float8), then the defaults. Two runs of one evaluation with one seed
#    and one data order still part (nondeterministic GPU kernels, amplified where the loss falls fastest),
#    so the check prints how far the two references are apart beside how far the defaults are from the
#    first. Passes when the defaults' loss at every 10th step is within 1% of the reference's, or within
#    the references' own largest difference where that is more. One pair only estimates that spread: on
#    an H200 the defaults run twice parted by 1.08%, the two references by 0.56% (docs/performance.md,
#    [v6]). So it also compares the mean loss over the last third of the run, within 0.5% (or the
#    references' own).
# 2. The optimizer study's Muon and NorMuon (101M, lr 0.01, seed 42, 1,000 steps) with the defaults,
#    run beside the 1.5B runs: passes when each final eval loss is within 0.5% of docs/data/study's
#    (seed 42), or of the same study run without CANDIDATE made in the same folder (RUNS's study-base).
# 3. Several seeds (SEEDS, or several OUT_DIRs): a lever that changes the iteration changes the whole
#    trajectory, and one seed's pair parts by 1-3% either way (docs/performance.md, [v10]); the means over
#    the seeds of each signed difference are held to the same bounds, and the count of seeds on which
#    the candidate's loss is higher says whether a difference is consistent.
# Env: STEPS (300), REFERENCE (overrides of the reference runs), CANDIDATE (overrides of the runs it
# checks: the 1.5B defaults run and the study runs; e.g. a Newton–Schulz lever before it becomes a
# default), EXTRA (overrides of every run), RUNS (which runs to make, default "reference reference-2
# defaults study", with SEEDS "reference defaults study study-base"; the comparison reads whichever of
# them OUT_DIR holds, so runs made in separate calls can be compared: RUNS= compares only), SEEDS.
set -uo pipefail
out=${1:?usage: ns_quality.sh OUT_DIR [OUT_DIR...]}
export PYTHONUNBUFFERED=1
here=$(cd "$(dirname "$0")/.." && pwd)
reference=${REFERENCE:-optimizer.muon.fused=false optimizer.muon.ns_products=torch optimizer.muon.ns_fold_norm=false optimizer.muon.ns_split_restart=false}
candidate=${CANDIDATE:-}
extra=${EXTRA:-}
seeds=${SEEDS:-}
if [[ -n $seeds ]]; then
  runs=" ${RUNS-reference defaults study study-base} "
else
  runs=" ${RUNS-reference reference-2 defaults study} "
fi
big=(qwen2-muon-fsdp2 data.tokenizer=byte 'data.sources=[{path: "${stdlib:}/*.py"}]' train.eval_interval=0
  data.seq_len=2048 train.micro_batch_size=8 model.hf.hidden_size=1536 model.hf.intermediate_size=8960
  model.hf.num_hidden_layers=28 model.hf.num_attention_heads=12 "train.max_steps=${STEPS:-300}"
  logging.log_interval=10 checkpoint.interval=0 checkpoint.save_at_end=false logging.console=plain)

run_all() {  # run_all DIR SEED: the runs RUNS names, into DIR
  local dir=$1 seed=$2 v run overrides
  mkdir -p "$dir"
  # The study runs share the GPU with the 1.5B runs (only their losses are compared).
  for v in muon normuon; do
    if [[ $runs == *" study "* ]]; then
      # shellcheck disable=SC2086
      python3 -m muonrun pretrain "study-$v" optimizer.muon.lr=0.01 train.seed="$seed" $candidate $extra \
        output_dir="$dir/study-$v" logging.console=plain >"$dir/study-$v.log" 2>&1 \
        || echo "ns_quality.sh: study-$v failed: $dir/study-$v.log" >&2 &
    fi
    if [[ $runs == *" study-base "* ]]; then
      # shellcheck disable=SC2086
      python3 -m muonrun pretrain "study-$v" optimizer.muon.lr=0.01 train.seed="$seed" $extra \
        output_dir="$dir/study-$v-base" logging.console=plain >"$dir/study-$v-base.log" 2>&1 \
        || echo "ns_quality.sh: study-$v-base failed: $dir/study-$v-base.log" >&2 &
    fi
  done
  for run in reference reference-2 defaults; do
    [[ $runs == *" $run "* ]] || continue
    overrides=$reference
    [[ $run == defaults ]] && overrides=$candidate
    # shellcheck disable=SC2086
    python3 -m muonrun pretrain "${big[@]}" train.seed="$seed" $overrides $extra output_dir="$dir/$run" \
      >"$dir/$run.log" 2>&1 || echo "ns_quality.sh: the $run run failed: $dir/$run.log" >&2
  done
  wait
}

dirs=("$@")
if [[ -n $seeds ]]; then
  dirs=()
  for s in $seeds; do
    run_all "$out/seed-$s" "$s"
    dirs+=("$out/seed-$s")
  done
elif [[ $# -eq 1 ]]; then
  run_all "$out" 42
fi
python3 "$here/benchmarks/ns_quality_compare.py" "$here/docs/data/study" "${dirs[@]}"
