#!/usr/bin/env bash
# Record the user-style trace fixtures (fixtures/user_traces/) on one GPU.
#   bash bench/user_style/record.sh OUTDIR
# Each line is one run of train_native.py in its own process; results.jsonl gets its printed summary.
set -u
out="${1:?OUTDIR}"; mkdir -p "$out/traces"
here="$(dirname "$0")"
run() {  # name, then train_native.py flags
    local name="$1"; shift
    echo "== $name $*" >&2
    timeout 300 python3 "$here/train_native.py" --out "$out/traces/$name.pt.trace.json.gz" "$@" \
        >>"$out/results.jsonl" 2>>"$out/stderr.log" || echo "{\"failed\": \"$name\", \"rc\": $?}" >>"$out/results.jsonl"
}
# the issue's recipe: schedule(wait=1, warmup=1, active=2), no shapes, no memory, batches built in the loop
run llava_fp32_autocast_ckpt_s2 --model llava --weights fp32 --autocast --ckpt --stage 2
run llava_fp32_s1               --model llava --weights fp32 --stage 1
run llava_fce_s2                --model llava --weights bf16 --stage 2 --liger fused_linear_cross_entropy
run llava_ckpt_spare_s2         --model llava --weights bf16 --ckpt --stage 2 --profile-memory
run llava_healthy_s2            --model llava --weights bf16 --stage 2 --batch-size 16 --with-modules --record-shapes
# other classes and other recipes: a plain `with profile()` (no ProfilerStep), stacks, a DataLoader
run qwen2vl_fp32_autocast_s2    --model qwen2vl --weights fp32 --autocast --ckpt --stage 2 --recipe plain --with-modules --batch-size 4
run qwen2vl_fce_s2              --model qwen2vl --weights bf16 --stage 2 --liger fused_linear_cross_entropy,rms_norm,swiglu,rope --batch-size 4
run smolvlm_healthy_s1_loader   --model smolvlm --weights bf16 --stage 1 --dataloader --with-stack --active 1 --batch-size 16
# added for issue 11's data-loader rule: the DataLoader without workers, its batches built in the training process
run llava_loader_main_s2        --model llava --weights bf16 --stage 2 --batch-size 16 --dataloader --loader-workers 0
ls -la "$out/traces" >&2
