#!/usr/bin/env bash
# The user's own data-parallel script on two GPUs of one host, under the launchers VLM training uses:
#   1. torchrun:   vlmdoctor run -- torchrun --standalone --nproc-per-node 2 examples/train_ddp.py   (unchanged)
#   2. accelerate: vlmdoctor run -- accelerate launch --multi_gpu --num_processes 2 examples/train_ddp.py
#   3. api:        torchrun ... examples/train_ddp.py --api   (vlmdoctor.Doctor on every rank, rank 0 reports)
# examples/train_ddp.py is the LLaVA of train_llava_loop.py (--size 0.5b: SigLIP base/16-224 + Qwen2.5-0.5B,
# random weights saved as a local bf16 checkpoint, loaded with from_pretrained) under plain DDP over NCCL.
#
#     bash bench/user_style/ways_in_2gpu.sh OUTDIR
#
# OUTDIR gets 6 files: <way>.txt (what the user sees, 80 columns, its last line the exit code) and
# <way>_report.json. Traces and the checkpoint stay in a temporary folder, removed at the end.
. "$(dirname "$0")/ways_common.sh"
ddp="$here/examples/train_ddp.py"
size="${SIZE:-0.5b}"
# the checkpoint is made once, before the timed runs (one process)
python3 -c "import sys; sys.path.insert(0, '$here/examples'); from train_llava_loop import checkpoint; checkpoint('$size')" \
    >"$work/checkpoint.log" 2>&1 || { cat "$work/checkpoint.log"; exit 1; }
way torchrun 200 python3 -m vlmdoctor run --out "$work/torchrun" --warmup 5 --steps 20 --stop-after-window -- \
    torchrun --standalone --nproc-per-node 2 "$ddp" --size "$size" --batch-size 8 --steps 300
way accelerate 200 python3 -m vlmdoctor run --out "$work/accelerate" --warmup 5 --steps 20 --stop-after-window -- \
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    "$ddp" --size "$size" --batch-size 8 --steps 300
way api 200 torchrun --standalone --nproc-per-node 2 "$ddp" --size "$size" --batch-size 8 --steps 40 --api \
    --out "$work/api"
