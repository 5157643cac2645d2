#!/usr/bin/env bash
# The landscape on one GPU before treat is changed: the hand-tuned Trainer peer (bench/peer_trainer.py)
# and vlmdoctor's runner at the configs that reached the most on llava-siglip2-0.5b stage 2, and two
# traces with memory events (plain cross entropy near the memory wall; FusedCE with memory to spare).
#     bash bench/peer/explore.sh OUTDIR [SECONDS]
# Everything lands in OUTDIR/explore.tgz (one file) plus OUTDIR/summary.txt.
set -u
out="${1:?OUTDIR}"; budget="${2:-540}"
here="$(cd "$(dirname "$0")/../.." && pwd)"
. "$here/bench/lib/timed_profile.sh"
work=$(mktemp -d); bench_setup "$work/res"
export COLUMNS=80 DEADLINE=$(( $(date +%s) + budget )) RUN_TIMEOUT=150 MIN_LEFT=40
res="$work/res"
peer() {  # NAME ARGS...
  local name=$1 left; shift
  left=$(( DEADLINE - $(date +%s) )); [ "$left" -lt 60 ] && { echo "$name skipped"; return; }
  [ "$left" -gt 150 ] && left=150
  timeout "$left" python3 "$here/bench/peer_trainer.py" "$@" --json "$res/$name.json" > "$res/$name.txt" 2>&1
  echo "$name exit $?"
}
M="--model llava-siglip2-0.5b --stage 2"
BASE="$M --weight-dtype bf16 --vision-no-grad --no-gradient-checkpointing --fused-optimizer --num-workers 8 --pin-memory --sampler length_bucketed --pad-to-multiple-of 64 --steps 20"
LIGER="--liger-rope --liger-rms-norm --liger-swiglu --liger-fused-ce"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, transformers, liger_kernel; print(torch.__version__, transformers.__version__)"; pip show liger-kernel 2>/dev/null | grep Version; } > "$res/env.txt" 2>&1
peer peer_tuned_b96 --model llava-siglip2-0.5b --recipe tuned --batch-size 96 --group-by-length --pad-to 64 --workers 8
timed_profile vd_liger_b112 "$res" $BASE $LIGER --batch-size 112 --no-diagnose
peer peer_tuned_b128 --model llava-siglip2-0.5b --recipe tuned --batch-size 128 --group-by-length --pad-to 64 --workers 8
timed_profile vd_liger_b144 "$res" $BASE $LIGER --batch-size 144 --no-diagnose
timed_profile wall_plain_ce_b40 "$res" $BASE --liger-rope --liger-rms-norm --liger-swiglu --batch-size 40 --trace-dir "$res/tr_wall" --trace-steps 1 --trace-memory --no-trace-shapes
timed_profile spare_fce_b16 "$res" $BASE $LIGER --batch-size 16 --trace-dir "$res/tr_spare" --trace-steps 1 --trace-memory --no-trace-shapes
peer peer_docs_b8 --model llava-siglip2-0.5b --recipe docs --steps 20
timed_profile vd_regions_fce_b112 "$res" $BASE --liger-fused-ce --compile default --compile-regions --batch-size 112 --no-diagnose
rm -rf "$res/compile-cache"
for f in "$res"/*.json; do python3 - "$f" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); m = d.get("metrics") or d
print(sys.argv[1].rsplit("/", 1)[-1], d.get("status"), m.get("real_tokens_per_s"), m.get("mfu"), m.get("peak_mem_gb"), (d.get("error") or "")[:120] if isinstance(d.get("error"), str) else (d.get("error") or {}).get("message"))
PY
done > "$out/summary.txt" 2>&1
cat "$res/env.txt" >> "$out/summary.txt"
tar -C "$work" -czf "$out/explore.tgz" res
ls -la "$out"; cat "$out/summary.txt"
