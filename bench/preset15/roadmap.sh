#!/usr/bin/env bash
# The foveated-VLM roadmap (seed 002) on one H100: each roadmap item as a `vlmdoctor profile` run of
# the preset the seed profiled (dino-135m: DINOv2-S/14 + SmolLM2-135M, stage 2, bf16, batch 8), then
# `vlmdoctor treat` on the same preset. Writes every report to $OUT and a table to $OUT/roadmap.md
# whose rows fill docs/foveated.md's "measured H100" column.
#
#   OUT=$OUT bash bench/preset15/roadmap.sh                    # the profiles (about 8-10 min on an H100)
#   PART=treat OUT=$OUT bash bench/preset15/roadmap.sh         # the treatment (treat's own 9-min budget)
#   MODEL=dino-1.7b OUT=$OUT bash bench/preset15/roadmap.sh    # the seed's 1.7B stage-2 config instead
#   RUNS="baseline no_ckpt" OUT=$OUT bash bench/preset15/roadmap.sh   # a subset (names below)
#
# Liger runs need liger-kernel importable (on the device machine: carry its wheel, see the device
# README's carry recipe); without it those runs end with a one-line usage error and the table says so.
# Each run is its own process (Liger patches classes globally). A run that fails (OOM, a compile
# error) still writes its report, and the script goes on.
set -u
OUT=${OUT:-bench/results/preset15}
MODEL=${MODEL:-dino-135m}
STAGE=${STAGE:-2}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
PART=${PART:-profiles}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}  # cpu only to smoke-test the script with MODEL=tiny-dino
. "$(dirname "$0")/../lib/timed_profile.sh"
bench_setup "$OUT"  # the compiled runs share one cache folder: later runs reuse what earlier ones compiled

BASE="--model $MODEL --stage $STAGE --device $DEVICE --weight-dtype bf16 --batch-size 8"
NOCK="--no-gradient-checkpointing"
CW=$((WARMUP > 10 ? WARMUP : 10))  # compiled runs: warm-up long enough to keep compilation out of the timed steps
# Compiled runs compile region by region (each decoder/encoder layer on its own, one compile per
# stack): on the H100 the whole-model compile of this preset had not finished after 130 s, twice,
# where the regional one took 10.5 s. REGIONS= (empty) compiles the whole model instead.
REGIONS=${REGIONS---compile-regions}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}  # seconds one profile may take before it is stopped and marked so
# DEADLINE (epoch seconds): no profile runs on past it (bench/lib/timed_profile.sh)
# name | roadmap item | flags on top of BASE (the seed's profiling plan, tests 1-9, plus items 5, 6 and 8)
PLAN=$(cat <<PLAN
baseline|0 baseline (checkpointing on)|--gradient-checkpointing
no_ckpt|1 remove gradient checkpointing|$NOCK
liger_fce|3 Liger FusedCE|$NOCK --liger-fused-ce
compile_default|4 compile default|$NOCK --compile default $REGIONS --warmup $CW
compile_max_autotune|4 compile max-autotune|$NOCK --compile max-autotune $REGIONS --warmup $CW
compile_reduce_overhead|4 compile reduce-overhead (whole model: CUDA graphs per region failed on the H100)|$NOCK --compile reduce-overhead --warmup $CW
vision_fullgraph|5 fullgraph encoder (alone)|$NOCK --compile-vision fullgraph --warmup $CW
compile_vision_fullgraph|5 fullgraph encoder + compiled LLM (whole-model compile: regions do not stack with it)|$NOCK --compile default --compile-vision fullgraph --warmup $CW
compile_no_shape_padding|6 shape padding off (vs compile default)|$NOCK --compile default $REGIONS --no-compile-shape-padding --warmup $CW
bs16|2 batch 16|$NOCK --batch-size 16
bs32|2 batch 32|$NOCK --batch-size 32
bs64|2 batch 64|$NOCK --batch-size 64
packing|8 sequence packing|$NOCK --packing --sampler length_bucketed
combined_bs16|1-4 combined, batch 16|$NOCK --liger-fused-ce --compile default $REGIONS --batch-size 16 --warmup $CW
combined_bs32|1-4 combined, batch 32|$NOCK --liger-fused-ce --compile default $REGIONS --batch-size 32 --warmup $CW
PLAN
)
RUNS=${RUNS:-$(echo "$PLAN" | cut -d'|' -f1 | tr '\n' ' ')}

if [ "$PART" = "treat" ]; then
  echo "== treat $MODEL stage $STAGE"
  # shellcheck disable=SC2086
  $PY -m vlmdoctor treat --model "$MODEL" --stage "$STAGE" --device "$DEVICE" --steps "$STEPS" --warmup "$WARMUP" \
    --set weight_dtype=bf16 --set batch_size=8 --time-budget "${TREAT_BUDGET:-540}" \
    --out "$OUT/treat_$MODEL" --json "$OUT/treat_$MODEL.json" --force > "$OUT/treat_$MODEL.txt" 2>&1
  echo "   exit $?"
  exit 0
fi

for name in $RUNS; do
  line=$(echo "$PLAN" | grep "^$name|") || { echo "unknown run $name"; continue; }
  flags=$(echo "$line" | cut -d'|' -f3)
  echo "== $name: $(echo "$line" | cut -d'|' -f2)"
  # shellcheck disable=SC2086
  timed_profile "$name" "$OUT" $BASE --steps "$STEPS" --warmup "$WARMUP" $flags
done

echo "$PLAN" > "$OUT/plan.txt"
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
plan = [line.split("|") for line in (out / "plan.txt").read_text().splitlines() if line.strip()]
base = None
p = out / "baseline.json"
if p.exists():
    base = (json.loads(p.read_text()).get("metrics") or {}).get("real_tokens_per_s")
rows = ["| run | roadmap item | status | tokens/s | vs baseline | step ms | samples/s | peak GiB | MFU |",
        "|---|---|---|---|---|---|---|---|---|"]
for name, item, flags in plan:
    p = out / f"{name}.json"
    if not p.exists():
        txt = out / f"{name}.txt"
        why = txt.read_text().strip().splitlines()[-1][:60] if txt.exists() and txt.read_text().strip() else "not run"
        rows.append(f"| {name} | {item} | {why} | | | | | | |")
        continue
    r = json.loads(p.read_text())
    m = r.get("metrics") or {}
    tps, ms = m.get("real_tokens_per_s"), m.get("step_ms")
    bs = (r.get("config") or {}).get("batch_size")
    rel = f"{tps / base:.2f}x" if tps and base else ""
    sps = f"{bs / ms * 1000:.1f}" if bs and ms else ""
    mfu = f"{m['mfu'] * 100:.1f}%" if m.get("mfu") else ""
    peak = f"{m['peak_mem_gb']:.1f}" if m.get("peak_mem_gb") else ""
    rows.append(f"| {name} | {item} | {r.get('status')} | {tps or 0:,.0f} | {rel} | {ms or 0:.1f} | {sps} | {peak} | {mfu} |")
(out / "roadmap.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PYEOF
