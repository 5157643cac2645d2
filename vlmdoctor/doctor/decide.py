"""Decide on paired evidence: is a candidate config faster than the current one, beyond the noise?

Why paired. On a shared host the speed of a whole process drifts with load: on the H100 the same
config measured 45,651 / 48,581 / 50,360 real tokens/s in three fresh processes, and on the 2-core
CI machine a same-config rerun came out 19% slower. A rule that compares one run of each config
against their within-run spread (what `treat` did before) reads that drift as a gain or a loss.
So both configs are measured in alternation, each in a fresh process, and what is judged is the
ratio candidate / current *within each pair* of runs taken next to each other: load that lasts
longer than a pair cancels out of it.

The statistic. For n pairs with ratios r_i, take l_i = log r_i and a Student-t interval on their
mean: exp(mean(l) +- t(n-1) * sd(l) / sqrt(n)). Log ratios, because the noise is multiplicative
(a loaded host slows everything by a factor) and a log ratio is symmetric (2x and 0.5x are
equally far from 1). A t-interval rather than a bootstrap, because a treatment affords 3-6 pairs:
a bootstrap over 3 pairs has 10 distinct resamples and its interval is far too narrow (it
cannot see beyond the spread of the pairs it has); the t-interval widens correctly for few
pairs (t(2) = 4.30 at 95%), which is what keeps a same-config pair from being "kept". At least
3 pairs (`min_pairs`): with 2, the sample sd is often tiny by luck.

The gate (`robust`): with 6 pairs or more, a pair far from the others (5 robust standard
deviations: a load burst during one of its runs) is set aside before the interval; the verdict
keeps every ratio, so that can be checked.

The decision, with the interval at `confidence` (two-sided 95% by default):
    kept     when  lower bound > 1 + min_gain, or every one of n >= `sign_pairs` pairs is above
                   1 + min_gain (the sign test: a 2 x 0.5^n chance with no gain, 3.1% at n = 6)
    harmful  when  upper bound < 1, or every one of n >= `sign_pairs` pairs is below 1
    no gain  when  upper bound < 1 + min_gain (it cannot pay what a config line costs)
    undecided otherwise: another pair is measured while `max_pairs` and the time allow.

Why the sign test beside the interval: one pair measured during a load burst (x2.4 among x1.14-1.31)
widens the t-interval until it reaches 1, while every pair still says "gain"; the sign test reads
only which side of the bar each pair is on, so one wild pair cannot hide a gain seen on all of them.
It can only start to decide at `sign_pairs` pairs, and "all n on one side" cannot become true later
once a pair fell on the other side, so its repeated looks add at most one test's error.

At the limit (no more pairs: `max_pairs` or the time), an interval that is still open is never
turned into "no gain": that would throw away a gain seen on every pair for want of time. It is
    likely_gain  when every pair (2 at least) is above 1 + min_gain (the sign test's side, on
                 fewer pairs than it needs to decide),
    likely_loss  when every pair is below 1,
    undecided    otherwise,
with the evidence kept (`p_sign`: the chance that every pair falls on that side with no effect,
0.5^n). "likely" is a decision under a budget, not a test at `confidence`: `treat` adopts a likely
gain, says so, and never calls it kept. Its rate under no effect is in tests/test_decide.py.

A large effect is decided on two pairs (`large_effect`): when both pair ratios are above 1.5 (or
both below 1/1.5), the third pair is skipped (the t-interval of two pairs, t(1) = 12.7, is
reported but too wide to decide a 2x change on its own). Compositions
and compiled configs move throughput 2-20x, and their runs are the slowest of a treatment (a
fresh compile each); the host's noise does not make two pairs in a row of one config differ by
half (tests/test_decide.py: the false-keep rate is unchanged under every noise model there).

Lanes (`interleaved(lanes=N)`): a round runs on N GPUs at once, one lane each, every lane's arms one
after another on its own GPU, so that a pair never pairs runs of two GPUs; a round of N lanes gives
N pairs in one round's time. The pair counts (`min_pairs`, `max_pairs`, the two-pair shortcut) count
pairs, not rounds.

The false-keep rate and the power under this host's noise are checked by simulation in
tests/test_decide.py; docs/treat.md ("How a change is decided") has the numbers.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

#: a report comes back from a run; its throughput is the median over its timed windows
Report = dict[str, Any]
Arm = Callable[[], Report]
#: below this gain (2%) a change is not worth a config line: `treat --min-gain`'s default
MIN_GAIN = 0.02
#: two-sided level of the interval on the paired ratio
CONFIDENCE = 0.95
#: the least evidence a decision is made on (two pairs' spread is often tiny by luck), for treat and the gate
MIN_PAIRS = 3


#: one pair beyond this factor, when the time allows no second, reads as a likely gain (or loss): the widest spread
#: between two pairs of one comparison measured here is 1.71x (qwen2-vl-2b's ten changes, x10.3 and x17.6, two
#: H200s, 2026-11-27), run-to-run noise of one config on one GPU 1-5%. On two H200s a qwen2-vl-2b treatment
#: measured its ten changes at x10.6 on one pair, had no time for a second, and ended at the start config
ONE_PAIR_X = 3.0
#: the pairs a large effect is decided on (`large_effect`); also the complete first pairs, already measured on as
#: many GPUs, that make a comparison's first round on their lanes alone (`interleaved`'s `lane_first`)
LARGE_EFFECT_PAIRS = 2


@dataclass
class PairedOptions:
    min_gain: float = MIN_GAIN
    confidence: float = CONFIDENCE
    min_pairs: int = MIN_PAIRS
    max_pairs: int = 10  # adaptive extra pairs stop here
    large_effect: float = 1.5  # two pairs both beyond this factor (either way) decide without a third
    one_pair: float = ONE_PAIR_X  # at the limit, one pair beyond this factor (either way) reads as a likely gain / loss
    sign: bool = True  # every one of `sign_pairs` pairs or more on one side decides too (the sign test)


# --- Student t quantile, without scipy --------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (Numerical Recipes, Lentz's method)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-12:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p (bisection on the CDF: slow-ish, exact, dependency-free)."""
    if not 0 < p < 1:
        raise ValueError("p must be in (0, 1)")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


