#!/usr/bin/env bash
# Record the labelled corpus (labels.yaml) on one machine with 2 GPUs, in about 7-9 minutes wall time:
#
#     bash bench/corpus/record.sh OUTDIR [COPY_TO]
#
#   1. the one-GPU runs of habits.py in two parallel lanes (CUDA_VISIBLE_DEVICES=0 and =1), each run
#      under `timeout`, a failure recorded in results.jsonl and the batch going on;
#   2. the torchrun runs of dist_habits.py on both GPUs (NCCL), in two groups (DDP, FSDP2);
#   3. everything packed into OUTDIR/corpus.tar (split into corpus.tar.partNN of 15 MB if it is larger).
#
# OUTDIR gets traces/NAME.pt.trace.json.gz (one GPU), dist/NAME/rankK.pt.trace.json.gz, results.jsonl
# (one JSON line per run: the scripts' own lines, or {"failed": NAME, "rc": ...}), stderr.log, env.txt.
# Runs that would start after BUDGET_S seconds (default 480) are skipped and said so in results.jsonl;
# every timeout is cut so that the batch, packing included, ends by DEADLINE_S (default 560: the device
# tool runs a command for at most 600 s). COPY_TO (e.g. "$OUT" of the device tool): the tar (or its
# parts), results.jsonl and env.txt are copied there, at most 6 files.
#
# Environment: NPROC (ranks of the torchrun runs, default 2; 4 on a 4-GPU machine), BUDGET_S, DEADLINE_S,
# TINY=1 DEVICE=cpu (a CPU smoke test of the whole batch: --tiny, --device cpu, gloo), ONLY (a regex:
# only the runs whose name matches), PYTHON (default python3), TORCHRUN (default torchrun).
set -u
out="${1:?usage: record.sh OUTDIR [COPY_TO]}"
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$out/traces" "$out/dist"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY="${PYTHON:-python3}"
TORCHRUN="${TORCHRUN:-torchrun}"
NPROC="${NPROC:-2}"
BUDGET_S="${BUDGET_S:-480}"
DEADLINE_S="${DEADLINE_S:-560}"
ONLY="${ONLY:-.}"
DEVICE="${DEVICE:-cuda}"
extra=(--device "$DEVICE")
[ "${TINY:-0}" = 1 ] && extra+=(--tiny)
slow=1
[ "${TINY:-0}" = 1 ] && slow=4     # the CPU smoke test: longer limits, no budget
T_ONE="${T_ONE:-$((150 * slow))}"         # seconds per one-GPU run
T_COMPILE="${T_COMPILE:-$((240 * slow))}" # the torch.compile run
T_DDP="${T_DDP:-$((240 * slow))}"         # the DDP group (8 habits in one torchrun)
T_FSDP="${T_FSDP:-$((150 * slow))}"       # the FSDP2 group (3 habits)
[ "${TINY:-0}" = 1 ] && { BUDGET_S="${BUDGET_S_TINY:-100000}"; DEADLINE_S="${DEADLINE_S_TINY:-100000}"; }

{
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    echo "host: $(hostname)  nproc: $(nproc)"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    echo "command: bash bench/corpus/record.sh $*  NPROC=$NPROC BUDGET_S=$BUDGET_S DEADLINE_S=$DEADLINE_S TINY=${TINY:-0} DEVICE=$DEVICE"
} >"$out/env.txt" 2>&1
cat "$out/env.txt" >&2

# "name model habit [ENV=VALUE ...] [--habits.py-flag=value ...]": one line per one-GPU run; lane A and
# lane B run side by side (lane A starts with the one torch.compile run, the longest)
LANE_A=(
    "deepseekvl_compile_static  deepseek_vl   compile_static      --llm-layers=2"
    "idefics2_healthy           idefics2      healthy"
    "glm4v_empty_cache          glm4v         empty_cache"
    "aya_sdpa_math              aya_vision    sdpa_math"
    "blip2_fp16_scaler          blip2         fp16_scaler"
    "mllama_pageable_h2d        mllama        pageable_h2d"
    "idefics2_log_tensors       idefics2      log_tensors"
    "mllama_deterministic       mllama        deterministic       CUBLAS_WORKSPACE_CONFIG=:4096:8"
    "qwen3vlmoe_tiny_batch      qwen3_vl_moe  moe_tiny_batch"
    "idefics2_spare_ckpt        idefics2      spare_checkpointing"
    "qwen3vl_tiny_ops           qwen3_vl      tiny_ops            --max-text=640 --batch-size=4"
    "idefics2_tuned             idefics2      tuned"
)
LANE_B=(
    "qwen3vl_healthy            qwen3_vl      healthy             --record-shapes"
    "mistral3_healthy           mistral3      healthy"
    "glm4v_cudnn_benchmark      glm4v         cudnn_benchmark"
    "deepseekvl_tokenize        deepseek_vl   tokenize_in_loop"
    "janus_eval_in_window       janus         eval_in_window"
    "mistral3_checkpoint_save   mistral3      checkpoint_save"
    "deepseekvl_launch_blocking deepseek_vl   launch_blocking     CUDA_LAUNCH_BLOCKING=1"
    "aya_forloop_adamw          aya_vision    forloop_adamw"
    "janus_fp32_weights         janus         fp32_weights"
    "blip2_eager_attention      blip2         eager_attention"
    "mistral3_loader_python     mistral3      loader_python"
    "idefics2_logits_to_cpu     idefics2      logits_to_cpu"
    "qwen3vlmoe_healthy         qwen3_vl_moe  healthy"
    "qwen3vl_tuned              qwen3_vl      tuned               --record-shapes"
    "mistral3_tuned             mistral3      tuned"
)

