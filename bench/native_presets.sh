#!/usr/bin/env bash
# Profile each full-size native transformers preset on one GPU, stage 1 and stage 2, and write the
# reports (JSON + the console text with prescriptions) to $OUT (default: bench/results/native).
#
#   OUT=/tmp/native bash bench/native_presets.sh            # all three presets, default knobs
#   PRESETS="qwen2-vl-2b" STEPS=10 bash bench/native_presets.sh
#   EXTRA="--weight-dtype bf16 --liger" bash bench/native_presets.sh   # any profile flags, for every run
#
# Each run is its own process (Liger patches classes globally). A run that fails (OOM, a crash in
# a step) still writes its report; the script goes on and prints a one-line summary per run at
# the end. liger-kernel must be importable for Liger flags (on the device machine: carry the wheel).
set -u
OUT=${OUT:-bench/results/native}
PRESETS=${PRESETS:-"llava-siglip2-0.5b qwen2-vl-2b smolvlm-256m"}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-5}
EXTRA=${EXTRA:-}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$(cd "$(dirname "$0")/.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

for preset in $PRESETS; do
  for stage in 1 2; do
    name="${preset}_s${stage}"
    echo "== $name"
    # shellcheck disable=SC2086
    $PY -m vlmdoctor profile --model "$preset" --stage "$stage" --device cuda --steps "$STEPS" --warmup "$WARMUP" \
      --json "$OUT/$name.json" --force $EXTRA > "$OUT/$name.txt" 2>&1
    echo "   exit $?"
  done
done

$PY - "$OUT" $PRESETS <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'run':<26}{'status':>8}{'tok/s':>10}{'step ms':>9}{'MFU':>7}{'peak GB':>9}  trainable")
for preset in sys.argv[2:]:
    for stage in (1, 2):
        p = out / f"{preset}_s{stage}.json"
        if not p.exists():
            print(f"{preset + ' s' + str(stage):<26}{'no report':>8}")
            continue
        r = json.loads(p.read_text())
        m, params = r.get("metrics") or {}, (r.get("model") or {}).get("params") or {}
        mfu = m.get("mfu")
        print(f"{preset + ' s' + str(stage):<26}{r['status']:>8}{m.get('real_tokens_per_s', 0):>10.0f}"
              f"{m.get('step_ms', 0):>9.1f}{(mfu or 0) * 100:>6.1f}%{m.get('peak_mem_gb') or 0:>9.1f}"
              f"  {params.get('trainable', 0) / 1e6:,.1f}M")
EOF
