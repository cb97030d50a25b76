#!/usr/bin/env bash
# Issue 13 on a GPU: `paratrain plan` profiled on one CUDA device (fp32 and bf16), validated at N = 1
# there (the plan's predicted step and memory against `paratrain train`), MFU against the datasheet's
# peak, the same profiles planned for an NVLink node (N = 1 ... 8), and each data-parallel strategy
# started over NCCL (world_size 1: one GPU holds one rank; NCCL refuses two ranks on one GPU).
# Every step has its own time limit and a failed step does not stop the others; logs go to $WORK.
#   PARATRAIN_DATA=../shared/data bash benchmarks/gpu_plan_validation.sh [step ...]
# steps: env digits ptb gpt gpt_bf16 nvlink nccl train_mfu towers_tf32 (default: all but towers_tf32, in that
# order). towers_tf32: benchmarks/gpu_towers_check.sh for the cuDNN workloads with TF32 off
# (NVIDIA_TF32_OVERRIDE=0, which cuDNN and cuBLAS obey) and on, side by side. pack: the small files of
# $WORK in $OUT/plan-gpu-small.tgz (name it last).
# On a 15-minute lease (2026-11-27, H200): env gpt_bf16 ptb digits towers_tf32 nvlink pack takes about
# 12 minutes; give each call's steps so that the call ends inside its limit, and pack in every call.
# A GPU profile took under 150 s (2026-11-27, version 19, its one-rank runs included; later versions add a
# little on a GPU: stage and checkpointing timings) and a
# validation run about 10 s, so one call of 540 s holds about three workloads at REPEATS=2:
#   REPEATS=2 PYTHONPATH=src bash benchmarks/gpu_plan_validation.sh env gpt_bf16 ptb digits nvlink pack
# A step cut by its limit keeps its profile.json (written before the validation starts) and, since
# 2026-12-01, the validation's runs so far (validation.partial.json and .md), which pack brings back.
# BUDGET (seconds, default 540: the device tool's 600 s a call, less the pack and the transfers): no
# step runs past it (but for timeout's 10 s grace), a step that would start with under 30 s left is
# skipped, and pack always runs.
# The data: the device machine has no ../shared, so stage a copy in the ignored gpudata/ and carry it:
#   mkdir -p gpudata && cp -r ../shared/data/ptb ../shared/data/wikitext-2 gpudata/
#   device run, carry ["gpudata/ptb", "gpudata/wikitext-2"]:
#   PYTHONPATH=src bash benchmarks/gpu_plan_validation.sh env gpt_bf16 ptb digits pack
# CKPT=1: each validated layout again with every block checkpointed (--activation-checkpointing; twice
# the runs: give LIMIT more). PARATRAIN_DATA defaults to gpudata where it exists and ../shared/data is missing. Remove gpudata/ after.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-runs/plan-gpu}
PY=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
if [ -z "${PARATRAIN_DATA:-}" ] && [ ! -d ../shared/data ] && [ -d gpudata ]; then
  export PARATRAIN_DATA=$PWD/gpudata
fi
mkdir -p "$WORK"
T0=$(date +%s)

run() {  # run NAME LIMIT_S COMMAND...: one step, its log in $WORK/NAME.log, its tail printed; the limit is
  # cut to what BUDGET leaves (pack's own steps are never cut)
  local name=$1 limit=$2 rc left
  shift 2
  left=$((BUDGET - ($(date +%s) - T0)))
  if [ "$left" -lt 30 ]; then
    echo "=== $name: skipped at +$(($(date +%s) - T0)) s (under 30 s of BUDGET=$BUDGET left)"
    return 0
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name: start at +$(($(date +%s) - T0)) s (limit $limit s)"
  timeout -k 10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  echo "=== $name: exit $rc at +$(($(date +%s) - T0)) s"
  tail -n "${TAIL:-25}" "$WORK/$name.log" | cut -c1-400
}

