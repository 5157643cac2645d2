"""The doctor: rules read as data from `rules/*.yaml`, evaluated against measured facts.

A rule's condition is a small expression over named facts (`gemm.fp32_share > MIN_SHARE and
run.stage == 2`), parsed with Python's `ast` and evaluated by walking only whitelisted nodes:
comparisons, and/or/not, arithmetic, literals, a few math functions. There is no `eval`.
A rule that needs a fact the trace does not hold is reported as not evaluated, never as fired.

A finding's severity follows its expected gain (doctor/gain.py, capped by the rule's own
`severity`), and findings are listed biggest expected gain first (`rank`); the layer (1 precision
... 5 system tuning) is the order in which the fixes are applied (`apply_order`). A finding whose
config patch contradicts or repeats an earlier-applied one's, or that names it under `conflicts`,
is kept as superseded rather than prescribed twice. A finding the user muted (`--ignore`,
`[tool.vlmdoctor]`) is kept under `muted`, never dropped.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from vlmdoctor.doctor.gain import SEVERITIES, gain_ratio, gain_severity
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import read_yaml
from vlmdoctor.run.config import LAYER_NAMES, RunConfig
from vlmdoctor.trace import catalog
from vlmdoctor.trace.accounts import ACCOUNT_IDS, WORK, step_accounts
from vlmdoctor.trace.families.idle import SYNC_CODE


def _builtin_rules_dir() -> Path:
    """The shipped rules: package data in an installed wheel, the top-level rules/ in a source checkout."""

    try:
        found = resources.files("vlmdoctor.builtin_rules")
        for entry in getattr(found, "_paths", [found]):  # a namespace package may span several folders
            if Path(str(entry)).is_dir() and any(Path(str(entry)).glob("*.yaml")):
                return Path(str(entry))
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "rules"


RULES_DIR = _builtin_rules_dir()
#: an account of the step this large gets a word in every diagnosis: a finding, or "no prescription known"
MIN_ACCOUNT_SHARE = 0.05
#: how a finding's evidence says that one of its rule's `contradicted_by` checks holds: its title is contradicted
#: by the run's own facts (bench/rule_precision.py counts these over the corpus; the target is none)
CONTRADICTED = "contradicted by its own evidence: "
FUNCTIONS = {"min": min, "max": max, "floor": math.floor, "ceil": math.ceil, "round": round, "abs": abs}
HAS = "has"  # has(fact.name): whether the trace measured it; never "not evaluated" (see rules/README.md)
#: how many positional arguments each function takes (no keywords)
ARITY = {"min": (1, 16), "max": (1, 16), "floor": (1, 1), "ceil": (1, 1), "round": (1, 2), "abs": (1, 1), HAS: (1, 1)}
#: bounds on every expression and every value it makes (docs/files.md): the shipped rules use 403
#: characters, 99 nodes, nesting 11, two arguments, specs like ".1f" and ",.0f"
MAX_EXPR_CHARS = 2000
MAX_EXPR_NODES = 500
MAX_EXPR_DEPTH = 40
MAX_INT = 2**256  # larger integers (a literal, a constant, a product, floor(1e300)) are refused
MAX_TEXT = 256  # characters of a string literal or constant
MAX_ITEMS = 64  # elements of a list literal or constant
MAX_ROUND_DIGITS = 20  # round(x, n): |n|
MAX_WIDTH = 100  # a format spec's width ({x:>12}) ...
MAX_PRECISION = 20  # ... and precision ({x:.3f})
MAX_RENDERED = 400  # characters one placeholder renders to (a list fact is cut, with how many were left out)
_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(?P<width>\d+)?[,_]?(?:\.(?P<precision>\d+))?[bcdeEfFgGnosxX%]?", re.S)


def missing_hint(name: str, facts: dict[str, Any]) -> str | None:
    """The profiler option that would have recorded a missing fact, when the trace shows it was off (what each
    fact needs is declared in trace/catalog.py)."""
    return catalog.missing_hint(name, facts)


REQUIRED = ("id", "layer", "title", "severity", "when", "evidence", "fix", "patch")

#: fact names a rule may use, as patterns: every fact of the catalogue (trace/catalog.py), and the rule's own
#: patch values (`patch.<knob>`, in gain expressions)
KNOWN_FACTS = [f.pattern for f in catalog.FACTS] + [
    re.compile(r"patch\.(" + "|".join(RunConfig.__dataclass_fields__) + r")")
]


class RuleError(UsageError):
    """A rule file that cannot be used: the message names the file and the problem."""


class RuleEvalError(Exception):
    """An expression that cannot be computed on these facts (not a missing fact: a bad rule)."""


#: what evaluating a user's expression may raise; each becomes a rule problem, the other rules still run
EVAL_ERRORS = (
    RuleEvalError,
    ArithmeticError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    RecursionError,
    MemoryError,
)


class _Missing(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


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
    def uses_dist(self) -> bool:
        """A rule about the job's ranks together: it runs on the cross-rank facts of a folder of rank traces."""
        return any(n.startswith("dist.") for n in self.facts_used())

    def facts_used(self) -> set[str]:
        exprs = [
            self.when,
            self.unless or "",
            *_alternatives(self.gain.get("saves_ms")),
            *_alternatives(self.gain.get("speedup")),
        ]
        exprs += [v for v in self.patch.values() if isinstance(v, str) and _looks_like_expr(v)]
        exprs += [m.group(1) for e in self.evidence for m in _PLACEHOLDER.finditer(e)]
        for c in self.contradicted_by:
            exprs += [c["when"], *(m.group(1) for m in _PLACEHOLDER.finditer(c["says"]))]
        return {n for e in exprs if e for n in _names(_parse(e, self)) if not n.isupper()}


