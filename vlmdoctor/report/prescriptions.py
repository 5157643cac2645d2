"""Prescriptions in the terminal: biggest expected gain first, each with its gain, its fix (the command that runs
it, or the lines the user writes) and, verbose, its evidence; then what the rules saw but did not prescribe."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from vlmdoctor.doctor.gain import gain_ratio
from vlmdoctor.documents import Analysis, Diagnosis, ExpectedGain, Finding
from vlmdoctor.report.text import fill, print_text


def gain_text(gain: dict[str, Any]) -> str:
    if gain["saves_ms_per_step"] is not None:
        g = f"-{gain['saves_ms_per_step']:,.1f} ms/step"
        if gain["share_of_step"] and gain.get("step_ms"):  # the ms and the step from one window, said
            g += f"\n({gain['share_of_step'] * 100:.0f}% of the {gain['step_ms']:,.1f} ms traced step)"
        elif gain["share_of_step"]:
            g += f"\n({gain['share_of_step'] * 100:.0f}% of the traced step)"
        return g
    if gain.get("throughput_x"):
        return f"x{gain['throughput_x']:.2f} throughput"
    return "n/a"


def gain_short(gain: dict[str, Any] | None) -> str:
    """A finding's expected gain in a few characters (x1.58, -3.1 ms/step, n/a), for the muted line."""
    ratio = gain_ratio(gain)
    if ratio is not None:
        return f"x{ratio:.2f}"
    saves = (gain or {}).get("saves_ms_per_step")
    return f"-{saves:,.1f} ms/step" if isinstance(saves, (int, float)) else "gain n/a"