plan_validate() {  # plan_validate NAME CONFIG [--set ...]: profile on the GPU, validate N = 1 there
  # (the profile's one-rank runs of allreduce, zero1 and fsdp make it 100-150 s on an H200; REPROFILE=0
  # keeps a profile already in $WORK, e.g. on the same warm machine after a call that ran out of time)
  local name=$1 cfg=$2 again=(--reprofile)
  shift 2
  [ "${REPROFILE:-1}" = 0 ] && again=()
  run "$name" "${LIMIT:-300}" $PY -m paratrain.cli plan "configs/$cfg.toml" --out "$WORK/$name" ${again[@]+"${again[@]}"} \
    --validate --validate-nproc 1 --validate-repeats "${REPEATS:-3}" --timed-seconds "${TIMED:-2}" \
    ${CKPT:+--activation-checkpointing} "$@"
}

for step in ${@:-env digits ptb gpt gpt_bf16 nvlink nccl train_mfu}; do
  case $step in
    env) run env 60 bash -c "nvidia-smi -L; $PY -c 'import torch, sys; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, torch.cuda.get_device_name(), torch.cuda.nccl.version())'" ;;
    digits) plan_validate digits_cnn digits_cnn ;;
    ptb) plan_validate ptb_small ptb_small ;;
    gpt) plan_validate gpt_wt2 gpt_wt2 ;;
    gpt_bf16) plan_validate gpt_wt2_bf16 gpt_wt2 --set train.precision=bf16 ;;
    nvlink)  # the GPU profiles planned for an 8-GPU NVLink node, and for a cluster of such nodes on 8 NDR
      # NICs each (nvlink+ib400, N up to 1024: rings one per NIC, NCCL's trees); no runs, from the cache
      for name in digits_cnn ptb_small gpt_wt2 gpt_wt2_bf16; do
        [ -f "$WORK/$name/profile.json" ] || continue
        cfg=${name%_bf16}
        extra=()
        [ "$name" = gpt_wt2_bf16 ] && extra=(--set train.precision=bf16)
        TAIL=40 run "$name-nvlink" 60 $PY -m paratrain.cli plan "configs/$cfg.toml" --out "$WORK/$name-nvlink" \
          --profile "$WORK/$name/profile.json" --interconnect nvlink --nproc 1,2,4,8 ${extra[@]+"${extra[@]}"}
        TAIL=40 run "$name-cluster" 60 $PY -m paratrain.cli plan "configs/$cfg.toml" --out "$WORK/$name-cluster" \
          --profile "$WORK/$name/profile.json" --interconnect nvlink+ib400 --nproc 1,8,16,64,1024 \
          ${extra[@]+"${extra[@]}"}
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
    towers_tf32)  # do the CUDA towers' 1e-4 differences from one device come from TF32? (cuDNN's default)
      for tf32 in 0 1; do
        env_=(); [ $tf32 = 0 ] && env_=(NVIDIA_TF32_OVERRIDE=0)
        run "towers-tf32-$tf32" 240 env ${env_[@]+"${env_[@]}"} TASKS="${TOWER_TASKS:-digits_cnn ptb_small}" \
          W="$WORK/towers-tf32-$tf32" PYTHON="$PY" bash benchmarks/gpu_towers_check.sh
      done ;;
    pack)  # the small files (profiles, plans, validations, logs) in one archive: run folders hold MBs
      # of metrics and TensorBoard files, and the device tool brings back at most 16 MiB a file
      dest=$(realpath -m "${OUT:-$WORK}")  # (absolute: the archive is written from $WORK's parent)
      (cd "$WORK/.." && find "$(basename "$WORK")" \( -name '*.json' -o -name '*.md' -o -name '*.log' \) \
        -size -2M -print0 | tar czf "$dest/plan-gpu-small.tgz" --null -T -)
      ls -la "$dest/plan-gpu-small.tgz" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done at +$(($(date +%s) - T0)) s"
