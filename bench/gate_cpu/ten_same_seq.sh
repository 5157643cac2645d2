#!/usr/bin/env bash
# Issue 37, one gate at a time: the same check as ten_same.sh (an unchanged config gates clean, on a CPU with
# bf16 units and with oneDNN capped below them), for a small machine where gates side by side would time out.
#
#   OUT=DIR N=10 CORE=1 bash bench/gate_cpu/ten_same_seq.sh
#
# The tiny preset in bf16, a baseline report per kind, then N same-config gates (--remeasure-baseline) per
# kind, alternating kinds, each pinned to core CORE with one intra-op thread. Run it from a checkout nobody
# edits while it runs (every gate starts fresh `python -m vlmdoctor` processes from this folder).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?OUT=DIR}"; N="${N:-10}"; CORE="${CORE:-1}"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
NOBF16=ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI
for kind in bf16 nobf16; do
  e=X=1; [ $kind = nobf16 ] && e=$NOBF16
  env $e taskset -c "$CORE" python -m vlmdoctor profile --model tiny --device cpu --weight-dtype bf16 --steps 8 \
    --warmup 2 --repeats 2 --quiet --force --json "$OUT/base_$kind.json" >"$OUT/base_$kind.log" 2>&1
done
for i in $(seq 1 "$N"); do
  for kind in bf16 nobf16; do
    e=X=1; [ $kind = nobf16 ] && e=$NOBF16
    s=$(date +%s)
    env $e taskset -c "$CORE" timeout -k 5 1500 python -m vlmdoctor gate --baseline "$OUT/base_$kind.json" \
      --remeasure-baseline --json "$OUT/gate_${kind}_$i.json" >"$OUT/gate_${kind}_$i.log" 2>&1
    echo "$kind gate $i exit $? $(( $(date +%s) - s ))s" >>"$OUT/exits.txt"
  done
done
