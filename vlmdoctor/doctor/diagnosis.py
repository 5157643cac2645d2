"""From a measured run to prescriptions: the run's trace -> facts (with its exact measurements) -> rules.

The runner only measures and records; this is where a run report meets the trace reader and the
rule engine, so the flow config -> run -> trace -> facts -> rules stays one-way.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmdoctor.doctor.rules import account_verdicts, diagnose, in_apply_order, load_rules, rank_findings
from vlmdoctor.errors import UsageError, VlmdoctorError
from vlmdoctor.run.zoo import refuse_composite_only
from vlmdoctor.trace.accounts import step_accounts
from vlmdoctor.trace.facts import analyze, merge_measured
from vlmdoctor.trace.split import step_split


def remove_temporary_trace(report: dict[str, Any]) -> None:
    """A trace the user did not ask to keep never outlives the command (also on Ctrl-C or a failed run)."""
    trace = report.get("trace") or {}
    if trace.get("kept", True) or not trace.get("path"):
        return
    shutil.rmtree(Path(trace["path"]).parent, ignore_errors=True)
    trace["path"] = None


def trace_facts(report: dict[str, Any]) -> dict[str, Any] | None:
    """The facts of the report's traced window, merged with what the untraced window measured exactly.

    A trace that cannot be read does not fail the run: its facts say why instead. A temporary
    trace (not asked for with --trace-dir) is removed once read.
    """
    trace = report.get("trace")
    if not trace or not trace.get("path"):
        return None
    # a job of several ranks: its folder of rank traces, so the ranks are joined (rank 0's facts come first)
    several = len(trace.get("rank_paths") or []) > 1 and trace.get("dir")
    path = Path(trace["dir"] if several else trace["path"])
    cfg = report.get("config") or {}
    try:
        result = analyze(path, cfg.get("stage"), cfg.get("model"))
        facts = result["files"][0]["facts"]
        cross = result.get("cross_rank") or {}
        if "facts" in cross:  # a folder of the job's rank traces: the ranks joined, for the rules on dist.* facts
            facts = {**facts, **cross["facts"]}
            report["cross_rank"] = cross
    except VlmdoctorError as e:
        facts = {"trace.error": e.message}
    finally:
        remove_temporary_trace(report)
    # measured over the untraced window (padding, memory, MFU): exact where the trace only bounds them
    return merge_measured(facts, report)


def measured_from_trace(entry: dict[str, Any]) -> dict[str, Any]:
    """An analyzed trace's facts merged with the measurements its run wrote into it, in place.

    vlmdoctor's runs record the timed windows' metrics in the trace's `vlmdoctor` metadata, so
    `analyze` of the trace alone diagnoses what `profile` did; other traces are left as they are.
    """
    vmeta = (entry.get("meta") or {}).get("vlmdoctor")
    if isinstance(vmeta, dict) and isinstance(vmeta.get("metrics"), dict) and "trace.error" not in entry["facts"]:
        env = vmeta.get("env") if isinstance(vmeta.get("env"), dict) else {}
        entry["facts"] = merge_measured(entry["facts"], {"metrics": vmeta["metrics"], "env": env})
    return entry


def cover_rank_accounts(result: dict[str, Any]) -> None:
    """Each rank's account verdicts again, in place, with the findings on the joined ranks (`cross_rank.diagnosis`).

    A rank that waits for a straggler holds that wait in its own accounts (idle.host.ranks, busy.communication),
    but its cause is on the other rank, so no rule on its own facts names it: the job's finding does. Call it once
    every rank and the joined ranks are diagnosed, as `vlmdoctor analyze` of a rank folder does.
    """
    job = (result.get("cross_rank") or {}).get("diagnosis")
    if not job:
        return
    covering = job["findings"] + job["superseded"] + job["muted"]
    for entry in result["files"]:
        d = entry.get("diagnosis")
        if d and "trace.error" not in entry["facts"]:
            d["accounts"] = account_verdicts(entry["facts"], d["findings"] + d["superseded"] + d["muted"], covering)


def examine(
    report: dict[str, Any], rules_dirs: Sequence[str] = (), prescribe: bool = True, selection: Any = None
) -> dict[str, Any]:
    """Add `facts`, and with `prescribe` the `diagnosis` and `findings`, to a run report in place.

    `selection` (doctor/select.py) mutes findings: they go to `diagnosis.muted`, not away.
    """
    facts = trace_facts(report)
    if facts is None:
        return report
    report["facts"] = facts
    if "trace.error" not in facts:
        report["split"] = step_split(facts)
        report["accounts"] = step_accounts(facts)
    if prescribe and "trace.error" not in facts:
        rules, problems = load_rules(*rules_dirs)
        report["diagnosis"] = diagnose(facts, rules, problems, selection)
        _set_aside_refused(report["diagnosis"], (report.get("config") or {}).get("model"))
        report["findings"] = report["diagnosis"]["findings"]
        report["muted"] = report["diagnosis"]["muted"]
    return report


def _set_aside_refused(diagnosis: dict[str, Any], model: str | None) -> None:
    """Findings whose knobs the run's preset refuses (composite-only knobs on a native class) do not apply."""

    if not model:
        return
    kept = []
    for f in diagnosis["findings"]:
        try:
            refuse_composite_only(model, f["config_patch"])
            kept.append(f)
        except UsageError as e:
            diagnosis["not_applicable"].append(
                {"id": f["id"], "why": e.message, "measured": True, "evidence": f["evidence"]}
            )
    if len(kept) < len(diagnosis["findings"]):  # numbered again: ranks and the order of application stay 1..n
        kept = rank_findings(in_apply_order(kept))
    diagnosis["findings"] = kept