# --- the interval and the verdict -------------------------------------------------------------

#: a pair farther than this many robust standard deviations (1.4826 x MAD) from the median pair is
#: taken as measured during a load burst and set aside (Iglewicz and Hoaglin suggest 3.5 for a
#: modified z-score; on 6-16 pairs the MAD is unsteady, and 3.5 set aside ordinary pairs too often)
OUTLIER_Z = 5.0
#: below this many pairs the median and MAD are too unsteady to call anything an outlier
MIN_PAIRS_FOR_OUTLIERS = 6


def outliers(ratios: Sequence[float]) -> list[int]:
    """Indices of pairs measured during a load burst: far from the others on a robust scale."""
    if len(ratios) < MIN_PAIRS_FOR_OUTLIERS:
        return []
    logs = [math.log(r) for r in ratios]
    med = statistics.median(logs)
    mad = 1.4826 * statistics.median(abs(x - med) for x in logs)
    if mad == 0:
        return []
    return [i for i, x in enumerate(logs) if abs(x - med) / mad > OUTLIER_Z]


def ratio_interval(
    ratios: Sequence[float], confidence: float = CONFIDENCE, robust: bool = False
) -> tuple[float, float, float]:
    """(geometric mean ratio, lower, upper): the t-interval on the mean log ratio, back in ratio units.

    `robust`: pairs that `outliers` names are left out first (a neighbour's job during one run
    moves one pair by 10-50%; kept, it widens the interval of the decision it touches). The gate
    uses it on the loaded CI host; treat does not (on few pairs it narrows the interval too often:
    1.0% false keeps instead of 0.3% in tests/test_decide.py's noise model)."""
    drop = set(outliers(ratios)) if robust else set()
    logs = [math.log(r) for i, r in enumerate(ratios) if i not in drop]
    n = len(logs)
    mean = statistics.fmean(logs)
    if n < 2:
        return math.exp(mean), 0.0, math.inf
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


