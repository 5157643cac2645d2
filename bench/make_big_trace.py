"""Build a large trace from a real one by repeating its recorded steps (for the analysis benchmark).

    python bench/make_big_trace.py fixtures/traces/default_s2.pt.trace.json.gz /tmp/big.json --min-gb 1.0

Every event of the source trace is copied once per repetition, shifted in time by the span of the
source trace and with ids offset (correlation, External id, Sequence number, flow ids), so
that steps, launches and autograd links stay consistent: a real trace, only longer. The
output is uncompressed JSON, the way large traces usually sit on disk, written streaming.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--min-gb", type=float, default=1.0)
    args = ap.parse_args()
    opener = gzip.open if args.src.endswith(".gz") else open
    with opener(args.src, "rt") as f:
        data = json.load(f)
    events = data.pop("traceEvents")
    timed = [e for e in events if e.get("ph") != "M"]
    meta_events = [e for e in events if e.get("ph") == "M"]
    t0 = min(e["ts"] for e in timed if "ts" in e)
    t1 = max(e["ts"] + e.get("dur", 0) for e in timed if "ts" in e)
    span = (t1 - t0) * 1.01
    step_names = sorted(
        {e["name"] for e in timed if str(e.get("name", "")).startswith("ProfilerStep#")},
        key=lambda s: int(s.split("#")[1]),
    )
    max_id = 1 + max(
        max(int((e.get("args") or {}).get(k, 0) or 0) for k in ("correlation", "External id", "Sequence number"))
        for e in timed
    )
    max_flow = 1 + max((int(e.get("id", 0)) for e in timed if isinstance(e.get("id"), (int, float))), default=0)
    one = sum(len(json.dumps(e)) + 2 for e in timed)
    reps = max(1, int(args.min_gb * 2**30 / one) + 1)
    with open(args.dst, "w") as out:
        out.write(json.dumps(data)[:-1] + ', "traceEvents": [\n')
        for e in meta_events:
            out.write(json.dumps(e) + ",\n")
        first = True
        for r in range(reps):
            for e in timed:
                e2 = dict(e)
                if "ts" in e2:
                    e2["ts"] = e["ts"] + r * span
                if "id" in e2 and isinstance(e2["id"], (int, float)):
                    e2["id"] = int(e["id"]) + r * max_flow
                a = e.get("args")
                if a:
                    a2 = dict(a)
                    for k in ("correlation", "External id", "Sequence number"):
                        if k in a2 and isinstance(a2[k], (int, float)) and a2[k] > 0:
                            a2[k] = int(a2[k]) + r * max_id
                    e2["args"] = a2
                if e2.get("name") in step_names:
                    e2["name"] = f"ProfilerStep#{r * len(step_names) + step_names.index(e['name'])}"
                out.write(("" if first else ",\n") + json.dumps(e2))
                first = False
        out.write("\n]}\n")
    print(
        f"{args.dst}: {os.path.getsize(args.dst) / 2**30:.2f} GiB, {reps} repetitions of "
        f"{len(step_names)} steps = {reps * len(step_names)} steps, {reps * len(timed):,} events"
    )


if __name__ == "__main__":
    main()
