"""A rule file (`rules/*.yaml`, format: rules/README.md): its declaration, `Rule`, and every check made when it
loads, so that a bad rule is a problem named with its file before any trace is read, never a wrong finding."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.doctor.rule_expr import (
    MAX_ITEMS,
    MAX_TEXT,
    PLACEHOLDER,
    RuleError,
    alternatives,
    check_spec,
    looks_like_expr,
    names,
    parse,
    small,
)
from vlmdoctor.documents.diagnosis import GainPer
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace import catalog
from vlmdoctor.trace.accounts import ACCOUNT_IDS

REQUIRED = ("id", "layer", "title", "severity", "when", "evidence", "fix", "patch")

#: fact names a rule may use, as patterns: every fact of the catalogue (trace/catalog.py), and the rule's own
#: patch values (`patch.<knob>`, in gain expressions)
KNOWN_FACTS = [f.pattern for f in catalog.FACTS] + [
    re.compile(r"patch\.(" + "|".join(RunConfig.__dataclass_fields__) + r")")
]


#: the keys of a rule's `gain` that are expressions over facts and constants (rules/README.md)
GAIN_EXPRS = ("saves_ms", "speedup", "target_ms", "grows_ms", "undo_ms")

#: the values of a rule's `gain.per` (documents/diagnosis.py `GainPer`), the first its default
GAIN_PER = get_args(GainPer)


@dataclass
class Rule:
    id: str
    layer: int
    title: str
    severity: str
    when: str
    evidence: list[str]
    fix: str
    patch: dict[str, Any]
    path: Path
    stages: list[int] = field(default_factory=lambda: [1, 2])
    unless: str | None = None
    constants: dict[str, dict[str, Any]] = field(default_factory=dict)
    gain: dict[str, Any] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    detects: str = ""
    accounts: list[str] = field(default_factory=list)  # the step's accounts (trace/accounts.py) its fix speaks to
    #: the facts that would contradict the title: each {when: expression, says: text with {fact} placeholders}
    contradicted_by: list[dict[str, str]] = field(default_factory=list)

    @property
    def gain_per(self) -> str:
        """Whether the time its fix saves is a cost of each step or of each sample (`gain.per`, default step)."""
        return self.gain.get("per", GAIN_PER[0])

    @property
    def where(self) -> str:
        """The start of every message about this rule: its file and id."""
        return f"{self.path}: rule {self.id}: "

    @property
    def uses_dist(self) -> bool:
        """A rule about the job's ranks together: it runs on the cross-rank facts of a folder of rank traces."""
        return any(n.startswith("dist.") for n in self.facts_used())

    def facts_used(self) -> set[str]:
        exprs = [
            self.when,
            self.unless or "",
            *(e for k in GAIN_EXPRS for e in alternatives(self.gain.get(k))),
        ]
        exprs += [v for v in self.patch.values() if isinstance(v, str) and looks_like_expr(v)]
        exprs += [m.group(1) for e in self.evidence for m in PLACEHOLDER.finditer(e)]
        for c in self.contradicted_by:
            exprs += [c["when"], *(m.group(1) for m in PLACEHOLDER.finditer(c["says"]))]
        return {n for e in exprs if e for n in names(parse(e, self.where)) if not n.isupper()}


def _check_gain(rule: Rule, path: Path) -> None:
    """A rule's `gain` (rules/README.md): each estimate one expression or a list of them, `per` one of GAIN_PER."""

    def _gain_forms_ok(v: Any) -> bool:  # one expression, or a list of them (a GPU form, then a CPU form)
        return (
            v is None or isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(e, str) for e in v))
        )

    if not isinstance(rule.gain, dict) or not all(_gain_forms_ok(rule.gain.get(k)) for k in GAIN_EXPRS):
        raise RuleError(
            f"{path}: rule {rule.id}: gain must be a mapping whose saves_ms, speedup, target_ms, grows_ms and undo_ms "
            "are expressions in strings"
        )
    if rule.gain_per not in GAIN_PER:
        raise RuleError(f"{path}: rule {rule.id}: gain.per must be one of {', '.join(GAIN_PER)}")
    if rule.gain.get("grows_ms") is not None and rule.gain_per != "sample":
        raise RuleError(
            f"{path}: rule {rule.id}: gain.grows_ms is the part of saves_ms that grows with the batch: "
            "it needs gain.per: sample"
        )


