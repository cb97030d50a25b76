#!/usr/bin/env bash
# Issue 13: `paratrain plan --validate` on the three built-in workloads (ptb_small, gpt_wt2, digits_cnn):
# profile once (cached), predict every strategy, run each at N = 1, 2 here and compare step time and
# peak memory; then re-plan for an 8-GPU ib400 cluster from the same cached profile.
# Keeps plan.md, validation.md and the JSON of each in benchmarks/results/plan/<config>/.
#   PARATRAIN_DATA=../shared/data bash benchmarks/plan_validation.sh [config ...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/plan
WORK=${WORK:-runs/plan-validation}
mkdir -p "$OUT" "$WORK"
for name in "${@:-ptb_small gpt_wt2 digits_cnn}"; do
  for cfg in $name; do
    dir="$WORK/$cfg"
    paratrain plan "configs/$cfg.toml" --out "$dir" --reprofile --validate --validate-steps "${STEPS:-30}" \
      --validate-repeats "${REPEATS:-2}" --profile-repeats "${REPEATS:-2}" \
      > "$WORK/$cfg.validate.log" 2>&1 || echo "[plan_validation] $cfg: exit $? (see $WORK/$cfg.validate.log)"
    paratrain plan "configs/$cfg.toml" --out "$dir" --interconnect ib400 --nproc 1,2,4,8,16,32,64 \
      --device-memory-gb 80 > "$WORK/$cfg.ib400.log" 2>&1
    mkdir -p "$OUT/$cfg"
    cp "$dir/validation.md" "$dir/validation.json" "$OUT/$cfg/"
    cp "$dir/plan.md" "$OUT/$cfg/plan-ib400.md"
    cp "$dir/profile.json" "$OUT/$cfg/profile.json"
    echo "[plan_validation] $cfg: $OUT/$cfg"
  done
done