def _alternatives(v: Any) -> list[str]:
    """A gain expression, or a list of them: the first whose facts were measured is used (GPU run, CPU run)."""
    if not v:
        return []
    return [str(x) for x in v] if isinstance(v, list) else [str(v)]


def _looks_like_expr(v: str) -> bool:
    return v.startswith("=")


def _parse(expr: str, rule: Rule | None = None) -> ast.AST:
    """The expression's tree, checked: only the allowed nodes, and every bound (size, nesting, calls, literals)."""
    where = f"{rule.path}: rule {rule.id}: " if rule else ""
    text = expr[1:] if expr.startswith("=") else expr
    if len(text) > MAX_EXPR_CHARS:
        raise RuleError(f"{where}an expression of {len(text):,} characters (at most {MAX_EXPR_CHARS:,})")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise RuleError(f"{where}condition {expr[:200]!r} does not parse ({e.msg})") from None
    except (ValueError, RecursionError, MemoryError) as e:  # a literal of over 4,300 digits; nesting
        raise RuleError(f"{where}condition {expr[:200]!r} does not parse ({type(e).__name__})") from None
    nodes = list(ast.walk(tree))
    if len(nodes) > MAX_EXPR_NODES:
        raise RuleError(f"{where}an expression of {len(nodes):,} parts (at most {MAX_EXPR_NODES})")
    if _depth(tree) > MAX_EXPR_DEPTH:
        raise RuleError(f"{where}an expression nested more than {MAX_EXPR_DEPTH} deep")
    for node in nodes:
        if not isinstance(node, _ALLOWED):
            raise RuleError(
                f"{where}{type(node).__name__} is not allowed in {expr[:200]!r} (only comparisons, and/or/not, "
                f"arithmetic, literals and {', '.join(FUNCTIONS)})"
            )
        if isinstance(node, ast.Call):
            _check_call(node, expr, where)
        if isinstance(node, ast.Constant) and not _small(node.value):
            raise RuleError(f"{where}the literal {str(node.value)[:40]!r}... is too large, in {expr[:200]!r}")
        if isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) > MAX_ITEMS:
            raise RuleError(f"{where}a list of {len(node.elts)} items (at most {MAX_ITEMS}), in {expr[:200]!r}")
    return tree


def _check_call(node: ast.Call, expr: str, where: str) -> None:
    if not (isinstance(node.func, ast.Name) and node.func.id in (*FUNCTIONS, HAS)):
        raise RuleError(f"{where}only {', '.join(FUNCTIONS)} and {HAS} may be called in {expr[:200]!r}")
    name = node.func.id
    lo, hi = ARITY[name]
    if name == HAS and not (len(node.args) == 1 and _dotted(node.args[0]) and not node.keywords):
        raise RuleError(f"{where}{HAS}() takes one fact name, in {expr[:200]!r}")
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args) or not lo <= len(node.args) <= hi:
        takes = f"{lo}" if lo == hi else f"{lo} to {hi}"
        raise RuleError(f"{where}{name}() takes {takes} plain argument(s), in {expr[:200]!r}")


