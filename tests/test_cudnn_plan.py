"""cuDNN re-planning attention for each new length, named from traces recorded on one H100 80GB without shapes.

paligemma_healthy_s2 (a user's plain loop, no record_shapes) pads each batch to its longest row, so every
step brings a new length and cuDNN builds new attention plans while the GPU waits; the fixtures that pad
to a multiple of 64, run the LLM's attention eagerly or in fp32 without autocast build none.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.trace.cudnn_plan import _outermost
from vlmdoctor.trace.facts import analyze, merge_measured

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RULES, PROBLEMS = load_rules()
CHURN, LAUNCH = "data-shape-churn", "fusion-compile-launch-bound"


@cache
def facts_of(name: str) -> dict:
    """A user trace's facts, or a vlmdoctor fixture's with its run report merged (what `profile` diagnoses)."""
    user = FIXTURES / "user_traces" / f"{name}.pt.trace.json.gz"
    if user.exists():
        return analyze(user)["files"][0]["facts"]
    own = FIXTURES / "traces" / f"{name}.pt.trace.json.gz"
    facts = analyze(own)["files"][0]["facts"]
    return merge_measured(facts, json.loads((FIXTURES / "traces" / f"{name}.report.json").read_text()))


def findings(facts: dict) -> dict[str, dict]:
    d = diagnose(facts, RULES, PROBLEMS)
    return {f["id"]: f for f in d["findings"] + d["superseded"]}


def test_the_fact_measures_plan_builds_without_shapes():
    f = facts_of("paligemma_healthy_s2")
    assert not f["trace.recorded.shapes"] and "shapes.distinct_token_batches" not in f
    assert f["cudnn_plan.long_calls"] >= 1 and f["cudnn_plan.calls"] > f["cudnn_plan.long_calls"]
    # most of the step's GPU idle time sits inside cuDNN attention calls
    assert f["cudnn_plan.idle_ms"] > 0.5 * f["gpu.idle_ms"]
    assert f["cudnn_plan.step_share"] == pytest.approx(f["cudnn_plan.idle_ms"] / f["step.ms"])
    assert f["cudnn_plan.idle_ms"] <= f["gpu.idle_ms"]


def test_churn_fires_on_a_plain_trace_with_evidence_and_a_measured_gain():
    f = facts_of("paligemma_healthy_s2")
    churn = findings(f)[CHURN]
    text = " ".join(churn["evidence"])
    assert f"{f['cudnn_plan.idle_ms']:.1f} ms per step" in text and f"{f['step.ms']:.1f} ms step" in text
    assert "record_shapes" in text  # the shapes it could not check are named, not silently assumed
    assert churn["expected_gain"]["saves_ms_per_step"] == pytest.approx(0.9 * f["cudnn_plan.idle_ms"])
    assert churn["config_patch"] == {"pad_to_multiple_of": 64}
    assert "FLASH_ATTENTION" in churn["fix"] and "--pad-to-multiple-of 64" in churn["fix"]


@pytest.mark.parametrize(
    "name",
    [
        "healthy_s2",  # vlmdoctor's run padded to a multiple of 64: two lengths, no plan built in the steps
        "treated_s2",
        "qwen25vl_fp32_s2",  # fp32 without autocast: SDPA does not run on cuDNN
        "paligemma_trainer_eager_s2",  # eager LLM attention; the tower's fixed-shape cuDNN calls reuse their plan
    ],
)
def test_churn_stays_silent_without_plan_builds(name):
    f = facts_of(name)
    assert f["cudnn_plan.long_calls"] == 0
    assert CHURN not in findings(f)
    bare = {k: v for k, v in f.items() if not k.startswith("config.")}  # silent from the measurement, not the knob
    assert CHURN not in findings(bare)


def test_churn_stays_silent_when_the_knob_is_set_or_shapes_show_one_length():
    f = facts_of("paligemma_healthy_s2")
    assert CHURN not in findings({**f, "config.pad_to_multiple_of": 64})
    assert CHURN not in findings({**f, "shapes.distinct_token_batches": 1, "shapes.token_batches": ["4x512"]})


def test_one_finding_where_shapes_were_recorded():
    f = facts_of("gemma3_healthy_s2")
    assert f["shapes.distinct_token_batches"] > 1
    churn = findings(f)[CHURN]
    assert "distinct token-batch shapes" in " ".join(churn["evidence"])
    assert not any("record_shapes" in line for line in churn["evidence"])
    assert sum(r.id == CHURN for r in RULES) == 1


def test_launch_bound_gain_leaves_the_planning_idle_out():
    f = facts_of("paligemma_healthy_s2")
    launch = next(r for r in RULES if r.id == LAUNCH)
    factor = launch.constants["COMPILE_ALONE_SPEEDUP"]["value"]
    gain = findings(f)[LAUNCH]["expected_gain"]["throughput_x"]
    plan, step = f["cudnn_plan.idle_ms"], f["step.ms"]
    assert gain == pytest.approx(step / (plan + (step - plan) / factor))
    assert gain < factor - 0.2  # most of the x1.48 claimed before was cuDNN planning
    # a step without planning keeps the whole factor (gemma3_eager_s2 plans 0.04 ms a step)
    assert findings(facts_of("gemma3_eager_s2"))[LAUNCH]["expected_gain"]["throughput_x"] == pytest.approx(
        factor, rel=1e-3
    )
    # an FP32 step whose kernels queue 4 ms is paced by the GPU: no launch-bound finding at all
    assert LAUNCH not in findings(facts_of("qwen25vl_fp32_s2"))


def test_a_wrapper_and_its_inner_op_are_one_call():
    ts = np.array([0.0, 1.0, 10.0, 10.0, 20.0])
    end = np.array([5.0, 4.0, 12.0, 11.0, 30.0])
    tid = np.array([1, 1, 1, 1, 2])
    assert _outermost(ts, end, tid).tolist() == [True, False, True, False, True]
