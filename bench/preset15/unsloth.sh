#!/usr/bin/env bash
# Liger vs Unsloth vs torch.compile on the same model and stage, one H100 (seed 004).
# Needs the trimmed site folder from bench/preset15/unsloth_carry.sh, carried as `.unsloth`:
#
#   run(command="OUT=$OUT bash bench/preset15/unsloth.sh", carry=[".unsloth"], kind="nvidia-h100-x1")
#   MODEL=dino-135m OUT=$OUT bash bench/preset15/unsloth.sh     # a Llama LLM instead of 0.5b's Qwen2
#
# Every arm: bf16 weights, batch 16, padded to 64, no gradient checkpointing (Unsloth brings its
# own), the same steps. Each arm is its own process: Unsloth and Liger patch transformers classes
# process-wide. Reports and console text go to $OUT, a table to $OUT/unsloth.md.
set -u
OUT=${OUT:-bench/results/unsloth}
MODEL=${MODEL:-0.5b}
STAGE=${STAGE:-2}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-10}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -f "$ROOT/.unsloth/site.tar.xz" ]; then
  mkdir -p /tmp/unsloth && tar xJf "$ROOT/.unsloth/site.tar.xz" -C /tmp/unsloth
  export PYTHONPATH="$ROOT:/tmp/unsloth/site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .unsloth/site.tar.xz: the Unsloth (and Liger) arms will end with a usage error"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
export TORCHINDUCTOR_CACHE_DIR="$OUT/compile-cache/inductor" TRITON_CACHE_DIR="$OUT/compile-cache/triton"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
$PY -c "import unsloth, unsloth_zoo, bitsandbytes, xformers, trl; print('unsloth', unsloth.__version__)" 2>&1 | tail -3

BASE="--model $MODEL --stage $STAGE --device cuda --weight-dtype bf16 --batch-size 16 --pad-to-multiple-of 64
      --no-gradient-checkpointing --steps $STEPS --warmup $WARMUP"
ARMS="eager|
unsloth|--unsloth
liger|--liger --liger-fused-ce
liger_no_fce|--liger
compile|--compile default"
echo "$ARMS" | while IFS='|' read -r name flags; do
  echo "== $name"
  # shellcheck disable=SC2086
  $PY -m vlmdoctor profile $BASE $flags --json "$OUT/$name.json" --force > "$OUT/$name.txt" 2>&1
  echo "   exit $?"
done

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rows = ["| arm | status | tokens/s | vs eager | step ms | peak GiB | compile s |", "|---|---|---|---|---|---|---|"]
base = None
for name in ("eager", "liger", "liger_no_fce", "compile", "unsloth"):
    p = out / f"{name}.json"
    if not p.exists():
        txt = (out / f"{name}.txt").read_text().strip().splitlines() if (out / f"{name}.txt").exists() else ["not run"]
        rows.append(f"| {name} | {txt[-1][:70] if txt else 'no output'} | | | | | |")
        continue
    m = json.loads(p.read_text()).get("metrics") or {}
    tps = m.get("real_tokens_per_s")
    base = tps if name == "eager" else base
    rel = f"{tps / base:.2f}x" if tps and base else ""
    rows.append(f"| {name} | {json.loads(p.read_text()).get('status')} | {tps or 0:,.0f} | {rel} | "
                f"{m.get('step_ms') or 0:.1f} | {m.get('peak_mem_gb') or 0:.1f} | {m.get('compile_s') or 0:.0f} |")
(out / "unsloth.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PYEOF
