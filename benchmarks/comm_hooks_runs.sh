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
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("| dist.comm_hook | payload bytes/step/rank | vs none | words/s | vs none | comm ms/step | valid ppl | test ppl |")
print("|---|---|---|---|---|---|---|---|")
base = None
for name in ("none", "fp16", "bf16", "powersgd_r1", "powersgd_r4"):
    s = json.loads(open(f"{out}/{name}.summary.json").read())
    base = base or s
    print(f"| {name} | {s['comm_bytes_per_step']:,} | {s['comm_bytes_per_step'] / base['comm_bytes_per_step']:.3f} | "
          f"{s['words_per_s']:,.0f} | {s['words_per_s'] / base['words_per_s']:.3f} | {s['comm_ms']:.1f} | "
          f"{s['valid_ppl']:.2f} | {s['test_ppl']:.2f} |")
PY
