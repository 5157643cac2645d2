"""The one estimator of throughput, its spread, and the tests of a window's stability and warm-up.

Every way in (the runner, `Doctor`, `DoctorCallback`, `vlmdoctor run`) and every reader of a report
(console, HTML, `compare`, `gate`, `treat`) takes its tokens/s from here, so one run shows one number.

The estimator: the median of the per-step rates, each step's own amount (real tokens, loss tokens,
model FLOPs) over its own wall time. A step's tokens and its time belong together (batches of
different lengths do different work), and the median is not moved by a few slow steps (a neighbour's
job, a page fault, a checkpoint written by the loop): one 556 ms step among 33 ms ones changes it by
at most one rank. It is also the centre of the samples the gate's rank test compares.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

ESTIMATOR = "median of the per-step rates (each timed step's tokens over its own wall time)"
#: a step whose rate is below the median's by this factor (it took this many times longer for its work) is an outlier
OUTLIER_RATIO = 2.0
#: a window whose rates spread (p90 - p10) more than this share of the median is unstable (pyperf warns at a
#: standard deviation of 10% of the mean; p10-p90 of a normal spans 2.56 of them: 26%)
MAX_SPREAD = 0.25
#: fewer timed steps than this cannot show a spread
MIN_STEPS = 5
#: warm-up settled: the last SETTLE_STEPS warm-up steps' time per token within this factor of each other
SETTLE_RATIO = 1.3
SETTLE_STEPS = 3
#: a window still warming up: the median of its first third this much slower per token than its last third
TREND_RATIO = 1.2
ADVICE = (
    "measure more steps (--steps, or steps= in Doctor / DoctorCallback) on a quieter machine "
    "(nothing else running on it), and compare only stable windows"
)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rates(amounts: Sequence[float] | float, step_ms: Sequence[float]) -> list[float]:
    """Per-step rates, amount per second; a single amount is the same for every step."""
    per = [amounts] * len(step_ms) if isinstance(amounts, (int, float)) else list(amounts)
    return [a / (ms / 1e3) for a, ms in zip(per, step_ms) if ms > 0 and a is not None]


def rate(amounts: Sequence[float] | float | None, step_ms: Sequence[float]) -> float | None:
    """THE estimator: the median over steps of amount / step time (None when nothing was counted)."""
    if amounts is None:
        return None
    r = rates(amounts, step_ms)
    return statistics.median(r) if r and any(r) else None


def _work_times(step_ms: Sequence[float], work: Sequence[float] | None) -> list[float]:
    """Step times per unit of work, scaled to the mean step's work (raw times when the work is not known)."""
    if not work or len(work) != len(step_ms) or not all(w and w > 0 for w in work):
        return list(step_ms)
    mean = sum(work) / len(work)
    return [ms * mean / w for ms, w in zip(step_ms, work)]


def stability(step_ms: Sequence[float], work: Sequence[float] | None = None) -> dict[str, Any]:
    """Is the window steady enough to stand behind one number? (as pyperf and pytest-benchmark check)

    On the step times per unit of work (the step's tokens), so that batches of different lengths do
    not count as noise: unstable with any step over OUTLIER_RATIO x the median, or a p10-p90 spread
    over MAX_SPREAD of the median, or fewer than MIN_STEPS steps.
    """
    n = len(step_ms)
    out: dict[str, Any] = {"stable": True, "unstable_reason": None, "advice": None, "outliers": []}
    if n == 0:
        return out | {"stable": False, "unstable_reason": "no timed step", "advice": ADVICE}
    t = _work_times(step_ms, work)
    med = statistics.median(t)
    out["outliers"] = [
        {"step": i + 1, "ms": round(step_ms[i], 3), "x_median": round(x / med, 2)}
        for i, x in enumerate(t)
        if med > 0 and x > OUTLIER_RATIO * med
    ]
    spread = (percentile(t, 0.9) - percentile(t, 0.1)) / med if med > 0 else 0.0
    out["spread"] = spread
    reasons = []
    if n < MIN_STEPS:
        reasons.append(f"only {n} timed step(s): too few to show the spread")
    if out["outliers"]:
        worst = max(out["outliers"], key=lambda o: o["x_median"])
        reasons.append(
            f"{len(out['outliers'])} of {n} steps took over {OUTLIER_RATIO:g}x the median for their tokens "
            f"(slowest: timed step {worst['step']} of the window, {worst['ms']:,.1f} ms, {worst['x_median']:.1f}x)"
        )
    if spread > MAX_SPREAD:
        reasons.append(f"the steps spread widely: p10-p90 is {spread:.0%} of the median (over {MAX_SPREAD:.0%})")
    if reasons:
        out.update(stable=False, unstable_reason="; ".join(reasons), advice=ADVICE)
    return out


def unsettled(per_token: Sequence[float]) -> bool:
    """Warm-up not over: the last SETTLE_STEPS steps' time per token differ by more than SETTLE_RATIO.

    Compiled runs kept getting faster after the warm-up on the H100 (a run that found its graph in the
    compile cache timed windows of 9.8K, 19K and 50K tokens/s); autotuning, allocator growth and a
    first-epoch cache do the same on a smaller scale. Per token, so batches of different lengths agree.
    """
    last = list(per_token)[-SETTLE_STEPS:]
    return len(last) < SETTLE_STEPS or max(last) > SETTLE_RATIO * min(last)


