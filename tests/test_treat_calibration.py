"""The calibration table of docs/treat.md: each rule's expected gain beside what treat measured of it, generated
from the committed treat results (bench/treat_tables.py), and the reading of one treat result behind it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from vlmdoctor.documents import TreatResult, as_document

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("treat_tables", ROOT / "bench" / "treat_tables.py")
tables = importlib.util.module_from_spec(_spec)
sys.modules["treat_tables"] = tables  # its dataclasses look their module up there
_spec.loader.exec_module(tables)


def _doc(**fields) -> TreatResult:
    return as_document({"schema_version": 1, "kind": "treat", **fields}, TreatResult, "t.json")


def test_docs_calibration_table_is_the_committed_results():
    text = (ROOT / "docs" / "treat.md").read_text()
    assert tables.with_calibration(text) == text, "regenerate: python bench/treat_tables.py --calibration"


def test_a_change_measured_alone_and_a_composition_are_read_with_their_estimates():
    gain = {"expected_gain": {"throughput_x": 2.0}}
    doc = _doc(
        created_at="x",
        ladder=[
            {"step": 0},
            {"step": 1, "rule": "a, b", "changes": [{"rule": "a", **gain}, {"rule": "b", "expected_gain": None}]},
            {"step": 2, "rule": "c, d", "changes": [{"rule": "c", **gain}, {"rule": "d", **gain}]},
        ],
        trials=[
            {"trial": 1, "kind": "composition", "rule": "a, b", "ratio": 5.0},  # b has no estimate: none composed
            {"trial": 2, "kind": "composition", "rule": "c, d", "ratio": 3.0},
            {"trial": 3, "kind": "ablation", "rule": "c", "ratio": 1.5, **gain},
            {"trial": 4, "rule": "e", "gain": 0.3, "expected_gain": {"throughput_x": 1.1}},  # the first treat
            {"trial": 5, "kind": "composition", "rule": "f", "outcome": "oom", **gain},  # measured nothing
            {"trial": 6, "kind": "ablation", "rule": "g", "ratio": 1.2, "expected_x": 1.6},
        ],
    )
    rows = tables.measurements(doc, "here")
    assert [(r.rule, r.expected_x, r.measured_x, r.paired) for r in rows] == [
        ("composition", 4.0, 3.0, True),
        ("c", 2.0, 1.5, True),
        ("e", 1.1, pytest.approx(1.3), False),
        ("g", 1.6, 1.2, True),
    ]
    table = tables.calibration_table(rows)
    line = next(x for x in table.splitlines() if x.startswith("| `e`"))
    assert line.endswith("| 1.18 |  |") and "1 (1)" in line  # 1.3 / 1.1: within x1.25
    assert next(x for x in table.splitlines() if x.startswith("| here")).endswith("| 0.75 | far off |")


def test_every_committed_treatment_counts_once():
    rows = tables.committed()
    assert len(rows) >= 60
    dino = [r for r in rows if r.rule == "composition" and "dino-135m" in r.source]
    assert len(dino) == 1  # the same treat.json is committed twice under preset15b/call1
    side = [r for r in rows if r.rule == "composition" and r.source == "2026-11-27-4xh200-issue39/run_a"]
    assert len(side) == 3  # three treatments side by side, two of them started in the same second


def test_a_loader_estimate_from_before_grows_ms_is_counted_apart():
    """A result from before `gain.grows_ms` kept only the loader's mean wait: its estimate in the final config moved
    a stall per sample (x10 where x1.4 was measured). Its rows are counted apart from those the rule estimates as it
    reads now (the least step's wait moved), so the table says which estimate is off."""
    old = {"saves_ms_per_step": 100.0, "throughput_x": 1.25, "per": "sample"}
    new = old | {"grows_ms_per_step": 5.0}
    doc = _doc(
        created_at="x",
        start_config={"batch_size": 4},
        final_config={"batch_size": 128},
        ladder=[{"step": 0}, {"step": 1, "rule": "system-data-loader", "step_ms": 400.0}],
        trials=[
            {"trial": 1, "kind": "ablation", "rule": "system-data-loader", "ratio": 1.4, "expected_gain": old},
            {"trial": 2, "kind": "ablation", "rule": "system-data-loader", "ratio": 1.4, "expected_gain": new},
        ],
    )
    rows = tables.measurements(doc, "here")
    assert [(r.basis, r.expected_x) for r in rows] == [
        ("estimated before `gain.grows_ms`", pytest.approx(1 + 100 * 32 / 400)),
        ("", pytest.approx(1 + 5 * 32 / 400)),
    ]
    lines = tables.calibration_table(rows).splitlines()
    assert next(x for x in lines if x.startswith("| `system-data-loader` |")).endswith("| 1.00 |  |")
    assert next(x for x in lines if "before `gain.grows_ms`" in x).endswith("far off |")


def test_a_gpu_share_is_read_again_from_the_traced_run_of_an_older_result():
    """A result from before `per: gpu` kept the recompute's saving and its share of the traced step only: the table
    reads its share of the GPU's work again from the run whose traced step the estimate read (its profile) and moves
    it over the final config's GPU time (x1.02 of the start's step becomes x1.17 of a final step 97% busy)."""
    gain = {"saves_ms_per_step": 9.0, "share_of_step": 9.0 / 400.0, "throughput_x": 400 / 391}
    fields = dict(
        created_at="x",
        start_config={"batch_size": 4},
        final_config={"batch_size": 152},
        ladder=[
            {"step": 0, "profile": {"step.ms": 300.0, "gpu.busy_ms": 20.0}},
            {"step": 1, "rule": "system-checkpoint-recompute", "step_ms": 470.0, "profile": {"gpu.busy_frac": 0.97}},
        ],
        trials=[
            {
                "trial": 1,
                "kind": "ablation",
                "rule": "system-checkpoint-recompute",
                "ratio": 1.28,
                "expected_gain": gain,
            }
        ],
    )
    doc = _doc(**fields, start={"profile": {"step.ms": 400.0, "gpu.busy_ms": 60.0}})
    (row,) = tables.measurements(doc, "here")
    assert row.expected_x == pytest.approx(1 + 0.15 / 0.85 * 0.97) and row.basis == ""
    # where no traced run is the estimate's, nothing is moved: the start config's estimate stays
    (row,) = tables.measurements(_doc(**fields), "here")
    assert row.expected_x == pytest.approx(400 / 391)