#: the fewest pairs a "likely" lean at the limit is read from: one pair has no side to agree with
LEAN_MIN_PAIRS = 2


def sign_pairs(confidence: float) -> int:
    """The fewest pairs whose all lying on one side is evidence at `confidence` (two-sided sign test): 6 at 95%.

    With no effect each pair falls on either side with chance 1/2, so all n on one given side has chance
    0.5^n, and on either side 2 x 0.5^n; the least n with 2 x 0.5^n <= 1 - confidence."""
    return math.ceil(math.log2(2 / (1 - confidence)))


def lean(ratios: Sequence[float], min_gain: float) -> str:
    """likely_gain / likely_loss / undecided: which way every pair points when no more pairs will come."""
    if len(ratios) < LEAN_MIN_PAIRS:
        return "undecided"
    if all(r > 1 + min_gain for r in ratios):
        return "likely_gain"
    if all(r < 1 for r in ratios):
        return "likely_loss"
    return "undecided"


def verdict(
    ratios: Sequence[float],
    min_gain: float = MIN_GAIN,
    confidence: float = CONFIDENCE,
    final: bool = False,
    sign: bool = True,
) -> dict[str, Any]:
    """kept / harmful / no_gain / undecided, with the interval (or the sign test) that decided it.

    `final`: no more pairs will come, so an interval still open is read for its lean (likely_gain,
    likely_loss), never called no gain. `sign`: the sign test decides beside the interval."""
    ratio, lo, hi = ratio_interval(ratios, confidence)
    n = len(ratios)
    signed = sign and n >= sign_pairs(confidence)
    how = "t-interval"
    if lo > 1 + min_gain:
        outcome = "kept"
    elif signed and all(r > 1 + min_gain for r in ratios):
        outcome, how = "kept", f"sign test: all {n} pairs above x{1 + min_gain:g}"
    elif hi < 1:
        outcome = "harmful"
    elif signed and all(r < 1 for r in ratios):
        outcome, how = "harmful", f"sign test: all {n} pairs below x1"
    elif hi < 1 + min_gain:
        outcome = "no_gain"
    elif final:
        outcome = lean(ratios, min_gain)
        how = "every pair's side, at the limit" if outcome != "undecided" else how
    else:
        outcome = "undecided"
    return {
        "outcome": outcome,
        "ratio": ratio,
        "gain": ratio - 1,
        "ci_low": lo,
        "ci_high": hi,
        "pairs": n,
        "ratios": list(ratios),
        "confidence": confidence,
        "min_gain": min_gain,
        "how": how,
        "p_sign": 0.5**n,
    }


def pooled_log_sd(groups: Sequence[Sequence[float]]) -> tuple[float, int] | None:
    """The spread of one pair's log ratio, pooled over comparisons: (sd, degrees of freedom), None with none.

    Each comparison of n >= 2 pairs gives n - 1 degrees of freedom about its own mean (its effect is
    its own; the noise of a pair is the host's). Used where an arm has too few pairs to estimate its own
    spread (an ablation arm the time left at one pair): the assumption, said where it is used, is that
    the pairs of one treatment share one noise level."""
    ss, df = 0.0, 0
    for g in groups:
        if len(g) < 2:
            continue
        logs = [math.log(r) for r in g]
        m = statistics.fmean(logs)
        ss += sum((x - m) ** 2 for x in logs)
        df += len(logs) - 1
    return (math.sqrt(ss / df), df) if df else None


def pooled_verdict(
    ratios: Sequence[float], pooled: tuple[float, int], min_gain: float = MIN_GAIN, confidence: float = CONFIDENCE
) -> dict[str, Any]:
    """The verdict of a few pairs whose spread is the treatment's pooled one: exp(mean +- t(df) sd / sqrt(n)).

    Open intervals are read for their lean, as at the limit: no more pairs come for these arms."""
    sd, df = pooled
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = t_quantile(1 - (1 - confidence) / 2, df) * sd / math.sqrt(len(logs))
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    if lo > 1 + min_gain:
        outcome = "kept"
    elif hi < 1:
        outcome = "harmful"
    elif hi < 1 + min_gain:
        outcome = "no_gain"
    else:
        outcome = lean(ratios, min_gain)
    return {
        "outcome": outcome,
        "ratio": math.exp(mean),
        "gain": math.exp(mean) - 1,
        "ci_low": lo,
        "ci_high": hi,
        "pairs": len(ratios),
        "ratios": list(ratios),
        "confidence": confidence,
        "min_gain": min_gain,
        "how": f"sd pooled over the treatment's pairs ({df} degrees of freedom)",
        "p_sign": 0.5 ** len(ratios),
    }