t_start=0  # seconds since the script started (bash's SECONDS)
say() { echo "[record $(date -u +%H:%M:%S) +$((SECONDS - t_start))s] $*" >&2; }

cap() {  # a timeout, cut to what is left before the deadline less 30 s for the packing
    local left=$((DEADLINE_S - SECONDS - 30))
    if (( left < $1 )); then echo "$left"; else echo "$1"; fi
}

one() {  # lane gpu "name model habit [ENV=V ...]"
    local lane="$1" gpu="$2"; shift 2
    read -r name model habit rest <<<"$1"
    local envs=() args=()
    for tok in ${rest:-}; do [[ "$tok" == --* ]] && args+=("$tok") || envs+=("$tok"); done
    [[ "$name" =~ $ONLY ]] || return 0
    if (( SECONDS - t_start > BUDGET_S )); then
        say "lane $lane: $name skipped (past the ${BUDGET_S}s budget)"
        echo "{\"skipped\": \"$name\", \"reason\": \"budget\"}" >>"$out/results.lane$lane.jsonl"
        return 0
    fi
    local limit=$T_ONE t0=$SECONDS rc
    [ "$habit" = compile_static ] && limit=$T_COMPILE
    limit=$(cap "$limit")
    if (( limit < 20 )); then
        say "lane $lane: $name skipped (too close to the ${DEADLINE_S}s deadline)"
        echo "{\"skipped\": \"$name\", \"reason\": \"deadline\"}" >>"$out/results.lane$lane.jsonl"
        return 0
    fi
    say "lane $lane (gpu $gpu): $name = $model / $habit ${rest:-}"
    env CUDA_VISIBLE_DEVICES="$gpu" "${envs[@]}" timeout -k 10 "$limit" "$PY" "$here/habits.py" --model "$model" \
        --habit "$habit" --out "$out/traces/$name.pt.trace.json.gz" "${extra[@]}" "${args[@]}" \
        >"$out/.lane$lane.out" 2>"$out/.lane$lane.err"
    rc=$?
    { echo "===== $name ($model / $habit) rc=$rc"; cat "$out/.lane$lane.err"; } >>"$out/stderr.lane$lane.log"
    if [ $rc -eq 0 ] && [ -s "$out/.lane$lane.out" ]; then
        tail -n 1 "$out/.lane$lane.out" | sed "s/^{/{\"name\": \"$name\", /" >>"$out/results.lane$lane.jsonl"
        say "lane $lane: $name ok in $((SECONDS - t0))s ($(stat -c %s "$out/traces/$name.pt.trace.json.gz" 2>/dev/null || echo 0) bytes)"
    else
        echo "{\"failed\": \"$name\", \"model\": \"$model\", \"habit\": \"$habit\", \"rc\": $rc, \"s\": $((SECONDS - t0))}" >>"$out/results.lane$lane.jsonl"
        say "lane $lane: $name FAILED rc=$rc after $((SECONDS - t0))s: $(tail -n 1 "$out/.lane$lane.err" | cut -c1-200)"
    fi
}

lane() {  # lane gpu runs...
    local lane="$1" gpu="$2"; shift 2
    for r in "$@"; do one "$lane" "$gpu" "$r"; done
}

say "one-GPU runs: ${#LANE_A[@]} on gpu 0, ${#LANE_B[@]} on gpu 1"
gpu_b=1
[ "$DEVICE" = cpu ] && gpu_b=""
lane A 0 "${LANE_A[@]}" &
pid_a=$!
lane B "$gpu_b" "${LANE_B[@]}" &
pid_b=$!
wait $pid_a $pid_b
cat "$out"/results.laneA.jsonl "$out"/results.laneB.jsonl >>"$out/results.jsonl" 2>/dev/null
cat "$out"/stderr.laneA.log "$out"/stderr.laneB.log >>"$out/stderr.log" 2>/dev/null
rm -f "$out"/.lane* "$out"/results.lane*.jsonl "$out"/stderr.lane*.log
say "one-GPU runs done"