def _depth(tree: ast.AST) -> int:
    deepest, todo = 0, [(tree, 1)]
    while todo:
        node, d = todo.pop()
        deepest = max(deepest, d)
        if deepest > MAX_EXPR_DEPTH:
            break
        todo.extend((c, d + 1) for c in ast.iter_child_nodes(node))
    return deepest


def _small(v: Any) -> bool:
    """A value within the bounds an expression may hold: an integer up to MAX_INT, a short string, a short
    list of such values (any float: its size is fixed)."""
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return True
    if isinstance(v, int):
        return abs(v) <= MAX_INT
    if isinstance(v, str):
        return len(v) <= MAX_TEXT
    if isinstance(v, (list, tuple)):
        return len(v) <= MAX_ITEMS and all(not isinstance(x, (list, tuple, dict)) and _small(x) for x in v)
    return False


def check_spec(spec: str | None) -> str | None:
    """Why a placeholder's format spec ({fact:spec}) cannot be used, or None: it must be `pct` or Python's
    format mini-language with a width up to MAX_WIDTH and a precision up to MAX_PRECISION."""
    if spec is None or spec == "pct":
        return None
    m = _SPEC.fullmatch(spec)
    if m is None:
        return f"the format spec {spec[:40]!r} is not one Python's format() reads"
    if m["width"] and int(m["width"][:6]) > MAX_WIDTH:
        return f"the format spec {spec[:40]!r} has a width over {MAX_WIDTH}"
    if m["precision"] and int(m["precision"][:6]) > MAX_PRECISION:
        return f"the format spec {spec[:40]!r} has a precision over {MAX_PRECISION}"
    return None


@cache
def _tree(expr: str) -> ast.AST:
    """Parsed once: expressions were validated when their rule was loaded."""
    return _parse(expr)


_ALLOWED = (
    ast.Expression,
    ast.BoolOp,
    ast.And,
    ast.Or,
    ast.UnaryOp,
    ast.Not,
    ast.USub,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Compare,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.Eq,
    ast.NotEq,
    ast.In,
    ast.NotIn,
    ast.Name,
    ast.Attribute,
    ast.Constant,
    ast.Load,
    ast.Call,
    ast.List,
    ast.Tuple,
    ast.IfExp,
)
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)(?::([^}]*))?\}")


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def _names(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            d = _dotted(node)
            if d and not (isinstance(node, ast.Name) and node.id in (*FUNCTIONS, HAS)):
                out.add(d)
    # keep the longest dotted names only (a.b.c, not a.b and a)
    return {n for n in out if not any(o != n and o.startswith(n + ".") for o in out)}


_ARITH = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}
_COMPARE = {
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}


def _eval(node: ast.AST, env: dict[str, Any]) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = _dotted(node)
        if name not in env:
            raise _Missing(name)
        return env[name]
    if isinstance(node, ast.BoolOp):
        vals = (_eval(v, env) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp):
        v = _eval(node.operand, env)
        if isinstance(node.op, ast.Not):
            return not v
        if not isinstance(v, (int, float)):
            raise RuleEvalError(f"cannot negate {type(v).__name__} {str(v)[:40]!r}")
        return -v
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env), _eval(node.right, env)
        for v in (left, right):  # no list or string repetition: an expression cannot allocate memory
            if not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > MAX_INT):
                raise RuleEvalError(f"arithmetic needs numbers, got {type(v).__name__} {str(v)[:40]!r}")
        return _bounded(_ARITH[type(node.op)](left, right))
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = _eval(comp, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and node.func.id == HAS:
        return _dotted(node.args[0]) in env
    if isinstance(node, ast.Call):
        return _call(node.func.id, [_eval(a, env) for a in node.args])
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, env) for e in node.elts]
    if isinstance(node, ast.IfExp):
        return _eval(node.body, env) if _eval(node.test, env) else _eval(node.orelse, env)
    raise RuleError(f"cannot evaluate {type(node).__name__}")