def rule_from(path: Path, data: Any) -> Rule:
    """The rule a file declares, every field and expression checked; RuleError names the file and the problem."""
    if not isinstance(data, dict):
        raise RuleError(f"{path}: expected a mapping with {', '.join(REQUIRED)}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise RuleError(f"{path}: missing {', '.join(missing)}")
    known = set(Rule.__dataclass_fields__) - {"path"}
    extra = sorted(set(data) - known)
    if extra:
        raise RuleError(f"{path}: unknown field(s) {', '.join(extra)}; valid fields: {', '.join(sorted(known))}")
    rule = Rule(path=path, **data)
    if not isinstance(rule.id, str) or not rule.id:
        raise RuleError(f"{path}: id must be a non-empty string, got {rule.id!r}")
    for key in ("title", "fix"):
        if not isinstance(getattr(rule, key), str):
            raise RuleError(f"{path}: rule {rule.id}: {key} must be a string")
    if not isinstance(rule.when, str) or (rule.unless is not None and not isinstance(rule.unless, str)):
        raise RuleError(
            f"{path}: rule {rule.id}: when and unless must be expressions in a string, e.g. "
            'when: "gemm.fp32_share > 0.5"'
        )
    if not isinstance(rule.evidence, list) or not all(isinstance(e, str) for e in rule.evidence):
        raise RuleError(f"{path}: rule {rule.id}: evidence must be a list of strings")
    if not isinstance(rule.patch, dict) or not all(isinstance(k, str) for k in rule.patch):
        raise RuleError(f"{path}: rule {rule.id}: patch must be a mapping of knob names to values")

    _check_gain(rule, path)
    if not isinstance(rule.stages, list) or not rule.stages or any(st not in (1, 2) for st in rule.stages):
        raise RuleError(f"{path}: rule {rule.id}: stages must be a list of 1 and/or 2")
    if not isinstance(rule.conflicts, list) or not isinstance(rule.sources, list):
        raise RuleError(f"{path}: rule {rule.id}: conflicts and sources must be lists")
    unknown = [a for a in rule.accounts if a not in ACCOUNT_IDS] if isinstance(rule.accounts, list) else None
    if unknown is None or unknown:
        raise RuleError(
            f"{path}: rule {rule.id}: accounts must be a list of the step's accounts"
            + (f"; unknown: {', '.join(map(str, unknown))}" if unknown else "")
            + f" (known: {', '.join(ACCOUNT_IDS)})"
        )
    if not isinstance(rule.constants, dict):
        raise RuleError(f"{path}: rule {rule.id}: constants must be a mapping")
    if isinstance(rule.layer, bool) or rule.layer not in range(1, 6):
        raise RuleError(f"{path}: layer must be 1-5 (1 precision ... 5 system tuning), got {rule.layer!r}")
    if rule.severity not in SEVERITIES:
        raise RuleError(f"{path}: severity must be one of {', '.join(SEVERITIES)}")
    _check_contradictions(rule, path)
    gains = [e for k in GAIN_EXPRS for e in alternatives(rule.gain.get(k))]
    for c in (rule.when, rule.unless, *gains):
        if c:
            parse(c, rule.where)
    bad = sorted(n for n in rule.facts_used() if not any(p.fullmatch(n) for p in KNOWN_FACTS))
    undefined = sorted(
        n
        for e in (rule.when, rule.unless, *gains)
        if e
        for n in names(parse(e, rule.where))
        if n.isupper() and n not in rule.constants
    )
    if bad:
        raise RuleError(f"{path}: rule {rule.id} uses unknown fact(s) {', '.join(bad)} (see docs/analysis.md)")
    if undefined:
        raise RuleError(f"{path}: rule {rule.id} uses undefined constant(s) {', '.join(undefined)}")
    if not isinstance(rule.constants, dict):
        raise RuleError(f"{path}: rule {rule.id}: constants must be a mapping")
    _check_values(rule, path)
    knobs = set(RunConfig.__dataclass_fields__)
    if set(rule.patch) - knobs:
        raise RuleError(f"{path}: rule {rule.id} patches unknown knob(s) {', '.join(sorted(set(rule.patch) - knobs))}")
    return rule


def _check_contradictions(rule: Rule, path: Path) -> None:
    """`contradicted_by`: a list of {when, says}, each `when` an expression over known facts and rule constants."""
    if not isinstance(rule.contradicted_by, list) or not all(
        isinstance(c, dict) and set(c) == {"when", "says"} and all(isinstance(v, str) for v in c.values())
        for c in rule.contradicted_by
    ):
        raise RuleError(f"{path}: rule {rule.id}: contradicted_by must be a list of {{when: expression, says: text}}")
    for c in rule.contradicted_by:
        used = names(parse(c["when"], rule.where))
        bad = sorted(n for n in used if not n.isupper() and not any(p.fullmatch(n) for p in KNOWN_FACTS))
        undefined = sorted(n for n in used if n.isupper() and n not in rule.constants)
        if bad or undefined:
            unknown = ", ".join(bad + undefined)
            raise RuleError(f"{path}: rule {rule.id}: contradicted_by uses unknown fact(s) or constant(s) {unknown}")


def _check_values(rule: Rule, path: Path) -> None:
    """Constants within the bounds of an expression's values, evidence placeholders with usable format specs."""
    for name, c in rule.constants.items():
        if not isinstance(c, dict) or "value" not in c or "why" not in c:
            raise RuleError(f"{path}: rule {rule.id}: each constant needs a value and a why (where it comes from)")
        if not small(c["value"]):
            raise RuleError(
                f"{path}: rule {rule.id}: constant {name} must be a number (integers up to 2^256), a string of "
                f"up to {MAX_TEXT} characters or a list of up to {MAX_ITEMS} of them"
            )
    for line in rule.evidence:
        for m in PLACEHOLDER.finditer(line):
            why = check_spec(m.group(2))
            if why:
                raise RuleError(f"{path}: rule {rule.id}: evidence {{{m.group(1)}:...}}: {why}")
