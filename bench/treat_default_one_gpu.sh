#!/usr/bin/env bash
# Issue 39 on one GPU, from the default config with treat's default budget: the hand-tuned HF Trainer peer
# (bench/peer_trainer.py, tuned recipe, the batch swept, one fresh process each) first, then treatments one after
# the other on the same GPU, each the literal command of the issue (`vlmdoctor treat --model MODEL --stage 2`, no
# --time-budget: its default, 540 s), in the foreground under a limit of 588 s (a treatment ends within its budget
# and its runs' own limit). Detached treatments (setsid, outliving the shell command) were tried and their trial
# processes failed to load torch's libraries once the command that started them had returned: not used.
#
#   OUT=DIR MODEL=llava-siglip2-0.5b bash bench/treat_default_one_gpu.sh peers 96,112,120,128
#   OUT=DIR MODEL=llava-siglip2-0.5b bash bench/treat_default_one_gpu.sh run t1
#
# DIR/env.txt, DIR/peers.jsonl (one JSON line per batch), DIR/NAME.json (the treat result), DIR/NAME.txt (its
# console). The treatment's own folder (--out) is /tmp/treat_default/NAME.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:?OUT=DIR}"; MODEL="${MODEL:-llava-siglip2-0.5b}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
W=/tmp/treat_default; mkdir -p "$OUT" "$W"
what="${1:?peers BATCHES | run NAME}"; arg="${2:?}"
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
  run)
    date -u +"$arg started %H:%M:%S"
    timeout -k 5 588 python -m vlmdoctor treat --model "$MODEL" --stage 2 --out "$W/$arg" --force \
      --json "$OUT/$arg.json" >"$OUT/$arg.txt" 2>&1
    echo "$arg exit $?"; date -u +"$arg ended %H:%M:%S"; tail -12 "$OUT/$arg.txt" ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