def large_effect(ratios: Sequence[float], opts: PairedOptions) -> dict[str, Any] | None:
    """The verdict on two pairs when both show a large effect the same way, else None."""
    if len(ratios) < LARGE_EFFECT_PAIRS or opts.large_effect <= 1:
        return None
    if all(r > opts.large_effect for r in ratios):
        outcome = "kept"
    elif all(r < 1 / opts.large_effect for r in ratios):
        outcome = "harmful"
    else:
        return None
    return verdict(ratios, opts.min_gain, opts.confidence) | {
        "outcome": outcome,
        "why": f"both pairs beyond {opts.large_effect:g}x: a large effect, decided on two pairs",
    }


def _one_pair(r: float, opts: PairedOptions) -> dict[str, Any] | None:
    """A lone pair's lean at the limit: likely gain / loss beyond `opts.one_pair` (ONE_PAIR_X) either way, else None."""
    if opts.one_pair <= 1 or 1 / opts.one_pair <= r <= opts.one_pair:
        return None
    gain = r > opts.one_pair
    return {
        "outcome": "likely_gain" if gain else "likely_loss",
        "how": "one pair",
        "why": f"1 pair at x{r:.2f}, beyond {opts.one_pair:g}x {'up' if gain else 'down'}: no time for a second; "
        f"not shown",
    }


def throughput(report: Report) -> float | None:
    """A run's real tokens/s by the one estimator (run/throughput.py); None when the run did not finish cleanly."""
    if report.get("status") != "ok":
        return None
    from vlmdoctor.run.throughput import headline

    return headline(report)


def step_throughput(report: Report, cpu_time: bool = False) -> float | None:
    """Median real tokens/s over a run's timed steps; None when the run did not finish cleanly.

    On a shared CPU host a neighbour's burst slows a few steps of a run by 10-30x (measured on the
    2-core CI machine: 80 ms steps next to 2-13 s ones); the mean of a window moves with them, the
    median step does not. `cpu_time`: tokens per second of the process's CPU time (`step_cpu_ms`),
    what a single-threaded CPU run's work costs whatever share of the cores the neighbours leave it.
    Falls back to `throughput` for reports without per-step records."""
    if report.get("status") != "ok":
        return None
    from vlmdoctor.run.throughput import rate

    key = "step_cpu_ms" if cpu_time else "step_ms"
    pairs = [
        (tok, ms)
        for r in report.get("repeats") or []
        for tok, ms in zip(r.get("step_real_tokens") or [], r.get(key) or [])
        if ms and ms > 0
    ]
    if cpu_time and not pairs:
        return step_throughput(report)
    # the one estimator (the median of the per-step rates), over wall or CPU time
    return rate([t for t, _ in pairs], [m for _, m in pairs]) if pairs else throughput(report)


# --- the engine -------------------------------------------------------------------------------


@dataclass
class ArmResult:
    name: str
    reports: list[Report]
    values: list[float | None]
    failed: Report | None = None  # the first run that did not finish cleanly: the arm stops there
    lanes: list[int] = field(default_factory=list)  # the lane (GPU) of each report in `reports`, in order


