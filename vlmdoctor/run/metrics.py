"""The one writer of a report's `metrics`, `stats` and `throughput` blocks, for every way in.

Every way in times windows of optimizer steps and hands them here, so that a number has one writer and one
meaning whoever measured it:

- vlmdoctor's own runs (runner.summarize): `repeats` windows of `steps` steps each, in one process;
- the user's loop (`Doctor`, `DoctorCallback`, `vlmdoctor run`: own/recorder.py): one window;
- a job of several ranks (own/rank_join.py for the user's, distributed.merge_ranks for vlmdoctor's own): the job's
  steps, per step the slowest rank's time and every rank's tokens and FLOPs (`joined`).

A window is a dict: the report's `repeats` entry, plus `losses` (the timed steps' losses) while in memory. Per
optimizer step it holds `step_ms`, `step_real_tokens`, `step_loss_tokens` and `step_flops` (None or absent: not
counted on every step); per window its own numbers (`window_numbers`), `steps`, and on a GPU `peak_mem_gb` and
`peak_mem_reserved_gb`. Tokens are per optimizer step: every micro-batch whose forward reaches a backward.
Forwards under no_grad (a stray evaluation inside the step) are not training: the own Recorder counts them apart
(`nograd_forwards_per_step`) and their tokens never reach a window; their time is in the step.

The estimator itself (the median of the per-step rates, its spread, its stability) is run/throughput.py's.
"""

from __future__ import annotations

import math
import resource
import statistics
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from vlmdoctor.run import throughput

#: the numbers each window has of its own (its `repeats` entry), by the estimator over its steps
RATES = ("real_tokens_per_s", "loss_tokens_per_s", "model_tflops_per_s", "mfu")
#: vlmdoctor's own runs: every window's numbers spread over the windows (`stats`)
SPREAD_OWN = ("real_tokens_per_s", "loss_tokens_per_s", "pad_fraction", "model_tflops_per_s", "mfu")
#: the user's loop: no spread of model TFLOP/s or MFU, whose FLOPs are not measured on the timed steps but
#: counted on the traced steps after them and carried to the timed ones (flopcount.per_step)
SPREAD_USER = ("real_tokens_per_s", "loss_tokens_per_s", "pad_fraction")
#: a job of the user's ranks: only the job's step times; a spread of rank 0's windows would pass for the job's
SPREAD_JOB: tuple[str, ...] = ()


class Blocks(NamedTuple):
    """A report's numbers of its timed windows."""

    metrics: dict[str, Any]
    stats: dict[str, dict[str, Any]]
    throughput: dict[str, Any]


def window_numbers(
    step_ms: Sequence[float],
    real: Sequence[float] | None,
    loss: Sequence[float] | None,
    padded: Sequence[float] | None,
    flops: Sequence[float] | None,
    peak: float | None,
) -> dict[str, float | None]:
    """One window's own numbers (its `repeats` entry): the estimator over its steps, and its pad fraction over its
    token totals. None where a count is missing: the user's FLOPs are counted on the traced steps, after the timed
    window, so the Recorder asks again once they are known."""
    est = throughput.window_stats(step_ms, real, loss, flops, peak)
    pad = 1.0 - sum(real) / sum(padded) if real is not None and padded and sum(padded) else None
    return {
        "real_tokens_per_s": est["real_tokens_per_s"],
        "loss_tokens_per_s": est["loss_tokens_per_s"],
        "pad_fraction": pad,
        "model_tflops_per_s": est["model_tflops_per_s"],
        "mfu": est["mfu"],
    }


def _summed(windows: Sequence[Mapping[str, Any]], key: str, n: int) -> list[float] | None:
    """Per step, the ranks' amounts summed; None when a rank did not count it."""
    cols = [w.get(key) for w in windows]
    if any(not isinstance(c, list) or len(c) < n for c in cols):
        return None
    return [sum(c[i] for c in cols) for i in range(n)]


def joined(ranks: Sequence[Mapping[str, Any]], peak: float | None = None) -> dict[str, Any]:
    """The ranks' windows of the same steps as the job's window: per step the slowest rank's time (every rank waits
    for it) and all ranks' tokens and FLOPs, over the steps every rank timed. `peak`: the job's (all ranks')."""
    n = min(len(w["step_ms"]) for w in ranks)
    step_ms = [max(float(w["step_ms"][i]) for w in ranks) for i in range(n)]
    amounts = {k: _summed(ranks, k, n) for k in ("step_real_tokens", "step_loss_tokens", "step_padded_tokens")}
    flops = _summed(ranks, "step_flops", n)
    real, loss, padded = amounts.values()
    return (
        {"steps": n, "step_ms": step_ms}
        | amounts
        | {"step_flops": flops}
        | window_numbers(step_ms, real, loss, padded, flops, peak)
    )


def pooled(windows: Sequence[Mapping[str, Any]], peak: float | None = None) -> dict[str, Any]:
    """The estimator over every timed step of the windows (the report's `throughput`). Tokens that are all zero
    were not counted (the user's model was not called with token ids): no rate, no spread of rates."""
    ms = [x for w in windows for x in w.get("step_ms") or []]

    def steps_of(key: str) -> list[float] | None:
        xs = [x for w in windows for x in w.get(key) or []]
        return xs if len(xs) == len(ms) else None

    real = steps_of("step_real_tokens")
    return throughput.window_stats(
        ms, real if real and any(real) else None, steps_of("step_loss_tokens"), steps_of("step_flops"), peak
    )


