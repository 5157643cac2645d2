"""Bad report JSONs given to gate and compare: refused with one line (exit 2), never a crash.

Named cases from the probe, then every top-level field and every metric of a real recorded report
replaced by values of the wrong type: whatever the comparison does with them, it must not crash.
"""

from __future__ import annotations

import json

import pytest
from _badinput import REPORT, assert_one_line, invoke, snapshot

BASE = json.loads(REPORT.read_text())


def _with(**changes) -> dict:
    r = json.loads(REPORT.read_text())
    for dotted, v in changes.items():
        keys = dotted.split("__")
        d = r
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = v
    return r


NAMED = [
    ("metrics-empty", _with(metrics={}), "real_tokens_per_s"),
    ("tps-null", _with(metrics__real_tokens_per_s=None), "real_tokens_per_s"),
    ("tps-string", _with(metrics__real_tokens_per_s="fast"), "real_tokens_per_s"),
    ("tps-zero", _with(metrics__real_tokens_per_s=0), "real_tokens_per_s"),
    ("tps-negative", _with(metrics__real_tokens_per_s=-5.0), "real_tokens_per_s"),
    ("schema-negative", _with(schema_version=-1), "schema_version"),
    ("schema-zero", _with(schema_version=0), "schema_version"),
    ("schema-future", _with(schema_version=99), "newer vlmdoctor"),
    ("schema-string", _with(schema_version="1"), "schema_version"),
    ("status-nan", _with(status="nan_loss"), "nan_loss"),
    ("repeats-string", _with(repeats="many"), "repeats"),
    ("repeats-step-ms-strings", _with(repeats=[{"step_ms": ["a"], "step_real_tokens": [1]}]), "step_ms"),
    ("findings-not-list", _with(findings="none"), "findings"),
    ("findings-no-id", _with(findings=[{"severity": "high"}]), "findings"),
    ("peak-mem-string", _with(metrics__peak_mem_gb="lots"), "peak_mem_gb"),
    ("config-list", _with(config=[1]), "config"),
    ("a-list", [BASE], "not a vlmdoctor profile report"),
    ("a-treat-result", _with(kind="treat"), "treat"),
    # fields that parse but break a verdict: all-zero step times, no tokens, a negative size, a wrong window
    ("step-ms-all-zero", _with(repeats=[{"step_ms": [0.0, 0.0], "step_real_tokens": [10, 10]}]), "all zero"),
    ("tokens-all-zero", _with(repeats=[{"step_ms": [5.0, 5.0], "step_real_tokens": [0, 0]}]), "all zero"),
    ("peak-mem-negative", _with(metrics__peak_mem_gb=-3.0), "must not be negative"),
    ("step-ms-negative", _with(metrics__step_ms=-1.0), "must not be negative"),
    ("script-warmup-string", _with(script={"command": ["python", "t.py"], "warmup": "five"}), "script.warmup"),
]


@pytest.mark.parametrize("as_current", [False, True], ids=["baseline", "current"])
@pytest.mark.parametrize("name, doc, needle", NAMED, ids=[n for n, _, _ in NAMED])
def test_gate_refuses_a_bad_report(tmp_path, name, doc, needle, as_current):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    good = tmp_path / "good.json"
    good.write_text(REPORT.read_text())
    before = snapshot(tmp_path)
    pair = ["--baseline", good, "--current", bad] if as_current else ["--baseline", bad, "--current", good]
    r = invoke(["gate", *pair])
    assert_one_line(r, 2, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name, doc, needle", NAMED, ids=[n for n, _, _ in NAMED])
def test_compare_refuses_a_bad_report(tmp_path, name, doc, needle):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    r = invoke(["compare", REPORT, bad])
    assert_one_line(r, 2, needle)


def test_a_nan_written_by_another_tool_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(REPORT.read_text().replace('"real_tokens_per_s": ', '"real_tokens_per_s": NaN, "x": ', 1))
    r = invoke(["gate", "--baseline", REPORT, "--current", bad])
    assert_one_line(r, 2, "real_tokens_per_s")


WRONG = [None, "text", -1, [], {}, [1, "a", None], {"a": {}}]
FIELDS = [("top", k) for k in BASE] + [("metrics", k) for k in BASE["metrics"]]


@pytest.mark.parametrize("where, key", FIELDS, ids=[f"{w}.{k}" for w, k in FIELDS])
def test_no_wrong_typed_field_crashes_gate_or_compare(tmp_path, where, key):
    for value in WRONG:
        doc = json.loads(REPORT.read_text())
        (doc if where == "top" else doc["metrics"])[key] = value
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        for args in (["gate", "--baseline", REPORT, "--current", bad], ["compare", REPORT, bad]):
            r = invoke(args)
            assert r.exit_code in (0, 1, 2), (key, value, r.output)
            assert "Traceback" not in r.output and "internal error" not in r.output, (key, value, r.output)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"schema_version": 1', "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_unreadable_report_files(tmp_path, content, needle):
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    for args in (["gate", "--baseline", bad, "--current", REPORT], ["compare", bad, REPORT]):
        assert_one_line(invoke(args), 2)