def interleaved(
    arms: dict[str, Arm],
    reference: str,
    opts: PairedOptions,
    time_left: Callable[[], float] = lambda: math.inf,
    contribution: bool = False,
    first: dict[str, Report] | None = None,
    judge: Callable[[list[float], bool], dict[str, Any]] | None = None,
    notify: Callable[[str], None] = lambda _: None,
    on_round: Callable[[dict[str, ArmResult]], None] = lambda _: None,
    value: Callable[[Report], float | None] = throughput,
    reserve_s: float = 0.0,
    first_s: dict[str, float] | None = None,
    lanes: int = 1,
    lane_arms: Callable[[int], dict[str, Arm]] | None = None,
    new_run_s: float = 0.0,
    partial_pairs: bool = False,
    lane_first: dict[int, dict[str, Report]] | None = None,
) -> dict[str, Any]:
    """Measure the arms in rounds, each arm once per round, and decide each candidate against the reference.

    The order within a round rotates (A B, B A, A B ... for two arms; R A B, A B R, B R A for three) so
    that a steady drift of the host does not always favour the arm that runs second. A round's ratio is
    candidate / reference of that round. After `min_pairs` rounds, another round runs only while some
    candidate is undecided, `max_pairs` is not reached and the last round's wall time still fits in
    `time_left()`. With `contribution`, a candidate's ratio is reference / candidate: what the
    reference has that the candidate lacks (a leave-one-out ablation). `judge(ratios, final)`
    replaces the keep/harmful verdict (the gate judges slowdowns). `first` holds reports
    already measured for round 1 (the diagnosed run a treatment starts from). An arm whose run fails
    (OOM, crash, timeout) leaves the comparison with that outcome; when the reference fails, nothing
    can be decided. `on_round` sees the results after every round (treat uses it to keep what was
    measured on Ctrl-C). `value` reads a run's throughput from its report (None: the run failed); the
    gate takes the median step. `reserve_s`: seconds of `time_left()` kept for later work (treat's
    ablation), spent here only while some undecided candidate has shown a gain on every pair so far:
    that comparison is the one worth finishing. `first_s`: the seconds each `first` report took, so
    that the next round is sized from it.

    A candidate left with fewer than `min_pairs` pairs (2 at least) is read for its lean
    (`verdict`'s likely_gain / likely_loss) unless the caller judges; a pair never decides alone.

    `lanes`: a round runs on that many GPUs at once (threads), lane 0 with `arms`, lane g >= 1 with
    `lane_arms(g)` (the same arms, each run pinned to GPU g); each lane runs the round's arms one after
    another, its order rotated by its own offset, so a pair's two runs are taken on one GPU. Lane 0 reuses
    `first`; lane g >= 1 reuses `lane_first[g]` (runs already made on GPU g: `treat` makes them while it sizes the
    batch), each lane in the first round it runs. Where LARGE_EFFECT_PAIRS lanes or more hold a whole first pair
    that way, the first round is those lanes alone, at no cost (enough to decide a large effect); the other lanes
    join from the next round, with what they hold. A complete lane adds one pair to every arm it ran (in lane
    order); a lane cut by the time pairs nothing. `min_pairs`, `max_pairs` and the two-pair shortcut count
    pairs (the last round runs no more lanes than `max_pairs` leaves); the result's "rounds" counts rounds,
    "pairs" pairs, "lanes" the most lanes a round ran on. Ctrl-C stops every lane's run (`supervise.stop_all`).

    A run starts only where its expected time (its arm's last run, else `new_run_s`, else the mean of the
    arms' runs) still fits in `time_left()`: the budget is a limit on the runs' ends, not their starts
    (a 0.5b treatment on the H200 started an ablation arm with 30 s left and ran 55 s past its budget). With
    `partial_pairs`, a round cut short keeps the pairs it completed (each arm that ran after or beside the
    reference's run of that round); without, it pairs nothing.
    """
    if lanes > 1 and lane_arms is None:
        raise ValueError("interleaved: lanes > 1 needs lane_arms (each lane's arms, pinned to its GPU)")
    early = judge is None  # a large effect may be decided on two pairs (not by a caller's own judge)
    if judge is None:

        def judge(ratios: list[float], final: bool) -> dict[str, Any]:
            return verdict(ratios, opts.min_gain, opts.confidence, final, opts.sign)

    names = [reference, *[n for n in arms if n != reference]]
    res = {n: ArmResult(n, [], []) for n in names}
    # each arm's expected time for its next run (a `first` report's from what it took)
    next_s = {n: next_run_s(s, (first or {})[n]) for n, s in (first_s or {}).items() if n in (first or {})}
    rounds = pairs = widest = 0
    # each lane's runs made already, until the first round it runs
    held = {0: dict(first or {}), **{g: dict(r) for g, r in (lane_first or {}).items() if g and r}}
    decisions: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()  # the lanes' progress messages and next_s, one at a time
    arms_of, more = {0: arms}, lane_arms or (lambda _g: arms)
    on_round(res)  # the arms fill as runs end: what an interruption keeps of a first round too
    while True:
        live = [n for n in names if res[n].failed is None]
        undecided = [
            n for n in live if n != reference and decisions.get(n, {}).get("outcome", "undecided") == "undecided"
        ]
        if res[reference].failed is not None or not undecided:
            break
        # only the reference and the undecided arms run again
        order = [n for n in names if n == reference or n in undecided]
        known = statistics.fmean(next_s.values()) if next_s else 0.0  # an arm reused from `first` has no timing
        round_s = sum(next_s.get(n, known) for n in order)
        gaining = any(rounds and all(r > 1 for r in _ratios(res[n], res[reference], contribution)) for n in undecided)
        avail = time_left() - (0.0 if gaining else reserve_s)
        if pairs >= opts.max_pairs or time_left() <= 0 or (rounds > 0 and round_s > avail):
            break  # the time budget is a hard limit, also before min_pairs: then there is no decision
        width = min(lanes, opts.max_pairs - pairs)  # the last round measures no more pairs than max_pairs leaves
        ready = [g for g in range(lanes) if all(n in held.get(g, {}) for n in order)]  # a whole pair held: free
        chosen = ready[:width] if rounds == 0 and len(ready) >= LARGE_EFFECT_PAIRS else list(range(width))
        for g in chosen:
            if g not in arms_of:
                arms_of[g] = more(g)  # each lane's arms built once, pinned to its GPU
        plan = [_Lane(g, arms_of[g], _rotated(order, rounds + g), _held(held, g, order)) for g in chosen]
        say = _progress(notify, lock, rounds + 1)
        expect = _expected(next_s, new_run_s)
        complete = _round(plan, res, next_s, value, _Budget(time_left, expect, reference, partial_pairs), say, lock)
        if not any(complete):  # a round no lane completed pairs nothing: its runs are kept, not counted
            break
        rounds, pairs, widest = rounds + 1, pairs + sum(complete), max(widest, width)
        ref_ok = res[reference].failed is None
        for n in undecided:
            if res[n].failed is not None or not ref_ok:
                continue
            ratios = _ratios(res[n], res[reference], contribution)
            if pairs >= opts.min_pairs:
                decisions[n] = judge(ratios, False)
            else:
                decisions[n] = (large_effect(ratios, opts) if early else None) or {"outcome": "undecided"}
        with lock:
            on_round(res)
        if not all(complete):  # a lane was cut: the time ran out inside the round
            break
    out: dict[str, Any] = {"rounds": rounds, "pairs": pairs, "lanes": widest, "arms": res, "decisions": {}}
    for n in names[1:]:
        a = res[n]
        if a.failed is not None:
            out["decisions"][n] = {"outcome": a.failed.get("status") or "error"}
        elif res[reference].failed is not None:
            out["decisions"][n] = {"outcome": "reference_failed"}
        else:
            ratios = _ratios(a, res[reference], contribution)
            if decisions.get(n, {}).get("outcome", "undecided") != "undecided" and len(ratios) < opts.min_pairs:
                out["decisions"][n] = decisions[n]  # a large effect, decided on two pairs
            elif len(ratios) < opts.min_pairs:
                why = {"why": f"{len(ratios)} pair(s) measured before the time ran out"}
                if early and len(ratios) >= LEAN_MIN_PAIRS:  # too few to decide: read for its lean
                    out["decisions"][n] = verdict(ratios, opts.min_gain, opts.confidence, True, False) | why
                    if out["decisions"][n]["outcome"] not in ("likely_gain", "likely_loss"):
                        out["decisions"][n]["outcome"] = "undecided"  # never kept or dropped on so few
                elif early and len(ratios) == 1 and (one := _one_pair(ratios[0], opts)) is not None:
                    out["decisions"][n] = verdict(ratios, opts.min_gain, opts.confidence, True, False) | one
                else:
                    out["decisions"][n] = {"outcome": "undecided", "pairs": len(ratios), "ratios": ratios} | why
            else:
                out["decisions"][n] = judge(ratios, True)
    return out


