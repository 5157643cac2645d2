"""The declared documents (vlmdoctor/documents/) against what vlmdoctor writes and what users keep: every
committed report, treat result and gate verdict loads and round-trips, a bad field is refused with its name,
fields are read by name, what the writers produce now fits its declaration, and docs/files.md's field table is
the declarations'."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

from vlmdoctor import documents as d
from vlmdoctor.ci.gate import check_comparable, gate, load_report
from vlmdoctor.cli import app
from vlmdoctor.documents.fields import _type_text
from vlmdoctor.errors import EXIT_USAGE, UsageError
from vlmdoctor.report.compare import compare

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
#: every report committed with the fixtures
REPORTS = sorted(FIX.rglob("*.report.json"))
#: the documents kept with the benchmark results (reports, treat results, gate verdicts of older vlmdoctors)
KEPT = sorted(p for p in (ROOT / "bench" / "results").rglob("*.json") if "trace" not in p.name)
BF16 = FIX / "traces" / "bf16_s2.report.json"
DPO = FIX / "mode_traces" / "h100_dpo_fixed_s2.report.json"
JOB = ROOT / "bench" / "results" / "2026-11-27-2xh100-ways-in" / "torchrun_report.json"


def _declared(value: dict[str, Any]) -> type[d.Doc] | None:
    """Which declaration a committed JSON document is, by what it holds (None: not a document: a manifest...)."""
    if "metrics" in value:
        return d.RunReport
    if value.get("kind") == "treat":
        return d.TreatResult
    if "checks" in value and "summary" in value:
        return d.GateVerdict
    return None


def _round_trip(doc: d.Doc) -> None:
    """decode -> encode -> decode gives an equal document, through JSON as a writer would write it."""
    cls = type(doc)
    assert msgspec.json.decode(msgspec.json.encode(doc), type=cls) == doc
    assert d.as_document(json.loads(msgspec.json.encode(doc)), cls, "again") == doc


def _bad(tmp_path: Path, raw: dict[str, Any], **changes: Any) -> Path:
    """The report with `a__b__0__c=value` set (a None value deletes the key), written to a file."""
    doc = copy.deepcopy(raw)
    for dotted, value in changes.items():
        keys = [int(k) if k.isdigit() else k for k in dotted.split("__")]
        at = doc
        for k in keys[:-1]:
            at = at[k]
        if value is None:
            del at[keys[-1]]
        else:
            at[keys[-1]] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    return path


# --- what is committed loads, and round-trips -------------------------------------------------------


def test_the_fixtures_hold_reports():
    assert len(REPORTS) >= 25 and len(KEPT) >= 150


@pytest.mark.parametrize("path", REPORTS, ids=[str(p.relative_to(FIX)) for p in REPORTS])
def test_every_fixture_report_loads_and_round_trips(path):
    report = d.read_report(path)
    assert report.schema_version == 1 and report.metrics is not None
    _round_trip(report)
    d.check_measured(report, str(path))  # and gate takes it


def test_every_kept_benchmark_document_loads_and_round_trips():
    """Reports, treat results and gate verdicts written by older vlmdoctors (bench/results): users keep such files
    as baselines, and they must still load."""
    seen: dict[str, int] = {}
    for path in KEPT:
        value = json.loads(path.read_text())
        cls = _declared(value) if isinstance(value, dict) else None
        if cls is None:
            continue
        doc = d.as_document(value, cls, str(path))
        _round_trip(doc)
        seen[cls.__name__] = seen.get(cls.__name__, 0) + 1
    assert seen.get("RunReport", 0) >= 50 and seen.get("TreatResult", 0) >= 20 and seen.get("GateVerdict", 0) >= 40


def test_unknown_keys_are_ignored_and_absent_ones_are_null():
    raw = json.loads(BF16.read_text())
    plain = d.as_report(raw)
    more = copy.deepcopy(raw)
    more["written_by_a_newer_vlmdoctor"] = {"any": [1, "thing"]}
    more["metrics"]["a_new_metric"] = 3.5
    more["repeats"][0]["per_step_something"] = [1, 2]
    more["env"]["a_new_library"] = "1.0"
    assert d.as_report(more) == plain
    less = copy.deepcopy(raw)
    for key in ("stats", "warmup", "trace", "flops", "created_at"):
        less.pop(key, None)
    del less["metrics"]["mfu"]
    fewer = d.as_report(less)
    assert fewer.stats is None and fewer.trace is None and fewer.metrics.mfu is None
    assert fewer.metrics.real_tokens_per_s == plain.metrics.real_tokens_per_s


# --- what is refused, and how it is said ------------------------------------------------------------


BAD_TYPES = [
    ({"metrics__step_ms": "slow"}, "metrics.step_ms: expected a number or null, got text"),
    ({"repeats__0__step_ms__1": "a"}, "repeats[0].step_ms[1]: expected a number, got text"),
    ({"env__cpu_count": "many"}, "env.cpu_count: expected a whole number or null, got text"),
    ({"script": {"command": ["python", "t.py"], "warmup": 1.5}}, "script.warmup: expected a whole number or null"),
    ({"config__stage": "two"}, "config.stage: expected a whole number or null, got text"),
    ({"findings": [{"severity": "high"}]}, "findings[0].id: missing (a required field)"),
    ({"distributed": {"world_size": True}}, "distributed.world_size: expected a whole number, got true/false"),
    ({"schema_version": "1"}, "schema_version: expected a whole number, got text"),
]


@pytest.mark.parametrize("changes, said", BAD_TYPES, ids=[next(iter(c)) for c, _ in BAD_TYPES])
def test_a_field_of_another_type_is_refused_with_its_name(tmp_path, changes, said):
    path = _bad(tmp_path, json.loads(BF16.read_text()), **changes)
    with pytest.raises(d.DocumentError) as e:
        d.read_report(path)
    assert e.value.exit_code == EXIT_USAGE and isinstance(e.value, UsageError)
    assert e.value.message.startswith(f"{path}: ") and said in e.value.message
    assert "\n" not in e.value.message
    with pytest.raises(UsageError, match=re.escape(said)):  # what gate and compare read it with
        load_report(str(path))


NEGATIVE = [
    ({"metrics__peak_mem_gb": -3.0}, "metrics.peak_mem_gb: must not be negative, got -3.0"),
    ({"metrics__step_ms": -1.0}, "metrics.step_ms: must not be negative, got -1.0"),
    ({"repeats__0__step_ms__0": -5.0}, "repeats[0].step_ms[0]: must not be negative, got -5.0"),
    ({"trace__bytes": -1}, "trace.bytes: must not be negative, got -1"),
    ({"metrics__pad_fraction": 1.5}, "metrics.pad_fraction: must be a number <= 1, got 1.5"),
    ({"script": {"command": ["python", "t.py"], "steps": 0}}, "script.steps: must be a whole number >= 1, got 0"),
]


@pytest.mark.parametrize("changes, said", NEGATIVE, ids=[next(iter(c)) for c, _ in NEGATIVE])
def test_a_value_out_of_its_range_is_refused_with_its_name(tmp_path, changes, said):
    path = _bad(tmp_path, json.loads(BF16.read_text()), **changes)
    with pytest.raises(d.DocumentError, match=re.escape(said)):
        d.read_report(path)


def test_bytes_name_the_document_as_told():
    data = BF16.read_bytes().replace(b'"peak_mem_gb": ', b'"peak_mem_gb": -', 1)
    with pytest.raises(d.DocumentError, match=r"^baseline: metrics\.peak_mem_gb: must not be negative"):
        d.read_report(data, "baseline")
    assert d.read_report(BF16.read_bytes()) == d.read_report(BF16)


def test_another_kind_or_a_newer_schema_is_said_before_the_fields(tmp_path):
    report = json.loads(BF16.read_text())
    with pytest.raises(d.DocumentError, match="a vlmdoctor profile result, not a treat result"):
        d.as_document(report | {"kind": "profile"}, d.TreatResult, "r.json")
    with pytest.raises(d.DocumentError, match=r"not a vlmdoctor analysis result \(no kind\)"):
        d.as_document(report, d.Analysis, "r.json")
    newer = report | {"schema_version": 99, "metrics": "changed in version 99"}
    with pytest.raises(d.DocumentError, match="written by a newer vlmdoctor"):
        d.as_report(newer)


def test_what_a_verdict_needs_is_checked_across_fields():
    raw = json.loads(BF16.read_text())
    zero = copy.deepcopy(raw)
    zero["repeats"] = [{"step_ms": [0.0, 0.0], "step_real_tokens": [10, 10]}]
    with pytest.raises(d.DocumentError, match=r"repeats\[0\]\.step_ms are all zero"):
        d.check_measured(d.as_report(zero), "r")
    oom = copy.deepcopy(raw) | {"status": "oom", "error": {"type": "OutOfMemory", "message": "CUDA out of memory"}}
    d.as_report(oom)  # a report of a failed run is a report
    with pytest.raises(d.DocumentError, match=r"status oom: CUDA out of memory"):
        d.check_measured(d.as_report(oom), "r")


# --- fields are read by name --------------------------------------------------------------------------


def test_fields_read_by_name_are_the_written_ones():
    """Renaming a declared field (or its key) breaks this: each value is read by attribute and checked against
    the key the writer wrote."""
    raw = json.loads(DPO.read_text())
    r = d.read_report(DPO)
    m = raw["metrics"]
    assert (r.metrics.real_tokens_per_s, r.metrics.step_ms, r.metrics.peak_mem_gb, r.metrics.mfu) == (
        m["real_tokens_per_s"],
        m["step_ms"],
        m["peak_mem_gb"],
        m["mfu"],
    )
    assert r.metrics.pad_fraction == m["pad_fraction"] and r.metrics.loss_finite is m["loss_finite"]
    assert r.knobs.model == raw["config"]["model"] and r.knobs.stage == raw["config"]["stage"] == 2
    assert r.env.gpu == raw["env"]["gpu"] and r.env.device_type == "cuda"
    assert r.repeats[0].step_ms == raw["repeats"][0]["step_ms"]
    assert r.repeats[0].step_real_tokens == raw["repeats"][0]["step_real_tokens"]
    assert r.trace.traced_step_ms == raw["trace"]["traced_step_ms"]
    assert r.model.params.total == raw["model"]["params"]["total"]
    top = r.findings[0]
    assert (top.id, top.layer, top.severity) == tuple(raw["findings"][0][k] for k in ("id", "layer", "severity"))
    assert top.expected_gain.throughput_x == raw["findings"][0]["expected_gain"]["throughput_x"]
    assert r.diagnosis.superseded[0].superseded_by == raw["diagnosis"]["superseded"][0]["superseded_by"]
    assert r.facts["step.ms"] == raw["facts"]["step.ms"]
    job_raw = json.loads(JOB.read_text())
    job = d.read_report(JOB)
    assert job.distributed.world_size == 2
    assert job.distributed.global_.slowest_rank == job_raw["distributed"]["global"]["slowest_rank"]
    assert job.distributed.ranks[1].real_tokens_per_s == job_raw["distributed"]["ranks"][1]["real_tokens_per_s"]
    assert job.script.command == job_raw["script"]["command"] and job.script.steps == job_raw["script"]["steps"]
    assert job.knobs.source == "script"


def test_every_declared_field_is_written_by_its_name():
    """Each declared key is spelled in vlmdoctor's code outside the declarations (a writer's key, or a keyword):
    a field renamed in the declaration alone would be read as null forever."""
    declared = ROOT / "vlmdoctor" / "documents"
    code = "\n".join(p.read_text() for p in (ROOT / "vlmdoctor").rglob("*.py") if declared not in p.parents)
    todo, seen, unwritten = list(d.DOCUMENTS), set(), []
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for f in msgspec.inspect.type_info(cls).fields:
            name = re.escape(f.encode_name)
            # a field kept for files older tools wrote ("an older treat.json: ...") has no writer left: it must
            # still be read by its name
            said = (getattr(f.type, "extra_json_schema", None) or {}).get("description", "")
            older = rf"\.{name}\b" if said.startswith("an older") else None
            if not re.search(rf"[\"']{name}[\"']|\b{name}=" + (f"|{older}" if older else ""), code):
                unwritten.append(f"{cls.__name__}.{f.encode_name}")
            todo += _type_text(f.type)[2]
    assert not unwritten, unwritten


# --- what the writers produce now fits its declaration ---------------------------------------------


def test_gate_verdicts_and_comparisons_fit_their_declarations():
    a, b = load_report(str(BF16)), load_report(str(FIX / "traces" / "fp32_noautocast_s2.report.json"))
    verdict = d.as_document(gate(a, b, notes=check_comparable(a, b)), d.GateVerdict, "verdict")
    assert verdict.passed is False and [c.name for c in verdict.checks] == ["throughput", "memory", "findings"]
    assert verdict.checks[0].ratio < 1 and verdict.model == "0.5b" and verdict.stage == 2
    _round_trip(verdict)
    diff = d.as_document(compare(a, b), d.Comparison, "comparison")
    assert diff.metrics[0].key == "real_tokens_per_s" and diff.metrics[0].verdict == "worse"
    assert {k.knob for k in diff.config} >= {"weight_dtype"} and diff.ranks.a == diff.ranks.b == 1
    _round_trip(diff)
    diagnosed = load_report(str(DPO))
    other = d.as_document(compare(diagnosed, copy.deepcopy(diagnosed)), d.Comparison, "comparison")
    assert other.findings is not None and other.findings.kept and not other.findings.added


@pytest.mark.parametrize("trace", ["user_cpu/llava_s2_plain.pt.trace.json.gz", "dist_cpu/ddp"])
def test_an_analysis_fits_its_declaration(tmp_path, trace):
    out = tmp_path / "analysis.json"
    r = CliRunner().invoke(app, ["analyze", str(FIX / trace), "--json", str(out)])
    assert r.exit_code == 0, r.output
    doc = d.read_analysis(out)
    assert doc.kind == "analysis" and doc.files and all(f.facts for f in doc.files)
    assert all(f.diagnosis is not None for f in doc.files)
    if trace.startswith("dist_cpu"):
        assert [f.rank for f in doc.files] == [0, 1] and doc.cross_rank is not None and doc.cross_rank.facts
    _round_trip(doc)


# --- the field table of docs/files.md ----------------------------------------------------------------


def test_the_docs_field_table_is_the_declarations():
    text = (ROOT / "docs" / "files.md").read_text()
    assert d.with_generated(text) == text, "regenerate: python -m vlmdoctor.documents"


def test_every_field_has_a_meaning():
    empty = [line for line in d.markdown_fields().splitlines() if line.startswith("| `") and line.endswith("|  |")]
    assert not empty, empty
