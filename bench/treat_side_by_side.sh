#!/usr/bin/env bash
# Issue 39 on a host with several GPUs: `vlmdoctor treat` from the default config, one independent run
# on each GPU of TREAT_GPUS, side by side, and the hand-tuned HF Trainer peer (bench/peer_trainer.py,
# tuned recipe: bf16 weights, Liger, fused AdamW, 8 workers, length grouping, padding to 64) on the
# GPUs of PEERS (gpu:batch,batch ...: the batch swept, one fresh process each), in the same command so
# that both sides share the machine.
#
#   OUT=DIR MODEL=qwen2-vl-2b BUDGET=500 TREAT_GPUS="0 1" PEERS="2:64,80 3:48,56" bash bench/treat_side_by_side.sh
#
# TREATS (instead of TREAT_GPUS and MODEL) names each treatment's GPUs and model: "0:llava-siglip2-0.5b
# 2,3:qwen2-vl-2b" runs a one-GPU treatment on GPU 0 and one on GPUs 2 and 3 with --trial-gpus 2 (its first GPU
# runs the sequential states, both its lanes and ablation arms). A peer may share a GPU with such a treatment's
# second GPU while the treatment is still in its sequential states (start, sizing: a few minutes).
#
# DIR/treat_<first gpu>.json, DIR/peer_g<gpu>.jsonl (one JSON line per batch), DIR/env.txt and, at the end,
# DIR/logs.tgz (every console). The treatments' own folders (--out) are under /tmp.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?OUT=DIR}"; MODEL="${MODEL:-qwen2-vl-2b}"; BUDGET="${BUDGET:-500}"
TREAT_GPUS="${TREAT_GPUS-0 1 2}"; PEERS="${PEERS-3:48,64}"  # "" runs none (unset: the default)
TREATS="${TREATS-$(for g in $TREAT_GPUS; do printf '%s:%s ' "$g" "$MODEL"; done)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
W=/tmp/treat_side_by_side; mkdir -p "$OUT" "$W"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>&1
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "command: OUT=$OUT MODEL=$MODEL BUDGET=$BUDGET TREATS=\"$TREATS\" PEERS=\"$PEERS\" bash bench/treat_side_by_side.sh"
} >"$OUT/env.txt"
for spec in $TREATS; do
  gpus="${spec%%:*}"; model="${spec#*:}"; g="${gpus%%,*}"; n=$(tr , '\n' <<<"$gpus" | wc -l)
  ( CUDA_VISIBLE_DEVICES=$gpus timeout -k 10 $((BUDGET + 60)) python -m vlmdoctor treat --model "$model" --stage 2 \
      --time-budget "$BUDGET" --trial-gpus "$n" --out "$W/treat_$g" --force --json "$OUT/treat_$g.json" \
      >"$W/treat_$g.txt" 2>&1
    echo "treat gpus $gpus ($model) exit $?" >>"$W/exits.txt" ) &
done
for spec in $PEERS; do
  g="${spec%%:*}"; specs=()
  IFS=, read -r -a batches <<<"${spec#*:}"
  for b in "${batches[@]}"; do
    specs+=("b$b:--model $MODEL --recipe tuned --batch-size $b --group-by-length --pad-to 64 --workers 8")
  done
  ( CUDA_VISIBLE_DEVICES=$g bash bench/peer/peers.sh "$W/peer_g$g" "$BUDGET" "${specs[@]}" >"$W/peer_g$g.txt" 2>&1
    cp "$W/peer_g$g/peers.jsonl" "$OUT/peer_g$g.jsonl" ) &
done
wait
tar -czf "$OUT/logs.tgz" -C "$W" --exclude=compile-cache --exclude="*.pt.trace.json.gz" . 2>/dev/null
