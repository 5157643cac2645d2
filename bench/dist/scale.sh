#!/usr/bin/env bash
# Scaling on one host with 2 or 4 GPUs (issue 42), every job against the same config on one GPU
# measured in the same command:
#   1. the one-GPU references of every model side by side, each on its own GPU
#      (CUDA_VISIBLE_DEVICES=i: no two share a GPU; they share the host's CPU cores), each with
#      OMP_NUM_THREADS=1 as torchrun gives every rank (REF_OMP: another count; unset, two references at
#      torch's default of a thread per core ran 0.5b's step in 478 ms against a DDP rank's 125);
#   2. each model on each rank count in NPROCS with each of PARALLELS, one job at a time, all GPUs idle
#      but the job's.
#
#   OUT=DIR MODELS="0.5b llava-siglip2-0.5b" NPROCS="2 4" bash bench/dist/scale.sh
#
# The config (FLAGS) is the one a user scales: bf16 weights, no gradient checkpointing, batches padded to a
# multiple of 64 so that few shapes recur (cuDNN and the allocator settle and the window is stable).
# Writes DIR/<model>_1gpu.json, DIR/<model>_<parallel>_<n>.json (+ .log), DIR/summary.txt, DIR/env.txt.
# A failed run (OOM: exit 3) is in summary.txt and the script goes on. T_RUN: each run's time limit (s).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:?OUT=DIR}"
MODELS="${MODELS:-0.5b}"
NPROCS="${NPROCS:-2 4}"
PARALLELS="${PARALLELS:-ddp fsdp2}"
STEPS="${STEPS:-30}"
WARMUP="${WARMUP:-8}"
T_RUN="${T_RUN:-240}"
FLAGS="${FLAGS:---weight-dtype bf16 --no-gradient-checkpointing --pad-to-multiple-of 64 --batch-size 8}"
PY="${PYTHON:-python}"
mkdir -p "$OUT"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', \
'.'.join(map(str, torch.cuda.nccl.version())), 'transformers', transformers.__version__)"
  echo "command: OUT=$OUT MODELS=\"$MODELS\" NPROCS=\"$NPROCS\" PARALLELS=\"$PARALLELS\" STEPS=$STEPS WARMUP=$WARMUP FLAGS=\"$FLAGS\" bash bench/dist/scale.sh"
} >"$OUT/env.txt"
cat "$OUT/env.txt"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu MODELS=tiny NPROCS=2 STEPS=2 WARMUP=1 FLAGS=--batch-size=2: a dry run without GPUs
COMMON=(--stage 2 --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" $FLAGS --quiet --force)
: >"$OUT/summary.txt"
say() { echo "[scale $(date -u +%H:%M:%S)] $*"; }

# 1. the references, side by side
gpu=0
for model in $MODELS; do
  say "$model: one GPU (gpu $gpu)"
  ( CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS="${REF_OMP:-1}" timeout -k 10 "$T_RUN" "$PY" -m vlmdoctor profile --model "$model" "${COMMON[@]}" \
      --no-diagnose --json "$OUT/${model}_1gpu.json" 2>"$OUT/${model}_1gpu.log"
    echo "$model 1gpu exit $?" >>"$OUT/summary.txt" ) &
  gpu=$((gpu + 1))
done
wait

# 2. the jobs, one at a time
for model in $MODELS; do
  ref=()
  if "$PY" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("status") != "ok")' \
      "$OUT/${model}_1gpu.json" 2>/dev/null; then
    ref=(--one-gpu-report "$OUT/${model}_1gpu.json")
  fi
  for n in $NPROCS; do
    for parallel in $PARALLELS; do
      say "$model: $n ranks, $parallel"
      timeout -k 10 "$T_RUN" "$PY" -m vlmdoctor profile --model "$model" "${COMMON[@]}" --nproc-per-node "$n" \
        --parallel "$parallel" ${ref[@]+"${ref[@]}"} --json "$OUT/${model}_${parallel}_${n}.json" \
        2>"$OUT/${model}_${parallel}_${n}.log"
      echo "$model ${parallel}_$n exit $?" >>"$OUT/summary.txt"
    done
  done
done

"$PY" bench/dist/scale_table.py "$OUT" | tee -a "$OUT/summary.txt"
