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
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
print("| run | precision | steps | words/s | vs fp32 | valid ppl | test ppl | skipped steps | train step ms |")
print("|---|---|---|---|---|---|---|---|---|")
base = None
for p in ("fp32", "bf16"):
    s = json.loads(open(f"{out}/gpt_wt2_epoch_{p}.summary.json").read())
    base = base or s["words_per_s"]
    print(f"| gpt_wt2, 1 epoch | {p} | {s['steps']} | {s['words_per_s']:,.0f} | {s['words_per_s'] / base:.3f} | "
          f"{s['valid_ppl']:.2f} | {s['test_ppl']:.2f} | {s.get('nonfinite_steps', 0)} | {s['train_step_ms']:.1f} |")
PY
