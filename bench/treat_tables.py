"""Markdown tables of a treat.json ladder, for docs/treat.md.

python bench/treat_tables.py bench/results/2026-11-23-h100/a/treat_0.5b_s2/treat.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    r = json.load(open(path))
    c = r["start_config"]
    print(
        f"**{c['model']} stage {c['stage']}** ({len(r['trials'])} trials, stopped: {r['stopped_because']}, "
        f"{r.get('wall_s', 0) / 60:.1f} min)\n"
    )
    print("| # | change | rule | real tokens/s (repeats) | x start | ms/step | MFU % | peak GiB |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for s in r["ladder"]:
        reps = s["tokens_per_s_repeats"]
        mfu = f"{s['mfu'] * 100:.1f}" if s.get("mfu") else "n/a"
        print(
            f"| {s['step']} | {s['change']} | {s['rule'] or ''} | {s['real_tokens_per_s']:,.0f} "
            f"({min(reps):,.0f}-{max(reps):,.0f}) | {s['speedup']:.2f} | {s['step_ms']:.0f} | {mfu} | "
            f"{s['peak_mem_gb']:.1f} |"
        )
    rejected = [t for t in r["trials"] if t["outcome"] != "kept"]
    if rejected:
        print("\n| trial | rule | change | outcome | real tokens/s | gain vs margin |")
        print("|---:|---|---|---|---:|---|")
        for t in rejected:
            ch = ", ".join(f"{k}={v}" for k, v in t["config_patch"].items())
            tok = f"{t['real_tokens_per_s']:,.0f}" if t.get("real_tokens_per_s") else "-"
            gm = f"{t['gain'] * 100:+.1f}% vs ±{t['margin'] * 100:.1f}%" if "gain" in t else (t.get("error") or "")
            print(f"| {t['trial']} | {t['rule']} | {ch} | {t['outcome']} | {tok} | {gm} |")
    print()


if __name__ == "__main__":
    for p in sys.argv[1:]:
        main(p)
