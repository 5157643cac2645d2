"""The last lines of the user's training: a short summary that stays on the screen.

The report is printed as soon as its windows are measured, perhaps hours before the training ends,
and scrolls away under the training's own output. At the end of training (of the script, with
`vlmdoctor run`) these lines come last, as pytest's short summary follows its details: the headline
numbers with their spread (the one estimator; console.py's `headline_lines`, the first lines of the
report too), the top findings by expected gain with the first lines of each fix in the user's terms,
and where the report, its HTML page and the trace are, with how to open the trace in Perfetto.
"""

from __future__ import annotations

from typing import Any

import msgspec
from rich.console import Console

from vlmdoctor.documents import Finding, RunReport, as_report
from vlmdoctor.report.console import by_rank, headline_lines
from vlmdoctor.report.prescriptions import gain_short
from vlmdoctor.report.progress import WHOLE, wrap
from vlmdoctor.report.text import esc

TOP = 3  # findings shown
LINES = 3  # lines of each fix shown
PERFETTO = "https://ui.perfetto.dev"

__all__ = ["headline_lines", "render_summary"]


def _finding_lines(findings: list[Finding]) -> list[str]:
    out = [f"top findings, biggest expected gain first ({len(findings)} in all):"]
    for i, f in enumerate(by_rank(findings)[:TOP], 1):
        gain = msgspec.structs.asdict(f.expected_gain) if f.expected_gain is not None else None
        out.append(f"  {i}. {f.title} ({gain_short(gain)})")
        lines = (f.advice or {}).get("lines") or []  # the fix in the user's terms: a free-form map (doctor/advice.py)
        shown = _first_lines(lines)
        out += [f"     {line}" for line in shown]
        if len(lines) > len(shown):
            out.append(f"     ... and {len(lines) - len(shown)} more line(s): the report has them all")
    return out


def _first_lines(lines: list[str]) -> list[str]:
    """Up to LINES lines of a fix, its imports left out; a class or a loop shows its first line, not its body."""
    shown: list[str] = []
    for line in lines:
        if len(shown) == LINES or line.startswith((" ", "\t")):
            break
        if line.startswith(("import ", "from ")):
            continue
        shown.append(line)
        if line.split("#")[0].rstrip().endswith(":"):
            break
    return shown


def render_summary(report: RunReport | dict[str, Any], console: Console, paths: dict[str, str | None]) -> None:
    """The summary; `paths`: report, html, trace and log, those that exist (None: not written)."""
    r = as_report(report)
    model, k, env = r.model, r.knobs, r.env
    where = (env.gpu if env else None) or f"CPU ({env.cpu_count if env else None} cores)"
    stage = f"stage {k.stage}" if k.stage else "stage unknown"
    console.rule("[bold]vlmdoctor summary[/bold]", style="dim")
    console.print(esc(f"{(model.class_name if model else None) or 'your model'} ({k.source}), {stage}, on {where}"))
    lines: list[str] = []
    if r.status in ("ok", "nan_loss") and r.metrics is not None:
        lines += headline_lines(r)
    elif r.error is not None:
        lines.append(f"{r.status}: {r.error.message}")
    for note in r.notes or []:
        if note.startswith(("the run had", "no traced window", "no tokens seen")):
            lines.append(f"note: {note}")
    if r.findings:
        lines += _finding_lines(r.findings)
    elif r.findings is not None:
        lines.append("no prescriptions: no rule fired on the measured facts")
    for line in lines:
        console.print(esc(line), overflow="fold")
    labels = {"report": "report", "html": "HTML", "log": "script output", "trace": "trace"}  # the trace last
    for key, label in labels.items():
        if paths.get(key):
            console.print(esc(wrap(f"{label + ':':<15}{paths[key]}", " " * 15)), **WHOLE)  # a path stays whole
    if paths.get("trace"):
        console.print(
            f"{'':<15}Perfetto: {PERFETTO}, Open trace file" + (" (one per rank)" if paths.get("ranks") else "")
        )
        console.print(f"{'':<15}(your browser reads the file; nothing is uploaded)")
