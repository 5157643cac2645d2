"""Findings ranked by expected gain, muted by --select / --ignore / [tool.vlmdoctor], and the measurements that
travel in a vlmdoctor trace, on the real H100 traces under fixtures/traces/ and a real CPU run."""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.doctor.gain import GAIN_SEVERITY, gain_ratio, gain_severity
from vlmdoctor.doctor.rules import diagnose, load_rules, rank_findings
from vlmdoctor.doctor.select import Selection, build_selection
from vlmdoctor.errors import UsageError
from vlmdoctor.report.console import render_findings
from vlmdoctor.trace.facts import analyze, merge_measured

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "fixtures" / "traces"
TRACE = str(TRACES / "default_s2.pt.trace.json.gz")
RULES, _ = load_rules()


@pytest.fixture(scope="module")
def trace_facts() -> dict:
    """The default_s2 trace's own facts (what `analyze` of the trace alone reads), parsed once."""
    return analyze(TRACES / "default_s2.pt.trace.json.gz")["files"][0]["facts"]


@pytest.fixture(scope="module")
def default_s2(trace_facts) -> dict:
    """Plus what the same run's report measured: what `profile` diagnosed."""
    return merge_measured(trace_facts, json.loads((TRACES / "default_s2.report.json").read_text()))


@pytest.fixture(scope="module")
def analyzed(trace_facts) -> dict:
    return diagnose(trace_facts, RULES)