group() {  # name limit habits
    local gname="$1" limit="$2" habits="$3" t0=$SECONDS rc
    local sel=""
    for h in ${habits//,/ }; do [[ "dist_$h" =~ $ONLY ]] && sel="$sel,$h"; done
    sel="${sel#,}"
    [ -z "$sel" ] && return 0
    if (( SECONDS - t_start > BUDGET_S + 60 )); then
        say "dist $gname skipped (past the budget)"
        echo "{\"skipped\": \"dist_$gname\", \"habits\": \"$sel\", \"reason\": \"budget\"}" >>"$out/results.jsonl"
        return 0
    fi
    limit=$(cap "$limit")
    if (( limit < 30 )); then
        say "dist $gname skipped (too close to the ${DEADLINE_S}s deadline)"
        echo "{\"skipped\": \"dist_$gname\", \"habits\": \"$sel\", \"reason\": \"deadline\"}" >>"$out/results.jsonl"
        return 0
    fi
    say "dist $gname ($NPROC ranks, limit ${limit}s): $sel"
    timeout -k 15 "$limit" "$TORCHRUN" --standalone --nproc-per-node "$NPROC" "$here/dist_habits.py" \
        --outdir "$out/dist" --habits "$sel" "${extra[@]}" >"$out/.dist.out" 2>"$out/.dist.err"
    rc=$?
    { echo "===== dist $gname ($sel) rc=$rc"; cat "$out/.dist.err"; } >>"$out/stderr.log"
    grep '^{' "$out/.dist.out" | sed 's/^{"habit": "\([a-z0-9_]*\)"/{"name": "dist_\1", "habit": "\1"/' >>"$out/results.jsonl"
    for h in ${sel//,/ }; do
        grep -q "\"habit\": \"$h\"" "$out/.dist.out" || \
            echo "{\"failed\": \"dist_$h\", \"habit\": \"$h\", \"rc\": $rc, \"group\": \"$gname\"}" >>"$out/results.jsonl"
    done
    rm -f "$out/.dist.out" "$out/.dist.err"
    say "dist $gname: rc=$rc in $((SECONDS - t0))s; $(ls "$out/dist" | wc -l) run folders so far"
}

if [ "$DEVICE" = cpu ] || [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge "$NPROC" ]; then
    group ddp "$T_DDP" ddp_healthy,ddp_find_unused,ddp_bucket1,ddp_bucket100,ddp_accum_sync,ddp_accum_nosync,ddp_long_rank1,ddp_slow_loader_rank1
    group fsdp "$T_FSDP" fsdp2_reshard,fsdp2_noreshard,fsdp2_prefetch2
else
    say "fewer than $NPROC GPUs: the torchrun runs are skipped"
    echo "{\"skipped\": \"dist\", \"reason\": \"fewer than $NPROC GPUs\"}" >>"$out/results.jsonl"
fi

# pack: one tar (the traces are gzipped already; the log is gzipped here)
cp "$here/labels.yaml" "$out/labels.yaml" 2>/dev/null
gzip -9 -c "$out/stderr.log" >"$out/stderr.log.gz"
members=()
for m in traces dist results.jsonl stderr.log.gz env.txt labels.yaml; do [ -e "$out/$m" ] && members+=("$m"); done
( cd "$out" && tar -cf corpus.tar "${members[@]}" )
size=$(stat -c %s "$out/corpus.tar")
n_ok=$(grep -c '^{"name"' "$out/results.jsonl" || true)
n_bad=$(grep -c '^{"failed"\|^{"skipped"' "$out/results.jsonl" || true)
n_bad_dist=$(grep -c '"failed": \[' "$out/results.jsonl" || true)
if [ "$size" -gt 15000000 ]; then
    split -b 15000000 -d -a 2 "$out/corpus.tar" "$out/corpus.tar.part"
    rm "$out/corpus.tar"
    say "corpus.tar was $size bytes: split into $(ls "$out"/corpus.tar.part* | wc -l) parts of at most 15 MB" \
        "(join: cat corpus.tar.part* > corpus.tar)"
    ls -la "$out"/corpus.tar.part* >&2
else
    say "corpus.tar: $size bytes"
fi
say "done in $((SECONDS - t_start))s: $n_ok runs recorded ($n_bad_dist of them with a failed rank), $n_bad failed or skipped (results.jsonl)"
if [ -n "${2:-}" ]; then
    mkdir -p "$2"
    cp "$out"/corpus.tar* "$out/results.jsonl" "$out/env.txt" "$2"/
    say "copied to $2: $(cd "$2" && ls | tr '\n' ' ')"
fi
