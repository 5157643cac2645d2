"""The paired decision engine on synthetic noise: false keeps, power, and the statistics under it.

The noise model is this host's, as measured: a run's throughput is the true value times
- lognormal jitter per process (sigma 2%: what is left between two fresh processes run back to back),
- a host speed that wanders from run to run (a random walk, 2% per run: over a treatment's 16 runs
  it spreads the same config over +-5-15%, as the H100 showed: 45,651 / 48,581 / 50,360, and the
  ladders' 29,085 vs 24,888 an hour apart),
- load bursts: 5% of runs slowed by 5-20% (a neighbour taking the host during one run).
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest

import vlmdoctor.doctor.decide as decide
from vlmdoctor.doctor.decide import (
    PairedOptions,
    interleaved,
    pooled_log_sd,
    pooled_verdict,
    ratio_interval,
    sign_pairs,
    t_quantile,
    verdict,
)


def host(
    rng: np.random.Generator,
    jitter: float = 0.02,
    walk: float = 0.02,
    burst_p: float = 0.05,
    burst: tuple[float, float] = (0.80, 0.95),
    trend: float = 0.0,
):
    """A measuring function: true tokens/s -> a report, with the host's state carried between runs."""
    state = {"level": 0.0, "runs": 0}

    def measure(true: float) -> dict:
        state["runs"] += 1
        state["level"] += rng.normal(0, walk) + trend
        v = true * math.exp(state["level"] + rng.normal(0, jitter))
        if rng.random() < burst_p:
            v *= rng.uniform(*burst)
        return {"status": "ok", "repeats": [{"real_tokens_per_s": v}]}

    return measure, state


def simulate(gain: float, trials: int, seed: int, opts: PairedOptions | None = None, **noise) -> dict[str, float]:
    opts = opts or PairedOptions()
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    runs = 0
    for _ in range(trials):
        m, state = host(rng, **noise)
        r = interleaved({"cur": lambda: m(1000.0), "cand": lambda: m(1000.0 * (1 + gain))}, "cur", opts)  # noqa: B023
        o = r["decisions"]["cand"]["outcome"]
        counts[o] = counts.get(o, 0) + 1
        runs += state["runs"]
    return {k: v / trials for k, v in counts.items()} | {"runs_per_decision": runs / trials}


def test_t_quantiles_match_the_tables():
    assert t_quantile(0.975, 1) == pytest.approx(12.706, abs=1e-3)
    assert t_quantile(0.975, 4) == pytest.approx(2.776, abs=1e-3)
    assert t_quantile(0.95, 10) == pytest.approx(1.812, abs=1e-3)
    assert t_quantile(0.025, 4) == pytest.approx(-2.776, abs=1e-3)


def test_interval_is_geometric_and_symmetric_in_log():
    ratio, lo, hi = ratio_interval([1.1, 1.2, 1.15])
    assert lo < ratio < hi and ratio == pytest.approx((1.1 * 1.2 * 1.15) ** (1 / 3))
    assert math.log(ratio) - math.log(lo) == pytest.approx(math.log(hi) - math.log(ratio))
    _, lo2, hi2 = ratio_interval([1 / 1.1, 1 / 1.2, 1 / 1.15])
    assert lo2 == pytest.approx(1 / hi) and hi2 == pytest.approx(1 / lo)


@pytest.mark.parametrize(
    "ratios,outcome",
    [
        ([1.30, 1.28, 1.33], "kept"),
        ([0.70, 0.72, 0.69], "harmful"),
        ([1.005, 0.995, 1.0], "no_gain"),  # the whole interval is under 1 + min_gain
        ([1.10, 0.95, 1.20], "undecided"),  # straddles the threshold: more pairs wanted
        ([1.30, 1.31], "kept"),  # two tight pairs of a large gain are enough
    ],
)
def test_verdict_classes(ratios, outcome):
    assert verdict(ratios, 0.02)["outcome"] == outcome
    # at the limit an open interval is never "no gain": [1.10, 0.95, 1.20] has a pair below 1, so no lean
    assert verdict(ratios, 0.02, final=True)["outcome"] == outcome


def test_sign_pairs_is_the_least_n_for_the_confidence():
    assert sign_pairs(0.95) == 6 and 2 * 0.5**6 <= 0.05 < 2 * 0.5**5
    assert sign_pairs(0.99) == 8


