#!/usr/bin/env bash
# The hand-tuned HF Trainer peer (bench/peer_trainer.py) on one GPU, each configuration in a fresh process.
#     bash bench/peer/peers.sh OUTDIR SECONDS NAME:ARGS...     e.g.  llava_b96:"--model llava-siglip2-0.5b --batch-size 96"
# Each NAME's JSON line goes to OUTDIR/peers.jsonl and its console to OUTDIR/peers.log.
set -u
out="${1:?OUTDIR}"; budget="${2:?SECONDS}"; shift 2
here="$(cd "$(dirname "$0")/../.." && pwd)"
deadline=$(( $(date +%s) + budget )); mkdir -p "$out"
for spec in "$@"; do
  name="${spec%%:*}"; args="${spec#*:}"
  left=$(( deadline - $(date +%s) )); [ "$left" -lt 45 ] && { echo "$name skipped"; continue; }
  [ "$left" -gt 200 ] && left=200
  start=$(date +%s)
  timeout "$left" python3 "$here/bench/peer_trainer.py" $args --json "$out/$name.json" > "$out/$name.log" 2>&1
  rc=$?
  { printf '{"name": "%s", "rc": %s, "s": %s, "result": ' "$name" "$rc" "$(( $(date +%s) - start ))"
    cat "$out/$name.json" 2>/dev/null | tr -d '\n' || printf 'null'; echo "}"; } >> "$out/peers.jsonl"
  echo "== $name rc=$rc" >> "$out/peers.log"; tail -3 "$out/$name.log" >> "$out/peers.log"; rm -f "$out/$name.json" "$out/$name.log"
  echo "$name rc=$rc $(( $(date +%s) - start )) s"
done
