"""A rule's expressions: parsed with Python's `ast`, checked against bounds, evaluated over the facts.

A condition (`gemm.fp32_share > MIN_SHARE and run.stage == 2`) is evaluated by walking only whitelisted
nodes: comparisons, and/or/not, arithmetic, literals, a few math functions. There is no `eval`, and every
expression and every value it makes is bounded (docs/files.md), because rule files may come from anyone.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from functools import cache
from typing import Any

from vlmdoctor.errors import UsageError

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
_SPEC = re.compile(r"(?:.?[<>=^])?[+\- ]?z?#?0?(?P<width>\d+)?[,_]?(?:\.(?P<precision>\d+))?[bcdeEfFgGnosxX%]?", re.S)
#: a fact's placeholder in an evidence line: {fact.name} or {fact.name:spec}
PLACEHOLDER = re.compile(r"\{([A-Za-z_][\w.]*)(?::([^}]*))?\}")


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


class MissingFact(Exception):
    """A fact the expression needs and the trace did not measure: the rule is not evaluated, never fired."""

    def __init__(self, name: str) -> None:
        self.name = name


def alternatives(v: Any) -> list[str]:
    """A gain expression, or a list of them: the first whose facts were measured is used (GPU run, CPU run)."""
    if not v:
        return []
    return [str(x) for x in v] if isinstance(v, list) else [str(v)]


def looks_like_expr(v: str) -> bool:
    """A patch value that is computed from the facts (`=min(...)`), not taken as written."""
    return v.startswith("=")


#: checked trees by their text: a rule folder's 740 expressions are parsed at every diagnosis (0.17 s on a 2-core
#: CPU); a tree is only read after its check (evaluated, its names listed), never changed
_CHECKED: dict[str, ast.AST] = {}
#: the most trees kept
CHECKED_MAX = 8192


def parse(expr: str, where: str = "") -> ast.AST:
    """The expression's tree, checked: only the allowed nodes, and every bound (size, nesting, calls, literals).

    `where` starts each message (the rule's file and id)."""
    text = expr[1:] if expr.startswith("=") else expr
    if text in _CHECKED:
        return _CHECKED[text]
    tree = _checked(expr, text, where)
    if len(_CHECKED) < CHECKED_MAX:
        _CHECKED[text] = tree
    return tree


def _checked(expr: str, text: str, where: str) -> ast.AST:
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
        if isinstance(node, ast.Constant) and not small(node.value):
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


def small(v: Any) -> bool:
    """A value within the bounds an expression may hold: an integer up to MAX_INT, a short string, a short
    list of such values (any float: its size is fixed)."""
    if isinstance(v, bool) or v is None or isinstance(v, float):
        return True
    if isinstance(v, int):
        return abs(v) <= MAX_INT
    if isinstance(v, str):
        return len(v) <= MAX_TEXT
    if isinstance(v, (list, tuple)):
        return len(v) <= MAX_ITEMS and all(not isinstance(x, (list, tuple, dict)) and small(x) for x in v)
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
def parsed(expr: str) -> ast.AST:
    """Parsed once: expressions were validated when their rule was loaded."""
    return parse(expr)


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


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def names(tree: ast.AST) -> set[str]:
    """The fact and constant names an expression reads (the longest dotted names only)."""
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


def evaluate(node: ast.AST, env: dict[str, Any]) -> Any:
    """The expression's value on these facts and constants; MissingFact names the first one absent."""
    if isinstance(node, ast.Expression):
        return evaluate(node.body, env)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = _dotted(node)
        if name not in env:
            raise MissingFact(name)
        return env[name]
    if isinstance(node, ast.BoolOp):
        vals = (evaluate(v, env) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.UnaryOp):
        v = evaluate(node.operand, env)
        if isinstance(node.op, ast.Not):
            return not v
        if not isinstance(v, (int, float)):
            raise RuleEvalError(f"cannot negate {type(v).__name__} {str(v)[:40]!r}")
        return -v
    if isinstance(node, ast.BinOp):
        left, right = evaluate(node.left, env), evaluate(node.right, env)
        for v in (left, right):  # no list or string repetition: an expression cannot allocate memory
            if not isinstance(v, (int, float)) or (isinstance(v, int) and abs(v) > MAX_INT):
                raise RuleEvalError(f"arithmetic needs numbers, got {type(v).__name__} {str(v)[:40]!r}")
        return _bounded(_ARITH[type(node.op)](left, right))
    if isinstance(node, ast.Compare):
        left = evaluate(node.left, env)
        for op, comp in zip(node.ops, node.comparators):
            right = evaluate(comp, env)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and node.func.id == HAS:
        return _dotted(node.args[0]) in env
    if isinstance(node, ast.Call):
        return _call(node.func.id, [evaluate(a, env) for a in node.args])
    if isinstance(node, (ast.List, ast.Tuple)):
        return [evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.IfExp):
        return evaluate(node.body, env) if evaluate(node.test, env) else evaluate(node.orelse, env)
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
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not small(v):
            raise RuleEvalError(f"{name}() needs numbers, got {type(v).__name__} {str(v)[:40]!r}")
    if name == "round" and len(args) == 2:
        digits = args[1]
        if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
            raise RuleEvalError(f"round()'s digits must be an integer within +-{MAX_ROUND_DIGITS}, got {digits!r}")
    return _bounded(FUNCTIONS[name](*args))
