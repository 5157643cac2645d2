"""`decide.interleaved(lanes=N)`: a round's pairs measured on N GPUs at once, one lane each, with fake arms.

Each fake report says the lane (GPU) it ran on, so that a test can check that every pair pairs two runs of one
lane; a lane's speed differs from the others' (GPU 1 runs at half speed here), so a pair of runs of two lanes
would show in its ratio."""

from __future__ import annotations

import threading

import pytest

from vlmdoctor import supervise
from vlmdoctor.doctor.decide import PairedOptions, interleaved

#: each lane's speed factor: a ratio across lanes would be off by 2x
LANE_SPEED = {0: 1.0, 1: 0.5, 2: 0.8, 3: 1.25}


def ok(v: float, **extra) -> dict:
    return {"status": "ok", "repeats": [{"real_tokens_per_s": v}], **extra}


class Lanes:
    """Fake arms per lane: arm `n` on lane g measures speed[n] x LANE_SPEED[g] tokens/s and records the call (a list
    of speeds: the arm's k-th run on each lane measures the k-th, cycled)."""

    def __init__(self, speed: dict[str, float | list[float]], fail: dict[tuple[str, int], str] | None = None) -> None:
        self.speed, self.fail = speed, fail or {}
        self.lock = threading.Lock()
        self.calls: dict[int, list[str]] = {}
        self.hooks: dict[tuple[str, int], object] = {}  # (arm, lane) -> a function called before that arm runs

    def arm(self, n: str, g: int):
        def go() -> dict:
            with self.lock:
                self.calls.setdefault(g, []).append(n)
                k = len(self.calls[g])
                own = self.calls[g].count(n)
            hook = self.hooks.get((n, g))
            if hook is not None:
                hook(k)
            if (n, g) in self.fail:
                return {"status": self.fail[(n, g)], "error": {"message": "CUDA out of memory"}, "lane": g}
            speed = self.speed[n]
            v = speed[(own - 1) % len(speed)] if isinstance(speed, list) else speed
            return ok(v * LANE_SPEED[g], lane=g)

        return go

    def arms(self, g: int) -> dict:
        return {n: self.arm(n, g) for n in self.speed}


def paired_lanes(res: dict, ref: str, n: str) -> list[tuple[int, int]]:
    """The lanes of the two runs behind each of arm n's values, in order (reports and values run alike here)."""
    return [(a["lane"], b["lane"]) for a, b in zip(res["arms"][n].reports, res["arms"][ref].reports)]


def test_two_lanes_give_two_pairs_a_round_each_of_one_lane():
    f = Lanes({"R": 100.0, "A": 112.0})
    r = interleaved(f.arms(0), "R", PairedOptions(min_pairs=3, max_pairs=6, sign=False), lanes=2, lane_arms=f.arms)
    assert r["pairs"] == 2 * r["rounds"] and r["lanes"] == 2
    assert r["rounds"] == 2  # 4 pairs >= min_pairs after round 2: decided there
    d = r["decisions"]["A"]
    assert d["outcome"] == "kept" and d["pairs"] == 4
    assert d["ratios"] == pytest.approx([1.12] * 4)  # a pair across lanes would read 2.24 or 0.56
    assert paired_lanes(r, "R", "A") == [(0, 0), (1, 1), (0, 0), (1, 1)]  # lane order within a round
    # each lane's order rotates from its own offset: a drift does not always favour one arm
    assert f.calls[0] == ["R", "A", "A", "R"] and f.calls[1] == ["A", "R", "R", "A"]


def held(g: int, **speeds: float) -> dict:
    """Runs made already on lane g (treat's, while it sized the batch): arm -> report."""
    return {n: ok(v * LANE_SPEED[g], lane=g, held=True) for n, v in speeds.items()}