def _bounded(v: Any) -> Any:
    """An integer result past MAX_INT is refused (a float's size is fixed; inf and NaN compare as such)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
        raise RuleEvalError(f"an integer of more than {MAX_INT.bit_length()} bits")
    return v


def _call(name: str, args: list[Any]) -> Any:
    """One of FUNCTIONS on numbers (min and max also on one list of numbers); the result bounded like arithmetic."""
    values = args[0] if name in ("min", "max") and len(args) == 1 and isinstance(args[0], list) else args
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not _small(v):
            raise RuleEvalError(f"{name}() needs numbers, got {type(v).__name__} {str(v)[:40]!r}")
    if name == "round" and len(args) == 2:
        digits = args[1]
        if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
            raise RuleEvalError(f"round()'s digits must be an integer within +-{MAX_ROUND_DIGITS}, got {digits!r}")
    return _bounded(FUNCTIONS[name](*args))


# --- loading --------------------------------------------------------------------------------------------


def _rule_from(path: Path, data: Any) -> Rule:
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

    def _gain_forms_ok(v: Any) -> bool:  # one expression, or a list of them (a GPU form, then a CPU form)
        return (
            v is None or isinstance(v, str) or (isinstance(v, list) and bool(v) and all(isinstance(e, str) for e in v))
        )

    if not isinstance(rule.gain, dict) or not all(_gain_forms_ok(rule.gain.get(k)) for k in ("saves_ms", "speedup")):
        raise RuleError(
            f"{path}: rule {rule.id}: gain must be a mapping whose saves_ms and speedup are expressions in strings"
        )
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
    gains = _alternatives(rule.gain.get("saves_ms")) + _alternatives(rule.gain.get("speedup"))
    for c in (rule.when, rule.unless, *gains):
        if c:
            _parse(c, rule)
    bad = sorted(n for n in rule.facts_used() if not any(p.fullmatch(n) for p in KNOWN_FACTS))
    undefined = sorted(
        n
        for e in (rule.when, rule.unless, *gains)
        if e
        for n in _names(_parse(e, rule))
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
        names = _names(_parse(c["when"], rule))
        bad = sorted(n for n in names if not n.isupper() and not any(p.fullmatch(n) for p in KNOWN_FACTS))
        undefined = sorted(n for n in names if n.isupper() and n not in rule.constants)
        if bad or undefined:
            unknown = ", ".join(bad + undefined)
            raise RuleError(f"{path}: rule {rule.id}: contradicted_by uses unknown fact(s) or constant(s) {unknown}")


def contradictions(rule: Rule, env: dict[str, Any]) -> list[str]:
    """What of a finding's own facts contradicts its title: each `contradicted_by` check that holds, in words.

    A check whose facts the trace lacks cannot contradict anything and is skipped.
    """
    out = []
    for c in rule.contradicted_by:
        try:
            holds = bool(_eval(_tree(c["when"]), env))
        except _Missing:
            continue
        if holds:
            out.append(_render(c["says"], env))
    return out


def _check_values(rule: Rule, path: Path) -> None:
    """Constants within the bounds of an expression's values, evidence placeholders with usable format specs."""
    for name, c in rule.constants.items():
        if not isinstance(c, dict) or "value" not in c or "why" not in c:
            raise RuleError(f"{path}: rule {rule.id}: each constant needs a value and a why (where it comes from)")
        if not _small(c["value"]):
            raise RuleError(
                f"{path}: rule {rule.id}: constant {name} must be a number (integers up to 2^256), a string of "
                f"up to {MAX_TEXT} characters or a list of up to {MAX_ITEMS} of them"
            )
    for line in rule.evidence:
        for m in _PLACEHOLDER.finditer(line):
            why = check_spec(m.group(2))
            if why:
                raise RuleError(f"{path}: rule {rule.id}: evidence {{{m.group(1)}:...}}: {why}")


