"""A light install: the analysis commands import no GPU stack, and Liger is an extra the GPU runner
asks for by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vlmdoctor.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "fixtures" / "traces"

HEAVY = {"torch", "transformers", "triton", "liger_kernel"}


def _heavy_imports(stderr: str) -> set[str]:
    """Top-level packages -X importtime saw imported, among HEAVY."""
    names = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in stderr.splitlines() if "import time:" in line}
    return names & HEAVY


def test_analyze_imports_no_torch(tmp_path):
    trace = TRACES / "default_s2.pt.trace.json.gz"
    cmd = [sys.executable, "-X", "importtime", "-m", "vlmdoctor", "analyze", str(trace), "--json", str(tmp_path / "a")]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "import time:" in r.stderr and _heavy_imports(r.stderr) == set()


def test_compare_gate_rules_and_export_import_no_torch(tmp_path):
    """The other commands that read reports and traces, each as its command line, in one interpreter."""
    a, b = TRACES / "default_s2.report.json", TRACES / "bf16_s2.report.json"
    trace = TRACES / "compile_s2.pt.trace.json.gz"
    runs = [
        ["compare", str(a), str(b), "--allow-different", "--json", str(tmp_path / "c.json")],
        ["gate", "--baseline", str(a), "--current", str(b), "--allow-env-change"],
        ["rules", "list"],
        ["rules", "show", "precision-autocast-casts"],
        ["export", str(trace), "--chrome", str(tmp_path / "e.json.gz")],
    ]
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom vlmdoctor.cli import app\n"
        f"for args in {runs!r}:\n"
        "    r = CliRunner().invoke(app, args)\n"
        "    assert r.exit_code in (0, 1), (args, r.output, r.exception)\n"
    )
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "c.json").exists() and (tmp_path / "e.json.gz").exists()
    assert "import time:" in r.stderr and _heavy_imports(r.stderr) == set()


def test_a_liger_config_without_liger_kernel_names_the_extra(monkeypatch):
    """On a CUDA device (no kernel runs: preflight refuses first), with liger-kernel not importable."""
    import torch

    from vlmdoctor.run.checks import preflight
    from vlmdoctor.run.config import RunConfig
    from vlmdoctor.run.zoo import resolve

    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import liger_kernel... -> ImportError, installed or not
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    cfg = RunConfig(model="tiny", liger_rms_norm=True)
    with pytest.raises(UsageError) as e:
        preflight(cfg, resolve("tiny"), torch.device("cuda"))
    assert "pip install 'vlmdoctor[liger]'" in e.value.message and "\n" not in e.value.message
