"""What becomes of a measured report of the user's own training: diagnosed (trace -> facts -> findings, the fix in
the user's terms), joined across ranks (rank 0 writes the job's), written (out/report.json and its page, through
the one file writer) and printed (the prescriptions; at the training's end, the summary)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmdoctor.doctor.advice import add_advice
from vlmdoctor.files import write_json
from vlmdoctor.own import rank_join
from vlmdoctor.report import progress
from vlmdoctor.report.console import render_own
from vlmdoctor.report.html import profile_html, write_html
from vlmdoctor.report.summary import render_summary
from vlmdoctor.window import HTML, REPORT


def diagnose_report(
    report: dict[str, Any], audience: str, rules_dirs: Sequence[str] = (), selection: Any = None
) -> dict[str, Any]:
    """Trace -> facts -> findings, plus CPU part times and the fix in the user's terms, in place.

    A trace the analyzer cannot read leaves `facts = {"trace.error": ...}`, never an exception.
    """
    from vlmdoctor.doctor.diagnosis import examine  # deferred: pandas, only once a window was traced

    trace = report.get("trace") or {}
    if report.get("status") not in ("ok", "nan_loss") or not trace.get("path"):
        return report
    try:
        examine(report, rules_dirs, selection=selection)
    except Exception as e:  # the analyzer on a trace it was not written for
        report["facts"] = {"trace.error": f"{type(e).__name__}: {e}"}
        report.pop("diagnosis", None)
        report.pop("findings", None)
        report.pop("muted", None)
    if "diagnosis" in report:
        add_advice(report, audience)
    return report


def existing_outputs(out: str | Path) -> list[Path]:
    """The outputs of an earlier run in this folder: never replaced without force (`vlmdoctor run`: --force)."""
    return [p for p in (Path(out) / REPORT, Path(out) / HTML) if p.exists() or p.is_symlink()]


def write_outputs(report: dict[str, Any], out: Path, json_path: str | None = None, html: bool = True) -> Path:
    """out/report.json and its page out/report.html (and a copy at --json) through the one file writer.

    A page that cannot be drawn costs the page only: the report is written first, and a note says why.
    """
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT
    if html:
        try:
            write_html(profile_html(report), out / HTML, force=True)  # refused up front, before the run
        except Exception as e:
            report.setdefault("notes", []).append(f"the HTML page could not be written: {type(e).__name__}: {e}")
    write_json(report, str(path))
    if json_path:
        write_json(report, json_path)
    return path


def gather_ranks(report: dict[str, Any], rec: Any) -> dict[str, Any] | None:
    """Several ranks: a rank other than 0 hands what it measured to rank 0 (None: nothing more to do here);
    rank 0 joins the ranks into the job's report (rank_join.py). One rank: the report as it is. `rec`: the
    Recorder that measured it."""
    if rec.world == 1:
        return report
    try:
        if rec.rank != 0:
            rank_join.write_part(report, rec.out, rec.rank)
            return None
        if "distributed" not in report:  # joined once, also when asked again
            rank_join.join(report, rec.out, rec.world)
    except Exception as e:  # this rank's own numbers stand
        rec.say("could not join the ranks' numbers, rank 0's own are kept", e)
    return report


def output_paths(report: dict[str, Any], out: Path) -> dict[str, str | None]:
    """Where the report, its page and the trace (a folder of rank traces for several ranks) are."""
    tr = report.get("trace") or {}
    several = len(tr.get("rank_paths") or []) > 1
    return {
        "report": str(out / REPORT) if (out / REPORT).exists() else None,
        "html": str(out / HTML) if (out / HTML).exists() else None,
        "trace": tr.get("dir") if several else tr.get("path"),
        "ranks": str(len(tr["rank_paths"])) if several else None,
    }


def show(report: dict[str, Any], file: Any = None, verbose: bool = False) -> None:
    """The report, 80 columns wide, around any live tqdm bar: one screen (the headline, the step's largest accounts,
    the prescriptions with their fix), or every table when verbose (`run --verbose`, `Doctor(verbose=True)`)."""
    progress.emit(lambda c: render_own(report, c, verbose), file or sys.stdout)


def show_summary(report: dict[str, Any], paths: dict[str, str | None], file: Any = None) -> None:
    """The short summary that ends the training's output (report/summary.py)."""
    progress.emit(lambda c: render_summary(report, c, paths), file or sys.stdout)
