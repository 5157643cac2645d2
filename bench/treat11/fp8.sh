#!/usr/bin/env bash
# FP8 training (torchao.float8, the --fp8 knob) on one H100, issue 11: where it pays and where it does not.
# The healthy stage-2 config, compiled by region, with --fp8 off / tensorwise / rowwise, at 1.5b (wide
# GEMMs, the GPU busy: where precision-fp8-gemm fires) and at 0.5b (hidden 896, a host-bound step: where
# it should not pay). Each run is `vlmdoctor profile ... --json OUT/NAME.json` in its own process, with
# the traced window diagnosed (the table's FP8 share and findings come from it); then OUT/fp8.md.
#
#   bash bench/treat11/fp8.sh OUT                               # about 300 s of H100 time, 1.5b first
#   TORCHAO_WHEEL=/path/torchao-0.17.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl \
#       bash bench/treat11/fp8.sh OUT                           # installs the wheel into OUT/.torchao first
#   RUNS="1.5b_off 1.5b_tensorwise" bash bench/treat11/fp8.sh OUT   # a subset, in the order given
#   DEADLINE=$(( $(date +%s) + 280 )) bash bench/treat11/fp8.sh OUT # runs that would start later are skipped
#
# Without DEADLINE the script gives itself BUDGET_S (300) seconds from its start. Each run is stopped
# after RUN_TIMEOUT (150) seconds or at the deadline, whichever comes first; a skipped or stopped run
# is a row that says so. The compiled runs share one Inductor/Triton cache under OUT.
set -u
OUT=${1:?usage: bash bench/treat11/fp8.sh OUTDIR}
PY=${PYTHON:-python3}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-10}
RUN_TIMEOUT=${RUN_TIMEOUT:-150}
DEADLINE=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-300} ))}
DEVICE=${DEVICE:-cuda}
. "$(dirname "$0")/../lib/timed_profile.sh"
bench_setup "$OUT"
export COLUMNS=80

if ! $PY -c "import torchao.float8" 2>/dev/null; then
  if [ -n "${TORCHAO_WHEEL:-}" ]; then  # offline: the wheel alone (torchao has no runtime dependencies)
    $PY -m pip install -q --no-deps --target "$OUT/.torchao" "$TORCHAO_WHEEL" || echo "== could not install $TORCHAO_WHEEL"
    export PYTHONPATH="$PYTHONPATH:$OUT/.torchao"
  fi
  $PY -c "import torchao.float8" 2>/dev/null \
    || echo "== torchao.float8 cannot be imported: the --fp8 runs will end with a usage error (set TORCHAO_WHEEL)"
fi
$PY -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)" 2>/dev/null \
  | tee "$OUT/versions.txt"

HEALTHY="--stage 2 --device $DEVICE --weight-dtype bf16 --batch-size 16 --pad-to-multiple-of 64 --sampler length_bucketed \
--no-gradient-checkpointing --lm-head-labeled-only --fused-optimizer --compile default --compile-regions"
# name | model | fp8 recipe   (the order is the order of importance: 1.5b off vs tensorwise first)
PLAN="1.5b_off|1.5b|off
1.5b_tensorwise|1.5b|tensorwise
0.5b_off|0.5b|off
0.5b_tensorwise|0.5b|tensorwise
1.5b_rowwise|1.5b|rowwise
0.5b_rowwise|0.5b|rowwise"
RUNS=${RUNS:-$(echo "$PLAN" | cut -d'|' -f1 | tr '\n' ' ')}
echo "$PLAN" > "$OUT/plan.txt"

for name in $RUNS; do
  line=$(echo "$PLAN" | grep "^$name|") || { echo "unknown run $name"; continue; }
  model=$(echo "$line" | cut -d'|' -f2); recipe=$(echo "$line" | cut -d'|' -f3)
  echo "== $name: --model $model --fp8 $recipe"
  # shellcheck disable=SC2086
  MIN_LEFT=45 timed_profile "$name" "$OUT" --model "$model" $HEALTHY --fp8 "$recipe" --steps "$STEPS" --warmup "$WARMUP"
done

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
plan = [line.split("|") for line in (out / "plan.txt").read_text().splitlines() if line.strip()]
base = {}
for name, model, recipe in plan:
    p = out / f"{name}.json"
    if recipe == "off" and p.exists():
        base[model] = (json.loads(p.read_text()).get("metrics") or {}).get("real_tokens_per_s")
rows = ["| run | status | tokens/s | vs off | MFU | step ms | peak GiB | FP8 GEMM share | bf16 GEMM of GPU "
        "| FP8 layers | FP8 rule |", "|---|---|---|---|---|---|---|---|---|---|---|"]
for name, model, recipe in plan:
    p, txt = out / f"{name}.json", out / f"{name}.txt"
    if not p.exists():
        why = txt.read_text().strip().splitlines()[-1][:70] if txt.exists() and txt.read_text().strip() else "not run"
        rows.append(f"| {name} | {why} | | | | | | | | | |")
        continue
    r = json.loads(p.read_text())
    m, f = r.get("metrics") or {}, r.get("facts") or {}
    tps = m.get("real_tokens_per_s")
    rel = f"{tps / base[model]:.2f}x" if tps and base.get(model) else ""
    pct = lambda v: f"{v * 100:.1f}%" if isinstance(v, (int, float)) else ""
    layers = ((r.get("mode") or {}).get("fp8") or {}).get("converted_linear_layers", "")
    ids = [x.get("id") for x in r.get("findings") or []]
    rule = "fires" if "precision-fp8-gemm" in ids else ("quiet" if f else "not diagnosed")
    status = r.get("status") if r.get("status") == "ok" else f"{r.get('status')}: {((r.get('error') or {}).get('message') or '')[:50]}"
    rows.append(f"| {name} | {status} | {tps or 0:,.0f} | {rel} | {pct(m.get('mfu'))} | {m.get('step_ms') or 0:.1f} "
                f"| {m.get('peak_mem_gb') or 0:.1f} | {pct(f.get('gemm.fp8_share'))} | {pct(f.get('gemm.bf16_share_of_gpu'))} "
                f"| {layers} | {rule} |")
note = ("MFU counts model FLOPs against the bf16 dense peak, FP8 runs included. FP8 GEMM share: FP8 kernels' share "
        "of GEMM time in the traced window; bf16 GEMM of GPU: bf16 tensor-core GEMMs' share of GPU kernel time.")
(out / "fp8.md").write_text("\n".join(rows) + "\n\n" + note + "\n")
print("\n".join(rows))
PYEOF
