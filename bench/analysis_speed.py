"""Time and peak RSS of `vlmdoctor analyze` and of traceinsight (HTA) on one large trace.

    python bench/make_big_trace.py fixtures/traces/default_s2.pt.trace.json.gz /tmp/big/trace.json --min-gb 1.0
    python bench/analysis_speed.py /tmp/big/trace.json

Each tool runs in its own process under /usr/bin/time -v, one after the other. HTA runs
TraceAnalysis (the parse) plus the breakdowns that overlap vlmdoctor's facts: temporal,
idle time and kernel launch statistics.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HTA = """
import time, warnings
warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
t = time.time()
a = TraceAnalysis(trace_dir={folder!r}, include_last_profiler_step=True)
t1 = time.time()
tb = a.get_temporal_breakdown(visualize=False)
a.get_idle_time_breakdown(visualize=False)
a.get_cuda_kernel_launch_stats(visualize=False)
print("HTA parse_s", round(t1 - t, 2), "breakdowns_s", round(time.time() - t1, 2))
print("HTA idle_pct", float(tb["idle_time_pctg"].iloc[0]))
"""


def timed(cmd: list[str]) -> dict:
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    err = proc.stderr
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", err).group(1)
    parts = [float(x) for x in wall.split(":")]
    seconds = parts[-1] + 60 * parts[-2] + (3600 * parts[-3] if len(parts) == 3 else 0)
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", err).group(1)) / 2**20
    return {"exit": proc.returncode, "wall_s": seconds, "peak_rss_gb": rss, "stdout_tail": proc.stdout[-600:]}


def main() -> None:
    trace = Path(sys.argv[1]).resolve()
    size_gb = trace.stat().st_size / 2**30
    with tempfile.TemporaryDirectory() as tmp:
        ours = timed([sys.executable, "-m", "vlmdoctor", "analyze", str(trace), "--json", f"{tmp}/facts.json"])
        facts = json.loads(Path(f"{tmp}/facts.json").read_text())["files"][0]["facts"]
    ours["idle_pct"] = 100 * (1 - facts["gpu.busy_frac"])
    ours["steps"] = facts["trace.steps"]
    hta = timed([sys.executable, "-c", HTA.format(folder=str(trace.parent))])
    m = re.search(r"HTA idle_pct (\S+)", hta["stdout_tail"])
    hta["idle_pct"] = float(m.group(1)) if m else None
    result = {
        "trace": str(trace),
        "trace_gb": size_gb,
        "cpus": os.cpu_count(),
        "vlmdoctor": ours,
        "traceinsight": hta,
        "speedup": hta["wall_s"] / ours["wall_s"],
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
