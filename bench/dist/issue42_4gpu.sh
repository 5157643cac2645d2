#!/usr/bin/env bash
# Issue 42 on a host with 4 GPUs, in parts of under 10 minutes each (one device command each):
#   PART=a  bench/dist/scale.sh for 0.5b, the native llava-siglip2-0.5b preset and 1.5b: one GPU (side by
#           side), then DDP and FSDP2 on 2 and on 4 ranks, one job at a time; then 0.5b's reference again,
#           alone, at torch's default CPU threads;
#   PART=b  `vlmdoctor run -- torchrun --nproc-per-node 4` of a user's own FSDP2 script
#           (bench/corpus/dist_habits.py, habit fsdp2_reshard), the report written by rank 0; then the
#           corpus's tuned controls (one GPU each) and its torchrun habits on 4 ranks (record.sh, NPROC=4);
#   PART=c  `vlmdoctor treat` of a 2-rank DDP config of 0.5b.
#   PART=d  part a's scaling for 1.5b alone (its FSDP2 and 4-rank jobs were cut from part a), then part b's
#           `run -- torchrun --nproc-per-node 4` with enough steps for the windows (--warm 40), both on cores
#           24-63; beside them on cores C0.. the CPU gates of bench/gate_cpu/ten_same.sh (issue 37).
#   OUT=DIR PART=a bash bench/dist/issue42_4gpu.sh      (results: DIR/part_<a|b|c>.tgz)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?OUT=DIR}"
PART="${PART:?PART=a|b|c}"
W=/tmp/issue42_$PART
mkdir -p "$W/alone_default_threads" "$OUT"
case "$PART" in
a)
  OUT="$W" MODELS="0.5b llava-siglip2-0.5b 1.5b" T_RUN="${T_RUN:-100}" timeout -k 5 "${T_SCALE:-480}" \
    bash bench/dist/scale.sh
  # the reference again, alone, at torch's default threads (one per core): is the thread count the cause?
  env -u OMP_NUM_THREADS CUDA_VISIBLE_DEVICES=0 timeout -k 10 100 python -m vlmdoctor profile --model 0.5b --stage 2 \
    --device cuda --steps 30 --warmup 8 --weight-dtype bf16 --no-gradient-checkpointing --pad-to-multiple-of 64 \
    --batch-size 8 --no-diagnose --quiet --force --json "$W/alone_default_threads/0.5b_1gpu.json" \
    2>"$W/alone_default_threads.log"
  ;;
b)
  timeout -k 10 "${T_USER:-120}" python -m vlmdoctor run --out "$W/run4" --force -- \
    torchrun --standalone --nproc-per-node 4 bench/corpus/dist_habits.py --outdir /tmp/run4_user \
    --habits fsdp2_reshard >"$W/run_torchrun4.txt" 2>&1
  echo "run exit $?" >>"$W/run_torchrun4.txt"
  NPROC=4 BUDGET_S=150 DEADLINE_S="${DEADLINE_C:-300}" T_DDP=150 T_FSDP=90 \
    ONLY='tuned|dist_(ddp_healthy|ddp_bucket1|ddp_long_rank1|ddp_slow_loader_rank1|fsdp2_reshard|fsdp2_prefetch2)$' \
    bash bench/corpus/record.sh /tmp/corpus4 "$W"
  ;;
c)
  timeout -k 10 "${T_TREAT:-560}" python -m vlmdoctor treat --model 0.5b --stage 2 --nproc-per-node 2 \
    --parallel ddp --time-budget "${TREAT_BUDGET:-480}" --out "$W/treat2" --force --json "$W/treat2.json" \
    >"$W/treat2.txt" 2>&1
  echo "treat exit $?" >>"$W/treat2.txt"
  ;;
d)
  ( OUT="$W/gates" N="${N_GATES:-10}" C0=1 T_GATE="${T_GATE:-480}" bash bench/gate_cpu/ten_same.sh \
      >"$W/gates.log" 2>&1 ) &
  gates=$!
  OUT="$W/scale15" MODELS=1.5b T_RUN="${T_RUN:-150}" timeout -k 5 "${T_SCALE:-400}" taskset -c 24-63 \
    bash bench/dist/scale.sh
  timeout -k 10 "${T_USER:-150}" taskset -c 24-63 python -m vlmdoctor run --out "$W/run4" --force -- \
    torchrun --standalone --nproc-per-node 4 bench/corpus/dist_habits.py --outdir /tmp/run4_user \
    --habits fsdp2_reshard --warm 40 >"$W/run_torchrun4.txt" 2>&1
  echo "run exit $?" >>"$W/run_torchrun4.txt"
  wait "$gates"
  ;;
esac
tar -czf "$OUT/part_$PART.tgz" -C "$W" --exclude="*.pt.trace.json.gz" --exclude="corpus.tar*" --exclude=compile-cache . 2>/dev/null
cp "$W"/corpus.tar* "$OUT"/ 2>/dev/null
ls -la "$OUT"
