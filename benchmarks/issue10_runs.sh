#!/usr/bin/env bash
# The measurements of issue 10 (any model, every strategy), one after the other on an otherwise idle
# machine. Results: benchmarks/results/issue10/ (metrics and summaries); run dirs under $RUNS.
#   bash benchmarks/issue10_runs.sh            # from the repository root; PARATRAIN_DATA must be set
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/issue10
RUNS=${RUNS:-/tmp/issue10-runs}
source benchmarks/_runs_lib.sh
# 1. the minimal-change port against the same script ported to plain DDP (speed ratio, loss)
python benchmarks/compare_ports.py --data-dir "$PARATRAIN_DATA" --repeats 5 --max-batches 400 \
  --json "$OUT/compare_ports.json" 2>&1 | tee "$OUT/compare_ports.txt"
# 2. regression: ptb_small, one epoch, 2 workers (target valid ppl <= 190)
paratrain train configs/ptb_small.toml --nproc 2 --set train.epochs=1 --run-dir "$RUNS/ptb_small_1ep" > "$OUT/ptb_small_1ep.log" 2>&1
keep ptb_small_1ep
# 3. digits-cnn, the whole recipe, 2 workers (target test accuracy >= 0.97)
paratrain train configs/digits_cnn.toml --nproc 2 --run-dir "$RUNS/digits_cnn" > "$OUT/digits_cnn.log" 2>&1
keep digits_cnn
# 4. gpt_wt2, one epoch, 2 workers; then wt2_small (LSTM) for the same training time
paratrain train configs/gpt_wt2.toml --nproc 2 --run-dir "$RUNS/gpt_wt2_1ep" > "$OUT/gpt_wt2_1ep.log" 2>&1
keep gpt_wt2_1ep
paratrain train configs/wt2_small.toml --nproc 2 --run-dir "$RUNS/wt2_small_pilot" --set train.max_steps=120 \
  --set data.eval_fraction=0.01 > "$OUT/wt2_small_pilot.log" 2>&1
STEPS=$(python - "$RUNS" <<'PY'
import json, sys
runs = sys.argv[1]
gpt = json.loads(open(f"{runs}/gpt_wt2_1ep/metrics.jsonl").read().strip().splitlines()[-1])
pilot = [json.loads(l) for l in open(f"{runs}/wt2_small_pilot/metrics.jsonl") if '"summary"' in l][-1]
train_s = gpt["words_per_s"] and gpt["steps"] * gpt["global_batch"] * 64 / gpt["words_per_s"]
print(int(train_s / (pilot["train_step_ms"] / 1000)))
PY
)
echo "wt2_small steps for the same training time as gpt_wt2's epoch: $STEPS" | tee "$OUT/wt2_small_same_time.txt"
paratrain train configs/wt2_small.toml --nproc 2 --run-dir "$RUNS/wt2_small_same_time" --set train.max_steps="$STEPS" \
  > "$OUT/wt2_small_same_time.log" 2>&1
keep wt2_small_same_time
echo done
