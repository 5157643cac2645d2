#!/usr/bin/env bash
# Issue 39: what gradient checkpointing costs in a treatment's final config (GPU-bound, compiled by region), against
# its recompute's share of the GPU's work, the share `system-checkpoint-recompute` carries there (`gain.per: gpu`).
# Two fresh `vlmdoctor profile` runs of the config, checkpointing off (as treat adopted it) and on, each timed and
# then traced (its default diagnosis window); the trace of each is analyzed for the recompute and the GPU's time.
#
#   OUT=DIR bash bench/checkpoint_in_final.sh FINAL_CONFIG.yaml
#
# DIR/{off,on}.json (the run reports), DIR/{off,on}.analysis.json (the facts of their traces), DIR/env.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?OUT=DIR}"; CFG="${1:?FINAL_CONFIG.yaml}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader 2>&1
  echo "command: OUT=$OUT bash bench/checkpoint_in_final.sh $CFG"
} >>"$OUT/env.txt"
for side in off on; do
  flag=--no-gradient-checkpointing; [ "$side" = on ] && flag=--gradient-checkpointing
  timeout -k 5 240 python -m vlmdoctor profile --config "$CFG" $flag --trace-dir "/tmp/ckpt_final/$side" \
    --json "$OUT/$side.json" --force --quiet >"$OUT/$side.txt" 2>&1
  echo "$side exit $?"
  trace=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['trace']['path'])" "$OUT/$side.json" 2>/dev/null)
  [ -n "$trace" ] && python -m vlmdoctor analyze "$trace" --json "$OUT/$side.analysis.json" --force --quiet
done
python - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for side in ("off", "on"):
    try:
        r = json.load(open(f"{out}/{side}.json"))
        f = json.load(open(f"{out}/{side}.analysis.json"))["files"][0]["facts"]
    except (OSError, KeyError, ValueError) as e:
        print(side, "no result:", e)
        continue
    m = r.get("metrics") or {}
    keys = ("step.ms", "gpu.busy_ms", "recompute.ms", "recompute.share", "phase.forward.ms", "phase.backward.ms")
    print(side, round(m.get("real_tokens_per_s") or 0), round(m.get("step_ms") or 0, 1),
          {k: round(f[k], 4) for k in keys if isinstance(f.get(k), (int, float))})
PY
