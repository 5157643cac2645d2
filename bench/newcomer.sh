#!/usr/bin/env bash
# The newcomer's first hour, timed: a fresh clone, a new virtual environment, the README's install lines for a
# CPU-only machine, then the README's "your own training script" command on the example loop.
#
#   bash bench/newcomer.sh [REPO]      (REPO: a URL or path to clone; default: this checkout)
#
# Prints the seconds from the start at each stage and the diagnosis; everything happens under /tmp/newcomer.
set -u
REPO="${1:-$(cd "$(dirname "$0")/.." && pwd)}"
T0=$(date +%s)
D=/tmp/newcomer; rm -rf "$D"; mkdir -p "$D"; cd "$D" || exit 1
say() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
git clone -q "$REPO" vlmdoctor && cd vlmdoctor && say cloned
python3 -m venv "$D/venv" && . "$D/venv/bin/activate" && say "virtual environment"
pip install -q --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu && say "torch installed"
pip install -q --no-cache-dir . && say "vlmdoctor installed"
vlmdoctor run --out doctor-out -- python examples/train_llava_loop.py --steps 50 >run.txt 2>&1
say "first diagnosis of the example script (exit $?, $(grep -c '' run.txt) lines printed)"
cat run.txt
