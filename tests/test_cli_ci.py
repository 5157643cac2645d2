"""The CI-facing commands through the CLI: gate, compare, export, --html (exit codes, files, messages)."""

from __future__ import annotations

import gzip
import json
import xml.etree.ElementTree as ET
from pathlib import Path

from typer.testing import CliRunner

from vlmdoctor.cli import app

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
BF16, FP32 = str(TRACES / "bf16_s2.report.json"), str(TRACES / "fp32_noautocast_s2.report.json")


def test_gate_fails_on_a_recorded_slowdown_and_writes_ci_outputs(tmp_path, monkeypatch):
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    junit = tmp_path / "gate.xml"
    r = CliRunner().invoke(app, ["gate", "--baseline", BF16, "--current", FP32, "--junit", str(junit)])
    assert r.exit_code == 1, r.output
    assert "FAILED" in r.output and "throughput" in r.output
    assert "FAILED" in summary.read_text()
    suite = ET.fromstring(junit.read_text())
    assert any(tc.find("failure") is not None for tc in suite.iter("testcase"))


def test_gate_passes_the_other_way_and_says_why():
    r = CliRunner().invoke(app, ["gate", "--baseline", FP32, "--current", BF16, "--max-memory-growth", "2"])
    assert r.exit_code == 0, r.output
    assert "PASSED" in r.output
    r = CliRunner().invoke(app, ["gate", "--baseline", FP32, "--current", BF16])  # bf16 B16 uses 2.3x the memory
    assert r.exit_code == 1 and "memory" in r.output


def test_gate_unusable_input_exits_2(tmp_path):
    bad = tmp_path / "cut.json"
    bad.write_text(Path(BF16).read_text()[:500])
    for args in (
        ["--baseline", str(tmp_path / "missing.json"), "--current", BF16],
        ["--baseline", str(bad), "--current", BF16],
        ["--baseline", str(TRACES / "bf16_s1.report.json"), "--current", BF16],
    ):
        r = CliRunner().invoke(app, ["gate", *args])
        assert r.exit_code == 2, (args, r.output)


def test_gate_remeasure_refuses_a_current_report_and_bad_env(tmp_path):
    r = CliRunner().invoke(app, ["gate", "--baseline", BF16, "--current", FP32, "--remeasure-baseline"])
    assert r.exit_code == 2 and "--remeasure-baseline" in r.output
    r = CliRunner().invoke(app, ["gate", "--baseline", BF16, "--remeasure-baseline", "--baseline-env", "NOEQUALS"])
    assert r.exit_code == 2 and "KEY=VALUE" in r.output


def test_gate_remeasure_judges_paired_runs(tmp_path, monkeypatch):
    """The CLI path of --remeasure-baseline, with the runs faked: the baseline side gets its own python/env."""
    import copy

    import vlmdoctor.run.runner as runner

    base = json.loads(Path(BF16).read_text())
    calls = []

    def fake(cfg, timeout=None, diagnose=True, rules_dirs=None, env=None, python=None, own_cwd=False):
        calls.append((python, env))
        rep = copy.deepcopy(base)
        rep["repeats"] = [{"real_tokens_per_s": 1000.0 if python else 800.0 + len(calls)}]
        return rep

    monkeypatch.setattr(runner, "run_isolated", fake)
    out = tmp_path / "verdict.json"
    r = CliRunner().invoke(
        app,
        [
            "gate",
            "--baseline",
            BF16,
            "--remeasure-baseline",
            "--baseline-python",
            "/old/python",
            "--baseline-env",
            "PYTHONPATH=/old",
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 1, r.output
    verdict = json.loads(out.read_text())
    assert verdict["remeasured"] and verdict["checks"][0]["method"].startswith("paired")
    assert ("/old/python", {"PYTHONPATH": "/old"}) in calls and (None, None) in calls


def test_gate_update_baseline_writes_on_purpose(tmp_path):
    base = tmp_path / "base.json"
    base.write_text(Path(FP32).read_text())
    r = CliRunner().invoke(app, ["gate", "--baseline", str(base), "--current", BF16, "--update-baseline"])
    assert r.exit_code == 0, r.output
    assert json.loads(base.read_text())["config"]["weight_dtype"] == "bf16"


def test_compare_prints_both_sides(tmp_path):
    r = CliRunner().invoke(
        app, ["compare", BF16, str(TRACES / "healthy_s2.report.json"), "--json", str(tmp_path / "c.json")]
    )
    assert r.exit_code == 0, r.output
    assert "bf16_s2.report.json" in r.output and "healthy_s2.report.json" in r.output
    result = json.loads((tmp_path / "c.json").read_text())
    tokens = next(m for m in result["metrics"] if m["key"] == "real_tokens_per_s")
    assert tokens["verdict"] == "better"
    assert "batch_size" in {c["knob"] for c in result["config"]}


def test_export_chrome_and_hta_folder(tmp_path):
    out = tmp_path / "t.json.gz"
    r = CliRunner().invoke(
        app,
        [
            "export",
            str(TRACES / "healthy_s2.pt.trace.json.gz"),
            "--chrome",
            str(out),
            "--hta-dir",
            str(tmp_path / "hta"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert list((tmp_path / "hta").glob("rank0*"))
    r = CliRunner().invoke(app, ["export", str(TRACES / "healthy_s2.pt.trace.json.gz"), "--chrome", str(out)])
    assert r.exit_code == 2  # no overwrite without --force


def test_export_of_a_report_without_its_trace_says_so(tmp_path):
    r = CliRunner().invoke(app, ["export", BF16, "--chrome", str(tmp_path / "x.json.gz")])
    assert r.exit_code == 2 and "is not here" in r.output
    report = json.loads(Path(BF16).read_text())
    report["trace"]["path"] = None
    (tmp_path / "r.json").write_text(json.dumps(report))
    r = CliRunner().invoke(app, ["export", str(tmp_path / "r.json"), "--chrome", str(tmp_path / "x.json.gz")])
    assert r.exit_code == 2 and "kept no trace" in r.output


def test_analyze_writes_html(tmp_path):
    page = tmp_path / "a.html"
    r = CliRunner().invoke(app, ["analyze", str(TRACES / "eager_s2.pt.trace.json.gz"), "--html", str(page)])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "<svg" in text and "fusion-eager-attention" in text