def spread(values: Sequence[float]) -> dict[str, float]:
    """A number's spread over the windows (or the steps)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def device_total_gb(device: Any) -> float | None:
    """The device's memory (None off a GPU)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch  # deferred: torch

    return torch.cuda.get_device_properties(device).total_memory / 2**30


def write(
    windows: Sequence[Mapping[str, Any]],
    *,
    peak: float | None,
    device_total_gb: float | None,
    spread_of: Sequence[str] = SPREAD_OWN,
    warmup: Mapping[str, float | None] | None = None,
    mfu_reason: str | None = None,
) -> Blocks:
    """THE writer: timed windows -> the report's `metrics`, `stats` and `throughput`.

    - `metrics`: the estimator over every timed step of the windows (`pooled`); the pad fraction is the median of
      the windows' (each over its token totals); FLOPs per step the mean over the steps; peak memory the largest
      window's; the final loss the last window's last.
    - `stats`: each number of `spread_of` spread over the windows, and the step times over every step. vlmdoctor's
      own runs time `repeats` windows of their own (SPREAD_OWN: how far one window's numbers move); the user's loop
      is timed once, its steps being the user's training, not vlmdoctor's to repeat (SPREAD_USER, n=1); a job's one
      window is the ranks' steps joined (SPREAD_JOB).
    - `peak`: the device's peak FLOP/s (a job: all ranks'), for the MFU. `warmup`: the warm-up's `warmup_s` and
      `compile_s` where the way in times the warm-up apart (vlmdoctor's own runs; the user's warm-up steps are the
      user's). `mfu_reason`: why there is no MFU, said where there is none.

    A window lacking a field (a rank's summary has no losses) gives None for what needs it.
    """
    est = pooled(windows, peak)
    m: dict[str, Any] = {k: est[k] for k in ("real_tokens_per_s", "loss_tokens_per_s", "model_tflops_per_s")}
    pads = [w.get("pad_fraction") for w in windows]
    m["pad_fraction"] = statistics.median(pads) if pads and None not in pads else None
    m["mfu"] = est["mfu"]
    flops = [x for w in windows for x in w.get("step_flops") or []]
    m["flops_per_step"] = sum(flops) / len(flops) if flops else None
    for k in ("step_ms", "step_ms_p10", "step_ms_p90"):
        m[k] = est[k]
    for k in ("peak_mem_gb", "peak_mem_reserved_gb"):
        mem = [w.get(k) for w in windows]
        m[k] = max(mem) if mem and None not in mem else None
    retries = [w.get("alloc_retries") for w in windows]
    m["alloc_retries"] = sum(retries) if retries and None not in retries else None
    m["device_mem_total_gb"] = device_total_gb
    m["host_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    losses = [x for w in windows for x in w.get("losses") or []]
    last = windows[-1].get("losses") if windows else None
    m["final_loss"] = last[-1] if last else None
    m["loss_finite"] = all(math.isfinite(x) for x in losses) if losses else None
    m["repeats"] = len(windows)
    m["steps_per_repeat"] = windows[0].get("steps") if windows else None
    if warmup is not None:
        m["warmup_s"], m["compile_s"] = warmup.get("warmup_s"), warmup.get("compile_s")
    if m["mfu"] is None and mfu_reason is not None:
        m["mfu_reason"] = mfu_reason

    stats: dict[str, dict[str, Any]] = {}
    for k in spread_of:
        values = [w.get(k) for w in windows]
        if values and None not in values:
            stats[k] = spread(values)
    steps = [x for w in windows for x in w.get("step_ms") or []]
    if steps:
        stats["step_ms"] = spread(steps) | {
            "p10": est["step_ms_p10"],
            "p90": est["step_ms_p90"],
            "n_repeats": len(windows),
        }
    return Blocks(m, stats, est)


def job_by_totals(ranks: Sequence[Mapping[str, Any]], headline: float | None, peak: float | None) -> dict[str, Any]:
    """vlmdoctor's own runs on several ranks (distributed.merge_ranks): the job's numbers besides its headline.

    Each rank sends its windows' totals of loss tokens and model FLOPs (distributed.rank_summary), not per step,
    so these follow the headline (the estimator over the job's steps, `joined`) in proportion: per window, all
    ranks' amount over the slowest rank's wall time, the median over windows, times headline / the same median of
    real tokens. MFU over all ranks' peak. The pad fraction: of all ranks' real tokens, over their padded tokens.
    """
    world = len(ranks)
    real: list[float] = []
    loss: list[float] = []
    tflops: list[float] = []
    mfu: list[float] = []
    for w in range(len(ranks[0]["windows"])):
        wall = max(r["windows"][w]["wall_s"] for r in ranks)
        fl = sum(r["windows"][w]["model_flops"] for r in ranks)
        real.append(sum(r["windows"][w]["real_tokens"] for r in ranks) / wall)
        loss.append(sum(r["windows"][w]["loss_tokens"] for r in ranks) / wall)
        tflops.append(fl / wall / 1e12)
        if peak:
            mfu.append(fl / wall / (peak * world))
    by_totals = statistics.median(real)
    scale = headline / by_totals if headline is not None and by_totals else 1.0
    padded = sum(r["real_tokens"] / (1.0 - r["pad_fraction"]) if r["pad_fraction"] < 1 else 0 for r in ranks)
    return {
        "real_tokens_per_s": headline,
        "loss_tokens_per_s": statistics.median(loss) * scale,
        "model_tflops_per_s": statistics.median(tflops) * scale,
        "mfu": statistics.median(mfu) * scale if mfu else None,
        "pad_fraction": 1.0 - sum(r["real_tokens"] for r in ranks) / padded,
    }
