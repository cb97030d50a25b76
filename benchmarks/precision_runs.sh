#!/usr/bin/env bash
# Mixed precision against fp32 (issue 12, part 1), one run after the other on an otherwise idle machine:
#   ptb_small (lstm-lm), 1 epoch, 2 workers: fp32, bf16 (fp16: oneDNN has no float16 LSTM on CPU)
#   gpt_wt2, the first $GPT_STEPS steps, 2 workers: fp32, bf16, fp16, and fp32 with
#   model.activation_checkpointing (issue 12, part 4: peak memory and step time it costs)
# Results: benchmarks/results/precision/ (metrics and summaries) and a table on stdout.
#   PARATRAIN_DATA=../shared/data bash benchmarks/precision_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/precision
RUNS=${RUNS:-/tmp/precision-runs}
GPT_STEPS=${GPT_STEPS:-100}
source benchmarks/_runs_lib.sh
for p in fp32 bf16; do
  paratrain train configs/ptb_small.toml --nproc 2 --set train.epochs=1 --set "train.precision=\"$p\"" \
    --run-dir "$RUNS/ptb_small_$p" > "$OUT/ptb_small_$p.log" 2>&1
  keep "ptb_small_$p"
done
for p in fp32 bf16 fp16; do
  paratrain train configs/gpt_wt2.toml --nproc 2 --set "train.max_steps=$GPT_STEPS" --set "train.precision=\"$p\"" \
    --run-dir "$RUNS/gpt_wt2_$p" > "$OUT/gpt_wt2_$p.log" 2>&1
  keep "gpt_wt2_$p"
done
paratrain train configs/gpt_wt2.toml --nproc 2 --set "train.max_steps=$GPT_STEPS" --set model.activation_checkpointing=true \
  --run-dir "$RUNS/gpt_wt2_fp32_ac" > "$OUT/gpt_wt2_fp32_ac.log" 2>&1
keep gpt_wt2_fp32_ac
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("| run | precision | words/s | vs fp32 | valid ppl | test ppl | skipped steps | train step ms | peak RSS MB |")
print("|---|---|---|---|---|---|---|---|---|")
for task, ps in (("ptb_small", ("fp32", "bf16")), ("gpt_wt2", ("fp32", "bf16", "fp16", "fp32_ac"))):
    base = None
    for p in ps:
        s = json.loads(open(f"{out}/{task}_{p}.summary.json").read())
        base = base or s["words_per_s"]
        print(f"| {task} | {p} | {s['words_per_s']:,.0f} | {s['words_per_s'] / base:.3f} | {s['valid_ppl']:.2f} | "
              f"{s['test_ppl']:.2f} | {s.get('nonfinite_steps', 0)} | {s['train_step_ms']:.1f} | "
              f"{s['peak_memory_mb']:.0f} |")
PY
