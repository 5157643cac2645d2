"""vlmdoctor's advice pasted into a script the way its lines say (vlmdoctor/doctor/advice.py), mechanically.

The advice lines are grouped into blocks at comment lines that start a line (comments are not code; one
indented inside a class or a loop stays with it). In a block:
- a block that assigns `loss` replaces the script's loss line (and its `loss.backward()` when the block
  has one): a new way to compute the loss;
- `import` lines go to the script's imports;
- `name=value` (a Trainer user's lines) sets that keyword of the script's `TrainingArguments(...)`;
- `f(..., k=v)` sets those keywords of every call of `f` in the script (a value `...`: the script's own);
- `class X(Trainer)` goes before `def main`, and the script's `Trainer(...)` becomes `X(...)`;
- `batch = ...` replaces the script's `batch = ...` line in its training loop;
- any other statement goes before `anchor` (the line that makes the DataLoader, or TrainingArguments):
  after the model and the data are made.
A line that cannot be pasted by these rules fails the paste: advice that says what it cannot do.
"""

from __future__ import annotations

import ast
import textwrap


def _parses(lines: list[str]) -> bool:
    try:
        ast.parse(textwrap.dedent("\n".join(lines)))
    except SyntaxError:
        return False
    return True


def blocks(lines: list[str]) -> list[str]:
    """Runs of code lines between comment lines; a statement spread over lines stays in one block."""
    out: list[list[str]] = []
    cur: list[str] = []
    for line in lines:
        comment = line.startswith("#")  # a comment inside a block (indented) stays in it
        if comment and (not cur or _parses(cur)):
            if cur:
                out.append(cur)
            cur = []
            continue
        cur.append(line)
    if cur:
        out.append(cur)
    return ["\n".join(b) for b in out]


def _name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def _is_ellipsis(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _statements(tree: ast.AST) -> list[ast.stmt]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.stmt)]


def _replace(src: str, stmt: ast.stmt, new: str) -> str:
    """Put `new` (a dedented block) where `stmt` is, at its indentation."""
    lines = src.splitlines()
    indent = lines[stmt.lineno - 1][: len(lines[stmt.lineno - 1]) - len(lines[stmt.lineno - 1].lstrip())]
    body = [indent + x if x else x for x in new.splitlines()]
    return "\n".join(lines[: stmt.lineno - 1] + body + lines[stmt.end_lineno :]) + "\n"


def _set_keywords(src: str, func: str, keywords: list[ast.keyword]) -> str:
    tree = ast.parse(src)
    simple = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr, ast.Return)  # the statement holding the call
    hits = [
        (stmt, call)
        for stmt in _statements(tree)
        if isinstance(stmt, simple)
        for call in ast.walk(stmt)
        if isinstance(call, ast.Call) and _name(call.func) == func
    ]
    assert hits, f"no call of {func}(...) in the script to add {[k.arg for k in keywords]} to"
    for stmt, call in sorted(hits, key=lambda h: -h[0].lineno):
        for kw in keywords:
            if _is_ellipsis(kw.value):
                continue
            call.keywords = [k for k in call.keywords if k.arg != kw.arg] + [kw]
        src = _replace(src, stmt, ast.unparse(stmt))
    return src


def _loop_statement(src: str, name: str) -> ast.stmt | None:
    """The training loop's statement that assigns `name` (the first `for` inside `main`)."""
    main = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next((n for n in ast.walk(main) if isinstance(n, ast.For)), None)
    for stmt in loop.body if loop else []:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            return stmt
    return None


def _backward_statement(src: str) -> ast.stmt | None:
    main = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    return next((s for s in loop.body if "backward()" in ast.unparse(s)), None)


def _insert_before(src: str, marker: str, text: str) -> str:
    lines = src.splitlines()
    i = next(k for k, line in enumerate(lines) if line.lstrip().startswith(marker))
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    return "\n".join(lines[:i] + [indent + x if x else x for x in text.splitlines()] + lines[i:]) + "\n"


def _add_import(src: str, stmt: str) -> str:
    tree = ast.parse(src)
    last = max(n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)))
    lines = src.splitlines()
    return "\n".join(lines[:last] + [stmt] + lines[last:]) + "\n"


def paste(src: str, advice: list[str], anchor: str, fields: set[str] = frozenset()) -> str:
    """The script's source with the advice pasted in; `fields`: the TrainingArguments field names."""
    for block in blocks(advice):
        code = textwrap.dedent(block)
        tree = ast.parse(code)
        if any(
            isinstance(t, ast.Name) and t.id == "loss"
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign)
            for t in n.targets
        ) and not any(isinstance(n, ast.ClassDef) for n in tree.body):
            rest = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
            for imp in (n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))):
                src = _add_import(src, ast.unparse(imp))
            backward = "backward()" in code and _backward_statement(src)
            if backward:
                src = _replace(src, backward, "")
            target = _loop_statement(src, "loss")
            assert target is not None, "the script has no loss line to replace"
            src = _replace(src, target, "\n".join(ast.unparse(n) for n in rest))
            continue
        for node in tree.body:
            text = ast.get_source_segment(code, node) or ast.unparse(node)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                src = _add_import(src, text)
            elif (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
                and node.targets[0].id in fields
            ):
                src = _set_keywords(src, "TrainingArguments", [ast.keyword(node.targets[0].id, node.value)])
            elif (
                isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and (
                    any(_is_ellipsis(a) for a in node.value.args)
                    or any(_is_ellipsis(k.value) for k in node.value.keywords)
                )
            ):
                src = _set_keywords(src, _name(node.value.func), node.value.keywords)
            elif isinstance(node, ast.ClassDef):
                src = _insert_before(src, "def main", text + "\n\n")
                src = src.replace("trainer = Trainer(", f"trainer = {node.name}(")
            elif (
                isinstance(node, ast.Assign)
                and isinstance(node.targets[0], ast.Name)
                and _loop_statement(src, node.targets[0].id) is not None
            ):
                src = _replace(src, _loop_statement(src, node.targets[0].id), text)
            else:
                src = _insert_before(src, anchor, text)
    return src
