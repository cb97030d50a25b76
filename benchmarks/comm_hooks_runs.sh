#!/usr/bin/env bash
# Gradient compression against plain all-reduce (issue 12, part 5), one run after the other on an
# otherwise idle machine: ptb_small (lstm-lm), 1 epoch, 2 workers (allreduce, gloo), with
# dist.comm_hook = none, fp16, bf16, powersgd (rank 1 and 4, compression from step $START).
# Results: benchmarks/results/comm_hooks/ (metrics and summaries) and a table on stdout.
#   PARATRAIN_DATA=../shared/data bash benchmarks/comm_hooks_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/comm_hooks
RUNS=${RUNS:-/tmp/comm-hook-runs}
START=${START:-100}
source benchmarks/_runs_lib.sh
run() {  # name, extra --set arguments
  local name=$1; shift
  rm -rf "$RUNS/$name"
  paratrain train configs/ptb_small.toml --nproc 2 --set train.epochs=1 "$@" --run-dir "$RUNS/$name" \
    > "$OUT/$name.log" 2>&1
  keep "$name"
}
run none --set 'dist.comm_hook="none"'
run fp16 --set 'dist.comm_hook="fp16"'
run bf16 --set 'dist.comm_hook="bf16"'
for r in 1 4; do
  run "powersgd_r$r" --set 'dist.comm_hook="powersgd"' --set "dist.matrix_approximation_rank=$r" \
    --set "dist.start_powerSGD_iter=$START"
done
python benchmarks/_table.py "$OUT" none fp16 bf16 powersgd_r1 powersgd_r4 -- comm_bytes_per_step \
  comm_bytes_per_step/ words_per_s words_per_s/ comm_ms valid_ppl test_ppl
