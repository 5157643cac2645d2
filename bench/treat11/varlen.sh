#!/usr/bin/env bash
# Padding-free packing through FlexAttention (issue 11) on one H100: a strong padded baseline
# against packing on SDPA (transformers' dense block-diagonal mask) and packing on FlexAttention
# (the same position ids as a document BlockMask: the blocks between samples are skipped).
#
#   DEADLINE=$(( $(date +%s) + 280 )) bash bench/treat11/varlen.sh OUT      # about 250 s of H100 time
#   RUNS="s2_padded s2_packed_flex" bash bench/treat11/varlen.sh OUT        # a subset (names below)
#   MODEL=tiny DEVICE=cpu RUNS="s2_padded s2_packed_sdpa" bash bench/treat11/varlen.sh OUT  # smoke test
#
# Every run is `vlmdoctor profile ... --json OUT/NAME.json` under `timeout`, most important first
# (stage 2: padded, packed sdpa, packed flex), then stage 1, then compiled by region. After DEADLINE
# (epoch seconds) the remaining runs are skipped. OUT/varlen.md gets the table: real tokens/s,
# MFU, step ms, peak GiB, pad fraction, and the attention kernels' share of GPU time (from the
# trace window that profile records and diagnoses by default).
#
# Tokens per step are the same in every run: 32 samples per step. Padded: batch 32, length-bucketed,
# padded to a multiple of 64. Packed: the same 32 samples in rows of at most 2048 tokens (about 6
# rows of ~340-token samples), the row width padded to a multiple of 256 so that few shapes reach
# cuDNN's plan cache and FlexAttention's compile (its block is 128 tokens).
set -u
OUT=${1:?usage: bash bench/treat11/varlen.sh OUT}
MODEL=${MODEL:-0.5b}
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-15}
WARMUP=${WARMUP:-8}   # FlexAttention compiles its kernels (and recompiles once, for dynamic shapes) in the warm-up
PY=${PYTHON:-python3}
RUN_TIMEOUT=${RUN_TIMEOUT:-120}
. "$(dirname "$0")/../lib/timed_profile.sh"  # DEADLINE and RUN_TIMEOUT limit each run
bench_setup "$OUT"  # compiled kernels (FlexAttention's among them) shared between runs

COMMON="--model $MODEL --device $DEVICE --weight-dtype bf16 --batch-size 32 --no-gradient-checkpointing --lm-head-labeled-only"
PADDED="--sampler length_bucketed --pad-to-multiple-of 64"
PACKED="--packing --pack-length 2048 --pad-to-multiple-of 256"
CR="--compile default --compile-regions --warmup 12"
# name | stage | what | flags on top of COMMON
PLAN=$(cat <<PLAN
s2_padded|2|padded, bucketed, pad64 (sdpa)|$PADDED --fused-optimizer
s2_packed_sdpa|2|packed 2048 (sdpa, dense mask)|$PACKED --fused-optimizer
s2_packed_flex|2|packed 2048 (flex, document BlockMask)|$PACKED --fused-optimizer --attention flex
s1_padded|1|padded, bucketed, pad64 (sdpa)|$PADDED
s1_packed_sdpa|1|packed 2048 (sdpa, dense mask)|$PACKED
s1_packed_flex|1|packed 2048 (flex, document BlockMask)|$PACKED --attention flex
s2_packed_flex_cr|2|packed flex + compile by region|$PACKED --fused-optimizer --attention flex $CR
s2_padded_cr|2|padded + compile by region|$PADDED --fused-optimizer $CR
PLAN
)
RUNS=${RUNS:-$(echo "$PLAN" | cut -d'|' -f1 | tr '\n' ' ')}

for name in $RUNS; do
  line=$(echo "$PLAN" | grep "^$name|") || { echo "== $name: no such run"; continue; }
  stage=$(echo "$line" | cut -d'|' -f2)
  flags=$(echo "$line" | cut -d'|' -f4)
  echo "== $name: stage $stage, $(echo "$line" | cut -d'|' -f3)"
  # shellcheck disable=SC2086
  timed_profile "$name" "$OUT" $COMMON --stage "$stage" --steps "$STEPS" --warmup "$WARMUP" $flags
done

echo "$PLAN" > "$OUT/plan.txt"
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
plan = [line.split("|") for line in (out / "plan.txt").read_text().splitlines() if line.strip()]
rows = ["| run | stage | what | status | real tokens/s | vs padded | MFU | step ms | peak GiB | pad | attention share | attention kernels |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
base = {}
for name, stage, _, _ in plan:
    p = out / f"{name}.json"
    if name.endswith("_padded") and p.exists():
        base[stage] = (json.loads(p.read_text()).get("metrics") or {}).get("real_tokens_per_s")
for name, stage, what, _ in plan:
    p = out / f"{name}.json"
    if not p.exists():
        txt = out / f"{name}.txt"
        lines = txt.read_text().strip().splitlines() if txt.exists() else []
        rows.append(f"| {name} | {stage} | {what} | {lines[-1][:60] if lines else 'not run'} | | | | | | | | |")
        continue
    r = json.loads(p.read_text())
    m, f = r.get("metrics") or {}, r.get("facts") or {}
    tps = m.get("real_tokens_per_s")
    rel = f"{tps / base[stage]:.2f}x" if tps and base.get(stage) else ""
    pct = lambda v: f"{v * 100:.1f}%" if isinstance(v, (int, float)) else ""
    num = lambda v, fmt: format(v, fmt) if isinstance(v, (int, float)) else ""
    kinds = ",".join(f.get("attention.backends") or [])
    rows.append(f"| {name} | {stage} | {what} | {r.get('status')} | {num(tps, ',.0f')} | {rel} | {pct(m.get('mfu'))} "
                f"| {num(m.get('step_ms'), '.1f')} | {num(m.get('peak_mem_gb'), '.1f')} | {pct(m.get('pad_fraction'))} "
                f"| {pct(f.get('attention.kernel_share'))} | {kinds} |")
(out / "varlen.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PYEOF