def trend(step_ms: Sequence[float], work: Sequence[float] | None = None) -> dict[str, Any]:
    """A timed window that was still warming up: its first third markedly slower than its last third."""
    t = _work_times(step_ms, work)
    k = len(t) // 3
    if k < 2:
        return {"settled": None, "settle_note": f"{len(t)} timed step(s): too few to see a trend"}
    first, last = statistics.median(t[:k]), statistics.median(t[-k:])
    ratio = first / last if last > 0 else 1.0
    if ratio > TREND_RATIO:
        return {
            "settled": False,
            "first_third_x_last": ratio,
            "settle_note": (
                f"still warming up: the first {k} timed steps took {ratio:.2f}x the time per token of the "
                "last ones (compilation, autotuning, allocator growth or a first-epoch cache); "
                "raise the warm-up (--warmup, or warmup= in Doctor / DoctorCallback)"
            ),
        }
    return {"settled": True, "first_third_x_last": ratio, "settle_note": None}


def window_stats(
    step_ms: Sequence[float],
    real_tokens: Sequence[float] | None = None,
    loss_tokens: Sequence[float] | None = None,
    flops: Sequence[float] | float | None = None,
    peak: float | None = None,
) -> dict[str, Any]:
    """The estimator over one window (or pooled windows), its spread, and whether to trust it."""
    real = rates(real_tokens, step_ms) if real_tokens else []
    out: dict[str, Any] = {
        "estimator": ESTIMATOR,
        "n": len(step_ms),
        "step_ms": statistics.median(step_ms) if step_ms else None,
        "step_ms_p10": percentile(step_ms, 0.1) if step_ms else None,
        "step_ms_p90": percentile(step_ms, 0.9) if step_ms else None,
        "real_tokens_per_s": rate(real_tokens, step_ms) if real_tokens else None,
        "real_tokens_per_s_p10": percentile(real, 0.1) if real else None,
        "real_tokens_per_s_p90": percentile(real, 0.9) if real else None,
        "loss_tokens_per_s": rate(loss_tokens, step_ms) if loss_tokens else None,
        "tokens_per_step": sum(real_tokens) / len(real_tokens) if real_tokens else None,
    }
    fl = rate(flops, step_ms) if flops is not None else None
    out["model_tflops_per_s"] = fl / 1e12 if fl is not None else None
    out["mfu"] = fl / peak if fl is not None and peak else None
    work = list(real_tokens) if real_tokens and all(real_tokens) else None
    out.update(stability(step_ms, work))
    out.update(trend(step_ms, work))
    return out


def report_steps(report: dict[str, Any]) -> tuple[list[float], list[float] | None]:
    """Every timed step of a report (pooled over its windows) and its real tokens (None if not recorded)."""
    ms: list[float] = []
    tok: list[float] = []
    have_tokens = True
    for r in report.get("repeats") or []:
        s = r.get("step_ms")
        if not isinstance(s, list):
            return [], None
        ms += s
        t = r.get("step_real_tokens")
        if isinstance(t, list) and len(t) == len(s):
            tok += t
        else:
            have_tokens = False
    return ms, (tok if have_tokens and tok else None)


def headline(report: dict[str, Any]) -> float | None:
    """A report's real tokens/s by the estimator: recomputed from its timed steps where it holds them
    (reports written before the estimator took the window's tokens over its time), else its metric."""
    ms, tok = report_steps(report)
    if ms and tok and "distributed" not in report:
        return rate(tok, ms)
    if "distributed" not in report:  # no per-step records: the median over its windows, as those reports had it
        reps = [r["real_tokens_per_s"] for r in report.get("repeats") or [] if r.get("real_tokens_per_s")]
        if reps:
            return statistics.median(reps)
    return (report.get("metrics") or {}).get("real_tokens_per_s")


def spread_text(tp: dict[str, Any]) -> str:
    """'p10-p90 1,020-1,180, n=20' for the tokens/s row; '' when there is nothing to show."""
    lo, hi = tp.get("real_tokens_per_s_p10"), tp.get("real_tokens_per_s_p90")
    if lo is None or hi is None:
        return ""
    return f"p10-p90 {lo:,.0f}-{hi:,.0f}, n={tp.get('n')}"


#: a scaling efficiency above this is no result: N GPUs cannot do more than N times one GPU's work
IMPOSSIBLE_EFFICIENCY = 1.0


def scaling(
    global_tps: float,
    world: int,
    one_gpu_tps: float,
    source: str,
    unstable: dict[str, str | None] | None = None,
) -> dict[str, Any]:
    """Scaling efficiency: global tokens/s / (ranks x the same config's tokens/s on one GPU), with why it
    cannot be trusted when it cannot: above 100%, or from a window flagged unstable (`unstable`: each
    window's reason, by name)."""
    efficiency = global_tps / (world * one_gpu_tps)
    doubts = []
    if efficiency > IMPOSSIBLE_EFFICIENCY:
        doubts.append(
            f"{efficiency * 100:.0f}% is above 100%, which {world} GPUs cannot do: a measurement problem (the "
            "one-GPU reference ran slower than one rank of this job: a host-bound or unsettled reference window, "
            "or another config on one GPU)"
        )
    for name, why in (unstable or {}).items():
        if why:
            doubts.append(f"the {name} window is unstable ({why})")
    return {
        "one_gpu_real_tokens_per_s": one_gpu_tps,
        "world_size": world,
        "source": source,
        "speedup": global_tps / one_gpu_tps,
        "efficiency": efficiency,
        "trusted": not doubts,
        "doubts": doubts,
        "remedy": "re-measure both with longer windows (--steps, --repeats) on a config that is not host-bound"
        if doubts
        else None,
    }
