#!/usr/bin/env bash
# GRPO against Dr.GRPO on the quickstart setting (same seed, same prompts at step 0), then one figure.
#
#   scripts/compare_grpo_drgrpo.sh STEPS [OUT_DIR] [dotted.key=value ...]
#
# Writes OUT_DIR/grpo and OUT_DIR/dr_grpo (run dirs with metrics.jsonl; OUT_DIR defaults to
# runs/compare) and OUT_DIR/compare.png; notebooks/compare_runs.ipynb reads the same dirs.
# Extra overrides go to both runs. Running again with a larger STEPS resumes both runs from
# their checkpoints. Each step of the quickstart takes on the order of a minute on a 2-core CPU.
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 STEPS [OUT_DIR] [dotted.key=value ...]  (STEPS: a positive integer, got '${1:-}')" >&2
  exit 2
fi
steps=$1
out_dir=${2:-runs/compare}
shift $(( $# >= 2 ? 2 : 1 ))
python=${PYTHON:-python}
config=${CONFIG:-configs/quickstart.yaml}

for algorithm in grpo dr_grpo; do
  echo "== $algorithm: $steps steps into $out_dir/$algorithm" >&2
  "$python" -m drgrpo_jax.train --config "$config" "algorithm.name=$algorithm" "train.steps=$steps" \
    "run.output_dir=$out_dir/$algorithm" "$@"
done
"$python" scripts/plot_run.py "$out_dir/grpo" "$out_dir/dr_grpo" --labels GRPO Dr.GRPO -o "$out_dir/compare.png"