@pytest.fixture(scope="module")
def ignored(tmp_path_factory, analyzed) -> tuple[str, str, dict]:
    """`vlmdoctor analyze TRACE --ignore <its top finding> --json FILE`: (the id, the console, the JSON entry)."""
    victim = analyzed["findings"][0]["id"]
    out = tmp_path_factory.mktemp("analyze") / "a.json"
    r = CliRunner().invoke(app, ["analyze", TRACE, "--ignore", victim, "--json", str(out)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    return victim, r.output, json.loads(out.read_text())["files"][0]


def _analyze(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(app, ["analyze", TRACE, *args])
    return r.exit_code, r.output


# --- rank by measured gain ----------------------------------------------------------------------------


def test_severity_follows_the_expected_gain_capped_by_the_rule():
    (high, x_high), (medium, x_medium) = GAIN_SEVERITY
    assert gain_severity(x_high, "high") == ("high", "gain")
    assert gain_severity(x_high, "medium") == ("medium", "gain")  # a rule file caps its findings' severity
    assert gain_severity(x_medium, "high") == ("medium", "gain")
    assert gain_severity(1.01, "high") == ("low", "gain")
    assert gain_severity(0.9, "high") == ("low", "gain")
    assert gain_severity(None, "high") == ("high", "rule")  # no computable gain: the rule's own
    assert gain_ratio({"throughput_x": None, "share_of_step": 0.2}) == pytest.approx(1.25)
    assert gain_ratio({"throughput_x": None, "share_of_step": None}) is None


def test_a_high_rule_with_a_one_percent_gain_is_low(default_s2):
    found = {f["id"]: f for f in diagnose(default_s2, RULES)["findings"]}
    head = found["fusion-lm-head-unlabeled"]  # the rule file says high; it saves ~1% of this step
    assert head["rule_severity"] == "high" and head["severity_from"] == "gain"
    assert head["expected_gain"]["share_of_step"] < 0.02 and head["severity"] == "low"
    for f in found.values():
        ratio = gain_ratio(f["expected_gain"])
        assert f["severity"] == gain_severity(ratio, f["rule_severity"])[0], f["id"]
    assert any(f["severity"] == "high" for f in found.values())  # the large wins stay high


def test_findings_without_a_gain_go_last_in_order_of_application():
    def f(i: str, layer: int, x: float | None) -> dict:
        return {"id": i, "layer": layer, "expected_gain": {"throughput_x": x, "share_of_step": None}}

    ranked = rank_findings([f("a", 1, 1.01), f("b", 2, None), f("c", 3, 1.5), f("d", 4, None), f("e", 5, 1.2)])
    assert [x["id"] for x in ranked] == ["c", "e", "a", "b", "d"]
    assert [x["rank"] for x in ranked] == [1, 2, 3, 4, 5]
    assert {x["id"]: x["apply_order"] for x in ranked} == {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}


def test_console_and_json_list_the_biggest_win_first(default_s2, ignored):
    d = diagnose(default_s2, RULES)
    buf = io.StringIO()
    render_findings(d, Console(file=buf, width=80), None)
    text = buf.getvalue()
    assert "biggest expected gain first" in text
    pos = [text.index(f"#{f['rank']} {f['id']}") for f in d["findings"] if f["config_patch"]]
    assert pos == sorted(pos)
    assert all(len(line) <= 80 for line in text.splitlines() if not line.startswith("  "))
    # JSON: ranked, with the order of application beside it, and the old fields kept
    findings = ignored[2]["findings"]
    ratios = [gain_ratio(f["expected_gain"]) for f in findings]
    assert ratios == sorted(ratios, reverse=True) and [f["rank"] for f in findings] == list(range(1, len(ratios) + 1))
    assert sorted(f["apply_order"] for f in findings) == list(range(1, len(findings) + 1))
    by_apply = sorted(findings, key=lambda f: f["apply_order"])
    assert [f["layer"] for f in by_apply] == sorted(f["layer"] for f in findings)
    assert [f["id"] for f in findings] != [f["id"] for f in by_apply]  # the gains and the layers disagree here
    assert all({"id", "layer", "layer_name", "severity", "expected_gain", "config_patch"} <= f.keys() for f in findings)


def test_treat_composes_in_order_of_application_whatever_the_listing():
    from vlmdoctor.doctor.treat import compose
    from vlmdoctor.run.config import RunConfig

    base = RunConfig(model="tiny", device="cpu", steps=2, warmup=0, repeats=1, num_samples=64, autocast="off")
    listed = [
        {"id": "late", "layer": 5, "title": "t", "config_patch": {"num_workers": 2}, "apply_order": 2, "rank": 1},
        {"id": "early", "layer": 2, "title": "t", "config_patch": {"batch_size": 8}, "apply_order": 1, "rank": 2},
    ]
    comps = compose(base, {"findings": listed}, [])
    assert [c["rule"] for c in comps[0]["changes"]] == ["early", "late"]


# --- select and mute ----------------------------------------------------------------------------------


def test_analyze_ignore_mutes_a_finding_and_shows_it(analyzed, ignored):
    victim, console, entry = ignored
    fired = [f["id"] for f in analyzed["findings"]]
    assert victim not in [f["id"] for f in entry["findings"]]
    muted = {m["id"]: m for m in entry["muted"]}
    assert muted[victim]["muted_by"] == f"--ignore {victim}" and muted[victim]["expected_gain"]
    assert entry["diagnosis"]["muted"] == entry["muted"]
    assert [f["rank"] for f in entry["findings"]] == list(range(1, len(entry["findings"]) + 1))  # the next win is #1
    assert set(fired) - {victim} <= {f["id"] for f in entry["findings"]}
    line = next(x for x in console.splitlines() if x.startswith("muted ("))
    ratio = gain_ratio(muted[victim]["expected_gain"])
    assert f"{victim} x{ratio:.2f}" in line and "--ignore" in line


def test_select_and_ignore_take_layers_severities_and_globs(trace_facts, analyzed):
    fired = analyzed["findings"]
    keep = min(f["layer"] for f in fired)
    ids = [r.id for r in RULES]
    d = diagnose(trace_facts, RULES, selection=build_selection([str(keep)], None, ids))
    assert {f["layer"] for f in d["findings"]} == {keep}
    # muted before supersession: a muted fix covers nothing, so what it superseded is judged on its own
    assert len(d["findings"]) + len(d["muted"]) == len(fired) + len(analyzed["superseded"])
    assert all(m["muted_by"].startswith("not in --select") for m in d["muted"])
    d = diagnose(trace_facts, RULES, selection=build_selection(None, ["low,system-*"], ids))
    assert not [f for f in d["findings"] if f["severity"] == "low" or f["id"].startswith("system-")]
    assert {m["id"] for m in d["muted"]} >= {f["id"] for f in fired if f["severity"] == "low"}
    sel = build_selection(["precision"], ["batching", "data-layout"], ids)
    assert sel.muted_by({"id": "precision-x", "layer": 1, "severity": "low"}) is None
    assert sel.muted_by({"id": "data-x", "layer": 3, "severity": "high"}).startswith("not in --select")


def test_html_names_the_top_finding_first_and_lists_the_muted(default_s2):
    from vlmdoctor.report.html import profile_html

    report = json.loads((TRACES / "default_s2.report.json").read_text())
    report["facts"] = default_s2
    report["diagnosis"] = diagnose(default_s2, RULES, selection=build_selection(None, ["low"], [r.id for r in RULES]))
    report["findings"], report["muted"] = report["diagnosis"]["findings"], report["diagnosis"]["muted"]
    page = profile_html(report)
    top = report["findings"][0]
    first_screen = page[: page.index("<h2>")]
    assert "Biggest expected win" in first_screen and f"<code>{top['id']}</code>" in first_screen
    assert top["fix"].split()[0] in first_screen
    muted = page[page.index('<p class="note">muted: ') :]
    for m in report["muted"]:
        assert f"<code>{m['id']}</code>" in muted[: muted.index("</p>")]
    assert report["muted"] and "by --ignore low" in muted


def test_a_typo_in_a_rule_token_is_one_line_with_did_you_mean():
    code, out = _analyze("--ignore", "fusion-eager-atention")
    assert code == 2 and len(out.strip().splitlines()) == 1
    assert "did you mean fusion-eager-attention" in out
    code, out = _analyze("--select", "precison")
    assert code == 2 and "did you mean precision" in out
    for command in (
        ["profile", "--model", "tiny", "--device", "cpu"],
        ["gate", "--baseline", TRACE],
        ["treat", "--model", "tiny", "--device", "cpu"],
    ):
        r = CliRunner().invoke(app, [*command, "--ignore", "fusion-lm-head-unlabled"])  # refused before any run
        assert r.exit_code == 2 and "did you mean fusion-lm-head-unlabeled" in r.output, (command, r.output)


def test_pyproject_table_mutes_rules_and_adds_rule_folders(tmp_path, monkeypatch):
    rules = tmp_path / "ci" / "rules"
    rules.mkdir(parents=True)
    (rules / "steps.yaml").write_text(
        "id: local-steps\nlayer: 5\ntitle: a traced step\nseverity: low\nwhen: step.ms > 0\n"
        "evidence: ['step {step.ms:.0f} ms']\nfix: nothing\npatch: {seed: 1}\n"
    )
    table = tmp_path / "pyproject.toml"
    table.write_text('[project]\nname = "mine"\n\n[tool.vlmdoctor]\nignore = ["local-steps"]\nrules = ["ci/rules"]\n')
    sub = tmp_path / "src" / "deep"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)  # found by searching upward, as ruff finds its table
    small = str(TRACES / "treated_s1.pt.trace.json.gz")
    r = CliRunner().invoke(app, ["analyze", small, "--json", "-"])
    entry = json.loads(r.stdout)["files"][0]
    assert r.exit_code == 0 and "local-steps" not in [f["id"] for f in entry["findings"]]
    # the table's rule folder (relative to the table) was loaded, its finding fired, and the table muted it
    assert [m["muted_by"] for m in entry["muted"]] == [f"{table.resolve()} ignore local-steps"]
    table.write_text("[tool.vlmdoctor]\nignroe = ['low']\n")
    r = CliRunner().invoke(app, ["analyze", small])
    assert r.exit_code == 2 and "unknown key 'ignroe'; did you mean ignore?" in r.output
    assert len(r.output.strip().splitlines()) == 1


def _gate(tmp_path: Path, *args: str) -> tuple[int, dict]:
    base = json.loads((TRACES / "eager_s2.report.json").read_text())
    cur = copy.deepcopy(base)
    cur["findings"].append({"id": "precision-fp32-gemms", "layer": 1, "severity": "high", "title": "FP32 GEMMs"})
    paths = []
    for name, rep in (("base.json", base), ("cur.json", cur)):
        (tmp_path / name).write_text(json.dumps(rep))
        paths.append(str(tmp_path / name))
    out = tmp_path / "verdict.json"
    r = CliRunner().invoke(
        app, ["gate", "--baseline", paths[0], "--current", paths[1], "--json", str(out), "--force", *args]
    )
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, next(c for c in json.loads(out.read_text())["checks"] if c["name"] == "findings")


def test_gate_fail_on_high_ignores_muted_findings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, check = _gate(tmp_path, "--fail-on", "high")
    assert code == 1 and check["failing"] == ["precision-fp32-gemms"]
    code, check = _gate(tmp_path, "--fail-on", "high", "--ignore", "precision-fp32-gemms")
    assert code == 0 and check["failing"] == [] and check["passed"]
    assert check["muted"] == [
        {"id": "precision-fp32-gemms", "severity": "high", "muted_by": "--ignore precision-fp32-gemms"}
    ]
    assert "muted: precision-fp32-gemms (high)" in check["detail"]
    (tmp_path / "pyproject.toml").write_text('[tool.vlmdoctor]\nignore = ["precision"]\n')
    code, check = _gate(tmp_path)
    assert code == 0 and check["muted"][0]["muted_by"].endswith("pyproject.toml ignore precision")
    (tmp_path / "pyproject.toml").write_text('[tool.vlmdoctor]\nfail-on = "low"\n')
    code, check = _gate(tmp_path)  # the table's gate threshold, not the default
    assert code == 1 and check["fail_on"] == "low"
    code, check = _gate(tmp_path, "--fail-on", "high", "--select", "batching")
    assert code == 0 and check["muted"][0]["muted_by"].startswith("not in --select")


def test_a_muted_selection_travels_to_a_child_process():
    sel = Selection([("precision", "--select")], [("low", "pyproject.toml ignore")])
    again = Selection.from_json(json.loads(json.dumps(sel.to_json())))
    assert again == sel and Selection.from_json(None) == Selection() and not Selection()


def test_rules_list_never_cuts_an_id_at_80_columns():
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT), "NO_COLOR": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", "rules", "list"], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    cells = {c.strip() for line in r.stdout.splitlines() for c in line.split("│")}
    missing = [x.id for x in RULES if x.id not in cells]
    assert missing == [] and max(len(line) for line in r.stdout.splitlines()) <= 80
    assert max(len(x.id) for x in RULES) > 28  # long enough to have been cut before


# --- analyze of a trace profile wrote -----------------------------------------------------------------


def test_analyze_merges_the_measurements_a_trace_carries(trace_facts, default_s2):
    """What a vlmdoctor run writes in its trace's metadata gives analyze the facts profile had."""
    from vlmdoctor.doctor.diagnosis import measured_from_trace

    report = json.loads((TRACES / "default_s2.report.json").read_text())
    bare = {"facts": dict(trace_facts), "meta": {"vlmdoctor": {"config": {}}}}  # an old trace: nothing to merge
    assert measured_from_trace(bare)["facts"] == trace_facts
    entry = {"facts": dict(trace_facts), "meta": {"vlmdoctor": {"metrics": report["metrics"], "env": {}}}}
    assert measured_from_trace(entry)["facts"] == default_s2
    ids = [f["id"] for f in diagnose(entry["facts"], RULES)["findings"]]
    assert ids == [f["id"] for f in diagnose(default_s2, RULES)["findings"]]
    assert ids != [f["id"] for f in diagnose(trace_facts, RULES)["findings"]]  # the trace alone says less


@pytest.mark.slow
def test_analyze_of_a_profile_trace_gives_what_profile_gave(tmp_path):
    """End to end, as a user would (the runner's side also runs by default in test_cpu_doctor.py)."""
    traces, report_path = tmp_path / "D", tmp_path / "r.json"
    runner = CliRunner()
    r = runner.invoke(
        app,
        [
            "profile",
            "--model",
            "tiny",
            "--stage",
            "2",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--trace-dir",
            str(traces),
            "--json",
            str(report_path),
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(report_path.read_text())
    (trace,) = traces.glob("*.pt.trace.json.gz")
    r = runner.invoke(app, ["analyze", str(trace), "--json", "-"])
    assert r.exit_code == 0, r.output
    entry = json.loads(r.stdout)["files"][0]
    assert entry["meta"]["vlmdoctor"]["metrics"]["pad_fraction"] == report["metrics"]["pad_fraction"]
    assert entry["facts"]["data.pad_fraction"] == report["facts"]["data.pad_fraction"]
    assert "data.loss_token_frac" in entry["facts"]
    assert [f["id"] for f in entry["findings"]] == [f["id"] for f in report["findings"]]
    assert "data-padding-waste" in [f["id"] for f in entry["findings"]]  # needs the measured padding


@pytest.mark.parametrize(
    "text",
    [
        '[ tool.vlmdoctor ]\nignore = ["low"]\n',
        '[tool."vlmdoctor"]\nignore = ["low"]\n',
        '[ tool . vlmdoctor ]\nignore = ["low"]\n',
        'tool.vlmdoctor.ignore = ["low"]\n',
        '[tool]\nvlmdoctor = { ignore = ["low"] }\n',
        '[tool]\nvlmdoctor.ignore = ["low"]\n',
        '[tool.vlmdoctor]\n"ignore" = ["low"]\n',
    ],
    ids=["spaces", "quoted", "spaced-dots", "dotted-keys", "inline-table", "dotted-in-tool", "quoted-key"],
)
def test_every_toml_spelling_of_the_table_is_the_table(text, tmp_path):
    """The table is found by parsing, not by its bytes: each spelling is read, and a parent's table never
    stands in for it."""
    from vlmdoctor.doctor.settings import project_settings

    (tmp_path / "pyproject.toml").write_text('[tool.vlmdoctor]\nignore = ["high"]\n')  # the parent's: not this
    here = tmp_path / "proj"
    here.mkdir()
    (here / "pyproject.toml").write_text(text)
    assert project_settings(here)["ignore"] == ["low"]


def test_a_pyproject_that_is_not_toml_stops_the_search(tmp_path):
    """A UTF-16 pyproject.toml is no TOML: said, rather than a parent folder's settings applied silently."""
    from vlmdoctor.doctor.settings import project_settings

    (tmp_path / "pyproject.toml").write_text('[tool.vlmdoctor]\nignore = ["high"]\n')
    here = tmp_path / "proj"
    here.mkdir()
    (here / "pyproject.toml").write_bytes('[tool.vlmdoctor]\nignore = ["low"]\n'.encode("utf-16"))
    with pytest.raises(UsageError, match="pyproject.toml"):
        project_settings(here)
