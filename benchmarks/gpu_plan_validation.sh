#!/usr/bin/env bash
# Issue 13 on a GPU: `paratrain plan` profiled on one CUDA device (fp32 and bf16), validated at N = 1
# there (the plan's predicted step and memory against `paratrain train`), MFU against the datasheet's
# peak, the same profiles planned for an NVLink node (N = 1 ... 8), and each data-parallel strategy
# started over NCCL (world_size 1: one GPU holds one rank; NCCL refuses two ranks on one GPU).
# Every step has its own time limit and a failed step does not stop the others; logs go to $WORK.
#   PARATRAIN_DATA=../shared/data bash benchmarks/gpu_plan_validation.sh [step ...]
# steps: env digits ptb gpt gpt_bf16 nvlink nccl train_mfu (default: all, in that order)
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/plan-gpu}
PY=${PYTHON:-python3}
mkdir -p "$WORK"
T0=$(date +%s)

run() {  # run NAME LIMIT_S COMMAND...: one step, its log in $WORK/NAME.log, its tail printed
  local name=$1 limit=$2 rc
  shift 2
  echo "=== $name: start at +$(($(date +%s) - T0)) s (limit $limit s)"
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc at +$(($(date +%s) - T0)) s"
  tail -n "${TAIL:-25}" "$WORK/$name.log" | cut -c1-400
}

plan_validate() {  # plan_validate NAME CONFIG [--set ...]: profile on the GPU, validate N = 1 there
  local name=$1 cfg=$2
  shift 2
  run "$name" "${LIMIT:-150}" $PY -m paratrain.cli plan "configs/$cfg.toml" --out "$WORK/$name" --reprofile \
    --validate --validate-nproc 1 --validate-repeats "${REPEATS:-3}" --timed-seconds "${TIMED:-2}" "$@"
}

for step in ${@:-env digits ptb gpt gpt_bf16 nvlink nccl train_mfu}; do
  case $step in
    env) run env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.nccl.version())'" ;;
    digits) plan_validate digits_cnn digits_cnn ;;
    ptb) plan_validate ptb_small ptb_small ;;
    gpt) plan_validate gpt_wt2 gpt_wt2 ;;
    gpt_bf16) plan_validate gpt_wt2_bf16 gpt_wt2 --set train.precision=bf16 ;;
    nvlink)  # the GPU profiles planned for an 8-GPU NVLink node (no runs: from the cache)
      for name in digits_cnn ptb_small gpt_wt2 gpt_wt2_bf16; do
        [ -f "$WORK/$name/profile.json" ] || continue
        cfg=${name%_bf16}
        extra=()
        [ "$name" = gpt_wt2_bf16 ] && extra=(--set train.precision=bf16)
        mkdir -p "$WORK/$name-nvlink" && cp "$WORK/$name/profile.json" "$WORK/$name-nvlink/"
        TAIL=40 run "$name-nvlink" 60 $PY -m paratrain.cli plan "configs/$cfg.toml" --out "$WORK/$name-nvlink" \
          --interconnect nvlink --nproc 1,2,4,8 "${extra[@]}"
      done ;;
    nccl)  # every data-parallel strategy through NCCL at world_size 1, a few steps each
      for strategy in allreduce fsdp zero1; do
        TAIL=12 run "nccl-$strategy" 90 $PY -m paratrain.cli train configs/gpt_wt2.toml --strategy "$strategy" \
          --nproc 1 --run-dir "$WORK/nccl-$strategy" --set train.max_steps=30 --set train.checkpoint_every=0 \
          --set train.precision=bf16 --set train.timing_warmup_steps=10
      done ;;
    train_mfu)  # the summary's MFU on the GPU, fp32 and bf16 (the peak from the datasheet table)
      for prec in fp32 bf16; do
        TAIL=45 run "train-gpt-$prec" 90 $PY -m paratrain.cli train configs/gpt_wt2.toml --strategy single \
          --run-dir "$WORK/train-gpt-$prec" --set train.max_steps=200 --set train.checkpoint_every=0 \
          --set "train.precision=$prec" --set train.timing_warmup_steps=20
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done at +$(($(date +%s) - T0)) s"
