"""HTML reports from real H100 reports, analyses and a treat ladder: charts, prescriptions, escaping,
no external resources; and a look at each page in headless Chromium (skipped without it)."""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
from _browser import CHROMIUM, SKIP, check_in_browser

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.errors import UsageError
from vlmdoctor.report.html import analyze_html, profile_html, treat_html, write_html
from vlmdoctor.trace.facts import analyze, merge_measured

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "fixtures" / "traces"
TREAT = ROOT / "bench" / "results" / "2026-11-23-h100" / "a" / "treat_0.5b_s2" / "treat.json"


def _report(name: str) -> dict:
    """A fixture report with facts and findings: as recorded, or, for a report recorded before diagnosis
    was part of profile, built the way profile builds them (trace facts + measured numbers, then the rules)."""
    report = json.loads((TRACES / f"{name}.report.json").read_text())
    if "findings" not in report:
        facts = analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
        report["facts"] = merge_measured(facts, report)
        report["diagnosis"] = diagnose(report["facts"], *load_rules())
        report["findings"] = report["diagnosis"]["findings"]
    return report


def _analysis(*names: str, folder: Path | None = None) -> dict:
    """What `vlmdoctor analyze --json` writes (the same steps as the CLI, through JSON and back)."""
    if folder is not None:
        folder.mkdir()
        for n in names:
            shutil.copy(TRACES / f"{n}.pt.trace.json.gz", folder / f"{n}.pt.trace.json.gz")
        result = analyze(folder)
    else:
        result = analyze(TRACES / f"{names[0]}.pt.trace.json.gz")
    rules, problems = load_rules()
    for entry in result["files"]:
        entry["diagnosis"] = diagnose(entry["facts"], rules, problems)
        entry["findings"] = entry["diagnosis"]["findings"]
    return json.loads(json.dumps({"schema_version": 1, "kind": "analysis", **result}, default=str))


def _self_contained(page: str) -> None:
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower()
    # no tag links to or loads anything (report text is escaped, so every '<' here starts a real tag)
    assert not re.search(r"<[^>]*\b(?:src|href|action|poster|background|srcset)\s*=", page, re.I)
    assert not re.search(r"<[^>]*(?:https?|ftp|file):", page, re.I)
    assert "url(" not in page and "@import" not in page
    assert "default-src 'none'" in page  # and the browser is told to fetch nothing


def _layers_in_order(page: str, findings: list[dict]) -> None:
    """Biggest expected win first (a finding without a computable gain last), the top one named on the first
    screen, and each row's place in the order of application (the layer) shown."""
    from vlmdoctor.doctor.rules import gain_ratio

    table = page[page.index("<h2>Prescriptions</h2>") :]
    pos = {f["id"]: table.index(f"<code>{f['id']}</code>") for f in findings}
    by_pos = sorted(findings, key=lambda f: pos[f["id"]])
    ratios = [gain_ratio(f.get("expected_gain")) for f in by_pos]
    known = [r for r in ratios if r is not None]
    assert known == sorted(known, reverse=True) and ratios == known + [None] * (len(ratios) - len(known))
    top = page[page.index('<p class="top">') :]
    assert page.index('<p class="top">') < page.index("<h2>", page.index("</h1>"))  # before any section
    assert top.index(f"<code>{by_pos[0]['id']}</code>") < top.index("</p>")
    assert "Biggest expected win" in top and "Fix:" in top
    for f in findings:
        assert f"layer {f['layer']} {f['layer_name']}" in table


# --- profile -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["default_s2", "sync_s2"])
def test_profile_html_from_a_real_report(name):
    report = _report(name)
    page = profile_html(report)
    _self_contained(page)
    assert page.count("<svg") == 2
    assert 'aria-label="step time split"' in page and 'aria-label="GPU time by kernel class"' in page
    f = report["facts"]
    assert f"{f['step.ms']:,.1f} ms" in page  # the step the bar splits
    assert "GPU busy" in page and "idle: other host work" in page
    top = max((k for k in f if k.startswith("kernels.") and k.endswith(".ms")), key=lambda k: f[k])
    assert f">{top.split('.')[1]}</text>" in page  # the largest kernel class has its bar
    findings = report["findings"]
    assert findings
    for fd in findings:
        assert f"<code>{fd['id']}</code>" in page
    _layers_in_order(page, findings)
    m = report["metrics"]
    assert f"{m['real_tokens_per_s']:,.0f}" in page
    env = report["env"]
    for key in ("gpu", "driver", "torch", "transformers"):
        assert f"<td>{env[key]}</td>" in page
    assert "real tokens/s" in page and "ms/step (median)" in page


def test_profile_html_evidence_and_patches_are_shown():
    report = _report("sync_s2")
    page = profile_html(report)
    for fd in report["findings"]:
        for line in fd["evidence"]:
            assert line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in page
        for k, v in fd["config_patch"].items():
            assert f'<code class="kv">{k}={v}</code>' in page
        if (fd.get("expected_gain") or {}).get("throughput_x"):
            assert f"x{fd['expected_gain']['throughput_x']:,.2f}" in page


def test_profile_html_without_trace_facts():
    report = json.loads((TRACES / "default_s2.report.json").read_text())
    assert "facts" not in report
    page = profile_html(report)
    _self_contained(page)
    assert "<svg" not in page
    assert "No trace facts" in page and "Not diagnosed" in page
    assert "2,729" in page and "NVIDIA H100 80GB HBM3" in page


def test_profile_html_of_a_failed_run():
    report = json.loads((TRACES / "default_s2.report.json").read_text())
    report.update(status="oom", error={"message": "CUDA out of memory. Tried to allocate 2.00 GiB"}, metrics={})
    page = profile_html(report)
    assert "oom: CUDA out of memory" in page


