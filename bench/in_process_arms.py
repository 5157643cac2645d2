"""Measure a config's in-process leave-one-out arms (run/arms.py) in one `vlmdoctor profile` run, as `treat` asks a run
of a composition to: the final config of a treat result of one round, its changes each left out where the knob switches
in one process. Prints each arm's status and pairs; writes the run's report.

    python bench/in_process_arms.py TREAT_JSON OUT_REPORT_JSON SECONDS [RULE ...] [--with KNOB=VALUE,...]

RULE: only the changes of these rules (default: every change whose knobs switch). --with: also an arm that adds knobs
(treat's later round in one process, doctor/treat.py `one_process`), e.g. `--with num_workers=4,pin_memory=true` on a
final config without loader workers; its pairs print as the arm over the config (its gain), beside the run's ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from vlmdoctor.commands.knobs import parse_sets
from vlmdoctor.doctor.treat_ablation import in_process_arms
from vlmdoctor.run.arms import ARMS_ENV, switch_patch, write_request
from vlmdoctor.run.config import RunConfig


def main() -> None:
    args, added = sys.argv[1:], None
    if "--with" in args:
        i = args.index("--with")
        added = args[i + 1]
        args = args[:i] + args[i + 2 :]
    treat = json.loads(Path(args[0]).read_text())
    out, seconds, only = args[1], float(args[2]), set(args[3:])
    rung = treat["ladder"][-1]
    start = RunConfig.from_dict(treat["start_config"])  # a treatment of one adopted round
    final = RunConfig.from_dict(treat["final_config"])
    chosen = [ch for ch in rung["changes"] if not only or ch["rule"] in only]
    arms = in_process_arms(start, final, rung["changes"], chosen)
    if added is not None:
        patch = switch_patch(final, final.replace(**parse_sets(added.split(","))))  # the CLI's --set values
        if not patch:
            sys.exit(f"--with {added}: nothing a run switches in its own process")
        arms = {f"with {', '.join(f'{k}={v}' for k, v in patch.items())}": patch, **arms}
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
        gain = f" (its gain: {[round(1 / r, 3) for r in a['ratios'] if r]})" if name.startswith("with ") else ""
        print(
            name,
            a["status"],
            [round(r, 3) for r in a["ratios"]],
            gain,
            "recompiled",
            a.get("recompiled"),
            a.get("error"),
        )


if __name__ == "__main__":
    main()
