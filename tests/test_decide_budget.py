"""`decide.interleaved` against a time budget: a run starts only where its expected time still fits (the budget
limits the runs' ends), and with `partial_pairs` a round cut short keeps the pairs it completed. Fake arms and a
fake clock: each run advances the clock by its arm's seconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vlmdoctor.doctor import decide
from vlmdoctor.doctor.decide import PairedOptions, interleaved


def ok(v: float) -> dict:
    return {"status": "ok", "repeats": [{"real_tokens_per_s": v}]}


class Clock:
    """A budget of `budget` seconds; arm n's run takes secs[n] and measures speed[n]."""

    def __init__(self, budget: float, secs: dict[str, float], speed: dict[str, float]) -> None:
        self.now, self.budget, self.secs, self.speed = 0.0, budget, secs, speed
        self.calls: list[str] = []

    def left(self) -> float:
        return self.budget - self.now

    def time(self) -> float:
        return self.now

    def arms(self) -> dict:
        def arm(n: str):
            def go() -> dict:
                self.calls.append(n)
                self.now += self.secs[n]
                return ok(self.speed[n])

            return go

        return {n: arm(n) for n in self.speed}


OPTS = PairedOptions(min_pairs=3, max_pairs=6, sign=False)


@pytest.fixture
def make_clock(monkeypatch):
    """The engine times its runs by the fake clock (each run's seconds are its arm's)."""

    def make(budget: float, secs: dict[str, float], speed: dict[str, float]) -> Clock:
        c = Clock(budget, secs, speed)
        monkeypatch.setattr(decide, "time", SimpleNamespace(time=c.time))
        return c

    return make


def test_a_run_whose_expected_time_does_not_fit_does_not_start(make_clock):
    """Round 1 reuses the reference's report; each arm takes 80 s, expected 80 s (new_run_s): with 200 s left two
    arms run and the third, which would end past the budget, does not start."""
    c = make_clock(200, {"R": 80, "A": 80, "B": 80, "C": 80}, {"R": 100.0, "A": 90.0, "B": 50.0, "C": 95.0})
    r = interleaved(
        c.arms(), "R", OPTS, c.left, contribution=True, first={"R": ok(100.0)}, new_run_s=80.0, partial_pairs=True
    )
    assert c.calls == ["A", "B"] and c.now <= c.budget
    # the cut round kept its pairs: each arm that ran beside the reference's run has one
    assert r["arms"]["A"].values == [90.0] and r["arms"]["B"].values == [50.0]
    assert r["arms"]["C"].values == [None]
    assert r["decisions"]["C"]["outcome"] == "undecided" and r["decisions"]["C"]["pairs"] == 0
    assert r["decisions"]["B"]["ratios"] == pytest.approx([2.0])


def test_without_partial_pairs_a_cut_round_pairs_nothing(make_clock):
    c = make_clock(200, {"R": 80, "A": 80, "B": 80, "C": 80}, {"R": 100.0, "A": 90.0, "B": 50.0, "C": 95.0})
    r = interleaved(c.arms(), "R", OPTS, c.left, contribution=True, first={"R": ok(100.0)}, new_run_s=80.0)
    assert c.calls == ["A", "B"]
    assert all(r["arms"][n].values == [] for n in "ABC") and r["pairs"] == 0


def test_an_unknown_run_time_starts_while_time_is_left(make_clock):
    """No estimate (no new_run_s, nothing timed): a run starts while any time is left, as before."""
    c = make_clock(100, {"R": 80, "A": 80}, {"R": 100.0, "A": 90.0})
    interleaved(c.arms(), "R", OPTS, c.left)
    assert c.calls == ["R", "A"]  # the second started with 20 s left: its time was not known before it ran


def test_a_later_round_keeps_its_pairs_where_the_reference_ran_first(make_clock):
    """A cut later round, with the reference first in its order, keeps the arms that ran after it."""
    c = make_clock(330, {"R": 50, "A": 50, "B": 100}, {"R": 100.0, "A": 90.0, "B": 80.0})
    r = interleaved(c.arms(), "R", OPTS, c.left, contribution=True, partial_pairs=True)
    # round 1: R A B (200 s); round 2 rotated: A B R, estimated 200 s > 130 left: not started
    assert c.calls == ["R", "A", "B"] and r["rounds"] == 1
    assert len(r["arms"]["A"].values) == len(r["arms"]["R"].values) == len(r["arms"]["B"].values)


def test_what_an_interruption_keeps_of_a_first_round(make_clock):
    """on_round sees the arms before the first round: a treatment interrupted in round 1 keeps the runs that ended."""
    seen: list[dict] = []
    c = make_clock(1000, {"R": 1, "A": 1}, {"R": 100.0, "A": 90.0})
    arms = c.arms()

    def boom() -> dict:
        raise KeyboardInterrupt

    arms["B"] = boom
    with pytest.raises(KeyboardInterrupt):
        interleaved(arms, "R", OPTS, c.left, on_round=seen.append)
    assert seen and seen[0]["R"].values == [100.0] and seen[0]["A"].values == [90.0]
