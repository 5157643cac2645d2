"""A scaling efficiency is a result only when it can be one: above 100%, or from an unstable window, it is
said to be a measurement problem, with the reason and the remedy, never printed as a number to believe."""

from __future__ import annotations

from rich.console import Console

from vlmdoctor.report.console import render_ranks
from vlmdoctor.run.throughput import scaling

#: recorded on two H200s of one host (2026-11-27): `profile --model 0.5b --stage 2 --weight-dtype bf16
#: --batch-size 16 --no-gradient-checkpointing --nproc-per-node 2 --parallel fsdp2 --measure-one-gpu`, both
#: windows flagged unstable (10 timed steps of a host-bound config)
JOB_TPS, ONE_GPU_TPS = 19_580.0, 6_406.0


def _printed(sc: dict) -> str:
    console = Console(record=True, width=80)
    d = {"world_size": 2, "parallel": "fsdp2", "backend": "nccl", "global": {"slowest_rank": 1}, "scaling": sc}
    d["ranks"] = [{"rank": 0, "step_ms": 100.0}, {"rank": 1, "step_ms": 110.0}]
    render_ranks(d, console)
    return console.export_text()


def test_an_impossible_efficiency_is_a_measurement_problem():
    sc = scaling(JOB_TPS, 2, ONE_GPU_TPS, "measured first", {"job's": "p10-p90 spread 38%", "reference's": None})
    assert not sc["trusted"] and sc["remedy"]
    assert "above 100%" in sc["doubts"][0] and "job's window is unstable" in sc["doubts"][1]
    text = _printed(sc)
    assert "scaling efficiency not measured" in text and "scaling efficiency 153%" not in text


def test_an_unstable_reference_is_doubted_even_below_100_percent():
    sc = scaling(10_000.0, 2, 6_000.0, "measured first", {"job's": None, "one-GPU reference's": "2 outliers"})
    assert not sc["trusted"] and "one-GPU reference's window is unstable (2 outliers)" in sc["doubts"][0]


def test_a_plausible_efficiency_from_stable_windows_is_a_result():
    sc = scaling(11_000.0, 2, 6_000.0, "measured first", {"job's": None, "one-GPU reference's": None})
    assert sc["trusted"] and sc["doubts"] == [] and sc["efficiency"] == 11_000 / 12_000
    assert "scaling efficiency 92%" in _printed(sc)
