"""The last lines of the user's training: a short summary that stays on the screen.

The report is printed as soon as its windows are measured, perhaps hours before the training ends,
and scrolls away under the training's own output. At the end of training (of the script, with
`vlmdoctor run`) these lines come last, as pytest's short summary follows its details: the headline
numbers with their spread (the one estimator), the top findings by expected gain with the first
lines of each fix in the user's terms, and where the report, its HTML page and the trace are, with
how to open the trace in Perfetto.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console

from vlmdoctor.report.html_sections import by_gain
from vlmdoctor.report.prescriptions import gain_short
from vlmdoctor.report.progress import WHOLE, wrap
from vlmdoctor.report.text import esc
from vlmdoctor.run import throughput

TOP = 3  # findings shown
LINES = 3  # lines of each fix shown
PERFETTO = "https://ui.perfetto.dev"


def _fmt(v: Any, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def headline_lines(report: dict[str, Any]) -> list[str]:
    """tokens/s with its spread and verdict; step time; MFU (or why not); the split; the ranks."""
    m, tp = report.get("metrics") or {}, report.get("throughput") or {}
    spread = throughput.spread_text(tp)
    tps = throughput.headline(report)
    first = f"real tokens/s {_fmt(tps, 0)}" + (f" ({spread})" if spread else "")
    if tp.get("stable") is False:
        first += "; unstable window (see the report's note)"
    out = [first]
    mfu = m.get("mfu")
    out.append(
        f"ms/step {_fmt(m.get('step_ms'))} (p10 {_fmt(m.get('step_ms_p10'))}, p90 {_fmt(m.get('step_ms_p90'))}); "
        + (f"MFU {mfu * 100:.2f}%" if mfu is not None else f"MFU n/a ({m.get('mfu_reason') or 'not computed'})")
    )
    sp = report.get("split")
    if sp:
        out.append(
            f"split of the traced step ({sp['basis']}): "
            + ", ".join(f"{r['part']} {r['share'] * 100:.0f}%" for r in sp["rows"])
        )
    d = report.get("distributed") or {}
    if d.get("ranks"):
        g = d.get("global") or {}
        out.append(
            f"{d.get('world_size')} ranks: the job's numbers above (all ranks' tokens over the slowest rank's "
            f"steps); slowest rank {g.get('slowest_rank')}"
            + (
                f", {g['step_imbalance'] * 100:.0f}% slower than the fastest"
                if g.get("step_imbalance", 0) >= 0.005
                else ""
            )
        )
    return out


def _finding_lines(findings: list[dict[str, Any]]) -> list[str]:
    out = [f"top findings, biggest expected gain first ({len(findings)} in all):"]
    for i, f in enumerate(by_gain(findings)[:TOP], 1):
        out.append(f"  {i}. {f['title']} ({gain_short(f.get('expected_gain'))})")
        lines = ((f.get("advice") or {}).get("lines")) or []
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


def render_summary(report: dict[str, Any], console: Console, paths: dict[str, str | None]) -> None:
    """The summary; `paths`: report, html, trace and log, those that exist (None: not written)."""
    model, cfg, env = report.get("model") or {}, report.get("config") or {}, report.get("env") or {}
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    stage = f"stage {cfg['stage']}" if cfg.get("stage") else "stage unknown"
    console.rule("[bold]vlmdoctor summary[/bold]", style="dim")
    console.print(esc(f"{model.get('class') or 'your model'} ({cfg.get('source')}), {stage}, on {where}"))
    lines: list[str] = []
    if report.get("status") in ("ok", "nan_loss") and report.get("metrics"):
        lines += headline_lines(report)
    elif report.get("error"):
        lines.append(f"{report.get('status')}: {(report.get('error') or {}).get('message')}")
    for note in report.get("notes") or []:
        if note.startswith(("the run had", "no traced window", "no tokens seen")):
            lines.append(f"note: {note}")
    findings = report.get("findings")
    if findings:
        lines += _finding_lines(findings)
    elif findings is not None:
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