def test_one_wild_pair_does_not_hide_a_gain_seen_on_every_pair():
    """x1.14-1.31 on every pair and one load-burst pair at x2.4: the t-interval reaches 1, the sign test decides."""
    ratios = [1.16, 1.31, 1.14, 2.4, 1.2, 1.18]
    _, lo, _ = ratio_interval(ratios)
    assert lo < 1.02  # the interval alone would leave it open
    d = verdict(ratios)
    assert d["outcome"] == "kept" and d["how"].startswith("sign test: all 6 pairs")
    assert verdict(ratios, sign=False)["outcome"] == "undecided"
    assert verdict([1 / r for r in ratios])["outcome"] == "harmful"
    assert verdict(ratios[:5])["outcome"] == "undecided"  # five pairs: 2 x 0.5^5 = 6% > 5%


def test_at_the_limit_a_gain_on_every_pair_is_likely_not_no_gain():
    """The issue's batch round: "no_gain 1.20 [0.91-1.58]" at the pair limit while every pair showed a gain."""
    d = verdict([1.14, 1.31, 1.08], final=True)  # x1.17 [0.92-1.50]
    assert d["ci_low"] < 1 and d["outcome"] == "likely_gain" and d["p_sign"] == 0.125
    assert verdict([0.9, 0.8, 0.95], final=True)["outcome"] == "likely_loss"
    assert verdict([1.015, 1.01, 1.012], final=True)["outcome"] == "no_gain"  # shown under the bar: no gain
    assert verdict([1.3, 0.99, 1.25], final=True)["outcome"] == "undecided"  # a pair says otherwise


def test_a_comparison_the_time_cut_at_two_pairs_is_read_for_its_lean():
    arms = {"cur": lambda: {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}]}}
    vals = iter([114.0, 131.0])
    arms["cand"] = lambda: {"status": "ok", "repeats": [{"real_tokens_per_s": next(vals)}]}
    runs = []
    r = interleaved(
        {k: (lambda f=f: (runs.append(1), f())[1]) for k, f in arms.items()},
        "cur",
        PairedOptions(),
        time_left=lambda: 100.0 if len(runs) < 4 else -1.0,
    )
    d = r["decisions"]["cand"]
    assert d["outcome"] == "likely_gain" and d["pairs"] == 2 and "before the time ran out" in d["why"]


@pytest.mark.parametrize(
    "cand, outcome",
    [(1060.0, "likely_gain"), (310.0, "likely_gain"), (290.0, "undecided"), (34.0, "undecided"), (30.0, "likely_loss")],
)
def test_one_pair_the_time_allowed_reads_as_likely_only_beyond_one_pair_x(cand, outcome):
    """On two H200s qwen2-vl-2b's ten changes measured x10.6 on one pair and the treatment ended at its start
    config: "undecided (1 of 3 pairs)". One pair beyond ONE_PAIR_X (3x) either way leans; below, it decides nothing;
    a caller's own judge (the gate) never reads one pair."""
    arms, runs = {}, []
    for name, v in (("cur", 100.0), ("cand", cand)):
        arms[name] = lambda v=v: (runs.append(1), {"status": "ok", "repeats": [{"real_tokens_per_s": v}]})[1]
    r = interleaved(arms, "cur", PairedOptions(), time_left=lambda: 100.0 if len(runs) < 2 else -1.0)
    d = r["decisions"]["cand"]
    assert d["outcome"] == outcome and d["pairs"] == 1 and d["ratios"] == [pytest.approx(cand / 100.0)]
    if outcome != "undecided":
        assert d["how"] == "one pair" and "no time for a second" in d["why"]
    runs.clear()
    gate = interleaved(
        arms, "cur", PairedOptions(), time_left=lambda: 100.0 if len(runs) < 2 else -1.0, judge=lambda r, f: {}
    )
    assert gate["decisions"]["cand"]["outcome"] == "undecided"


def test_the_reserve_is_spent_only_on_a_comparison_that_gains_on_every_pair(monkeypatch):
    """450 s, 100 s of them reserved: after round 1 a round of two 100 s runs fits only in the reserve."""

    def run(values):
        it = iter(values)
        return lambda: {"status": "ok", "repeats": [{"real_tokens_per_s": next(it)}]}

    clock = {"t": 0.0}
    monkeypatch.setattr(decide, "time", types.SimpleNamespace(time=lambda: clock["t"]))

    def timed(f):
        def go():
            clock["t"] += 100.0
            return f()

        return go

    for cand, rounds in (([120.0, 125.0, 118.0], 2), ([90.0, 120.0, 118.0], 1)):
        clock["t"] = 0.0
        r = interleaved(
            {"cur": timed(run([100.0] * 3)), "cand": timed(run(cand))},
            "cur",
            PairedOptions(large_effect=0),
            time_left=lambda: 450.0 - clock["t"],
            reserve_s=100.0,
        )
        # after round 1 (200 s) 250 s are left, 150 outside the reserve: only a gaining comparison goes on
        assert r["rounds"] == rounds


