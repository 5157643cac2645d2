"""The table of bench/dist/scale.sh: one line per report in a folder, read from the reports' own fields.

    python bench/dist/scale_table.py DIR [--markdown]

Per report: the job's real tokens/s (the headline; all ranks), MFU over all GPUs, the scaling efficiency
against the one-GPU reference and whether the report trusts it, the rank-0 trace's exposed communication
(less the wait for late ranks when several ranks were traced), each rank's median step, the largest peak
memory, and the job's step spread (p10-p90 over the median: above 25% the window is unstable).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(path: Path) -> dict:
    r = json.loads(path.read_text())
    m = r.get("metrics") or {}
    d = r.get("distributed") or {}
    sc = d.get("scaling") or {}
    f = r.get("facts") or {}
    step, p10, p90 = m.get("step_ms"), m.get("step_ms_p10"), m.get("step_ms_p90")
    return {
        "run": path.stem,
        "status": r.get("status", "?"),
        "tok_s": m.get("real_tokens_per_s"),
        "mfu": m.get("mfu"),
        "eff": sc.get("efficiency"),
        "trusted": sc.get("trusted"),
        "doubts": sc.get("doubts") or [],
        "exposed_ms": f.get("dist.comm.exposed_own_ms", f.get("comm.exposed_ms")),
        "rank_ms": [x.get("step_ms") for x in d.get("ranks") or []],
        "peak_gb": m.get("peak_mem_gb"),
        "spread": (p90 - p10) / step if step and p10 is not None and p90 is not None else None,
    }


def fmt(v, spec: str, width: int) -> str:
    return format(v, spec).rjust(width) if isinstance(v, (int, float)) else "-".rjust(width)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    rows = [row(p) for p in sorted(Path(a.folder).glob("*.json"))]
    if a.markdown:
        print("| run | real tokens/s | MFU | scaling | exposed comm ms | rank step ms | peak GiB | spread |")
        print("|---|---:|---:|---:|---:|---|---:|---:|")
    else:
        print(f"{'run':28} {'tok/s':>8} {'MFU':>6} {'scale':>6} {'exp ms':>7} {'peak':>5} {'spread':>6}  rank ms")
    for x in rows:
        eff = fmt(x["eff"], ".0%", 5) + ("?" if x["eff"] is not None and not x["trusted"] else " ")
        ranks = "/".join(f"{v:.0f}" for v in x["rank_ms"] if v is not None) or "-"
        cells = [
            fmt(x["tok_s"], ",.0f", 8),
            fmt(x["mfu"], ".1%", 6),
            eff,
            fmt(x["exposed_ms"], ".1f", 7),
            fmt(x["peak_gb"], ".1f", 5),
            fmt(x["spread"], ".0%", 6),
        ]
        if a.markdown:
            print(f"| {x['run']} | " + " | ".join(c.strip() for c in cells[:4]) + f" | {ranks} | "
                  + " | ".join(c.strip() for c in cells[4:]) + " |")
        else:
            print(f"{x['run']:28} " + " ".join(cells) + f"  {ranks}" + ("" if x["status"] == "ok" else f"  {x['status']}"))
    doubts = [(x["run"], d) for x in rows for d in x["doubts"]]
    if doubts:
        print("\n'?': the report doubts this efficiency:")
        for run, d in doubts:
            print(f"  {run}: {d}")


if __name__ == "__main__":
    main()
