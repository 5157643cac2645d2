"""The composed expected gain of treat's changes (treat_trials.composed_x): the shares of one traced step add, a
speedup without a share multiplies, and one committed treat result shows why."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vlmdoctor.doctor.gain import MAX_SAVED_SHARE
from vlmdoctor.doctor.treat import FAR_OFF
from vlmdoctor.doctor.treat_trials import composed_x

ROOT = Path(__file__).resolve().parents[1]


def _change(share=None, x=None, **gain) -> dict:
    return {"rule": "r", "expected_gain": {"share_of_step": share, "throughput_x": x, **gain}}


def test_shares_of_one_step_add():
    # two quarters of the step: half of it goes away, x2.0 (their product would say 1/0.75^2 = x1.78)
    assert composed_x([_change(0.25, 1 / 0.75), _change(0.25, 1 / 0.75)]) == pytest.approx(2.0)
    assert composed_x([_change(0.2, 1.25)]) == pytest.approx(1.25)  # one share: as its own estimate
    assert composed_x([_change(0.3, 1.43), _change(0.0, 1.0), _change(-0.1, 0.9)]) == pytest.approx(1 / 0.8)


def test_a_speedup_without_a_share_multiplies():
    assert composed_x([_change(None, 2.0), _change(0.5, 2.0)]) == pytest.approx(4.0)
    assert composed_x([_change(None, 2.0), _change(None, 1.5)]) == pytest.approx(3.0)
    assert composed_x([{"rule": "b", "expected_gain": {"throughput_x": 2.75}}]) == pytest.approx(2.75)


def test_the_saved_share_is_capped():
    assert MAX_SAVED_SHARE == 0.9
    shares = [_change(0.5, 2.0), _change(0.5, 2.0), _change(0.5, 2.0)]  # 1.5 of the step: estimated alone
    assert composed_x(shares) == pytest.approx(1 / (1 - MAX_SAVED_SHARE))
    assert composed_x([_change(None, 3.0), *shares]) == pytest.approx(3 / (1 - MAX_SAVED_SHARE))


def test_no_estimate_where_a_change_has_none():
    probe = {"rule": "batch-probe", "expected_gain": None}
    assert composed_x([_change(0.2, 1.25), probe]) is None
    assert composed_x([_change(0.2, 1.25), {"rule": "r"}]) is None
    assert composed_x([_change(0.2, 1.25), _change(None, None)]) is None
    assert composed_x([_change(0.2, 1.25), _change(None, 0.0)]) is None  # not a speedup
    assert composed_x([]) is None


@pytest.mark.parametrize("share", [True, False, None, "0.2", float("nan"), 1.0])
def test_a_share_that_is_not_one_is_left_for_the_speedup(share):
    # a bool, a string, NaN or the whole step is no share: the change's throughput_x counts instead
    assert composed_x([_change(share, 1.5), _change(0.5, 2.0)]) == pytest.approx(3.0)
    assert composed_x([_change(share, None)]) is None


def test_a_committed_composition_is_estimated_within_far_off():
    # 2026-11-27, 4xH200, qwen2-vl-2b: ten changes composed in round 1, measured x12.57 over the start
    doc = json.loads((ROOT / "bench/results/2026-11-27-4xh200-issue39/run_a/treat_0.json").read_text())
    changes = doc["ladder"][1]["changes"]
    assert len(changes) == 10 and all(c.get("expected_gain") for c in changes)
    measured = doc["trials"][0]["ratio"]
    assert doc["trials"][0]["kind"] == "composition" and measured == pytest.approx(12.57, abs=0.01)
    product = math.prod(c["expected_gain"]["throughput_x"] for c in changes)
    assert product == pytest.approx(doc["trials"][0]["expected_x"])  # what the result kept: x6.85
    assert not 1 / FAR_OFF <= measured / product <= FAR_OFF  # x1.83: far off
    composed = composed_x(changes)
    assert composed == pytest.approx(14.3, abs=0.05)
    assert 1 / FAR_OFF <= measured / composed <= FAR_OFF  # x0.88