def test_pooled_spread_gives_one_pair_an_interval():
    sd, df = pooled_log_sd([[1.1, 1.12, 1.08], [0.95, 0.97], [1.3]])
    assert df == 3 and 0 < sd < 0.03
    d = pooled_verdict([1.4], (sd, df))
    assert d["outcome"] == "kept" and d["ci_low"] > 1.2 and "pooled" in d["how"]
    assert pooled_verdict([1.01], (sd, df))["outcome"] == "undecided"
    assert pooled_log_sd([[1.2]]) is None


def test_a_same_config_at_the_limit_is_rarely_a_likely_gain():
    """The price of reading a lean: under this host's noise, a same-config comparison the limit cuts at two
    pairs is called a likely gain in 8% of cases, at three pairs in 3%; a true +20% is called kept or a
    likely gain in 95% or more. Measured: docs/treat.md ("At the limit")."""
    for pairs, same_limit, gain_floor in ((2, 0.12, 0.9), (3, 0.05, 0.9)):
        opts = PairedOptions(min_pairs=pairs, max_pairs=pairs, large_effect=0)
        same = simulate(0.0, 600, seed=21, opts=opts)
        real = simulate(0.2, 300, seed=22, opts=opts)
        assert same.get("likely_gain", 0) < same_limit and same.get("kept", 0) < 0.01, same
        assert real.get("likely_gain", 0) + real.get("kept", 0) > gain_floor, real


def test_same_config_is_kept_in_under_1_percent():
    r = simulate(0.0, 1500, seed=1)
    assert r.get("kept", 0) < 0.01, r


def test_a_true_10_percent_gain_is_found_in_95_percent():
    r = simulate(0.10, 1500, seed=2)
    assert r.get("kept", 0) >= 0.95, r
    assert r.get("harmful", 0) == 0


def test_a_true_10_percent_loss_is_never_kept_and_mostly_called_harmful():
    """The engine stops once the interval is under 1 + min_gain (no gain either way reverts it), so a
    loss is not always measured long enough to be called harmful."""
    r = simulate(-0.10, 600, seed=3)
    assert r.get("kept", 0) == 0 and r.get("harmful", 0) >= 0.75, r


@pytest.mark.parametrize(
    "noise,limit",
    [
        ({"jitter": 0.03}, 0.01),  # 3% per process: still under 1%
        ({"jitter": 0.02, "walk": 0.0, "trend": 0.02}, 0.01),  # a steady drift (thermal, a growing load)
        (
            {"jitter": 0.02, "burst_p": 0.15, "burst": (0.5, 0.9)},
            0.01,
        ),  # frequent heavy bursts (the 2-core CI machine)
        # 5% per process and a faster-wandering host: measured 3.7% false keeps (docs/treat.md); more
        # looks at a noisier mean. The bound here says how far it degrades, not that it meets 1%.
        ({"jitter": 0.05, "walk": 0.03}, 0.05),
    ],
)
def test_same_config_is_rarely_kept_under_harsher_noise(noise, limit):
    r = simulate(0.0, 600, seed=4, **noise)
    assert r.get("kept", 0) < limit, r


def test_a_large_gain_is_decided_with_the_least_pairs():
    """A composition that doubles the speed needs no extra pairs: with the two-pair shortcut off, 3 pairs, 6 runs."""
    r = simulate(1.0, 200, seed=5, opts=PairedOptions(large_effect=0))
    assert r["kept"] == 1.0 and r["runs_per_decision"] == 6


def test_a_failing_candidate_stops_and_says_why():
    ok = {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}]}
    calls = []

    def cand():
        calls.append(1)
        return {"status": "oom", "error": {"message": "CUDA out of memory"}}

    r = interleaved({"cur": lambda: ok, "cand": cand}, "cur", PairedOptions())
    assert r["decisions"]["cand"]["outcome"] == "oom" and len(calls) == 1 and r["rounds"] == 1


def counting_arm() -> tuple:
    """An arm that always measures 100 tokens/s, and the list its calls are counted in."""
    calls: list[int] = []

    def arm():
        calls.append(1)
        return {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}]}

    return arm, calls


def test_time_budget_stops_before_the_least_evidence_and_says_so():
    arm, calls = counting_arm()
    r = interleaved(
        {"cur": arm, "cand": arm}, "cur", PairedOptions(), time_left=lambda: 100.0 if len(calls) < 2 else -1.0
    )
    d = r["decisions"]["cand"]
    assert r["rounds"] == 1 and len(calls) == 2 and d["outcome"] == "undecided" and "time" in d["why"]


