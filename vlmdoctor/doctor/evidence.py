"""A finding's evidence in words: its rule's evidence lines with the measured values, a caveat for each fact
that was not measured, and what of the run's own facts contradicts the finding's title. Bounded, since the
values may be long lists from a trace and the format specs come from rule files."""

from __future__ import annotations

from typing import Any

from vlmdoctor.doctor.rule_expr import (
    MAX_INT,
    PLACEHOLDER,
    MissingFact,
    RuleEvalError,
    check_spec,
    evaluate,
    names,
    parsed,
)
from vlmdoctor.doctor.rule_file import Rule
from vlmdoctor.trace import catalog

MAX_RENDERED = 400  # characters one placeholder renders to (a list fact is cut, with how many were left out)
#: how a finding's evidence says that one of its rule's `contradicted_by` checks holds: its title is contradicted
#: by the run's own facts (bench/rule_precision.py counts these over the corpus; the target is none)
CONTRADICTED = "contradicted by its own evidence: "


def missing_hint(name: str, facts: dict[str, Any]) -> str | None:
    """The profiler option that would have recorded a missing fact, when the trace shows it was off (what each
    fact needs is declared in trace/catalog.py)."""
    return catalog.missing_hint(name, facts)


def _fmt(value: Any, spec: str | None) -> str:
    """A fact's value in an evidence line, at most MAX_RENDERED characters whatever the value or the spec."""
    why = check_spec(spec)
    if why:
        raise RuleEvalError(why)
    if isinstance(value, list) and value and all(isinstance(v, dict) and "code" in v for v in value):
        # whose code synced (idle.sync.by_code): each with its idle time and calls
        return _cut(", ".join(f"{v['code']} {v.get('ms', 0):.1f} ms (x{v.get('calls', 0):g})" for v in value[:5]))
    if isinstance(value, list) and value and all(isinstance(v, dict) and "op" in v for v in value):
        # host ops: the top five with their time or call count
        return _cut(
            ", ".join(
                f"{str(v['op'])[:60]} " + (f"{v['ms']:.1f} ms" if "ms" in v else f"x{v.get('calls', 0):g}")
                for v in value[:5]
            )
        )
    if isinstance(value, list):
        shown = ", ".join(_cut(str(v), 80) for v in value[:10]) or "none"
        return _cut(shown + (f" (+{len(value) - 10} more)" if len(value) > 10 else ""))
    if spec == "pct" and isinstance(value, (int, float)):
        return f"{value * 100:.1f}%"
    if spec and isinstance(value, (int, float)) and not (isinstance(value, int) and abs(value) > MAX_INT):
        return _cut(format(value, spec))
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and abs(value) > MAX_INT:
        return f"{value:.3g}" if abs(value) < 2**1000 else "(a huge integer)"
    return _cut(str(value))


def _cut(text: str, most: int = MAX_RENDERED) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def _render(text: str, env: dict[str, Any]) -> str:
    return PLACEHOLDER.sub(lambda m: _fmt(env[m.group(1)], m.group(2)) if m.group(1) in env else "n/a", text)


def evidence_lines(rule: Rule, env: dict[str, Any]) -> list[str]:
    """Evidence lines with their numbers; a line about a fact the trace lacks gives way to a caveat naming it.

    A rule can fire without a fact only through has(): the caveat says what was not measured, and
    how to measure it, so the finding is read as resting on the facts that were.
    """
    lines = [_render(e, env) for e in rule.evidence if all(m.group(1) in env for m in PLACEHOLDER.finditer(e))]
    unmeasured = sorted(
        n for n in names(parsed(rule.when)) if not n.isupper() and n not in env and not catalog.is_measured(n)
    )
    for name in unmeasured:
        hint = missing_hint(name, env)
        lines.append(
            f"not measured: {name}"
            + (f" (record with {hint})" if hint else "")
            + "; the finding assumes it does not rule the fix out"
        )
    return lines


def contradictions(rule: Rule, env: dict[str, Any]) -> list[str]:
    """What of a finding's own facts contradicts its title: each `contradicted_by` check that holds, in words.

    A check whose facts the trace lacks cannot contradict anything and is skipped.
    """
    out = []
    for c in rule.contradicted_by:
        try:
            holds = bool(evaluate(parsed(c["when"]), env))
        except MissingFact:
            continue
        if holds:
            out.append(_render(c["says"], env))
    return out