def render_unprescribed(diagnosis: dict[str, Any], console: Console) -> None:
    """Each large account of the step that no finding speaks to, said as seen: no cost of that size goes unnamed."""
    for a in diagnosis.get("accounts") or []:
        if a["verdict"] != "no prescription known":
            continue
        where = f" (in {', '.join(a['where'])})" if a.get("where") else ""
        console.print(
            f"seen: {a['ms']:,.1f} ms/step ({a['share'] * 100:.0f}% of the traced step) in {a['account']}, "
            f"{a['meaning']}{where}; no prescription known",
            style="yellow",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def render_muted(diagnosis: dict[str, Any], console: Console) -> None:
    """One line naming every muted finding with its expected gain: muted, never silently dropped."""
    muted = diagnosis.get("muted") or []
    if not muted:
        return
    by = sorted({str(m.get("muted_by", "")).split(" ")[0] for m in muted})
    console.print(
        f"muted ({len(muted)}, by {', '.join(by)}): "
        + ", ".join(f"{m['id']} {gain_short(m.get('expected_gain'))}" for m in muted),
        style="dim",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


@dataclass
class Prescribed:
    """A finding to print: where it was seen (ranks, the job) and how its patch becomes a command."""

    finding: Finding
    where: list[str]
    command: Callable[[dict[str, Any]], str] | None = None


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def command_lines(cmd: str, width: int, indent: str = "  ") -> list[str]:
    """A shell command broken between flags (a flag keeps its value), each broken line ending in a
    continuation backslash: pasted, the shell reads one command."""
    groups: list[str] = []
    for token in cmd.split(" "):
        if groups and not token.startswith("-") and groups[-1].startswith("-") and " " not in groups[-1]:
            groups[-1] += " " + token  # a flag's value stays with its flag
        else:
            groups.append(token)
    lines = [indent]
    for g in groups:
        line = lines[-1]
        if line.strip() and len(line) + 1 + len(g) + 2 > width:
            lines[-1] = line + " \\"
            lines.append(indent + "    " + g)
        else:
            lines[-1] = line + ("" if not line.strip() else " ") + g
    return lines


def gain_x(gain: ExpectedGain) -> float | None:
    """The expected throughput ratio, by the rules' one formula (doctor/gain.py)."""
    return gain_ratio(msgspec.structs.asdict(gain))


def gain_words(f: Finding, short: bool = False) -> str:
    """The expected gain in words on one line: x1.58, -241.2 ms/step (37% of the 660.1 ms traced step); short: its
    first part alone (x1.58, or -1,234.5 ms/step where no ratio is known)."""
    g = f.expected_gain or ExpectedGain()
    ratio = gain_x(g)
    parts = [f"x{ratio:.2f}"] if ratio is not None else []
    if g.saves_ms_per_step is not None:
        ms = f"-{g.saves_ms_per_step:,.1f} ms/step"
        if g.share_of_step and g.step_ms and not short:
            ms += f" ({g.share_of_step * 100:.0f}% of the {g.step_ms:,.1f} ms traced step)"
        parts.append(ms)
    return (parts[0] if short and parts else ", ".join(parts)) or "gain n/a"


def render_prescriptions(items: list[Prescribed], console: Console, verbose: bool) -> None:
    """Prescriptions, biggest expected gain first. Compact: one line each with the gain, then the fix (the
    command or the user's lines). Verbose: also the evidence, the fix in words and where it was seen."""
    width = console.width
    if not items:
        console.print("[bold green]no prescriptions[/bold green]: no rule fired on the measured facts")
        return
    print_text(console, fill("prescriptions, biggest expected gain first; apply them in layer order:", width), "bold")
    for i, rx in enumerate(items, 1):
        f = rx.finding
        order = f", apply {_ordinal(f.apply_order)}" if f.apply_order is not None else ""
        where = f" [{', '.join(rx.where)}]" if rx.where else ""
        if verbose:
            print_text(console, fill(f"#{i} {f.id}: {f.title or ''}", width, "", "   "), "bold")
            head = f"layer {f.layer} {f.layer_name or ''}{order}; {f.severity or ''}; expected {gain_words(f)}"
            print_text(console, fill(head + where, width, "   ", "     "))
            for e in f.evidence or []:
                print_text(console, fill(f"seen: {e}", width, "   ", "     "))
            print_text(console, fill(f"fix: {f.fix or ''}", width, "   ", "     "))
        else:
            g = gain_words(f, short=True)
            line = f"{i}. {g} {f.severity or ''}{order}: {f.title or f.id}{where}"
            print_text(console, fill(line, width, "", "   "))
        advice = f.advice or {}
        if advice.get("lines"):  # the user's own training: the fix in their terms, not vlmdoctor knobs
            print_text(console, f"   {f.id}, in your {advice.get('audience', 'code')}:")
            for line in advice["lines"]:
                print_text(console, f"     {line}", "cyan")
        elif f.config_patch:
            patch = f.config_patch
            if rx.command is None:
                knobs = ", ".join(f"{k}={v}" for k, v in patch.items())
                print_text(console, fill(f"knobs ({f.id}): {knobs}", width, "   ", "     "), "cyan")
            else:
                print_text(console, f"   {f.id}, run:")
                print_text(console, "\n".join(command_lines(rx.command(patch), width, "     ")), "cyan")


def render_not_prescribed(diagnoses: list[Diagnosis], console: Console, verbose: bool) -> None:
    """What the rules saw but did not prescribe: large accounts without a cause (always said), muted findings,
    and, verbose, the superseded, inapplicable and unevaluated rules (compact: counted on one line)."""
    width = console.width
    seen: set[str] = set()
    for d in diagnoses:
        for a in d.accounts:
            if a.verdict != "no prescription known" or a.account in seen:
                continue
            seen.add(a.account)
            at = f" (in {', '.join(a.where)})" if a.where else ""
            text = (
                f"seen: {a.ms or 0:,.1f} ms/step ({(a.share or 0) * 100:.0f}% of the traced step) in {a.account}, "
                f"{a.meaning or ''}{at}; no prescription known"
            )
            print_text(console, fill(text, width, "", "  "), "yellow")
    muted = _unique(f for d in diagnoses for f in d.muted)
    if muted:
        by = sorted({str(m.muted_by or "").split(" ")[0] for m in muted})
        text = f"muted ({len(muted)}, by {', '.join(by)}): " + ", ".join(
            f"{m.id} {gain_words(m).split(',')[0]}" for m in muted
        )
        print_text(console, fill(text, width, "", "  "), "dim")
    superseded = _unique(f for d in diagnoses for f in d.superseded)
    fired = {f.id for d in diagnoses for f in (*d.findings, *d.superseded, *d.muted)}
    # several diagnoses (ranks, the job): a rule is said once, by what the best-informed one did with it
    evaluated = {n.id: n for d in diagnoses for n in d.not_evaluated if n.id not in fired}
    inapplicable = {n.id: n for d in diagnoses for n in d.not_applicable if n.id not in fired | set(evaluated)}
    gpu_only = sorted(k for k, n in inapplicable.items() if "fact of GPU runs" in (n.why or ""))
    if not verbose:
        counts = [
            f"{len(x)} {word}"
            for x, word in ((superseded, "superseded"), (evaluated, "not evaluated"), (inapplicable, "not applicable"))
            if x
        ]
        if counts:
            print_text(console, fill(f"other rules: {', '.join(counts)} (--verbose says which and why)", width), "dim")
    else:
        for s in superseded:
            print_text(console, fill(f"superseded: {s.id} (covered by {s.superseded_by})", width, "", "  "), "dim")
        for n in inapplicable.values():
            if n.measured:
                print_text(console, fill(f"seen, fix not applicable: {n.id} ({n.why})", width, "", "  "), "dim")
        for n in evaluated.values():
            hint = f"; record with {n.hint}" if n.hint else ""
            text = f"not evaluated: {n.id} (needs {', '.join(n.missing or [])}{hint})"
            print_text(console, fill(text, width, "", "  "), "dim")
        if gpu_only:
            text = f"not applicable to a CPU run ({len(gpu_only)} rules need GPU kernel facts): " + ", ".join(gpu_only)
            print_text(console, fill(text, width, "", "  "), "dim")
    for p in dict.fromkeys(p for d in diagnoses for p in d.problems):
        print_text(console, fill(f"rule problem: {p}", width, "", "  "), "yellow")


def _unique(findings: Iterable[Finding]) -> list[Finding]:
    """Findings by id, the first of each (several ranks' diagnoses name the same rule)."""
    return list({f.id: f for f in reversed(list(findings))}.values())[::-1]


def _facts_config(facts: dict[str, Any]) -> dict[str, Any]:
    """The run config a vlmdoctor trace carries (its `config.*` facts, model and stage), for the commands."""
    cfg = {k.removeprefix("config."): v for k, v in facts.items() if k.startswith("config.")}
    for k in ("stage", "model"):
        if f"run.{k}" in facts:
            cfg[k] = facts[f"run.{k}"]
    return cfg


def analysis_prescriptions(
    doc: Analysis, run_command: Callable[[dict[str, Any], dict[str, Any]], str] | None
) -> tuple[list[Prescribed], list[Diagnosis]]:
    """Every file's findings and the job's as one list, biggest gain first: a rule that fired on several ranks
    is one prescription that names them; the diagnoses, for what was not prescribed."""
    several = len(doc.files) > 1
    by_id: dict[str, Prescribed] = {}
    diagnoses: list[Diagnosis] = []
    for entry in doc.files:
        if entry.diagnosis is None:
            continue
        diagnoses.append(entry.diagnosis)
        name = f"rank {entry.rank}" if entry.rank is not None else Path(entry.file).name
        cfg = _facts_config(entry.facts)
        command = None
        if run_command is not None and entry.facts.get("trace.written_by_vlmdoctor"):
            command = functools.partial(run_command, cfg)
        for f in entry.diagnosis.findings:
            rx = by_id.setdefault(f.id, Prescribed(f, [], command))
            if several:
                rx.where.append(name)
    cross = doc.cross_rank
    if cross is not None and cross.diagnosis is not None:
        diagnoses.append(cross.diagnosis)
        for f in cross.diagnosis.findings:
            by_id.setdefault(f.id, Prescribed(f, [], None)).where.append("the job")
    items = list(by_id.values())
    if several:  # every rank alike: said once, not as a list of ranks
        for rx in items:
            if len(rx.where) == len(doc.files) and rx.where != ["the job"]:
                rx.where = ["every rank"]
    items.sort(key=lambda rx: -(gain_x(rx.finding.expected_gain or ExpectedGain()) or 0))
    return items, diagnoses
