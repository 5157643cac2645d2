"""Where the analyzer's time goes on one trace: CPU seconds of each phase, in one process.

    python bench/analysis_phases.py /tmp/big/trace.json [--top 15]

Phases (CPU seconds, and the process's peak resident memory after each, in GB): importing the
analysis modules, reading the file into tables (trace/tables.py), the facts (compute_facts), the
collectives (rank_comms) and the rules. --top adds the functions that take the most time inside
the facts, from cProfile (its own overhead inflates them; read the ranks).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=0)
    args = ap.parse_args()
    clock = time.process_time
    cpu: dict[str, float] = {}
    peak: dict[str, float] = {}

    def done(phase: str, t: float) -> float:
        cpu[phase] = clock() - t
        peak[phase] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
        return clock()

    t = clock()
    from vlmdoctor.doctor.rules import diagnose, load_rules
    from vlmdoctor.trace.comms import rank_comms
    from vlmdoctor.trace.facts import compute_facts
    from vlmdoctor.trace.tables import load_tables

    t = done("imports", t)
    tables = load_tables(Path(args.trace))
    t = done("read into tables", t)
    facts = compute_facts(tables)
    t = done("facts", t)
    facts.update(rank_comms(tables).facts)
    t = done("collectives", t)
    rules, problems = load_rules()
    diagnose(facts, rules, problems)
    done("rules", t)
    size = Path(args.trace).stat().st_size / 2**30
    per_gib = {k: v / size for k, v in cpu.items()}
    print(json.dumps({"trace_gib": size, "cpu_s": cpu, "cpu_s_per_gib": per_gib, "peak_rss_gb_after": peak}, indent=2))
    if args.top:
        prof = cProfile.Profile()
        prof.runcall(compute_facts, tables)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
