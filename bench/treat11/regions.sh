#!/usr/bin/env bash
# The compiled head-and-loss region, A/B against the code before it, interleaved in one call:
#   bash bench/treat11/regions.sh OLD_TREE OUT
# OLD_TREE holds the previous commit's vlmdoctor/ package (git archive <commit> vlmdoctor).
# Each arm is `vlmdoctor profile --config C` in a fresh process; the Inductor cache is shared.
set -u
old="$1"; out="$2"; mkdir -p "$out"
export TORCHINDUCTOR_CACHE_DIR=/tmp/regions-inductor TRITON_CACHE_DIR=/tmp/regions-triton COLUMNS=80
arm() {  # arm NAME CODE CONFIG [extra args]
  local name="$1" code="$2" cfg="$3"; shift 3
  local pp="$PYTHONPATH"; [ "$code" = old ] && pp="$old:$PYTHONPATH"
  local t0=$(date +%s)
  PYTHONPATH="$pp" python3 -m vlmdoctor profile --config "$cfg" --json "$out/$name.json" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc=$? wall=$(( $(date +%s) - t0 ))s $(grep -m1 'real tokens/s' "$out/$name.txt")" | tee -a "$out/summary.txt"
}
c05=bench/treat11/configs/s2_05b_b54.yaml; c15=bench/treat11/configs/s2_15b_b20_workers.yaml
arm s2_05b_old1 old $c05
arm s2_05b_new1 new $c05 --trace-dir "$out/trace_s2_05b_new"
arm s2_05b_old2 old $c05
arm s2_05b_new2 new $c05
arm s2_15b_old1 old $c15
arm s2_15b_new1 new $c15 --trace-dir "$out/trace_s2_15b_new"
python3 bench/treat11/startup.py $c05 "$out/startup_s2_05b.json" > "$out/startup_s2_05b.txt" 2>&1
tail -12 "$out/startup_s2_05b.txt"
