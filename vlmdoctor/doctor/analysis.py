"""`vlmdoctor analyze`'s document: an analyzed trace (trace/facts.py `analyze`: each file's facts, and the joined
ranks' for a folder of rank traces) diagnosed by the rules, each file on its own and the job as a whole.

A trace vlmdoctor wrote carries its run's measurements, which are merged first, so `analyze` of it prescribes
what `profile` did; on a user's own trace each fix is also said as the lines of their loop (doctor/advice.py).
"""

from __future__ import annotations

from typing import Any

from vlmdoctor import SCHEMA_VERSION
from vlmdoctor.doctor.advice import add_advice
from vlmdoctor.doctor.diagnosis import cover_rank_accounts, measured_from_trace
from vlmdoctor.doctor.rules import diagnose, load_rules


def diagnosed(result: dict[str, Any], rules_dirs: list[str] | None = None, selection: Any = None) -> dict[str, Any]:
    """The analysis document of an analyzed trace: each file's and the joined ranks' `diagnosis`, `findings` and
    `muted` (`selection`, doctor/select.py, mutes findings: they are listed as muted, not dropped)."""
    rules, problems = load_rules(*(rules_dirs or []))
    for entry in result["files"]:
        measured_from_trace(entry)  # a vlmdoctor trace carries its run's measurements: as profile diagnosed
        _diagnose(entry, rules, problems, selection)
        if not entry["facts"].get("trace.written_by_vlmdoctor"):
            # a user's own training: the fix as the lines of their loop, not a vlmdoctor command
            add_advice({"config": {}, "diagnosis": entry["diagnosis"]}, "loop")
    cross = result.get("cross_rank")
    if cross and "facts" in cross:  # the job as a whole: rules over the joined ranks' facts
        _diagnose(cross, [r for r in rules if r.uses_dist], problems, selection)
        if not any(e["facts"].get("trace.written_by_vlmdoctor") for e in result["files"]):
            add_advice({"config": {}, "diagnosis": cross["diagnosis"]}, "loop")
        cover_rank_accounts(result)  # a rank's wait for a straggler is named by the job's finding
    return {"schema_version": SCHEMA_VERSION, "kind": "analysis", **result}


def _diagnose(entry: dict[str, Any], rules: list[Any], problems: list[str], selection: Any) -> None:
    """One entry's facts through the rules, in place."""
    entry["diagnosis"] = diagnose(entry["facts"], rules, problems, selection)
    entry["findings"] = entry["diagnosis"]["findings"]
    entry["muted"] = entry["diagnosis"]["muted"]
