#!/usr/bin/env bash
# The three treated configs (the final configs of the 2026-11-23 ladders) profiled with the trace kept,
# for the fixtures treated_s2 / treated_s1 / treated_1.5b_s2:
#   bash bench/treat11/treated.sh OUT
set -u
out="$1"; mkdir -p "$out"
export COLUMNS=80
for n in s2_05b s1_05b s2_15b; do
  mkdir -p "$out/$n"
  python3 -m vlmdoctor profile --config "bench/treat11/configs/treated_$n.yaml" --trace-dir "$out/$n" \
      --json "$out/$n/report.json" > "$out/$n/console.txt" 2>&1
  echo "$n rc=$? $(grep -m1 'real tokens/s' "$out/$n/console.txt")"
done
