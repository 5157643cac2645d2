"""User rule files that are broken when loaded or fail while evaluated: each is a rule problem naming
its file, the other rules still run, and no expression can allocate unbounded memory."""

from __future__ import annotations

import json

import pytest
from _badinput import TRACE, TRACES, invoke

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.trace.facts import analyze, merge_measured

GOOD = """id: {id}
layer: 2
title: test rule
severity: low
when: "{when}"
constants: {{LIMIT: {{value: 0.9, why: test}}}}
evidence: ["{evidence}"]
fix: do something
patch: {{batch_size: {patch}}}
"""


def rule(id="user-bad", when="gpu.busy_frac < LIMIT", evidence="busy {gpu.busy_frac:pct}", patch="8") -> str:
    return GOOD.format(id=id, when=when, evidence=evidence, patch=patch)


@pytest.fixture(scope="module")
def facts():
    """Facts of a real recorded trace (the default config: the GPU is busy 8% of the step)."""
    f = analyze(TRACE)["files"][0]["facts"]
    return merge_measured(f, json.loads((TRACES / "default_s2.report.json").read_text()))


EVAL_CASES = [
    ("division by zero", rule(when="gpu.busy_frac / 0 > 1"), "ZeroDivisionError"),
    ("string vs number", rule(when="'fast' < gpu.busy_frac"), "TypeError"),
    ("list repetition", rule(when="[0] * 1000000000000 == []"), "arithmetic needs numbers"),
    ("string repetition", rule(when="'ab' * 1000000000000 == ''"), "arithmetic needs numbers"),
    ("nested repetition", rule(when="([0] * 100000) * 100000 == []"), "arithmetic needs numbers"),
    ("negated string", rule(when="-'a' == 1"), "negate"),
    ("overflow", rule(when="floor(1e400) > 0"), "OverflowError"),
    ("bad patch expression", rule(when="gpu.busy_frac >= 0", patch="'=1 / 0'"), "ZeroDivisionError"),
]


@pytest.mark.parametrize("name, text, needle", EVAL_CASES, ids=[c[0] for c in EVAL_CASES])
def test_a_rule_failing_while_evaluated_is_a_problem_and_the_rest_run(tmp_path, facts, name, text, needle):
    d = tmp_path / "rules"
    d.mkdir()
    (d / "bad.yaml").write_text(text)
    (d / "good.yaml").write_text(rule(id="user-good", patch="16"))
    rules, problems = load_rules(d)
    assert problems == [], problems
    result = diagnose(facts, rules, problems)
    bad = [p for p in result["problems"] if "bad.yaml" in p]
    assert len(bad) == 1 and "user-bad" in bad[0] and needle in bad[0], result["problems"]
    fired = {f["id"] for f in result["findings"] + result["superseded"]}
    assert "user-good" in fired and "user-bad" not in fired


LOAD_CASES = [
    ("when is a number", rule().replace('when: "gpu.busy_frac < LIMIT"', "when: 1"), "when and unless"),
    ("when is a list", rule().replace('when: "gpu.busy_frac < LIMIT"', "when: [a, b]"), "when and unless"),
    (
        "evidence is a string",
        rule().replace('evidence: ["busy {gpu.busy_frac:pct}"]', "evidence: hi"),
        "evidence",
    ),
    ("stage 3", rule() + "stages: [3]\n", "stages"),
    ("id is a number", rule().replace("id: user-bad", "id: 5"), "id must be"),
    ("layer is a bool", rule().replace("layer: 2", "layer: true"), "layer"),
    ("gain is a number", rule() + "gain: {saves_ms: 5}\n", "gain"),
    (
        "constants is a list",
        rule().replace("constants: {LIMIT: {value: 0.9, why: test}}", "constants: [1]"),
        "constants",
    ),
    ("patch is a list", rule().replace("patch: {batch_size: 8}", "patch: [1]"), "patch"),
    ("a bare scalar", "7\n", "expected a mapping"),
    ("no arguments", rule(when="min() > 0"), "min() takes 1 to 16"),
    ("bad format spec", rule(when="gpu.busy_frac >= 0", evidence="busy {gpu.busy_frac:%%%}"), "format spec"),
]


@pytest.mark.parametrize("name, text, needle", LOAD_CASES, ids=[c[0] for c in LOAD_CASES])
def test_a_malformed_rule_is_a_problem_naming_its_file(tmp_path, name, text, needle):
    d = tmp_path / "rules"
    d.mkdir()
    (d / "bad.yaml").write_text(text)
    (d / "good.yaml").write_text(rule(id="user-good"))
    rules, problems = load_rules(d)
    assert len(problems) == 1 and "bad.yaml" in problems[0] and needle in problems[0], problems
    assert "user-good" in {r.id for r in rules}


def test_non_utf8_rule_file_and_a_folder_named_like_one(tmp_path):
    d = tmp_path / "rules"
    d.mkdir()
    (d / "latin1.yaml").write_bytes(rule().encode().replace(b"test rule", b"r\xe8gle"))
    (d / "x.yaml").mkdir()
    (d / "good.yaml").write_text(rule(id="user-good"))
    rules, problems = load_rules(d)
    assert len(problems) == 2, problems
    assert any("latin1.yaml" in p and "not UTF-8" in p for p in problems)
    assert any("x.yaml" in p and "not a file" in p for p in problems)
    assert "user-good" in {r.id for r in rules}


@pytest.mark.parametrize(
    "text",
    [
        rule(when="[0] * 1000000000000 == []"),
        rule(when="gpu.busy_frac / 0 > 1"),
        rule().replace('when: "gpu.busy_frac < LIMIT"', "when: 1"),
    ],
)
def test_analyze_with_a_broken_user_rule_reports_it_and_finishes(tmp_path, text):
    d = tmp_path / "rules"
    d.mkdir()
    (d / "bad.yaml").write_text(text)
    out = tmp_path / "a.json"
    r = invoke(["analyze", TRACE, "--rules", d, "--json", out])
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output
    problems = json.loads(out.read_text())["files"][0]["diagnosis"]["problems"]
    assert any("bad.yaml" in p for p in problems)
    assert json.loads(out.read_text())["files"][0]["findings"]  # the shipped rules still ran


def test_rule_text_is_never_read_as_console_markup(tmp_path):
    """A user's title, evidence or fix holding [/bold] or [red] is printed as written, not parsed."""
    d = tmp_path / "rules"
    d.mkdir()
    text = rule(id="user-markup", evidence="[/bold] busy [red]{gpu.busy_frac:pct}")
    (d / "markup.yaml").write_text(text.replace("title: test rule", "title: '[/] closes nothing'"))
    (d / "broken.yaml").write_text(rule(id="user-broken", when="[1] * 2 == [/x]"))
    r = invoke(["analyze", TRACE, "--rules", d])
    assert r.exit_code == 0, r.output
    assert "[/] closes" in r.stdout and "[/bold]" in r.stdout and "[red]" in r.stdout
    listed = invoke(["rules", "list", "--rules", d])
    assert listed.exit_code == 2 and "Traceback" not in listed.output and "internal error" not in listed.output
    assert "[/] closes" in listed.stdout and "broken.yaml" in listed.stderr
