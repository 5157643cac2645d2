#!/usr/bin/env bash
# The compiled head-and-loss region, A/B against the code before it, interleaved in one call:
#   bash bench/treat11/regions.sh OLD_TREE OUT
# OLD_TREE holds the previous commit's vlmdoctor/ and rules/ (git archive <commit> vlmdoctor rules).
# Each arm is `vlmdoctor profile --config C` in a fresh process; the Inductor cache is shared.
# The old arm starts inside OLD_TREE: `python3 -m` imports from the current folder before PYTHONPATH
# (run from the repository root, both arms ran the new code on 2026-11-23).
set -u
old="$(cd "$1" && pwd)"; mkdir -p "$2"; out="$(cd "$2" && pwd)"; repo="$PWD"
export TORCHINDUCTOR_CACHE_DIR=/tmp/regions-inductor TRITON_CACHE_DIR=/tmp/regions-triton COLUMNS=80
arm() {  # arm NAME CODE CONFIG [extra args]
  local name="$1" code="$2" cfg="$3"; shift 3
  local dir="$repo"; [ "$code" = old ] && dir="$old"
  local t0=$(date +%s)
  (cd "$dir" && python3 -c 'import vlmdoctor, sys; print(vlmdoctor.__file__, file=sys.stderr)' &&
   python3 -m vlmdoctor profile --config "$repo/$cfg" --json "$out/$name.json" "$@") > "$out/$name.txt" 2>&1
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