# --- one round, on one lane or several at once ---------------------------------------------------------------


@dataclass
class _Lane:
    """One lane of a round: its GPU (`g`), its arms (pinned to that GPU), its order, the reports it reuses."""

    g: int
    arms: dict[str, Arm]
    order: list[str]
    reused: dict[str, Report]


def _held(held: dict[int, dict[str, Report]], g: int, order: list[str]) -> dict[str, Report]:
    """Lane g's runs made already of the arms in `order`, taken once: the first round the lane runs reuses them."""
    mine = held.pop(g, {})
    return {n: mine[n] for n in order if n in mine}


def _rotated(order: list[str], k: int) -> list[str]:
    """The order started at its k-th arm: round r of lane g starts at (r + g), so that a steady drift of the host
    does not always favour the arm that runs second, in a round or across the lanes of one round."""
    k %= len(order)
    return order[k:] + order[:k]


def _progress(
    notify: Callable[[str], None], lock: threading.Lock, round_: int
) -> Callable[[int], Callable[[str], None]]:
    """Each lane's progress message for round `round_`, one at a time; a lane past the first names its GPU."""

    def lane(g: int) -> Callable[[str], None]:
        tag = f" (GPU {g})" if g else ""

        def say(n: str) -> None:
            with lock:
                notify(f"round {round_}: {n}{tag}")

        return say

    return lane


