#!/usr/bin/env bash
# Record H100 traces of the training modes on the 0.5b preset into $OUT (issue 15).
#
#   OUT=/tmp/modes WHEELS=shared/wheels bash bench/modes15/record.sh
#
# Two kinds of input, both for the mode rules (docs/modes.md):
#   1. vlmdoctor's own runs (`vlmdoctor profile --trace-dir`): LoRA, QLoRA, DPO (full and LoRA), each
#      before and after the fix the doctor prescribes; report JSON + console text + a trace each;
#   2. a user's own script (train_modes.py, no vlmdoctor inside): the same modes, with
#      record_shapes, as a user profiles them.
# QLoRA and the paged optimizer need bitsandbytes, which the GPU image lacks: carry the wheel
#   bitsandbytes==0.50.2  bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl  (43.1 MB, 41.1 MiB)
# (its dependencies torch>=2.4, numpy>=1.17 and packaging>=20.9 are in the image) in $WHEELS; this script
# installs it with --no-deps. Without it the QLoRA runs end with vlmdoctor's one-line message (exit 2)
# and the rest still run. peft is in the image.
set -u
OUT=${OUT:-bench/results/modes15}
WHEELS=${WHEELS:-}
STEPS=${STEPS:-10}
MODEL=${MODEL:-0.5b}
DEVICE=${DEVICE:-cuda}  # cpu with MODEL=tiny only smoke-tests the script (QLoRA is refused there)
PY=${PYTHON:-python3}
mkdir -p "$OUT/traces"
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$(cd "$here/../.." && pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [ -n "$WHEELS" ] && ! $PY -c "import bitsandbytes" 2>/dev/null; then
  $PY -m pip install -q --no-deps "$WHEELS"/bitsandbytes-0.50.2-*.whl || echo "bitsandbytes install failed"
fi
$PY -c "import peft, torch; print('peft', peft.__version__, 'torch', torch.__version__)"
$PY -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" 2>&1 | tail -1

RUNS=${RUNS:-}  # a subset of the run names below (profile and user runs), space-separated; empty: all
ANALYZE=${ANALYZE:-1}  # 0: leave `vlmdoctor analyze` of the user traces to a machine without a GPU
want() { [ -z "$RUNS" ] || [[ " $RUNS " == *" $1 "* ]]; }
prof() {  # name, then profile flags
  local name="$1"; shift
  want "$name" || return 0
  echo "== $name $*"
  timeout 900 $PY -m vlmdoctor profile --model "$MODEL" --stage 2 --device "$DEVICE" --steps "$STEPS" --warmup 3 \
    --weight-dtype bf16 --trace-dir "$OUT/traces/$name" --trace-memory --json "$OUT/$name.json" --force "$@" \
    > "$OUT/$name.txt" 2>&1
  echo "   exit $?"
}
# LoRA: tiny GEMMs (fusion-lora-tiny-gemms), checkpointing it does not need (system-checkpoint-recompute)
prof lora_r16            --train lora
prof lora_r16_compiled   --train lora --compile default --warmup 10 --pad-to-multiple-of 64
prof lora_r16_nockpt     --train lora --no-gradient-checkpointing
# QLoRA: dequantization (precision-qlora-dequant); paged AdamW
prof qlora_r16           --train qlora
prof qlora_r16_paged8    --train qlora --optimizer paged_adamw_8bit
# DPO: a first script's reference (fp32 copy, grad tracking), then each fix
prof dpo_full            --objective dpo --batch-size 2 --num-samples 512
prof dpo_full_nograd_bf16 --objective dpo --batch-size 2 --num-samples 512 --dpo-reference-no-grad --dpo-reference-dtype bf16
prof dpo_full_precompute --objective dpo --batch-size 2 --num-samples 256 --dpo-reference-no-grad --dpo-precompute-reference
prof dpo_lora            --objective dpo --train lora --batch-size 2 --num-samples 512
prof dpo_lora_nograd     --objective dpo --train lora --batch-size 2 --num-samples 512 --dpo-reference-no-grad

# a user's own script, no vlmdoctor markers: the DPO reference forward is a range named as the user
# names it (TRL's method name), or not named at all (dpo_lora)
[ "$DEVICE" = cuda ] || exit 0
user() {
  local name="user_$1"; shift
  want "$name" || return 0
  name=${name#user_}
  echo "== user $name $*"
  timeout 600 $PY "$here/train_modes.py" --out "$OUT/traces/user_$name.pt.trace.json.gz" "$@" \
    >> "$OUT/user_results.jsonl" 2>> "$OUT/user_stderr.log" || echo "{\"failed\": \"$name\"}" >> "$OUT/user_results.jsonl"
}
user lora       --mode lora --ckpt
user qlora      --mode qlora --ckpt
user dpo        --mode dpo --batch-size 4
user dpo_nograd --mode dpo --batch-size 4 --no-grad-ref
user dpo_lora   --mode dpo --lora --batch-size 4 --ref-range ""

# the doctor on each trace, as a user runs it
for t in "$OUT"/traces/user_*.pt.trace.json.gz; do
  [ "$ANALYZE" = 1 ] || break
  [ -e "$t" ] || continue
  $PY -m vlmdoctor analyze "$t" --json "${t%.pt.trace.json.gz}.analysis.json" --force > "${t%.pt.trace.json.gz}.txt" 2>&1
done
$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'run':<24}{'status':>8}{'tok/s':>10}{'step ms':>9}{'MFU':>7}{'peak GB':>9}  findings")
for f in sorted(out.glob("*.json")):
    r = json.loads(f.read_text())
    m = r.get("metrics") or {}
    ids = [x["id"] for x in (r.get("diagnosis") or {}).get("findings", [])]
    mfu = f"{m['mfu']:.3f}" if m.get("mfu") else "-"
    print(f"{f.stem:<24}{r.get('status', '?'):>8}{m.get('real_tokens_per_s', 0):>10.0f}{m.get('step_ms', 0):>9.1f}"
          f"{mfu:>7}{m.get('peak_mem_gb') or 0:>9.1f}  {','.join(ids)}")
PYEOF
