#!/usr/bin/env bash
# Mixed precision against fp32 on gpt_wt2 for one whole epoch (issue 12, part 1: final quality), 2 workers,
# one run after the other on an otherwise idle machine: fp32 and bf16 (fp16's 100-step run is in
# precision_runs.sh). Results: benchmarks/results/precision/gpt_wt2_epoch_*.summary.json and a table on stdout.
#   PARATRAIN_DATA=../shared/data bash benchmarks/precision_gpt_epoch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/precision
RUNS=${RUNS:-/tmp/precision-runs}
source benchmarks/_runs_lib.sh
for p in fp32 bf16; do
  paratrain train configs/gpt_wt2.toml --nproc 2 --set train.epochs=1 --set train.checkpoint_every=0 \
    --set "train.precision=\"$p\"" --run-dir "$RUNS/gpt_wt2_epoch_$p" > "$OUT/gpt_wt2_epoch_$p.log" 2>&1
  keep "gpt_wt2_epoch_$p"
done
python benchmarks/_table.py "$OUT" gpt_wt2_epoch_fp32 gpt_wt2_epoch_bf16 -- steps words_per_s words_per_s/ valid_ppl \
  test_ppl nonfinite_steps train_step_ms