#: a run a lane kept: (arm, report, seconds its next run should take: None for a reused report)
Kept = Callable[[str, Report, float | None], None]


@dataclass
class _Budget:
    """What a round's runs are started against: the time left, each arm's expected run, and what a cut round keeps."""

    time_left: Callable[[], float]
    expect: Callable[[str], float]
    reference: str
    partial: bool

    def fits(self, n: str) -> bool:
        left = self.time_left()
        return left > 0 and left >= self.expect(n)


def _expected(next_s: dict[str, float], new_run_s: float) -> Callable[[str], float]:
    """An arm's expected run: its last run's time, else `new_run_s`, else the mean of the timed arms (0: none)."""
    fallback = new_run_s or (statistics.fmean(next_s.values()) if next_s else 0.0)
    return lambda n: next_s.get(n, fallback)


def _run_lane(lane: _Lane, budget: _Budget, say: Callable[[str], None], keep: Kept, stop: threading.Event) -> bool:
    """The lane's order, one arm after another on its GPU; False when the round was cut: the next run would end past
    the budget, or the comparison was stopped (Ctrl-C), and no run starts after that."""
    for n in lane.order:
        reuse = n in lane.reused
        if stop.is_set() or (not reuse and not budget.fits(n)):
            return False
        say(n)
        t0 = time.time()
        rep = lane.reused[n] if reuse else lane.arms[n]()
        keep(n, rep, None if reuse else next_run_s(time.time() - t0, rep))
    return True


def _round(
    plan: list[_Lane],
    res: dict[str, ArmResult],
    next_s: dict[str, float],
    value: Callable[[Report], float | None],
    budget: _Budget,
    say: Callable[[int], Callable[[str], None]],
    lock: threading.Lock,
) -> list[bool]:
    """One round on every lane of `plan`; which lanes completed it. One lane runs here, its runs kept as they come
    (what Ctrl-C keeps); several run at once, one thread each, and are kept after every lane has finished, each
    complete lane's values appended to the arms in lane order, so that the arms' values stay paired lane by lane.
    A cut lane is settled (`_settle_cut`)."""
    if len(plan) == 1:
        return [_one_lane(plan[0], res, next_s, value, budget, say(0))]
    got, complete = _at_once(plan, next_s, value, budget, say, lock)
    for lane, runs, ok in zip(plan, got, complete):
        for n, rep, v in runs:
            _keep(res, lane.g, n, rep, v)
        if not ok:
            _settle_cut(res, lane, [(n, v) for n, _, v in runs], budget)
    return complete


