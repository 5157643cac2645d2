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
    ("gain per token", rule() + "gain: {saves_ms: gpu.busy_ms, per: token}\n", "gain.per must be one of step, sample"),
    (
        "a growing part of a per-step cost",
        rule() + "gain: {saves_ms: gpu.busy_ms, grows_ms: gpu.busy_ms}\n",
        "gain.grows_ms is the part of saves_ms that grows with the batch: it needs gain.per: sample",
    ),
    (
        "undoing reads an unknown fact",
        rule() + "gain: {saves_ms: gpu.busy_ms, undo_ms: part.llm.nothing_ms}\n",
        "uses unknown fact(s) part.llm.nothing_ms",
    ),
    ("undoing is a number", rule() + "gain: {saves_ms: gpu.busy_ms, undo_ms: 5}\n", "undo_ms are expressions"),
    (
        "a growing part with an undefined constant",
        rule() + "gain: {saves_ms: gpu.busy_ms, per: sample, grows_ms: gpu.busy_ms * NOWHERE}\n",
        "undefined constant(s) NOWHERE",
    ),
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
    r = invoke(["analyze", TRACE, "--rules", d, "--verbose"])  # the evidence too
    assert r.exit_code == 0, r.output
    assert "[/] closes" in r.stdout and "[/bold]" in r.stdout and "[red]" in r.stdout
    listed = invoke(["rules", "list", "--rules", d])
    assert listed.exit_code == 2 and "Traceback" not in listed.output and "internal error" not in listed.output
    assert "[/] closes" in listed.stdout and "broken.yaml" in listed.stderr


# --- bounds on every operation of an expression (generated) ---------------------------------------------

from vlmdoctor.doctor import rule_expr  # noqa: E402
from vlmdoctor.doctor import rules as rules_mod  # noqa: E402
from vlmdoctor.doctor.evidence import MAX_RENDERED  # noqa: E402


def _load_one(tmp_path, monkeypatch, text: str) -> tuple[list, list[str]]:
    """One user rule loaded beside a single shipped-style rule (the full shipped set is not needed here)."""
    shipped = tmp_path / "shipped"
    shipped.mkdir(exist_ok=True)
    (shipped / "good.yaml").write_text(rule(id="user-good"))
    monkeypatch.setattr(rules_mod, "RULES_DIR", shipped)
    d = tmp_path / "user"
    d.mkdir(exist_ok=True)
    (d / "bad.yaml").write_text(text)
    return load_rules(d)


def _specs() -> list[tuple[str, bool]]:
    """Format specs around the bounds, in Python's mini-language: (spec, within the bounds)."""
    out = []
    widths = (("", True), ("12", True), (str(rule_expr.MAX_WIDTH), True), (str(rule_expr.MAX_WIDTH + 1), False))
    precisions = (("", True), (".3", True), (f".{rule_expr.MAX_PRECISION}", True), (".21", False))
    for head in ("", "x>", "^", "+", "0"):
        for width, w_ok in (*widths, ("999999999", False)):
            for prec, p_ok in precisions:
                for kind in ("f", "e", "%", ","):
                    spec = f"{head}{width}{prec}{kind}" if kind != "," else f"{head}{width},{prec}"
                    if head == "0" and not width:
                        continue
                    out.append((spec, w_ok and p_ok))
    return out


SPECS = _specs()


def test_format_specs_are_bounded_in_width_and_precision(tmp_path, monkeypatch, facts):
    """Every spec over the width or precision bound is refused when its rule loads (a rule problem naming the
    file); every spec within them renders, to at most MAX_RENDERED characters. One rule file per spec."""
    _load_one(tmp_path, monkeypatch, rule(id="user-first"))
    d = tmp_path / "user"
    for i, (spec, _) in enumerate(SPECS):
        (d / f"spec{i}.yaml").write_text(rule(id=f"user-spec{i}", evidence=f"busy {{gpu.busy_frac:{spec}}}"))
    rules, problems = load_rules(d)
    loaded = {r.id for r in rules}
    result = diagnose(facts, rules)
    evidence = {f["id"]: f["evidence"][0] for f in result["findings"] + result["superseded"]}
    for i, (spec, ok) in enumerate(SPECS):
        mine = [p for p in problems if f"spec{i}.yaml:" in p]
        if not ok:
            assert len(mine) == 1 and "format spec" in mine[0] and f"user-spec{i}" not in loaded, (spec, mine)
            continue
        assert mine == [] and f"user-spec{i}" in loaded, (spec, mine)
        format(0.5, spec)  # the generator writes specs Python reads
        assert len(evidence[f"user-spec{i}"]) <= MAX_RENDERED + 10, spec


def test_a_format_width_attack_in_the_probe_shape(tmp_path, monkeypatch):
    """The probe's shape, `{x:999999999}`: refused at load, never formatted (that is a 1 GB string)."""
    _, problems = _load_one(tmp_path, monkeypatch, rule(evidence="busy {gpu.busy_frac:999999999}"))
    assert len(problems) == 1 and "width over" in problems[0]


