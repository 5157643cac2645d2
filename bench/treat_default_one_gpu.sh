#!/usr/bin/env bash
# Issue 39 on one GPU, from the default config with treat's default budget: the hand-tuned HF Trainer peer
# (bench/peer_trainer.py, tuned recipe, the batch swept, one fresh process each) first, then treatments one after
# the other on the same GPU, each the literal command of the issue (`vlmdoctor treat --model MODEL --stage 2`, no
# --time-budget: its default, 540 s). A treatment runs detached (setsid), so that it can outlast one shell command
# of a machine that stops commands after ten minutes; `wait NAME` waits for it and copies what it wrote.
#
#   OUT=DIR MODEL=llava-siglip2-0.5b bash bench/treat_default_one_gpu.sh peers 96,112,120,128
#   OUT=DIR MODEL=llava-siglip2-0.5b bash bench/treat_default_one_gpu.sh start t1
#   OUT=DIR bash bench/treat_default_one_gpu.sh wait t1
#
# DIR/env.txt, DIR/peers.jsonl (one JSON line per batch), DIR/NAME.json (the treat result), DIR/NAME.txt (its
# console). The treatment's own folder (--out) is /tmp/treat_default/NAME.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?OUT=DIR}"; MODEL="${MODEL:-llava-siglip2-0.5b}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
W=/tmp/treat_default; mkdir -p "$OUT" "$W"
what="${1:?peers BATCHES | start NAME | wait NAME}"; arg="${2:?}"
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version,uuid --format=csv,noheader 2>&1
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  echo "command: OUT=$OUT MODEL=$MODEL bash bench/treat_default_one_gpu.sh $what $arg"
} >>"$OUT/env.txt"
case "$what" in
  peers)
    IFS=, read -r -a batches <<<"$arg"; specs=()
    for b in "${batches[@]}"; do
      specs+=("b$b:--model $MODEL --recipe tuned --batch-size $b --group-by-length --pad-to 64 --workers 8")
    done
    bash bench/peer/peers.sh "$W/peers" 600 "${specs[@]}"
    cp "$W/peers/peers.jsonl" "$OUT/peers.jsonl"
    cat "$OUT/peers.jsonl" | cut -c1-400 ;;
  start)
    setsid bash -c "timeout -k 10 660 python -m vlmdoctor treat --model '$MODEL' --stage 2 --out '$W/$arg' --force \
      --json '$W/$arg.json' >'$W/$arg.txt' 2>&1; echo \$? >'$W/$arg.rc'" </dev/null >/dev/null 2>&1 &
    echo "started $arg at $(date -u +%H:%M:%S)" ;;
  wait)
    while [ ! -e "$W/$arg.rc" ]; do sleep 5; done
    cp "$W/$arg.json" "$W/$arg.txt" "$OUT/" 2>/dev/null
    echo "$arg exit $(cat "$W/$arg.rc")"; tail -25 "$W/$arg.txt" ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
