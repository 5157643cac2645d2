#!/usr/bin/env bash
# The three ways into a user's own training, on one GPU, on the user-style example scripts at --size 0.5b
# (LlavaForConditionalGeneration: SigLIP base/16-224 + Qwen2.5-0.5B, random weights, a bf16 checkpoint made
# locally and loaded with from_pretrained, a DataLoader, AdamW):
#   1. run:     vlmdoctor run -- python examples/train_llava_loop.py   (the script unchanged)
#   2. api:     vlmdoctor.Doctor in the same loop                       (examples/train_llava_loop.py --api)
#   3. trainer: vlmdoctor.DoctorCallback in transformers.Trainer        (examples/train_llava_trainer.py)
#
#     bash bench/user_style/ways_in_gpu.sh OUTDIR                          # one GPU
#     SIZE=tiny DEVICE=cpu bash bench/user_style/ways_in_gpu.sh OUTDIR     # the same steps on a CPU, tiny
#
# OUTDIR gets 6 files: <way>.txt (what the user sees: the script's output, vlmdoctor's progress lines, the
# report, the summary; 80 columns; its last line the exit code) and <way>_report.json. The traces, the HTML
# pages and the checkpoint stay in a temporary folder, removed at the end.
. "$(dirname "$0")/ways_common.sh"
loop="$here/examples/train_llava_loop.py"
size="${SIZE:-0.5b}" device="${DEVICE:-cuda}"
way run 120 python3 -m vlmdoctor run --out "$work/run" --warmup 5 --steps 20 --stop-after-window -- \
    python3 "$loop" --size "$size" --device "$device" --batch-size 8 --steps 200
way api 90 python3 "$loop" --size "$size" --device "$device" --batch-size 8 --steps 30 --api --out "$work/api"
way trainer 90 python3 "$here/examples/train_llava_trainer.py" --size "$size" --device "$device" --batch-size 8 \
    --steps 30 --out "$work/trainer"
