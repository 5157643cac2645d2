"""Run a grid of vlmdoctor configurations, one fresh process each, and tabulate them.

    python bench/grid.py bench/grids/issue2_0.5b.yaml --out results/           # all rows, all stages
    python bench/grid.py bench/grids/issue2_0.5b.yaml --stage 2 --only 0,1     # a subset

Writes OUT/results.jsonl (one report per line, written as each run ends, so a cut-off grid
keeps what it measured) and prints a Markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlmdoctor.ci.sweep import grid_rows  # noqa: E402
from vlmdoctor.run.runner import run_isolated  # noqa: E402


def row(name: str, r: dict) -> str:
    cfg = r.get("config", {})
    if r.get("status") != "ok":
        msg = (r.get("error") or {}).get("message", "")[:80]
        return f"| {cfg.get('stage')} | {name} | {r.get('status')}: {msg} | | | | | | |"
    m = r["metrics"]
    mfu = f"{m['mfu'] * 100:.1f}" if m.get("mfu") is not None else "n/a"
    mem = f"{m['peak_mem_gb']:.1f}" if m.get("peak_mem_gb") is not None else "n/a"
    return (
        f"| {cfg['stage']} | {name} | {m['real_tokens_per_s']:,.0f} | {m['loss_tokens_per_s']:,.0f} | "
        f"{m['pad_fraction'] * 100:.1f} | {m['step_ms']:.1f} ({m['step_ms_p10']:.1f}-{m['step_ms_p90']:.1f}) | "
        f"{mfu} | {mem} | {m['final_loss']:.3f} |"
    )


HEADER = (
    "| stage | configuration | real tok/s | loss tok/s | pad % | ms/step median (p10-p90) | MFU % | peak GiB | loss |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|"
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("grid")
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--stage", type=int, action="append", help="only these stages")
    ap.add_argument("--only", help="comma-separated row indexes")
    ap.add_argument("--set", action="append", default=[], help="knob=value applied to every row (YAML value)")
    args = ap.parse_args()
    extra = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in args.set)}
    keep = {int(i) for i in args.only.split(",")} if args.only else None
    plan = [(i, n, c) for i, n, c in grid_rows(args.grid, extra, args.stage) if keep is None or i in keep]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    with open(out / "results.jsonl", "a") as f:
        for i, name, cfg in plan:
            t0 = time.time()
            rep = run_isolated(cfg, timeout=900)
            rep["bench"] = {"grid": args.grid, "row": i, "name": name, "wall_s": time.time() - t0}
            f.write(json.dumps(rep) + "\n")
            f.flush()
            lines.append(row(name, rep))
            print(lines[-1], f"[{time.time() - t0:.0f}s]", flush=True)
    print("\n" + HEADER + "\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