def test_lanes_holding_whole_first_pairs_make_a_free_first_round_the_others_join_later():
    """Lanes 0, 2 and 3 hold a whole first pair (made while the batch was sized) and lane 1 half of one: the first
    round is the three held pairs alone, with no run; a second round (min_pairs 4) runs every lane, lane 1 reusing
    the run it holds, and every pair is of one lane."""
    f = Lanes({"R": 100.0, "A": 300.0})
    first = held(0, R=100.0, A=300.0)
    lane_first = {2: held(2, R=100.0, A=300.0), 3: held(3, R=100.0, A=300.0), 1: held(1, A=300.0)}
    opts = PairedOptions(min_pairs=4, max_pairs=8, sign=False, large_effect=0)  # no two-pair shortcut
    r = interleaved(f.arms(0), "R", opts, first=first, lanes=4, lane_arms=f.arms, lane_first=lane_first)
    assert r["rounds"] == 2 and r["pairs"] == 7
    assert paired_lanes(r, "R", "A")[:3] == [(0, 0), (2, 2), (3, 3)]  # round 1: the held pairs, lane order
    assert sorted(paired_lanes(r, "R", "A")[3:]) == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert f.calls[1] == ["R"]  # lane 1 ran only the arm it did not hold
    assert all(len(f.calls[g]) == 2 for g in (0, 2, 3))  # their second round: both arms, fresh
    assert r["decisions"]["A"]["ratios"] == pytest.approx([3.0] * 7)


def test_one_held_pair_is_no_free_round_each_lane_runs_what_it_lacks():
    """Fewer than two whole held pairs decide nothing alone: the first round runs every lane, each running only the
    arms it does not hold (lane 1 holds the reference, lane 2 nothing)."""
    f = Lanes({"R": 100.0, "A": 300.0})
    r = interleaved(
        f.arms(0),
        "R",
        PairedOptions(max_pairs=3),
        first=held(0, R=100.0, A=300.0),
        lanes=3,
        lane_arms=f.arms,
        lane_first={1: held(1, R=100.0)},
    )
    assert r["rounds"] == 1 and r["pairs"] == 3
    assert 0 not in f.calls and f.calls[1] == ["A"] and sorted(f.calls[2]) == ["A", "R"]
    assert paired_lanes(r, "R", "A") == [(0, 0), (1, 1), (2, 2)]


def test_the_lanes_of_a_round_run_at_once():
    """Every lane's first run waits for the others' (a barrier): lanes run one after another would break it."""
    f = Lanes({"R": 100.0, "A": 130.0})
    barrier = threading.Barrier(3, timeout=10)
    for first_arm in (("R", 0), ("A", 1), ("R", 2)):  # the orders: R A, A R (rotated by one), R A
        f.hooks[first_arm] = lambda k: barrier.wait() if k == 1 else None
    r = interleaved(f.arms(0), "R", PairedOptions(max_pairs=3, large_effect=0), lanes=3, lane_arms=f.arms)
    assert r["rounds"] == 1 and r["pairs"] == 3 and r["decisions"]["A"]["outcome"] == "kept"


def test_lane_0_reuses_first_and_the_other_lanes_run_every_arm():
    f = Lanes({"R": 100.0, "A": 120.0})
    first = ok(100.0, lane=0, reused=True)
    said: list[str] = []
    r = interleaved(
        f.arms(0),
        "R",
        PairedOptions(max_pairs=2),
        first={"R": first},
        lanes=2,
        lane_arms=f.arms,
        notify=said.append,
    )
    assert r["rounds"] == 1 and r["pairs"] == 2
    assert f.calls[0] == ["A"] and f.calls[1] == ["A", "R"]  # lane 1: rotated by one
    assert r["arms"]["R"].reports[0] is first and paired_lanes(r, "R", "A") == [(0, 0), (1, 1)]
    assert sorted(said) == sorted(["round 1: R", "round 1: A", "round 1: A (GPU 1)", "round 1: R (GPU 1)"])


def test_a_large_effect_is_decided_in_one_round_of_two_lanes():
    """Two pairs beyond 1.5x decide: one round on two GPUs, where one GPU takes two rounds."""
    one, two = Lanes({"R": 100.0, "A": 200.0}), Lanes({"R": 100.0, "A": 200.0})
    r1 = interleaved(one.arms(0), "R", PairedOptions())
    r2 = interleaved(two.arms(0), "R", PairedOptions(), lanes=2, lane_arms=two.arms)
    assert r1["decisions"]["A"]["outcome"] == r2["decisions"]["A"]["outcome"] == "kept"
    assert (r1["rounds"], r1["pairs"]) == (2, 2) and (r2["rounds"], r2["pairs"]) == (1, 2)
    assert r2["decisions"]["A"]["ratios"] == pytest.approx([2.0, 2.0])
    assert len(two.calls[0]) == len(two.calls[1]) == 2


