#!/usr/bin/env bash
# One treat ladder on one GPU, from the default config, as issue 11's table asks.
#   bash bench/treat11/ladder.sh NAME MODEL STAGE BUDGET_S OUTDIR
# The treatment's own folder (with its compile cache) stays in /tmp; the results are copied to
# OUTDIR/NAME/: treat.json, final_config.yaml, ladder.png, console.txt.
set -u
name="$1"; model="$2"; stage="$3"; budget="$4"; out="$5"
work="/tmp/treat-$name"; rm -rf "$work"; mkdir -p "$out/$name"
start=$(date +%s)
PYTHONUNBUFFERED=1 COLUMNS=80 python3 -m vlmdoctor treat --model "$model" --stage "$stage" \
    --time-budget "$budget" --out "$work" --json "$out/$name/treat.json" 2>&1 | tee "$out/$name/console.txt"
echo "wall_s $(( $(date +%s) - start ))" | tee -a "$out/$name/console.txt"
cp "$work/final_config.yaml" "$work/ladder.png" "$out/$name/" 2>/dev/null || true
