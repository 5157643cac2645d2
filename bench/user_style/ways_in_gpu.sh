#!/usr/bin/env bash
# The three ways into a user's own training, on one GPU, each on a user-style script:
#   1. `vlmdoctor run --` on bench/user_style/train_native.py (LLaVA: SigLIP base/16 + Qwen2.5-0.5B, bf16,
#      batch 8, no profiler of its own), no code change;
#   2. `vlmdoctor.Doctor` in a plain loop (examples/train_llava_loop.py --api, a tiny LLaVA);
#   3. `vlmdoctor.DoctorCallback` in a transformers Trainer (examples/train_llava_trainer.py, a tiny LLaVA;
#      that example trains on the CPU, so its report has no GPU numbers and a null MFU with the reason).
#     bash bench/user_style/ways_in_gpu.sh OUTDIR
# Each way's console goes to OUTDIR/<way>.txt and its report to OUTDIR/<way>_report.json.
set -u
out="${1:?OUTDIR}"; mkdir -p "$out"
here="$(cd "$(dirname "$0")/../.." && pwd)"
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 COLUMNS=80
work=$(mktemp -d); cd "$work" || exit 1
timeout 300 python3 -m vlmdoctor run --out "$work/run" --warmup 5 --steps 20 --stop-after-window -- \
    python3 "$here/bench/user_style/train_native.py" --model llava --weights bf16 --batch-size 8 --steps 80 \
    --recipe none --out "$work/unused.json.gz" >"$out/run.txt" 2>&1
echo "run: exit $?" >>"$out/run.txt"; cp "$work/run/report.json" "$out/run_report.json"
timeout 200 python3 "$here/examples/train_llava_loop.py" --api --device cuda --steps 40 --out "$work/api" >"$out/api.txt" 2>&1
echo "api: exit $?" >>"$out/api.txt"; cp "$work/api/report.json" "$out/api_report.json"
timeout 200 python3 "$here/examples/train_llava_trainer.py" --steps 40 --out "$work/trainer" >"$out/trainer.txt" 2>&1
echo "trainer: exit $?" >>"$out/trainer.txt"; cp "$work/trainer/report.json" "$out/trainer_report.json"