def test_every_text_is_escaped():
    evil = '<script>alert("x")</script>'
    report = copy.deepcopy(_report("sync_s2"))
    report["findings"][0]["evidence"].append(evil)
    report["findings"][0]["title"] = evil
    report["findings"][0]["config_patch"] = {"batch_size": evil}
    report["env"]["torch"] = evil
    report["config"]["data"] = evil
    report["facts"]["idle.top_host_ops"][0]["op"] = evil
    report["facts"]["kernels.<img src=x>.ms"] = 1.0
    page = profile_html(report)
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    _self_contained(page)


# --- analyze -------------------------------------------------------------------------------------------


def test_analyze_html_of_one_trace():
    result = _analysis("default_s2")
    page = analyze_html(result)
    _self_contained(page)
    assert page.count("<svg") == 2
    entry = result["files"][0]
    assert entry["file"] in page
    for fd in entry["findings"]:
        assert f"<code>{fd['id']}</code>" in page
    _layers_in_order(page, entry["findings"])
    assert "aten::_cudnn_attention_forward" in page  # the host op that held the GPU up
    assert "NVIDIA H100 80GB HBM3" in page
    assert "A trace records the device, not the software" in page


def test_analyze_html_of_a_folder_of_ranks(tmp_path):
    result = _analysis("cache_s1", "bf16_s1", folder=tmp_path / "ranks")
    page = analyze_html(result)
    _self_contained(page)
    assert len(result["files"]) == 2
    assert page.count("<svg") == 4
    for entry in result["files"]:
        assert entry["file"] in page


# --- treat ---------------------------------------------------------------------------------------------


def test_treat_html_of_a_real_ladder():
    result = json.loads(TREAT.read_text())
    page = treat_html(result)
    _self_contained(page)
    assert page.count("<svg") == 1 and 'aria-label="treat ladder"' in page
    for r in result["ladder"]:
        assert f"x{r['speedup']:,.2f}" in page  # speedup label on each kept step
    assert page.count("<rect") >= len(result["ladder"])
    for t in result["trials"]:
        assert f"<code>{t['rule']}</code>" in page
        assert f">{t['outcome']}</span>" in page
    # not kept: the no-gain trial is a grey dot at what it measured, the timeout a red cross
    assert page.count("<circle cx=") >= 1 + 1  # one trial dot + the legend's
    assert "trial 3: batching-host-bound (compile=default): timeout" in page
    assert "batch_size=24" in page and "pad_to_multiple_of=64" in page  # the final config's changes
    assert "+63.2% vs ±51.7%" in page  # the decision's numbers
    assert "NVIDIA H100 80GB HBM3" in page and "580.159.04" in page and "2.11.0+cu130" in page


def test_treat_html_when_the_start_did_not_run():
    result = {
        "schema_version": 1,
        "kind": "treat",
        "start_config": {"model": "0.5b", "stage": 2},
        "ladder": [],
        "trials": [],
        "skipped": [],
        "start": {"status": "oom", "error": "CUDA out of memory"},
        "stopped_because": "the start config did not run: oom",
        "final_config": {"model": "0.5b", "stage": 2},
        "env": {},
    }
    page = treat_html(result)
    _self_contained(page)
    assert "did not run" in page and "CUDA out of memory" in page


# --- the documents, read by their declarations -------------------------------------------------------


def test_each_page_reads_its_document_through_the_declaration():
    """A page takes the parsed JSON or the document as declared, and draws the same; a JSON that is not the
    document the page shows is refused with one line naming it (DocumentError, exit 2), not drawn half."""
    from vlmdoctor.documents import Analysis, DocumentError, TreatResult, as_document, as_report

    report, analysis, treat = _report("sync_s2"), _analysis("default_s2"), json.loads(TREAT.read_text())
    assert profile_html(as_report(report)) == profile_html(report)
    assert profile_html(as_report(report), "own") == profile_html(report, "own")
    assert analyze_html(as_document(analysis, Analysis, "analysis")) == analyze_html(analysis)
    assert treat_html(as_document(treat, TreatResult, "treat")) == treat_html(treat)
    with pytest.raises(DocumentError, match="a vlmdoctor profile result, not a treat result"):
        treat_html({**report, "kind": "profile"})
    with pytest.raises(DocumentError, match="not a vlmdoctor analysis result"):
        analyze_html({"files": []})
    with pytest.raises(DocumentError, match=r"metrics\.step_ms: must not be negative"):
        profile_html({**report, "metrics": {**report["metrics"], "step_ms": -1.0}})


# --- writing -------------------------------------------------------------------------------------------


def test_write_html_refuses_to_overwrite(tmp_path):
    path = tmp_path / "sub" / "r.html"
    write_html("<p>one</p>", path, force=False)
    assert path.read_text() == "<p>one</p>"
    with pytest.raises(UsageError, match="exists; pass --force"):
        write_html("<p>two</p>", path, force=False)
    write_html("<p>two</p>", path, force=True)
    assert path.read_text() == "<p>two</p>"
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.html"]


# --- a look in a real browser ------------------------------------------------------------------------


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP)
@pytest.mark.parametrize("kind", ["profile", "analyze", "treat"])
def test_page_renders_in_headless_chromium(tmp_path, kind):
    page = {
        "profile": lambda: profile_html(_report("sync_s2")),
        "analyze": lambda: analyze_html(_analysis("default_s2")),
        "treat": lambda: treat_html(json.loads(TREAT.read_text())),
    }[kind]()
    check_in_browser(page, tmp_path, kind)
