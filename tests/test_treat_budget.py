"""`treat`'s time budget as a limit on the runs' ends: a run's limit is the time left (none starts once it
is spent), and a run
the budget stopped is marked `budget` (not measured), never read as a config that times out. On CPU with the fake
runner of test_treat.py."""

from __future__ import annotations

import time

import pytest
from test_treat import BASE, FakeRunner, SizedRunner

from vlmdoctor.doctor.decide import ArmResult
from vlmdoctor.doctor.treat import TreatOptions, _Treatment, treat
from vlmdoctor.doctor.treat_ablation import NOT_ABLATED, _judge
from vlmdoctor.doctor.treat_trials import STOPPED_BY_BUDGET, outcome_of


class TimingOut(FakeRunner):
    """Every run reports a timeout; the limits it was given are kept."""

    def __init__(self) -> None:
        super().__init__()
        self.limits: list[float] = []

    def __call__(self, c, diagnose, timeout, device=None, **_):  # type: ignore[override]
        self.limits.append(timeout)
        return {"status": "timeout", "error": {"message": f"took longer than {timeout:.0f} s"}}


def treatment(runner: FakeRunner, budget: float | None, trial_timeout: float = 900.0) -> _Treatment:
    return _Treatment(
        BASE, runner, TreatOptions(time_budget_s=budget, trial_timeout_s=trial_timeout), lambda _: None, lambda c: None
    )


def test_a_run_near_the_end_of_the_budget_is_limited_to_it_and_marked_budget():
    runner = TimingOut()
    tr = treatment(runner, budget=100.0)
    tr.t0 = time.time() - 60  # 40 s left
    rep = tr.runner(BASE, False)()
    assert 38 <= runner.limits[0] <= 40  # the budget's end, not a second past it
    assert rep["status"] == STOPPED_BY_BUDGET
    assert outcome_of({"outcome": STOPPED_BY_BUDGET}, ArmResult("x", [rep], [None], rep)) == "undecided"


def test_no_run_starts_once_the_budget_is_spent():
    runner = TimingOut()
    tr = treatment(runner, budget=100.0)
    tr.t0 = time.time() - 101
    rep = tr.runner(BASE, False)()
    assert runner.limits == [] and rep["status"] == STOPPED_BY_BUDGET


def test_a_run_that_times_out_on_its_own_limit_stays_a_timeout():
    """Without a budget, or with the budget far away, the limit is --trial-timeout: a timeout is the config's."""
    for budget in (None, 10_000.0):
        runner = TimingOut()
        rep = treatment(runner, budget=budget, trial_timeout=120.0).runner(BASE, False)()
        assert runner.limits[0] == 120.0 and rep["status"] == "timeout"


def test_an_ablation_arm_the_budget_stopped_is_not_called_needed():
    """Before, the arm's timeout read as "kept: the run timed out without it" (BROKEN_WITHOUT)."""
    tr = treatment(FakeRunner(), budget=100.0)
    tr.out["trials"] = []
    change = {"rule": "r", "layer": 1, "title": "t", "config_patch": {}, "contribution": {"how": "x"}}
    stopped = {"status": STOPPED_BY_BUDGET}
    ab = {
        "decisions": {"without r": {"outcome": STOPPED_BY_BUDGET}},
        "arms": {"without r": ArmResult("without r", [stopped], [None], stopped)},
    }
    _judge(tr, change, ab, None)
    assert change["contribution"]["outcome"] == "undecided"
    assert "time budget stopped its run" in change["contribution"]["why"]


def _adopted(k: int) -> list[list[dict]]:
    return [[{"contribution": {"how": NOT_ABLATED}} for _ in range(k)]]


def test_the_budget_plan_counts_the_gpus_that_run_pairs_and_arms_at_once():
    """On one GPU a later round of one composition in 3 pairs takes 5 runs and the ablation of 10 changes 32 (more
    than its 25% share); on 4 GPUs the round takes one lane's 2 runs and each GPU ablates 3 changes (11 runs)."""
    plans = {}
    for gpus in (1, 4):
        tr = _Treatment(
            BASE, FakeRunner(), TreatOptions(time_budget_s=1000.0, trial_gpus=gpus), lambda _: None, lambda c: None
        )
        tr.run_s = [10.0]
        tr.adopted = _adopted(10)
        tr.t0 = time.time() - 500  # 500 s left
        comps = [{"changes": [{"expected_gain": {"throughput_x": 1.1}}]}]
        plans[gpus] = (tr.reserve(), tr._round_fits(comps))
    assert plans[1][0] == 250.0  # the share: 10 changes x 3 pairs + 2 at 10 s is 320 s
    assert plans[4][0] == pytest.approx(110.0)  # 3 arms x 3 pairs + 2 finals at 10 s
    assert plans[1][1] and plans[4][1]


def test_a_round_that_fits_only_in_lanes():
    """40 s left beside the reserve: a round of 5 runs of 10 s does not fit one GPU; on 4 GPUs it takes 2 runs' time."""
    fits = {}
    for gpus, left in ((1, 40.0), (4, 40.0)):
        tr = _Treatment(
            BASE, FakeRunner(), TreatOptions(time_budget_s=1000.0, trial_gpus=gpus), lambda _: None, lambda c: None
        )
        tr.run_s, tr.adopted = [10.0], _adopted(1)
        tr.t0 = time.time() - (1000 - left - tr.reserve())
        fits[gpus] = tr._round_fits([{"changes": [{"expected_gain": {"throughput_x": 1.1}}]}])
    assert fits == {1: False, 4: True}


@pytest.mark.parametrize("budget", [60, 80, 100, 130])
def test_no_run_starts_that_the_budget_would_stop(monkeypatch, budget):
    """Every run takes 25 s of a fake clock: none, sizing runs included, is given less (at 60 s a second sizing run
    started with 10 s left before: a run the budget stops measures nothing)."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    sized, limits = SizedRunner(clock), []

    def run(c, diagnose, timeout, **_):
        limits.append(timeout)
        return sized(c, diagnose, timeout)

    result = treat(BASE.replace(batch_size=4), run, TreatOptions(time_budget_s=budget), validate=lambda c: None)
    assert limits and min(limits) >= 25.0
    assert result["wall_s"] <= budget
