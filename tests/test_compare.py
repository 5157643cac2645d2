"""`vlmdoctor compare`: two real H100 reports side by side, with the causes from their traces."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from rich.console import Console

from vlmdoctor.ci.gate import load_report
from vlmdoctor.errors import UsageError
from vlmdoctor.report.compare import compare, render_compare
from vlmdoctor.trace.facts import analyze, merge_measured

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"


def fixture(name: str, with_facts: bool = False) -> dict:
    """A recorded report; with_facts adds what a diagnosed profile holds, read from its recorded trace."""
    r = load_report(str(TRACES / f"{name}.report.json"))
    if with_facts and "facts" not in r:
        cfg = r["config"]
        facts = analyze(TRACES / f"{name}.pt.trace.json.gz", cfg["stage"], cfg["model"])["files"][0]["facts"]
        r["facts"] = merge_measured(facts, r)
    return r


@pytest.fixture(scope="module")
def bf16_vs_healthy() -> dict:
    return compare(fixture("bf16_s2", True), fixture("healthy_s2", True), labels=("bf16_s2.json", "healthy_s2.json"))


def rows(result: dict) -> dict:
    return {r["key"]: r for r in result["metrics"]}


def test_metrics_side_by_side(bf16_vs_healthy):
    m = rows(bf16_vs_healthy)
    assert set(m) == {
        "real_tokens_per_s",
        "loss_tokens_per_s",
        "step_ms",
        "mfu",
        "peak_mem_gb",
        "pad_fraction",
    }
    t = m["real_tokens_per_s"]
    assert round(t["a"]) == 26909 and round(t["b"]) == 51793
    assert t["delta"] == pytest.approx(t["b"] - t["a"]) and t["rel"] == pytest.approx(t["b"] / t["a"] - 1)
    assert t["verdict"] == "better"
    assert m["loss_tokens_per_s"]["verdict"] == "better"
    assert m["mfu"]["verdict"] == "better"
    assert m["step_ms"]["delta"] < 0 and m["step_ms"]["verdict"] == "better"  # lower is better
    assert m["pad_fraction"]["verdict"] == "better"
    assert m["peak_mem_gb"]["delta"] > 0 and m["peak_mem_gb"]["verdict"] == "worse"  # B32 costs memory


def test_kernel_classes_and_idle_causes(bf16_vs_healthy):
    k = bf16_vs_healthy["kernels"]
    classes = {r["class"]: r for r in k}
    assert {"gemm_tensor_core", "elementwise", "liger_swiglu", "liger_rms_norm"} <= set(classes)
    assert [abs(r["delta_ms"]) for r in k] == sorted((abs(r["delta_ms"]) for r in k), reverse=True)
    assert classes["liger_swiglu"]["a_ms"] == 0 and classes["liger_swiglu"]["b_ms"] > 0  # only B uses Liger
    assert classes["gemm_tensor_core"]["b_ms"] > classes["gemm_tensor_core"]["a_ms"]  # B32 does twice the GEMMs
    gpu = bf16_vs_healthy["gpu"]
    assert 0 < gpu["gpu.busy_frac"]["a"] < gpu["gpu.busy_frac"]["b"] < 1
    causes = {r["cause"]: r for r in gpu["idle"]}
    assert "data_loader" in causes and causes["data_loader"]["delta_ms"] < 0  # num_workers 0 -> 4
    assert not any("." in c for c in causes)  # idle.op.<name>.ms are host ops, not causes


def test_config_differences(bf16_vs_healthy):
    diff = {r["knob"]: (r["a"], r["b"]) for r in bf16_vs_healthy["config"]}
    assert diff["batch_size"] == (16, 32)
    assert diff["num_workers"] == (0, 4) and diff["liger_swiglu"] == (False, True)
    assert "weight_dtype" not in diff and "model" not in diff
    layers = [r["layer"] for r in bf16_vs_healthy["config"]]
    assert layers == sorted(layers)


def test_render_fits_a_terminal(bf16_vs_healthy):
    console = Console(record=True, width=100)
    render_compare(bf16_vs_healthy, console)
    text = console.export_text()
    for needle in (
        "real tokens/s",
        "better",
        "worse",
        "gemm_tensor_core",
        "data_loader",
        "batch_size",
        "bf16_s2.json",
        "healthy_s2.json",
        "GPU busy",
    ):
        assert needle in text, needle
    assert max(len(line) for line in text.splitlines()) <= 100


def test_without_facts_kernels_are_noted_not_invented():
    r = compare(fixture("bf16_s2"), fixture("healthy_s2"))
    assert r["kernels"] is None and r["gpu"] is None and r["findings"] is None
    assert any("kernel classes" in n for n in r["notes"])
    assert any("findings not compared" in n for n in r["notes"])
    console = Console(record=True, width=80)
    render_compare(r, console)
    assert "real tokens/s" in console.export_text()


def test_findings_added_and_gone():
    r = compare(fixture("eager_s2"), fixture("sync_s2"))
    added = {f["id"]: f for f in r["findings"]["added"]}
    gone = {f["id"]: f for f in r["findings"]["gone"]}
    assert added["precision-autocast-casts"]["title"].startswith("Autocast re-casts")
    assert {"system-data-loader", "system-non-fused-optimizer"} <= set(gone)
    assert "batching-gpu-underfed" in r["findings"]["kept"]
    assert r["kernels"] is not None  # both were diagnosed, so both carry facts
    console = Console(record=True, width=100)
    render_compare(r, console)
    text = console.export_text()
    assert "new in B: precision-autocast-casts" in text and "gone in B: system-data-loader" in text


def test_same_report_is_all_same():
    a = fixture("eager_s2")
    r = compare(a, copy.deepcopy(a))
    assert {m["verdict"] for m in r["metrics"]} == {"same"}
    assert r["config"] == [] and r["notes"] == []
    assert r["findings"]["added"] == r["findings"]["gone"] == []
    assert all(k["delta_ms"] == 0 for k in r["kernels"])
    console = Console(record=True, width=100)
    render_compare(r, console)
    assert "config: identical" in console.export_text()


def test_cpu_metrics_without_mfu_or_memory_are_na():
    a = fixture("bf16_s2")
    b = copy.deepcopy(a)
    for r in (a, b):
        r["metrics"]["mfu"] = r["metrics"]["peak_mem_gb"] = None
        r["metrics"]["host_peak_rss_gb"] = 0.84
    b["metrics"]["host_peak_rss_gb"] = 0.65
    m = rows(compare(a, b))
    assert m["mfu"]["verdict"] == "n/a"
    # no device memory: the process's resident memory is the row, labelled as such
    assert "peak_mem_gb" not in m and m["host_peak_rss_gb"]["label"] == "host peak RSS (GiB)"
    assert m["host_peak_rss_gb"]["verdict"] == "better"


def test_different_stage_or_model_refused_unless_allowed():
    with pytest.raises(UsageError, match="stage: 1 -> 2") as e:
        compare(fixture("bf16_s1"), fixture("bf16_s2"), labels=("s1.json", "s2.json"))
    assert "s1.json" in e.value.message and "--allow-different" in e.value.message
    with pytest.raises(UsageError, match="model"):
        compare(fixture("healthy_s2"), fixture("healthy_1.5b_s2"))
    r = compare(fixture("healthy_s2"), fixture("healthy_1.5b_s2"), allow_different=True)
    assert any("model: 0.5b -> 1.5b" in n for n in r["notes"])


def test_environment_differences_are_noted():
    a = fixture("bf16_s2")
    b = copy.deepcopy(a)
    b["env"]["driver"] = "590.1"
    r = compare(a, b)
    assert r["notes"][0] == ("different environment: driver: 580.159.04 -> 590.1")


def test_two_runs_report_json_get_columns_that_tell_them_apart(tmp_path):
    """Two runs' reports are both report.json: the columns are headed by the shortest paths that differ."""
    import shutil

    from typer.testing import CliRunner

    from vlmdoctor.cli import app
    from vlmdoctor.commands.compare import compare_labels

    assert compare_labels("runs/a/report.json", "runs/b/report.json") == ("a/report.json", "b/report.json")
    assert compare_labels("x.json", "y.json") == ("x.json", "y.json")
    src = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "bf16_s2.report.json"
    for side in ("before", "after"):
        (tmp_path / side).mkdir()
        shutil.copy(src, tmp_path / side / "report.json")
    r = CliRunner().invoke(
        app, ["compare", str(tmp_path / "before" / "report.json"), str(tmp_path / "after" / "report.json")]
    )
    assert r.exit_code == 0, r.output
    assert "before/report.json" in r.output and "after/report.json" in r.output
    assert "before -> after" in r.output  # the table's columns: the folders, not report.json twice


def test_values_are_written_as_a_reader_writes_them():
    """No Python spellings in the comparison: a missing value is none, a list its items."""
    from vlmdoctor.report.compare import shown

    assert [shown(None), shown(["a", "b"]), shown([]), shown(True), shown(4)] == ["none", "a, b", "none", "True", "4"]
    a = fixture("bf16_s2")
    b = copy.deepcopy(a)
    b["config"]["lora_targets"] = ["q", "v"]
    b["env"]["gpu"] = None
    r = compare(a, b)
    console = Console(record=True, width=80)
    render_compare(r, console)
    text = console.export_text()
    assert "None" not in text and "[" not in text.replace("[95%", "")
    assert "gpu: NVIDIA H100 80GB HBM3 -> none" in " ".join(text.split())