def load_rules(*dirs: str | Path) -> tuple[list[Rule], list[str]]:
    """Rules of the shipped folder plus any extra folders; problems are reported, the other rules still load."""
    rules: list[Rule] = []
    problems: list[str] = []
    seen: dict[str, Path] = {}
    if not any(RULES_DIR.glob("*.y*ml")):
        raise UsageError(
            f"no built-in rules found (looked in {RULES_DIR}); this vlmdoctor install is broken: "
            "reinstall it (pip install --force-reinstall vlmdoctor)"
        )
    folders: dict[Path, Path] = {}  # a folder named twice (--rules and [tool.vlmdoctor] rules) loads once
    for d in [RULES_DIR, *dirs]:
        folders.setdefault(Path(os.path.abspath(d)), Path(d))
    for d in folders.values():
        if not d.is_dir():
            problems.append(f"{d}: not a folder of rule files")
            continue
        try:
            paths = sorted(d.glob("*.y*ml"))
        except OSError as e:
            problems.append(f"{d}: cannot read the folder ({e.strerror})")
            continue
        for path in paths:
            if not path.is_file():
                problems.append(f"{path}: not a file")
                continue
            try:
                rule = _rule_from(path, read_yaml(path, "rule file"))
            except UsageError as e:
                problems.append(e.message)
                continue
            except (TypeError, ValueError, AttributeError, RecursionError) as e:
                problems.append(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            if rule.id in seen:
                problems.append(f"{path}: rule id {rule.id!r} is already used by {seen[rule.id]}")
                continue
            seen[rule.id] = path
            rules.append(rule)
    return rules, problems


def rule_page(rule: Rule) -> dict[str, Any]:
    """A rule as a page a person reads: detects, evidence, fix, and where each threshold comes from."""
    return {
        "id": rule.id,
        "title": rule.title,
        "layer": rule.layer,
        "layer_name": LAYER_NAMES[rule.layer],
        "severity": rule.severity,
        "stages": rule.stages,
        "file": str(rule.path),
        "detects": " ".join(rule.detects.split()),
        "when": rule.when,
        "unless": rule.unless,
        "evidence": list(rule.evidence),
        "fix": rule.fix,
        "patch": dict(rule.patch),
        "gain": {k: v for k, v in rule.gain.items()},
        "thresholds": [{"name": k, "value": c.get("value"), "why": c.get("why")} for k, c in rule.constants.items()],
        "facts": sorted(rule.facts_used()),
        "conflicts": list(rule.conflicts),
        "sources": list(rule.sources),
    }


# --- diagnosis ------------------------------------------------------------------------------------------


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
    return _PLACEHOLDER.sub(lambda m: _fmt(env[m.group(1)], m.group(2)) if m.group(1) in env else "n/a", text)


def _evidence(rule: Rule, env: dict[str, Any]) -> list[str]:
    """Evidence lines with their numbers; a line about a fact the trace lacks gives way to a caveat naming it.

    A rule can fire without a fact only through has(): the caveat says what was not measured, and
    how to measure it, so the finding is read as resting on the facts that were.
    """
    lines = [_render(e, env) for e in rule.evidence if all(m.group(1) in env for m in _PLACEHOLDER.finditer(e))]
    unmeasured = sorted(
        n for n in _names(_tree(rule.when)) if not n.isupper() and n not in env and not catalog.is_measured(n)
    )
    for name in unmeasured:
        hint = missing_hint(name, env)
        lines.append(
            f"not measured: {name}"
            + (f" (record with {hint})" if hint else "")
            + "; the finding assumes it does not rule the fix out"
        )
    return lines


def diagnose(
    facts: dict[str, Any],
    rules: list[Rule],
    problems: list[str] | None = None,
    selection: Any = None,
) -> dict[str, Any]:
    """Findings biggest expected gain first, plus what was muted, superseded, not evaluated or not applicable.

    `problems` (rule files that did not load) travel with the diagnosis so reports show them.
    `selection` (vlmdoctor.doctor.select.Selection) mutes findings before supersession: a muted
    fix covers nothing, so a finding it would have superseded is prescribed instead.
    """
    fired, not_evaluated, not_applicable = [], [], []
    stage = facts.get("run.stage")
    for rule in rules:
        if set(rule.stages) != {1, 2}:
            if stage is None:
                not_evaluated.append({"id": rule.id, "missing": ["run.stage"]})
                continue
            if stage not in rule.stages:
                not_applicable.append(
                    {"id": rule.id, "why": f"applies in stage {', '.join(map(str, rule.stages))} only"}
                )
                continue
        try:
            finding = _fire(rule, facts, not_evaluated, not_applicable)
        except EVAL_ERRORS as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
            problems = [
                *(problems or []),
                f"{rule.path}: rule {rule.id} failed while being evaluated ({why})",
            ]
            continue
        if finding is not None:
            fired.append(finding)
    fired.sort(key=lambda f: (f["layer"], -f["_order"]))
    fired, muted = selection.split(fired) if selection is not None else (fired, [])
    kept, superseded = [], []
    for f in fired:  # superseded: a declared conflict, or an earlier fix already sets every knob this one sets
        clash = next(
            (
                k
                for k in kept
                if f["id"] in k["conflicts"]
                or k["id"] in f["conflicts"]
                or (f["config_patch"] and set(f["config_patch"]) <= set(k["config_patch"]))
            ),
            None,
        )
        if clash:
            superseded.append({**f, "superseded_by": clash["id"]})
        else:
            kept.append(f)
    for f in kept + superseded + muted:
        f.pop("conflicts", None)
        f.pop("_order", None)
    return {
        "findings": rank_findings(kept),
        "superseded": superseded,
        "muted": muted,
        "not_evaluated": not_evaluated,
        "not_applicable": not_applicable,
        "problems": list(problems or []),
        "accounts": account_verdicts(facts, kept + superseded + muted),
    }


def account_verdicts(
    facts: dict[str, Any], findings: list[dict[str, Any]], job: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Every account of the step that holds at least MIN_ACCOUNT_SHARE of it, with what the diagnosis says of it:
    the findings that speak to it, or that it is the step's own work, or that no prescription is known. No cost of
    that size goes unnamed. `job`: the findings on the joined ranks, for one rank's accounts: a rank's wait for the
    others is caused on another rank, so only the job's finding (the straggler's loader, its extra tokens) names it."""
    acc = step_accounts(facts)
    if acc is None:
        return []
    where = _where(facts)
    out = []
    for row in acc["rows"]:
        if row["share"] < MIN_ACCOUNT_SHARE:
            continue
        named = [f["id"] for f in findings if row["account"] in f.get("accounts", ())]
        named += [f["id"] for f in job if row["account"] in f.get("accounts", ()) and f["id"] not in named]
        verdict = "prescribed" if named else "work" if row["account"] in WORK else "no prescription known"
        out.append(
            {
                "account": row["account"],
                "meaning": row["meaning"],
                "ms": row["ms"],
                "share": row["share"],
                "verdict": verdict,
                "findings": named,
                "where": where.get(row["account"], []),
            }
        )
    if acc["unattributed_share"] >= MIN_ACCOUNT_SHARE:
        out.append(
            {
                "account": "unattributed",
                "meaning": "GPU idle under no host event, outside every step marker",
                "ms": acc["unattributed_ms"],
                "share": acc["unattributed_share"],
                "verdict": "no prescription known",
                "findings": [],
                "where": ["record with a torch.profiler schedule and prof.step() so that steps are marked"],
            }
        )
    return out


def _where(facts: dict[str, Any]) -> dict[str, list[str]]:
    """Where an idle account's time went: the innermost host ops and calls the GPU waited on, by their cause."""
    out: dict[str, list[str]] = {}
    for row in facts.get("idle.top_host_ops") or []:
        cause = row.get("cause") if isinstance(row, dict) else None
        if isinstance(cause, str) and len(out.get(f"idle.host.{cause}", [])) < 3:
            out.setdefault(f"idle.host.{cause}", []).append(f"{row['op']} {row['ms']:,.1f} ms")
    for row in facts.get("idle.sync.by_code") or []:  # the sync account: whose code made the syncs
        if isinstance(row, dict) and isinstance(row.get("ms"), (int, float)) and row["ms"] > 0:
            code = row.get("code")
            out.setdefault("idle.sync", []).append(f"{SYNC_CODE.get(code, code)} {row['ms']:,.1f} ms")
    return out


def _fire(
    rule: Rule,
    facts: dict[str, Any],
    not_evaluated: list[dict[str, Any]],
    not_applicable: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The finding of one rule, or None; errors in the rule's expressions propagate to the caller."""
    env = {**facts, **{k: c["value"] for k, c in rule.constants.items()}}
    try:
        hit = bool(_eval(_tree(rule.when), env))
    except _Missing as m:
        if m.name.startswith("dist.") and "dist.ranks" not in facts:
            not_applicable.append(
                {
                    "id": rule.id,
                    "why": f"needs {m.name}, a fact of several ranks' traces together "
                    "(analyze a folder of per-rank traces)",
                }
            )
        elif facts.get("trace.cpu_only") and catalog.gpu_only(m.name):
            not_applicable.append(
                {"id": rule.id, "why": f"needs {m.name}, a fact of GPU runs (this trace ran on the CPU)"}
            )
        elif m.name.startswith("dpo."):  # only vlmdoctor's runs and ranges a user named after the reference have them
            not_applicable.append(
                {
                    "id": rule.id,
                    "why": f"needs {m.name}: no DPO reference forward found; in a DPO loop, "
                    "wrap it in record_function('ref_forward')",
                }
            )
        elif "gpu.busy_ms" in facts and m.name.startswith("cpu."):
            not_applicable.append(
                {
                    "id": rule.id,
                    "why": f"needs {m.name}, a fact of CPU-only runs (this trace has GPU kernels)",
                }
            )
        else:
            hint = missing_hint(m.name, facts)
            not_evaluated.append({"id": rule.id, "missing": [m.name], **({"hint": hint} if hint else {})})
        return None
    if hit and rule.unless:
        try:
            hit = not _eval(_tree(rule.unless), env)
        except _Missing:
            pass  # an exception that cannot be checked does not hide a measured problem
    if not hit:
        return None
    patch = {}
    for knob, value in rule.patch.items():
        if isinstance(value, str) and _looks_like_expr(value):
            try:
                value = _eval(_tree(value), env)
            except _Missing:
                continue
        patch[knob] = value
    env.update({f"patch.{k}": v for k, v in patch.items()})
    saves = _gain(rule, "saves_ms", env)
    speedup = _gain(rule, "speedup", env)
    step = facts.get("step.ms")
    if speedup is None and saves is not None and step and saves < step:
        speedup = step / (step - saves)
    equivalent = step * (1 - 1 / speedup) if speedup and step and speedup > 1 else saves
    share = (saves / step) if saves and step else None
    severity, basis = gain_severity(gain_ratio({"throughput_x": speedup, "share_of_step": share}), rule.severity)
    return {
        "id": rule.id,
        "layer": rule.layer,
        "layer_name": LAYER_NAMES[rule.layer],
        "title": rule.title,
        "severity": severity,
        "severity_from": basis,
        "rule_severity": rule.severity,
        "evidence": _evidence(rule, env) + [CONTRADICTED + c for c in contradictions(rule, env)],
        "fix": rule.fix,
        "config_patch": patch,
        "expected_gain": {
            "saves_ms_per_step": saves,
            "share_of_step": share,
            # the step the ms and the share are of: the traced window's (facts' step.ms), never the timed median
            "step_ms": step,
            "window": "traced",
            "throughput_x": speedup,
            "how": rule.gain.get("how"),
        },
        "_order": equivalent or 0.0,
        "sources": rule.sources,
        "conflicts": rule.conflicts,
        "accounts": list(rule.accounts),
    }


def rank_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings in order of application (layer order) numbered `apply_order`, then listed by expected gain.

    `rank` 1 is the biggest expected win; findings whose gain cannot be computed come after those
    with one, in order of application.
    """
    for i, f in enumerate(findings, 1):
        f["apply_order"] = i
    ranked = sorted(
        findings,
        key=lambda f: (
            gain_ratio(f.get("expected_gain")) is None,
            -(gain_ratio(f.get("expected_gain")) or 0.0),
            f["apply_order"],
        ),
    )
    for i, f in enumerate(ranked, 1):
        f["rank"] = i
    return ranked


def in_apply_order(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings in the order their fixes are applied (layer order): `apply_order`, else the layer (older reports)."""
    return sorted(
        findings,
        key=lambda f: (f.get("apply_order") if f.get("apply_order") is not None else 10**6, f.get("layer") or 9),
    )


def _gain(rule: Rule, key: str, env: dict[str, Any]) -> float | None:
    for expr in _alternatives(rule.gain.get(key)):
        try:
            value = float(_eval(_tree(expr), env))
        except (_Missing, ZeroDivisionError, TypeError, ValueError, OverflowError, RuleEvalError):
            continue
        if math.isfinite(value):
            return value
    return None