def test_no_run_starts_after_the_budget_and_a_cut_round_pairs_nothing():
    arm, calls = counting_arm()
    # two full rounds, then the budget runs out after the first run of round 3
    r = interleaved(
        {"cur": arm, "cand": arm}, "cur", PairedOptions(), time_left=lambda: 100.0 if len(calls) < 5 else -1.0
    )
    assert len(calls) == 5 and r["rounds"] == 2
    assert [len(a.values) for a in r["arms"].values()] == [2, 2]  # the cut round's run is not paired
    assert r["decisions"]["cand"]["pairs"] == 2


def test_contribution_reads_the_ratio_the_other_way():
    """Ablation: the reference is the full composition; a candidate lacks one change."""
    full = {"status": "ok", "repeats": [{"real_tokens_per_s": 130.0}]}
    minus = {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}]}
    r = interleaved({"full": lambda: full, "minus": lambda: minus}, "full", PairedOptions(), contribution=True)
    assert r["decisions"]["minus"]["outcome"] == "kept" and r["decisions"]["minus"]["ratio"] == pytest.approx(1.3)


def test_order_alternates_within_rounds():
    order = []
    ok = {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}]}
    arms = {n: (lambda n=n: (order.append(n), ok)[1]) for n in ("A", "B")}
    interleaved(arms, "A", PairedOptions(min_pairs=4, max_pairs=4, min_gain=-1.0))  # never decided early... forced 4
    assert order[:8] == ["A", "B", "B", "A", "A", "B", "B", "A"]


@pytest.mark.parametrize(
    "noise,early_limit",
    [
        ({}, 0),  # this host's model: never
        # frequent heavy bursts (one run in seven slowed to 0.5-0.9x): two bursts in a row on the
        # current side can fake a 1.5x pair twice; measured 2 in 600 (0.3%)
        ({"jitter": 0.02, "burst_p": 0.15, "burst": (0.5, 0.9)}, 0.01),
        ({"jitter": 0.05, "walk": 0.03}, 0),  # a noisy, wandering host
    ],
)
def test_the_two_pair_shortcut_keeps_false_keeps_under_1_percent(noise, early_limit):
    """Two pairs both beyond 1.5x: the shortcut must not turn host noise into keeps (the same seeds
    with the shortcut off give the false keeps the 3-pair rule has anyway)."""
    kept = {}
    for le in (1.5, 0):
        rng = np.random.default_rng(11)
        kept[le] = early = 0
        for _ in range(600):
            m, _state = host(rng, **noise)
            d = interleaved(
                {"cur": lambda: m(1000.0), "cand": lambda: m(1000.0)},  # noqa: B023 (run inside this iteration)
                "cur",
                PairedOptions(large_effect=le),
            )["decisions"]["cand"]
            kept[le] += d["outcome"] == "kept"
            early += d["outcome"] == "kept" and d["pairs"] == 2
        if le:
            assert early / 600 <= early_limit
    assert (kept[1.5] - kept[0]) / 600 <= early_limit


def test_a_large_gain_is_decided_on_two_pairs_and_a_small_one_is_not():
    assert simulate(1.0, 200, seed=6)["runs_per_decision"] == 4  # 2x: two pairs
    r = simulate(0.3, 200, seed=7)  # +30%: under the shortcut, three pairs or more
    assert r["kept"] > 0.95 and r["runs_per_decision"] >= 6
    bad = simulate(-0.6, 100, seed=8)  # 0.4x: harmful on two pairs
    assert bad["harmful"] == 1.0 and bad["runs_per_decision"] == 4


def test_the_next_round_is_sized_without_the_first_compile(monkeypatch):
    """A compiled arm's first run pays its compilation; later runs find the graph in the cache."""
    assert decide.next_run_s(140.0, {"metrics": {"compile_s": 100.0}}) == pytest.approx(
        140.0 - 100.0 + decide.CACHE_HIT_S
    )
    assert decide.next_run_s(40.0, {"metrics": {"compile_s": None}}) == 40.0
    assert decide.next_run_s(40.0, {"status": "oom"}) == 40.0
    clock = {"t": 0.0}
    monkeypatch.setattr(decide, "time", types.SimpleNamespace(time=lambda: clock["t"]))

    def arm(took: float, compile_s: float):
        runs = []

        def run():  # the first run compiles; the later ones load the graph from the cache
            c = compile_s if not runs else min(compile_s, 12.0)
            runs.append(1)
            clock["t"] += took - compile_s + c
            return {"status": "ok", "repeats": [{"real_tokens_per_s": 100.0}], "metrics": {"compile_s": c}}

        return run

    # 100 s left after round 1: a round of the 40 s reference and the candidate (140 s, 100 of them compiling) fits
    r = decide.interleaved(
        {"cur": arm(40.0, 0.0), "cand": arm(140.0, 100.0)},
        "cur",
        PairedOptions(min_pairs=2, max_pairs=2, large_effect=0),
        time_left=lambda: 280.0 - clock["t"],
    )
    assert r["rounds"] == 2