def test_the_last_round_runs_no_more_lanes_than_max_pairs_leaves():
    f = Lanes({"R": 100.0, "A": [110.0, 92.0, 105.0]})  # pairs 1.10 1.10 0.92 0.92 1.05: open to the end
    r = interleaved(f.arms(0), "R", PairedOptions(max_pairs=5, large_effect=0), lanes=2, lane_arms=f.arms)
    assert r["rounds"] == 3 and r["pairs"] == 5 and r["decisions"]["A"]["pairs"] == 5
    assert len(f.calls[0]) == 6 and len(f.calls[1]) == 4


def test_a_lane_the_time_cut_pairs_nothing():
    """Round 1: lane 0 completes; the budget runs out after lane 1's first run, so its round is cut."""
    f = Lanes({"R": 100.0, "A": 120.0})
    lane0_done, spent = threading.Event(), threading.Event()
    f.hooks[("A", 0)] = lambda k: lane0_done.set()  # lane 0's last run of round 1 (R then A)

    def lane1_first(k: int) -> None:
        assert lane0_done.wait(10)
        spent.set()

    f.hooks[("A", 1)] = lane1_first  # lane 1 starts with A
    r = interleaved(
        f.arms(0),
        "R",
        PairedOptions(),
        time_left=lambda: -1.0 if spent.is_set() else 100.0,
        lanes=2,
        lane_arms=f.arms,
    )
    assert f.calls == {0: ["R", "A"], 1: ["A"]}  # no run starts after the budget
    assert r["rounds"] == 1 and r["pairs"] == 1
    a, ref = r["arms"]["A"], r["arms"]["R"]
    assert len(a.reports) == 2 and len(a.values) == 1 and len(ref.values) == 1  # the cut lane's run: kept, unpaired
    assert [rep["lane"] for rep in a.reports] == [0, 1]
    d = r["decisions"]["A"]
    assert d["outcome"] == "undecided" and d["pairs"] == 1 and d["ratios"] == pytest.approx([1.2])


def test_an_arm_failing_on_lane_1_leaves_with_its_outcome_and_the_others_stay_paired():
    f = Lanes({"R": 100.0, "A": 130.0, "B": 112.0}, fail={("A", 1): "oom"})
    r = interleaved(f.arms(0), "R", PairedOptions(large_effect=0, sign=False), lanes=2, lane_arms=f.arms)
    assert r["decisions"]["A"]["outcome"] == "oom"
    assert f.calls[0].count("A") == 1 and f.calls[1].count("A") == 1  # round 1 only: then it left
    assert r["arms"]["A"].failed is not None and r["arms"]["A"].failed["lane"] == 1
    b = r["decisions"]["B"]
    assert b["outcome"] == "kept" and b["ratios"] == pytest.approx([1.12] * b["pairs"]) and b["pairs"] == 4
    assert paired_lanes(r, "R", "B") == [(0, 0), (1, 1), (0, 0), (1, 1)]


def test_the_reference_failing_on_one_lane_decides_nothing():
    f = Lanes({"R": 100.0, "A": 130.0}, fail={("R", 1): "oom"})
    r = interleaved(f.arms(0), "R", PairedOptions(), lanes=2, lane_arms=f.arms)
    assert r["decisions"]["A"]["outcome"] == "reference_failed" and r["rounds"] == 1


def test_ctrl_c_stops_every_lane_and_no_run_starts_after_it(monkeypatch):
    """A run of lane 1 interrupted (as `supervise.stop_all` interrupts a run in its thread): every lane stops,
    the runs in progress are stopped, and lane 0, still in its first run, starts no other."""
    stopped: list[int] = []
    called = threading.Event()

    def stop_all() -> None:
        stopped.append(1)
        called.set()

    monkeypatch.setattr(supervise, "stop_all", stop_all)
    f = Lanes({"R": 100.0, "A": 120.0})
    f.hooks[("R", 0)] = lambda k: called.wait(10)  # lane 0's first run lasts until the runs are stopped

    def interrupted(k: int) -> None:
        raise KeyboardInterrupt

    f.hooks[("A", 1)] = interrupted
    with pytest.raises(KeyboardInterrupt):
        interleaved(f.arms(0), "R", PairedOptions(), lanes=2, lane_arms=f.arms)
    assert stopped == [1] and f.calls == {0: ["R"], 1: ["A"]}


