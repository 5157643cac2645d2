"""Markdown tables from grid results (results.jsonl files written by bench/grid.py).

    python bench/tabulate.py bench/results/2026-11-22-h100/grid_pad64_both_stages.jsonl

One table per stage, with each row's speedup over row 0 (the default) of the same stage and model.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(paths: list[str]) -> None:
    by_stage: dict[int, list[dict]] = defaultdict(list)
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            by_stage[r["config"]["stage"]].append(r)
    for stage, runs in sorted(by_stage.items()):
        # speedups are over row 0 of the grid for the same stage and model
        base = {
            r["config"]["model"]: r["metrics"]["real_tokens_per_s"]
            for r in reversed(runs)
            if r["bench"]["row"] == 0 and r["status"] == "ok"
        }
        print(f"\nStage {stage}\n")
        print(
            "| configuration | real tok/s | x first row | loss tok/s | pad % | ms/step median (p10-p90) | MFU % "
            "| peak alloc GiB | run wall s |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in runs:
            name = r["bench"]["name"]
            if r["status"] != "ok":
                print(f"| {name} | {r['status']}: {r['error']['message'][:60]} | | | | | | | |")
                continue
            m = r["metrics"]
            spread = ""
            s = r["stats"]["real_tokens_per_s"]
            if s["n"] > 1:
                spread = f" ({s['min']:,.0f}-{s['max']:,.0f}, n={s['n']})"
            b = base.get(r["config"]["model"])
            x = f"{m['real_tokens_per_s'] / b:.2f}" if b else "-"
            print(
                f"| {name} | {m['real_tokens_per_s']:,.0f}{spread} | {x} | "
                f"{m['loss_tokens_per_s']:,.0f} | {m['pad_fraction'] * 100:.1f} | {m['step_ms']:.1f} "
                f"({m['step_ms_p10']:.0f}-{m['step_ms_p90']:.0f}) | {m['mfu'] * 100:.1f} | {m['peak_mem_gb']:.1f} | "
                f"{r['bench']['wall_s']:.0f} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
