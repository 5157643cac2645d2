#!/usr/bin/env bash
# Distributed profiles on a host with 2 GPUs (issue 13): the 0.5b and 1.5b presets, stage 2, on
# 2 ranks with FSDP2 and with DDP, each against the same config on one GPU (scaling efficiency).
#
#   OUT=/some/folder bash bench/dist/run_2gpu.sh          # from the repository root
#   MODELS="0.5b" STEPS=10 OUT=... bash bench/dist/run_2gpu.sh   # a shorter run
#
# Six profiles (3 per model), each with its own start-up; if one command may run 10 minutes at most,
# run the models apart: MODELS=0.5b ..., then MODELS=1.5b ... (into different OUT folders or the same).
#
# Writes to $OUT (default bench/results/dist):
#   <model>_1gpu.json            the one-GPU reference (one process, no wrapper)
#   <model>_<fsdp2|ddp>.json     the 2-rank report (per-rank metrics, global tokens/s, scaling)
#   <model>_<fsdp2|ddp>.log      the command's stderr
#   traces/<run folder>/         one trace per rank (..._rank0/1.pt.trace.json.gz), HTA's layout
#   summary.txt                  one line per run
#   env.txt                      GPUs, driver, torch
# A failed run (OOM: exit 3) is recorded in summary.txt and the script goes on with the next.
# vlmdoctor sets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 for
# every rank itself (unless already set); they are exported here too, for anything else started.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}" TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
PY="${PYTHON:-python}"
OUT="${OUT:-bench/results/dist}"
MODELS="${MODELS:-0.5b 1.5b}"
STEPS="${STEPS:-20}"
WARMUP="${WARMUP:-5}"
DEVICE="${DEVICE:-cuda}"  # DEVICE=cpu MODELS=tiny STEPS=2 WARMUP=1: a dry run of this script without GPUs
mkdir -p "$OUT/traces"

{
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} > "$OUT/env.txt"
cat "$OUT/env.txt"
if [ "$DEVICE" = cuda ] && [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -lt 2 ]; then
  echo "error: this bench needs 2 visible GPUs" >&2
  exit 2
fi

COMMON=(--stage 2 --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP")
: > "$OUT/summary.txt"

for model in $MODELS; do
  echo "== $model: one GPU (reference)"
  "$PY" -m vlmdoctor profile --model "$model" "${COMMON[@]}" --no-diagnose --quiet --force \
    --json "$OUT/${model}_1gpu.json" 2> "$OUT/${model}_1gpu.log"
  echo "$model 1gpu exit $?" >> "$OUT/summary.txt"
  for parallel in fsdp2 ddp; do
    echo "== $model: 2 ranks, $parallel"
    ref=()  # the scaling reference, when the one-GPU run finished
    if "$PY" -c 'import json, sys; sys.exit(json.load(open(sys.argv[1])).get("status") != "ok")' \
        "$OUT/${model}_1gpu.json" 2> /dev/null; then
      ref=(--one-gpu-report "$OUT/${model}_1gpu.json")
    fi
    "$PY" -m vlmdoctor profile --model "$model" "${COMMON[@]}" --nproc-per-node 2 --parallel "$parallel" \
      ${ref[@]+"${ref[@]}"} --trace-dir "$OUT/traces" --quiet --force \
      --json "$OUT/${model}_${parallel}.json" 2> "$OUT/${model}_${parallel}.log"
    echo "$model $parallel exit $?" >> "$OUT/summary.txt"
  done
done

"$PY" bench/dist/scale_table.py "$OUT" | tee -a "$OUT/summary.txt"
