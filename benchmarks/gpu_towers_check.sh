#!/usr/bin/env bash
# Towers (strategy replicate) on CUDA against one device, for the three workloads: the same global
# batch, no dropout (towers draw their own masks), a few steps, the summary's losses and step time printed side by side. On a one-GPU machine
# DEV=cuda:0,cuda:1 soft-places both towers on cuda:0, so DataParallel runs two replicas on one GPU:
# the code path (SeededDataParallel, replicas, threads, gather, tower sync BatchNorm) and the maths,
# not the speed of two GPUs.
#   PARATRAIN_DATA=../shared/data bash benchmarks/gpu_towers_check.sh   (DEV=cpu:0,cpu:1 runs CPU towers)
set -u
cd "$(dirname "$0")/.."
DEV=${DEV:-cuda:0,cuda:1}
W=${W:-runs/towers-gpu}
PY=${PYTHON:-python3}
rm -rf "$W" && mkdir -p "$W"
for task in ${TASKS:-digits_cnn ptb_small gpt_wt2}; do
  for s in single replicate; do
    extra=()
    [ $s = replicate ] && extra=(--devices "$DEV")
    [ $s = single ] && [ "${DEV#cpu}" != "$DEV" ] && extra=(--set 'dist.device="cpu"')
    timeout -k 5 "${LIMIT:-90}" $PY -m paratrain.cli train "configs/$task.toml" --strategy $s ${extra[@]+"${extra[@]}"} \
      --run-dir "$W/$task-$s" --set "train.max_steps=${STEPS:-20}" --set train.checkpoint_every=0 \
      --set train.timing_warmup_steps=5 --set train.log_every=5 --set model.dropout=0.0 > "$W/$task-$s.log" 2>&1
    echo "=== $task $s: exit $?"
    grep -iE "error|warn|Traceback|tower " "$W/$task-$s.log" | head -6 | cut -c1-300
  done
  $PY - "$W/$task-single" "$W/$task-replicate" <<'PYEOF'
import json, sys
rows = []
for d in sys.argv[1:]:
    try:
        s = [json.loads(l) for l in open(f"{d}/metrics.jsonl") if '"summary"' in l][-1]
    except (OSError, IndexError):
        print(f"{d}: no summary"); continue
    rows.append(s)
    print(f"{d}: device {s.get('device')} valid_loss {s.get('valid_loss')!r} test_loss {s.get('test_loss')!r} "
          f"step_ms {s.get('step_ms')}")
if len(rows) == 2:
    print("  |valid_loss difference| =", abs(rows[0]["valid_loss"] - rows[1]["valid_loss"]))
PYEOF
done
