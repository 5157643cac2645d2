#!/usr/bin/env bash
# Issue 42 on a host with 2 GPUs, in one command of under 10 minutes:
#   1. bench/dist/run_2gpu.sh for the 0.5b preset (one GPU, then FSDP2 and DDP on 2 ranks against it), 30 timed
#      steps each so that the windows are long enough to be stable;
#   2. `vlmdoctor run -- torchrun --nproc-per-node 2` of a user's own script (bench/corpus/dist_habits.py, DDP
#      and FSDP2 habits), the report written by rank 0.
#   OUT=DIR bash bench/dist/issue42_2gpu.sh      (results: DIR/*.json, summary.txt, env.txt, run_torchrun.txt)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?OUT=DIR}"
mkdir -p "$OUT"
MODELS=0.5b STEPS="${STEPS:-30}" WARMUP="${WARMUP:-8}" OUT="$OUT/dist" timeout -k 10 "${T_PROFILE:-420}" \
  bash bench/dist/run_2gpu.sh 2>&1 | tail -20
cp "$OUT"/dist/*.json "$OUT"/dist/summary.txt "$OUT"/dist/env.txt "$OUT"/ 2>/dev/null
timeout -k 10 "${T_RUN:-120}" python -m vlmdoctor run --out /tmp/run42 --warmup 1 --steps 2 --trace-steps 1 --force -- \
  torchrun --standalone --nproc-per-node 2 bench/corpus/dist_habits.py --outdir /tmp/run42_user \
  --habits ddp_healthy >"$OUT/run_torchrun.txt" 2>&1
echo "run exit $?" >>"$OUT/run_torchrun.txt"
cp /tmp/run42/report.json "$OUT/run_torchrun_report.json" 2>/dev/null
ls -la "$OUT"