LOAD_BOUNDS = [
    *[(f"{f}() without arguments", f"{f}() > 0", "takes") for f in rule_expr.FUNCTIONS],
    *[(f"{f}() with 17 arguments", f"{f}({', '.join(['1'] * 17)}) > 0", "takes") for f in rule_expr.FUNCTIONS],
    ("a keyword argument", "round(gpu.busy_frac, ndigits=2) > 0", "takes"),
    ("a starred argument", "max(*[1, 2]) > 0", "takes"),
    ("a long string literal", "'" + "a" * (rule_expr.MAX_TEXT + 1) + "' == 'a'", "too large"),
    ("an integer past 2^256", f"{2**256 + 1} > 0", "too large"),
    ("an integer of 5000 digits", "1" + "0" * 5000 + " > 0", "characters"),
    ("a list of 65 items", "gpu.busy_frac in [" + ", ".join(["1"] * 65) + "]", "65 items"),
    ("an expression of 2001 characters", "gpu.busy_frac" + " " * 2000 + "> 0", "characters"),
    ("an expression of 600 parts", " + ".join(["1"] * 300) + " > 0", "parts"),
    ("nesting 50 deep", "(" * 50 + "-" * 50 + "1" + ")" * 50 + " > 0", "nested"),
    ("nesting 45 deep through calls", "abs(" * 45 + "1" + ")" * 45 + " > 0", "nested"),
]


@pytest.mark.parametrize("name, when, needle", LOAD_BOUNDS, ids=[c[0] for c in LOAD_BOUNDS])
def test_expressions_are_bounded_when_the_rule_loads(tmp_path, monkeypatch, name, when, needle):
    rules, problems = _load_one(tmp_path, monkeypatch, rule(when=when.replace('"', "'")))
    assert len(problems) == 1 and "bad.yaml" in problems[0] and needle in problems[0], problems
    assert "\n" not in problems[0] and len(problems[0]) < 600
    assert {r.id for r in rules} == {"user-good"}


EVAL_BOUNDS = [
    ("floor of 1e300 (a 997-bit integer)", "floor(1e300) > 0", "bits"),
    ("ceil of -1e300", "ceil(-1e300) < 0", "bits"),
    ("a product past 2^256", f"{2**200} * {2**200} > 0", "bits"),
    ("round to 10^9 digits", "round(gpu.busy_frac, 1000000000) > 0", "digits"),
    ("round to -21 digits", "round(2 ** 0 + 1, -21) > 0", "digits"),
    ("max of strings", "max('a', 'b') == 'b'", "needs numbers"),
    ("min of a list of lists", "min([[1], [2]]) == [1]", "needs numbers"),
    ("abs of a string", "abs('a') > 0", "needs numbers"),
]


@pytest.mark.parametrize("name, when, needle", EVAL_BOUNDS, ids=[c[0] for c in EVAL_BOUNDS])
def test_expressions_are_bounded_while_evaluated(tmp_path, monkeypatch, facts, name, when, needle):
    when = when.replace("2 ** 0 + 1", "2")  # no power operator: the case needs a plain integer
    rules, problems = _load_one(tmp_path, monkeypatch, rule(when=when))
    assert problems == [], problems
    result = diagnose(facts, rules, problems)
    bad = [p for p in result["problems"] if "bad.yaml" in p]
    assert len(bad) == 1 and needle in bad[0], result["problems"]
    assert "user-good" in {f["id"] for f in result["findings"] + result["superseded"]}


@pytest.mark.parametrize(
    "value, ok",
    [
        ("0.9", True),
        (str(2**256), True),
        (str(2**256 + 1), False),
        ("'" + "a" * 300 + "'", False),
        ("[" + ", ".join(["1"] * 65) + "]", False),
        ("[[1, 2], [3]]", False),
        ("{a: 1}", False),
    ],
)
def test_constants_are_values_an_expression_may_hold(tmp_path, monkeypatch, value, ok):
    text = rule().replace("{LIMIT: {value: 0.9, why: test}}", f"{{LIMIT: {{value: {value}, why: test}}}}")
    rules, problems = _load_one(tmp_path, monkeypatch, text)
    if ok:
        assert problems == [] and "user-bad" in {r.id for r in rules}
    else:
        assert len(problems) == 1 and "constant LIMIT" in problems[0], problems


def test_a_long_list_fact_renders_cut_in_evidence(tmp_path, monkeypatch, facts):
    """A fact that is a long list (kernel names from a trace) renders as its first items and a count."""
    many = {**facts, "gemm.fp32_top_kernels": [f"kernel_{'x' * 500}_{i}" for i in range(100_000)]}
    text = rule(when="gpu.busy_frac >= 0", evidence="top {gemm.fp32_top_kernels}")
    rules, problems = _load_one(tmp_path, monkeypatch, text)
    assert problems == []
    result = diagnose(many, rules)
    f = next(f for f in result["findings"] + result["superseded"] if f["id"] == "user-bad")
    assert len(f["evidence"][0]) <= MAX_RENDERED + 10 and f["evidence"][0].endswith("...")


def test_an_expression_is_checked_once_and_a_refused_one_is_refused_where_it_is_each_time(monkeypatch):
    """Checked trees are kept by their text (a rule folder's 740 expressions at every diagnosis); a refusal is not
    kept: each rule that writes it is told, by its own name."""
    from vlmdoctor.doctor import rule_expr

    tree = rule_expr.parse("=step.ms > 1 and has(idle.host.ms)", "r1: ")
    monkeypatch.setattr(rule_expr.ast, "parse", lambda *a, **k: pytest.fail("parsed again"))
    assert rule_expr.parse("step.ms > 1 and has(idle.host.ms)", "r2: ") is tree
    monkeypatch.undo()
    for where in ("r1: ", "r2: "):
        with pytest.raises(rule_expr.RuleError, match=f"^{where}Lambda is not allowed"):
            rule_expr.parse("lambda: 1", where)