def _keep(res: dict[str, ArmResult], g: int, n: str, rep: Report, v: float | None) -> None:
    """Arm n's run of lane g, kept: its report, lane and value; a run that failed (no value) ends the arm."""
    res[n].reports.append(rep)
    res[n].lanes.append(g)
    res[n].values.append(v)
    if v is None and res[n].failed is None:
        res[n].failed = rep


def _settle_cut(res: dict[str, ArmResult], lane: _Lane, ran: list[tuple[str, float | None]], budget: _Budget) -> None:
    """A lane's round cut short, its runs kept (`_keep`): with `budget.partial`, where the reference ran, its pairs
    stay and each arm of its order that did not run gets no value for the round (the arms stay aligned); else it
    pairs nothing: its values are taken back (a failed run's None stays: the arm has left)."""
    names = [n for n, _ in ran]
    if budget.partial and budget.reference in names:
        for n in lane.order:
            if n not in names:
                res[n].values.append(None)
        return
    for n, v in ran:
        if v is not None:
            res[n].values.pop()


def _one_lane(
    lane: _Lane,
    res: dict[str, ArmResult],
    next_s: dict[str, float],
    value: Callable[[Report], float | None],
    budget: _Budget,
    say: Callable[[str], None],
) -> bool:
    """The round on one lane, here: each run kept as it comes (what Ctrl-C keeps); a cut round settled
    (`_settle_cut`)."""
    ran: list[tuple[str, float | None]] = []

    def keep(n: str, rep: Report, took: float | None) -> None:
        if took is not None:
            next_s[n] = took
        v = value(rep)
        _keep(res, 0, n, rep, v)
        ran.append((n, v))

    ok = _run_lane(lane, budget, say, keep, threading.Event())
    if not ok:
        _settle_cut(res, lane, ran, budget)
    return ok


def _at_once(
    plan: list[_Lane],
    next_s: dict[str, float],
    value: Callable[[Report], float | None],
    budget: _Budget,
    say: Callable[[int], Callable[[str], None]],
    lock: threading.Lock,
) -> tuple[list[list[tuple[str, Report, float | None]]], list[bool]]:
    """The lanes of a round at once, one thread each (each run is a subprocess): each lane's runs (arm, report,
    value) in the order they ran, and whether the lane completed the round. On Ctrl-C (or a lane's error) no lane
    starts another run and every run in progress stops (`supervise.stop_all`), then it is raised again."""
    from vlmdoctor import supervise  # deferred: the engine needs only the standard library until lanes run

    stop = threading.Event()
    got: list[list[tuple[str, Report, float | None]]] = [[] for _ in plan]

    def run(i: int, lane: _Lane) -> bool:
        def keep(n: str, rep: Report, took: float | None) -> None:
            got[i].append((n, rep, value(rep)))
            if took is not None:
                with lock:
                    next_s[n] = took

        return _run_lane(lane, budget, say(lane.g), keep, stop)

    complete = supervise.at_once([partial(run, i, lane) for i, lane in enumerate(plan)], "compare-lane", stop)
    return got, complete


#: what a compiled run spends loading its graph from the treatment's compile cache (0.5b on the H100: 12-13 s)
CACHE_HIT_S = 15.0


def next_run_s(took_s: float, report: Report) -> float:
    """How long this arm's next run should take: this one's time, less the compilation a cache hit skips.

    The first compiled run of a config compiles for 100 s or more; the runs after it find the
    graph in the treatment's compile cache. Counting the first run's compile in every later round
    stopped a treatment with 73 s left that a 90 s round would have decided.
    """
    compile_s = (report.get("metrics") or {}).get("compile_s") or 0.0
    return max(took_s - max(0.0, compile_s - CACHE_HIT_S), 0.0)


def _ratios(arm: ArmResult, ref: ArmResult, contribution: bool = False) -> list[float]:
    """Per-round ratios, over the rounds where both ran cleanly."""
    return [(b / a if contribution else a / b) for a, b in zip(arm.values, ref.values) if a and b]
