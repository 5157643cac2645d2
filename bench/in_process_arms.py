"""Measure a config's in-process leave-one-out arms (run/arms.py) in one `vlmdoctor profile` run, as `treat` asks a run
of a composition to: the final config of a treat result of one round, its changes each left out where the knob switches
in one process. Prints each arm's status and pairs; writes the run's report.

    python bench/in_process_arms.py TREAT_JSON OUT_REPORT_JSON SECONDS [RULE ...]

RULE: only the changes of these rules (default: every change whose knobs switch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vlmdoctor.doctor.treat_ablation import in_process_arms
from vlmdoctor.run.arms import ARMS_ENV, write_request
from vlmdoctor.run.config import RunConfig


def main() -> None:
    treat = json.loads(Path(sys.argv[1]).read_text())
    out, seconds, only = sys.argv[2], float(sys.argv[3]), set(sys.argv[4:])
    rung = treat["ladder"][-1]
    start = RunConfig.from_dict(treat["start_config"])  # a treatment of one adopted round
    final = RunConfig.from_dict(treat["final_config"])
    chosen = [ch for ch in rung["changes"] if not only or ch["rule"] in only]
    arms = in_process_arms(start, final, rung["changes"], chosen)
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "config.json"
        final.dump(cfg)
        env = {**os.environ, ARMS_ENV: str(write_request(Path(d), arms, seconds))}
        cmd = [sys.executable, "-m", "vlmdoctor", "profile", "--config", str(cfg), "--json", out, "--quiet", "--force"]
        subprocess.run([*cmd, "--no-diagnose"], env=env, check=False)
    rep = json.loads(Path(out).read_text())
    got = rep.get("in_process") or {}
    print(rep["config"]["model"], "batch", rep["config"]["batch_size"], "status", rep["status"])
    print("rounds", got.get("rounds"), "stopped", got.get("stopped"), "seconds", got.get("seconds"), got.get("error"))
    print("final", [round(x) for x in got.get("final_tokens_per_s") or []])
    for name, a in (got.get("arms") or {}).items():
        print(name, a["status"], [round(r, 3) for r in a["ratios"]], "recompiled", a.get("recompiled"), a.get("error"))


if __name__ == "__main__":
    main()
