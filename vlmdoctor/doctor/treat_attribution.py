"""Each adopted change's target measured in two traces (doctor/treat.py): the share of the traced step that the
cost its rule was prescribed for took in the start config and takes in the adopted config, and how much of the
measured time per real token saved that cost's drop makes up.

Why: a leave-one-out ablation measures a change's own worth in the final config, but an arm is a run of 45-80 s
and ten changes do not fit a 500 s budget (on the H200s, 2026-11-27, one to three of ten arms were measured). The
start run and the adopted composition's first run are traced and diagnosed already: reading the same cost in both
adds no run. What it says is measured, in both traces. What it does not say is the final config's loss without the
change: another change may have cut the same cost (a larger batch shrinks every per-step cost per token). Changes
whose rules read the same account or fact share a target and are measured together (`shared_with`); the
ablation's arms go to those first (doctor/treat_ablation.py).
"""

from __future__ import annotations

from typing import Any

from vlmdoctor.doctor.decide import throughput
from vlmdoctor.trace.accounts import ACCOUNT_FACTS

#: the source of a change's trace attribution, as the report says it
HOW = "its rule's target, read in the start trace and in the adopted config's trace"


def _time_per_token_us(report: dict[str, Any]) -> float | None:
    """Microseconds of the timed step per real token, from the run's throughput by the one estimator (the ladder's)."""
    tps = throughput(report)
    return 1e6 / tps if tps else None


def _step_ms(report: dict[str, Any]) -> float | None:
    step = (report.get("facts") or {}).get("step.ms")
    return float(step) if isinstance(step, (int, float)) and step > 0 else None


def attribute(
    start: dict[str, Any] | None,
    final: dict[str, Any] | None,
    adopted: list[list[dict[str, Any]]],
    rules_dirs: list[str] | tuple[str, ...] = (),
) -> dict[str, Any] | None:
    """Each adopted change's `trace` (its target in both traces, in place) and the two traces' time per real token;
    None where either run has no traced step or no throughput: nothing is attributed then.

    A cost's time per real token is its share of the traced step times the timed step's time per real token, so
    that the accounts of one step add up to it (the traced step runs under the profiler, the timed one does not)."""
    from vlmdoctor.doctor.rules import load_rules, target_ms, target_names  # deferred: the rule engine loads pandas

    runs = [(r or {}, _step_ms(r or {}), _time_per_token_us(r or {})) for r in (start, final)]
    if any(step is None or t is None for _, step, t in runs):
        return None
    (r0, step0, t0), (r1, step1, t1) = runs
    f0, f1 = r0.get("facts") or {}, r1.get("facts") or {}
    by_id = {r.id: r for r in load_rules(*rules_dirs)[0]}
    changes = [c for round_ in adopted for c in round_]
    reads = {id(c): target_names(by_id[c["rule"]]) for c in changes if c["rule"] in by_id}
    saved = t0 - t1
    for c in changes:
        rule = by_id.get(c["rule"])
        ms0 = target_ms(rule, f0) if rule else None
        ms1 = target_ms(rule, f1) if rule else None
        if rule is None or ms0 is None or ms1 is None:
            why = "no rule names its target" if rule is None else "the traces do not hold its target"
            lacks = [f"{n} ({w})" for n, w in _missing(reads.get(id(c), frozenset()), f0, f1)]
            c["trace"] = {"how": HOW, "why": why + (f": no {', '.join(lacks)}" if lacks else "")}
            continue
        u0, u1 = ms0 / step0 * t0, ms1 / step1 * t1
        c["trace"] = {
            "how": HOW,
            "reads": sorted(reads[id(c)]),
            "start_ms": ms0,
            "start_share": ms0 / step0,
            "final_ms": ms1,
            "final_share": ms1 / step1,
            "start_us_per_token": u0,
            "final_us_per_token": u1,
            "share_of_saving": (u0 - u1) / saved if saved > 0 else None,
            "shared_with": [
                o["rule"] for o in changes if o is not c and id(o) in reads and reads[id(o)] & reads[id(c)]
            ],
        }
    return {
        "how": HOW,
        "start_us_per_token": t0,
        "final_us_per_token": t1,
        "saved_us_per_token": saved,
        "start_step_ms": step0,
        "final_step_ms": step1,
        "explained_share": _explained(changes, saved),
    }


def _explained(changes: list[dict[str, Any]], saved: float) -> float | None:
    """The targets' drops per real token added up, each target once (changes that read the same target count once),
    over the time per real token saved; None where nothing was saved, no target was read, or two different targets
    read a fact in common. A sum, not a decomposition: targets of different kinds (a step account, a model part's
    GPU time) may overlap in time, so it can exceed what they explain; far below 1, the step got faster where no
    rule was looking."""
    read = {tuple(t["reads"]): t for c in changes if (t := c.get("trace") or {}).get("reads")}
    keys = [frozenset(k) for k in read]
    if saved <= 0 or not read or any(a & b for i, a in enumerate(keys) for b in keys[i + 1 :]):
        return None
    return sum(t["start_us_per_token"] - t["final_us_per_token"] for t in read.values()) / saved


def _missing(reads: frozenset[str], f0: dict[str, Any], f1: dict[str, Any]) -> list[tuple[str, str]]:
    """The facts a target reads that a trace lacks, and which trace ("start", "adopted", "either"): what the report
    names when it cannot read the target (an account's fact, for a target of accounts)."""
    out = []
    for n in sorted(reads):
        fact = ACCOUNT_FACTS.get(n, n)
        where = [w for w, f in (("start", f0), ("adopted", f1)) if f.get(fact) is None]
        if where:
            out.append((n, "either" if len(where) == 2 else where[0]))
    return out


def separable(change: dict[str, Any]) -> bool:
    """The change's target was read in both traces and no other adopted change reads it: the trace attributes its
    drop to it alone."""
    tr = change.get("trace") or {}
    return tr.get("start_share") is not None and not tr.get("shared_with")


def unseparable(
    start: dict[str, Any] | None, changes: list[dict[str, Any]], rules_dirs: list[str] | tuple[str, ...] = ()
) -> set[str]:
    """The rules of `changes` whose drop the traces cannot give them alone, known before any is adopted: no rule
    names a target, the start trace does not hold it, or another of the changes reads the same cost. Their own
    worth needs a measurement with and without them (the in-process arms first: doctor/treat.py). A target read
    through one of several facts (not step accounts, which a trace leaves out where they are empty) counts as
    unreadable where any of them is missing."""
    from vlmdoctor.doctor.rules import load_rules, target_ms, target_names  # deferred: the rule engine loads pandas

    facts = (start or {}).get("facts") or {}
    by_id = {r.id: r for r in load_rules(*rules_dirs)[0]}
    reads = {c["rule"]: target_names(by_id[c["rule"]]) for c in changes if c["rule"] in by_id}
    out = set()
    for c in changes:
        rule = by_id.get(c["rule"])
        # any fact its target reads missing at the start: the adopted trace may miss what the start read too (on one
        # H200, qwen2-vl-2b's start trace held loss.head_rows_frac, the adopted one neither it nor cpu.lm_head.ms)
        lacks = [n for n, _ in _missing(reads.get(c["rule"], frozenset()), facts, facts) if n not in ACCOUNT_FACTS]
        if rule is None or target_ms(rule, facts) is None or lacks:
            out.add(c["rule"])
        elif any(o["rule"] != c["rule"] and reads.get(o["rule"], frozenset()) & reads[c["rule"]] for o in changes):
            out.add(c["rule"])
    return out
