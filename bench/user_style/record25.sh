#!/usr/bin/env bash
# Record user-style traces of the VLM classes not yet in fixtures/user_traces/ on one GPU, each
# class healthy (bf16 weights, sdpa, no checkpointing) and sick, under a plain loop and under the
# HF Trainer.   bash bench/user_style/record25.sh OUTDIR      (about 6-7 minutes on one H100 80GB)
# Each line is one run of train_native.py in its own process (timeout 120 s); results.jsonl gets
# its printed summary (command, versions, device, timings, peak memory), stderr.log its stderr.
set -u
out="${1:?OUTDIR}"; mkdir -p "$out/traces"
here="$(dirname "$0")"
run() {  # name, then train_native.py flags
    local name="$1"; shift
    echo "== $name $*" | tee -a "$out/stderr.log" >&2
    local t0=$SECONDS
    timeout 120 python3 "$here/train_native.py" --out "$out/traces/$name.pt.trace.json.gz" "$@" \
        >>"$out/results.jsonl" 2>>"$out/stderr.log" \
        || echo "{\"failed\": \"$name\", \"rc\": $?}" >>"$out/results.jsonl"
    echo "   $name: $((SECONDS - t0)) s" >&2
}
# small traces: batch 4, text rows of 96-320 tokens plus the image tokens, 4 warm steps, then
# schedule(wait=1, warmup=1, active=2); no shapes, memory or stacks unless named
small=(--batch-size 4 --min-text 96 --max-text 320 --steps 4)
# Gemma3-4B widths, LLM cut to 8 of its 34 layers; SigLIP so400m/14-896 with its pooling head
run gemma3_healthy_s2          --model gemma3 --llm-layers 8 --weights bf16 "${small[@]}" --record-shapes
run gemma3_eager_s2            --model gemma3 --llm-layers 8 --weights bf16 --attn eager "${small[@]}"
# PaliGemma-3B widths, LLM cut to 12 of its 18 layers
run paligemma_healthy_s2       --model paligemma --llm-layers 12 --weights bf16 "${small[@]}"
run paligemma_fp32_autocast_s2 --model paligemma --llm-layers 12 --weights fp32 --autocast "${small[@]}"
# Qwen2.5-VL-3B widths, LLM cut to 12 of its 36 layers
run qwen25vl_healthy_s2        --model qwen2_5_vl --llm-layers 12 --weights bf16 "${small[@]}" --record-shapes
run qwen25vl_fp32_s2           --model qwen2_5_vl --llm-layers 12 --weights fp32 "${small[@]}"
# InternVL3-1B and SmolVLM-256M at full depth
run internvl_healthy_s2        --model internvl --weights bf16 "${small[@]}"
run internvl_ckpt_spare_s2     --model internvl --weights bf16 --ckpt "${small[@]}"
run smolvlm_eager_s2           --model smolvlm --weights bf16 --attn eager "${small[@]}"
# the HF Trainer: bf16=True (autocast) as users set it, a TrainerCallback starting the profiler
run internvl_trainer_healthy_s2       --trainer --model internvl --weights bf16 --autocast "${small[@]}" --loader-workers 2
run gemma3_trainer_healthy_s2         --trainer --model gemma3 --llm-layers 8 --weights bf16 --autocast "${small[@]}" --loader-workers 0
run qwen25vl_trainer_fp32_autocast_s2 --trainer --model qwen2_5_vl --llm-layers 12 --weights fp32 --autocast "${small[@]}" --loader-workers 2
run smolvlm_trainer_ckpt_spare_s2     --trainer --model smolvlm --weights bf16 --autocast --ckpt "${small[@]}" --loader-workers 2
run paligemma_trainer_eager_s2        --trainer --model paligemma --llm-layers 12 --weights bf16 --autocast --attn eager "${small[@]}" --loader-workers 2
ls -la "$out/traces" >&2
