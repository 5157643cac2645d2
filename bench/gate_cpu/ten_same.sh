#!/usr/bin/env bash
# Issue 37: an unchanged config gates clean 10 times in 10, on a CPU with bf16 units and on one without.
#
#   OUT=DIR N=10 bash bench/gate_cpu/ten_same.sh      (C0=K: the first core used, default 0)
#
# The tiny preset in bf16 (--weight-dtype bf16: the config whose CPU bf16 rule once flipped between identical
# runs), a baseline report, then N same-config gates with --remeasure-baseline side by side, each gate and
# every run it starts pinned to its own core (taskset). Twice: as the CPU is, and with oneDNN capped below its
# bf16 instructions (ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI: no AVX512-BF16, no AMX), the closest this host comes
# to a CPU without bf16 units. DIR/summary.txt: each gate's exit code and verdict; DIR/*.json the verdicts.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?OUT=DIR}"
N="${N:-10}"
C0="${C0:-0}"
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | sed 's/Flags:.*\(amx_bf16\).*/Flags: ... amx_bf16 .../' >"$OUT/cpu.txt"
grep -o -w "avx512_bf16\|amx_bf16" /proc/cpuinfo | sort | uniq -c >>"$OUT/cpu.txt"
run_kind() {  # kind, first core, env...
    local kind="$1" core0="$2"; shift 2
    env "$@" taskset -c "$core0" python -m vlmdoctor profile --model tiny --device cpu --weight-dtype bf16 \
        --steps 8 --warmup 2 --repeats 2 --quiet --force --json "$OUT/base_$kind.json" >"$OUT/base_$kind.log" 2>&1
    for i in $(seq 1 "$N"); do
        ( env "$@" taskset -c $((core0 + i)) timeout -k 5 "${T_GATE:-420}" python -m vlmdoctor gate \
            --baseline "$OUT/base_$kind.json" --remeasure-baseline --json "$OUT/gate_${kind}_$i.json" \
            >"$OUT/gate_${kind}_$i.log" 2>&1
          echo "$kind gate $i exit $?" >>"$OUT/exits.txt" ) &
    done
    wait
}
run_kind bf16 "$C0" &
run_kind nobf16 $((C0 + N + 1)) ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI &
wait
sleep 1
wait
python - "$OUT" <<'PYEOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print((out / "cpu.txt").read_text().strip())
for line in sorted((out / "exits.txt").read_text().splitlines()):
    kind, _, i, _, code = line.split()
    v = out / f"gate_{kind}_{i}.json"
    d = json.loads(v.read_text()) if v.exists() else {}
    print(f"{kind:7} gate {i:>2}: exit {code}; {d.get('summary', 'no verdict')[:150]}")
PYEOF