def test_several_lanes_need_their_arms():
    with pytest.raises(ValueError, match="lane_arms"):
        interleaved({"R": lambda: ok(1.0), "A": lambda: ok(1.0)}, "R", PairedOptions(), lanes=2)


# --- one lane: the calls of the engine before lanes, recorded from it ---------------------------------------------


def recorded(vals: dict[str, list[float | None]], first=None, opts=None, cut=None, **kw) -> dict:
    calls, said = [], []
    its = {n: iter(v) for n, v in vals.items()}

    def arm(n):
        def go():
            calls.append(n)
            v = next(its[n])
            return {"status": "oom"} if v is None else ok(v)

        return go

    tl = (lambda: 100.0 if len(calls) < cut else -1.0) if cut else (lambda: float("inf"))
    r = interleaved({n: arm(n) for n in vals}, "R", opts or PairedOptions(), tl, first=first, notify=said.append, **kw)
    return {
        "calls": calls,
        "said": said,
        "rounds": r["rounds"],
        "values": {n: a.values for n, a in r["arms"].items()},
        "outcomes": {n: d["outcome"] for n, d in r["decisions"].items()},
    }


@pytest.mark.parametrize("kw", [{}, {"lanes": 1}])
def test_one_lane_makes_the_calls_it_made_before(kw):
    """The sequences below were recorded from `interleaved` before lanes existed (2026-11-27)."""
    three = recorded(
        {"R": [100.0] * 20, "A": [110, 90, 105, 101, 99, 104, 100, 102, 98, 100], "B": [200.0] * 20},
        first={"R": ok(100.0)},
        **kw,
    )
    # round 1: R reused, then A B; round 2 rotated: A B R; B decided on two pairs (2x); then R A, A R, ...
    assert three["calls"] == ["A", "B", "A", "B", "R"] + ["R", "A", "A", "R"] * 4
    assert three["said"][:5] == ["round 1: R", "round 1: A", "round 1: B", "round 2: A", "round 2: B"]
    assert three["rounds"] == 10 and three["outcomes"] == {"A": "undecided", "B": "kept"}
    fail = recorded({"R": [100.0] * 20, "A": [120, None], "B": [105, 95, 103, 99, 104, 100, 101, 98, 102, 100]}, **kw)
    assert fail["calls"] == ["R", "A", "B", "A", "B", "R"] + ["R", "B", "B", "R"] * 4
    assert fail["rounds"] == 10 and fail["outcomes"] == {"A": "oom", "B": "undecided"}
    assert fail["values"]["A"] == [120, None]
    cut = recorded({"R": [100.0] * 20, "A": [120.0] * 20}, cut=5, **kw)
    assert cut["calls"] == ["R", "A", "A", "R", "R"] and cut["rounds"] == 2
    assert cut["values"] == {"R": [100.0, 100.0], "A": [120.0, 120.0]}
    most = recorded(
        {"R": [100.0] * 20, "A": [101, 99, 102, 98, 103, 97, 100, 100, 100, 100]}, opts=PairedOptions(max_pairs=5), **kw
    )
    assert most["calls"] == ["R", "A", "A", "R", "R", "A", "A", "R", "R", "A"] and most["rounds"] == 5


def test_each_report_records_its_lane():
    """`ArmResult.lanes`: the lane of each report, in order: 0 for every report on one lane (a reused `first` report
    too), the GPU of each lane's run on two lanes (treat keeps the adopted arm's last run on each GPU from it)."""
    f = Lanes({"R": 100.0, "A": 130.0})
    one = interleaved(f.arms(0), "R", PairedOptions(min_pairs=3, max_pairs=3), first={"R": ok(100.0, lane=0)})
    for a in one["arms"].values():
        assert a.lanes == [0] * len(a.reports) and len(a.reports) == 3
    f = Lanes({"R": 100.0, "A": 112.0})
    two = interleaved(f.arms(0), "R", PairedOptions(min_pairs=3, max_pairs=6), lanes=2, lane_arms=f.arms)
    for a in two["arms"].values():
        assert a.lanes == [r["lane"] for r in a.reports] == [0, 1, 0, 1]
