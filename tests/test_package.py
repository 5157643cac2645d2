"""The package as users get it: a built wheel carries the rules and configs; imports follow the flow."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vlmdoctor"

#: the flow, upstream first: a module may import its own stage and the stages before it, never a later one
LAYERS = ["base", "run", "trace", "doctor", "report", "ci", "cli"]


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "vlmdoctor":
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in (
        "errors",
        "files",
        "inputs",
        "supervise",
        "invisible",
        "documents",
        "docgen",
        "window",
        "__init__",
    ):
        return "base"
    # the ways in: the command line (cli.py and its commands/) and the ways into a user's own training (own/)
    if parts[1] in ("cli", "commands", "__main__", "own"):
        return "cli"
    return parts[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmdoctor"):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("vlmdoctor")]
    return found


def test_every_module_is_in_a_stage_of_the_flow():
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        assert _layer(module) in LAYERS, f"{module} is in no stage of the flow"


#: the package's public face: `vlmdoctor.Doctor` and `vlmdoctor.DoctorCallback`, imported lazily on first use
PUBLIC_EXPORTS = {("vlmdoctor.__init__", "vlmdoctor.own.api"), ("vlmdoctor.__init__", "vlmdoctor.own.callback")}


def test_imports_run_one_way_down_the_flow():
    bad = []
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        here = LAYERS.index(_layer(module))
        for imp in _imports(path):
            if (module, imp) in PUBLIC_EXPORTS:
                continue
            if LAYERS.index(_layer(imp)) > here:
                bad.append(f"{module} ({_layer(module)}) imports {imp} ({_layer(imp)})")
    assert not bad, "imports that reach back up the flow:\n" + "\n".join(bad)


def _module_imports(path: Path) -> set[str]:
    """Every vlmdoctor module a file imports, at the top or inside a function. `from pkg import mod` is an
    edge to pkg.mod only (pkg's __init__ runs first for every module of pkg anyway); `from pkg import name`
    of a name defined in pkg's __init__ is an edge to pkg."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vlmdoctor"):
            for a in node.names:
                sub = ROOT.joinpath(*f"{node.module}.{a.name}".split("."))
                if sub.with_suffix(".py").is_file() or sub.is_dir():
                    found.add(f"{node.module}.{a.name}")
                else:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("vlmdoctor")}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a graph, each as the path that closes it."""
    out, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                out.append([*path[path.index(n) :], n])
            elif n not in state:
                visit(n, [*path, n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the vlmdoctor modules it imports (at the top or inside a function), over the whole package;
    the package's lazy public face (PUBLIC_EXPORTS, a module `__getattr__` that runs only once the package
    is imported) is left out."""
    graph = {}
    for path in PKG.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        name = module.removesuffix(".__init__")
        graph[name] = {m for m in _module_imports(path) if m != name and (module, m) not in PUBLIC_EXPORTS}
    return graph


def test_no_import_cycle_in_the_package():
    """No cycle among the package's modules, counting imports inside functions: a cycle hidden behind a
    function-level import is still a cycle (each module of a pair then works only once the other is loaded)."""
    graph = _import_graph()
    assert "vlmdoctor.trace.catalog" in graph["vlmdoctor.trace.families.idle"]  # the graph is read
    assert "vlmdoctor.run.runner" in graph["vlmdoctor.commands.profile"]  # imports inside functions count
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_cycle_checker_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_import_checker_sees_a_backward_import(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("from vlmdoctor.report.console import render\n")
    assert LAYERS.index(_layer(_imports(p)[0])) > LAYERS.index("run")


def test_the_built_wheel_ships_the_rules_outside_the_source_tree(tmp_path):
    """Built and installed like a user's `pip install vlmdoctor`: no source checkout to fall back on."""
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = wheels.glob("vlmdoctor-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    probe = (
        "import json, vlmdoctor.doctor.rules as r; from vlmdoctor.run.zoo import presets; "
        "print(json.dumps({'dir': str(r.RULES_DIR), 'rules': len(r.load_rules()[0]), 'presets': len(presets())}))"
    )
    got = json.loads(
        subprocess.run(
            [sys.executable, "-c", probe],
            cwd=elsewhere,
            env=env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    shipped = len(list((ROOT / "rules").glob("*.yaml")))
    assert got["rules"] == shipped > 0
    assert Path(got["dir"]).is_relative_to(site), got["dir"]
    assert got["presets"] >= 3
    r = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", "rules", "list"],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "precision" in r.stdout


def test_zero_builtin_rules_is_an_error_not_silence(tmp_path, monkeypatch):
    import vlmdoctor.doctor.rules as rules
    from vlmdoctor.errors import UsageError

    monkeypatch.setattr(rules, "RULES_DIR", tmp_path)
    with pytest.raises(UsageError, match="no built-in rules"):
        rules.load_rules()
