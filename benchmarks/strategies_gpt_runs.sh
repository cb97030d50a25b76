#!/usr/bin/env bash
# words/s of every multi-process strategy on gpt_wt2 at 2 processes (issue 12), fp32 and bf16, one
# run after the other on an otherwise idle machine: allreduce, zero1, fsdp, pipeline (2 stages,
# 4 micro-batches) with gpipe and 1f1b, and 1f1b with the stage plan "2,0" (both blocks on stage 0, the head
# alone on stage 1). $STEPS steps each (the first 20 are not timed), evaluation
# on 10% of valid/test. Results: benchmarks/results/strategies_gpt/ and a table on stdout.
#   PARATRAIN_DATA=../shared/data bash benchmarks/strategies_gpt_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/strategies_gpt
RUNS=${RUNS:-/tmp/strategies-gpt-runs}
STEPS=${STEPS:-80}
source benchmarks/_runs_lib.sh
run() {  # name, arguments
  local name=$1; shift
  rm -rf "$RUNS/$name"
  paratrain train configs/gpt_wt2.toml --nproc 2 --set "train.max_steps=$STEPS" --set data.eval_fraction=0.1 \
    --set train.checkpoint_every=0 "$@" --run-dir "$RUNS/$name" > "$OUT/$name.log" 2>&1
  keep "$name"
}
for p in fp32 bf16; do
  for s in allreduce zero1 fsdp; do
    run "${s}_$p" --strategy "$s" --set "train.precision=\"$p\""
  done
  for sch in gpipe 1f1b; do
    run "pipeline-${sch}_$p" --strategy pipeline --set "dist.pipeline_schedule=\"$sch\"" --set "train.precision=\"$p\""
  done
  run "pipeline-1f1b-split20_$p" --strategy pipeline --set 'dist.pipeline_split="2,0"' --set "train.precision=\"$p\""
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("| strategy | precision | words/s | vs allreduce fp32 | vs allreduce, same precision | train step ms | bubble (measured / theory) | valid ppl (10%) |")
print("|---|---|---|---|---|---|---|---|")
base = json.loads(open(f"{out}/allreduce_fp32.summary.json").read())["words_per_s_after_warmup"]
for p in ("fp32", "bf16"):
    same = json.loads(open(f"{out}/allreduce_{p}.summary.json").read())["words_per_s_after_warmup"]
    for s in ("allreduce", "zero1", "fsdp", "pipeline-gpipe", "pipeline-1f1b", "pipeline-1f1b-split20"):
        r = json.loads(open(f"{out}/{s}_{p}.summary.json").read())
        w = r["words_per_s_after_warmup"]
        bubble = f"{r['bubble_fraction']:.3f} / {r['bubble_theory']:.3f}" if "bubble_fraction" in r else "-"
        print(f"| {s} | {p} | {w:,.0f} | {w / base:.3f} | {w / same:.3f} | {r['train_step_ms']:.1f} | {bubble} | "
              f"{r['valid_ppl']:.2f} |")
PY
