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
    if len(parts) == 1 or parts[1] in ("errors", "files", "inputs", "__init__"):
        return "base"
    if parts[1] in ("cli", "__main__", "api", "callback", "launch"):
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
PUBLIC_EXPORTS = {("vlmdoctor.__init__", "vlmdoctor.api"), ("vlmdoctor.__init__", "vlmdoctor.callback")}


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
