"""`vlmdoctor gate`: fail CI when a change makes training slower, hungrier or sicker.

A ratio threshold alone would fail pull requests on noise, so throughput follows asv: the drop
must be both larger than `max_regression` and statistically distinguishable from run-to-run
noise. Memory growth and new high-severity findings fail on their own.

Numbers taken at another time on another load are not comparable on a shared machine: on the
project's 2-core CI host a same-config rerun was flagged -19% (p = 1e-13) and a real -11%
slowdown passed. With `--remeasure-baseline` the baseline config is measured again in the same
job, alternating with the current one in fresh processes, and judged on the paired engine of
`vlmdoctor.doctor.decide` (`paired_gate`): load that lasts longer than a pair cancels out.
"""

from __future__ import annotations

import copy
import math
import os
import re
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from typing import Any

from vlmdoctor.doctor.decide import MIN_PAIRS, PairedOptions, interleaved, outliers, ratio_interval, step_throughput
from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.doctor.select import mute_report
from vlmdoctor.doctor.settings import ALPHA, CPU_THREADS, FAIL_ON, MAX_MEMORY_GROWTH, MAX_PAIRS, MAX_REGRESSION
from vlmdoctor.documents import (
    MAX_DOCUMENT_BYTES,
    OWN_SOURCES,
    Env,
    Finding,
    RunReport,
    Script,
    as_document,
    as_report,
    check_measured,
)
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import read_json
from vlmdoctor.report.compare import (
    MODEL_KEYS,
    _differences,
    env_differences,
    model_differences,
    slowest_rank,
    world_size,
)
from vlmdoctor.report.text import plain
from vlmdoctor.run.config import RunConfig
from vlmdoctor.window import STEPS, WARMUP

#: severities, lowest first, so "at or above" is an index comparison
SEVERITY_ORDER = SEVERITIES[::-1]
#: below this many samples a side the Mann-Whitney normal approximation is too coarse
MIN_SAMPLES_FOR_TEST = 8


# --- loading ----------------------------------------------------------------------------------


def load_report(path: str) -> dict[str, Any]:
    """Read a profile report, refusing anything a comparison would silently misread.

    The report comes back whole, every key kept (`--update-baseline` writes back what it read); the gate reads
    it by field, through its declaration (vlmdoctor/documents/)."""

    return validate_report(read_json(path, "report", max_bytes=MAX_DOCUMENT_BYTES), path)


def validate_report(report: Any, name: str) -> dict[str, Any]:
    """The checks of load_report on a report already in memory (e.g. one just measured): its declaration, then
    what a verdict needs of its numbers (`documents.check_measured`)."""
    check_measured(as_document(report, RunReport, name), name)
    return report


def run_current(base: dict[str, Any], diagnose: bool = True, timeout: float | None = None) -> dict[str, Any]:
    """Re-measure the baseline's own config in a fresh process, so only the code under test differs."""
    from vlmdoctor.run.runner import run_isolated  # deferred: the runner imports torch

    source = as_report(base).knobs.source
    if source == "script":
        raise UsageError(
            "the baseline measures your own training script: pass --remeasure-baseline to run its recorded "
            "command again on both sides, alternating (docs/ci.md), or record the current run the same way "
            "and pass --current"
        )
    if source in OWN_SOURCES:
        raise UsageError(
            f"the baseline measures your own training (recorded by the {source} way in), which "
            "vlmdoctor cannot re-run by itself; record the current run the same way and pass --current"
        )
    cfg = RunConfig.from_dict(base["config"], source="baseline config")
    return validate_report(run_isolated(cfg, timeout=timeout, diagnose=diagnose), "current run")


# --- comparability ----------------------------------------------------------------------------

#: environment keys a regression gate compares across and names: an upgrade of torch, transformers,
#: liger-kernel, triton or the driver is exactly what a gate is for
NAMED_ENV_KEYS = ("driver", "torch", "transformers", "liger_kernel", "triton")
#: on a CPU run these are the hardware, as the GPU model is on a GPU run: refused unless allowed
CPU_HARDWARE_KEYS = ("cpu_model", "cpu_count")


def _as_asked(r: RunReport) -> dict[str, Any]:
    """A report's config as it was asked for. A window that waited for the time per token to settle ran more
    warm-up steps than asked and records them in `config.warmup`: that is the measurement's doing, not a knob
    that differs (same script, same flags: 3 asked, 5 run on one side)."""
    cfg = dict(r.config or {})
    if r.warmup is not None and r.warmup.asked is not None and "warmup" in cfg:
        cfg["warmup"] = r.warmup.asked
    return cfg


def check_comparable(base: dict[str, Any], cur: dict[str, Any], allow_env_change: bool = False) -> list[str]:
    """Refuse comparisons that would blame the code for a different model or GPU.

    Returns notes to show with the verdict: software that changed between the two (named, so a
    slowdown after a torch upgrade says so), config knobs that differ. Only a different GPU model
    is refused (unless `allow_env_change`): its speed is the hardware's, not the code's.
    """
    b, c = as_report(base, "baseline"), as_report(cur, "current")
    model = model_differences(b, c)
    if model:
        raise UsageError(
            "baseline and current measure different things ("
            + "; ".join(model)
            + "); a gate compares one model and stage with itself"
        )
    nb, nc = world_size(b), world_size(c)
    if nb != nc:
        raise UsageError(
            f"baseline ran on {nb} rank(s), current on {nc}: global tokens/s of different GPU counts "
            "differ by scaling, not by the code. Record the baseline with the same --nproc-per-node "
            "(and --nnodes); for scaling use `vlmdoctor compare` or profile --one-gpu-report"
        )
    be, ce = b.env or Env(), c.env or Env()
    gpu = [d for d in env_differences(b, c) if d.startswith("gpu:")]
    cpu: list[str] = []
    if not gpu and be.device_type == ce.device_type == "cpu":
        # on a CPU run the CPU is the hardware: its model and how many cores the run had
        cpu = [
            f"{k}: {getattr(be, k)!r} -> {getattr(ce, k)!r}"
            for k in CPU_HARDWARE_KEYS
            if getattr(be, k) is not None and getattr(ce, k) is not None and getattr(be, k) != getattr(ce, k)
        ]
    if gpu and not allow_env_change:
        raise UsageError(
            "baseline and current ran on different GPU models ("
            + "; ".join(gpu)
            + "); a speed change would be the hardware's. Re-record the baseline on this GPU, "
            "or pass --allow-env-change to compare anyway"
        )
    if cpu and not allow_env_change:
        raise UsageError(
            "baseline and current ran on different CPUs ("
            + "; ".join(cpu)
            + "); a speed change would be the hardware's. Re-record the baseline on this machine, "
            "or pass --allow-env-change to compare anyway"
        )
    soft = [
        f"{k}: {getattr(be, k)!r} -> {getattr(ce, k)!r}" for k in NAMED_ENV_KEYS if getattr(be, k) != getattr(ce, k)
    ]
    notes = [f"GPU changed (allowed): {d}" for d in gpu] + [f"CPU changed (allowed): {d}" for d in cpu]
    notes += [f"environment changed: {d}" for d in soft]
    if be.device_type == ce.device_type == "cpu" and (be.cpu_model is None) != (ce.cpu_model is None):
        notes.append(
            "the CPU model is recorded on one side only (a report from an older vlmdoctor): "
            "the hardware could not be checked"
        )
    kb, kc = _as_asked(b), _as_asked(c)
    knobs = sorted((set(kb) | set(kc)) - {*MODEL_KEYS, "stage"})
    notes += [f"config differs: {d}" for d in _differences(kb, kc, knobs)]
    return notes


# --- the paired gate: baseline re-measured in the same job ------------------------------------

#: two-sided level of the interval whose lower bound above 1 - max_regression passes
CONFIDENCE = 0.98
#: two-sided level of the interval whose upper bound must be below 1 for "slower". The gate looks
#: after every pair from the 3rd to the 16th, and each look is a chance of a false alarm: at 98% a
#: look (1% one-sided) the same config failed 1.0-1.7% of gates on the measured noise of the CI host
#: (tests/test_gate.py), at 99.5% 0.4%, while 10% slowdowns were still caught in 99.8%
SLOWER_CONFIDENCE = 0.995
#: the same level on the looks past `max_pairs`. The extension is entered only when the ratio at
#: `max_pairs` is already below 1 - max_regression, which a same config does in 0.4% of simulated
#: gates: that bounds what the extra looks can add to the false alarms (added: none measurable in
#: 5,000 simulated gates), and 99.8% a look (0.1% one-sided) keeps each extra look cheaper still
EXTENDED_CONFIDENCE = 0.998


def slowdown_verdict(
    ratios: Sequence[float],
    max_regression: float = MAX_REGRESSION,
    confidence: float = CONFIDENCE,
    final: bool = False,
    slower_confidence: float = SLOWER_CONFIDENCE,
    max_pairs: int | None = None,
    extended_confidence: float = EXTENDED_CONFIDENCE,
) -> dict[str, Any]:
    """current / baseline ratios of paired runs -> slower / pass / undecided.

    slower   when the upper bound of the `slower_confidence` interval is below 1 (beyond the
             noise, also after up to 14 looks) and both the ratio and the median pair are below
             1 - max_regression (large enough to matter, and not the doing of one or two pairs);
    pass     when the lower bound of the `confidence` interval is above 1 - max_regression (any
             slowdown is within the allowed),
             or `max_pairs` pairs were measured and their ratio is not below 1 - max_regression
             (nothing points to a slowdown), or no more pairs will come (not shown beyond the noise);
    undecided otherwise: another pair.

    Past `max_pairs` (the extension, entered only by a ratio below 1 - max_regression) the slower
    bound is at `extended_confidence`: every extra pair is one more look.
    """
    ratio, lo, hi = ratio_interval(ratios, confidence, robust=True)
    extended = max_pairs is not None and len(ratios) > max_pairs
    level = max(confidence, slower_confidence, extended_confidence if extended else 0.0)
    strict_hi = ratio_interval(ratios, level, robust=True)[2]
    median = statistics.median(ratios)
    if strict_hi < 1 and ratio < 1 - max_regression and median < 1 - max_regression:
        outcome = "slower"
    elif lo > 1 - max_regression or final:
        outcome = "pass"
    elif max_pairs is not None and len(ratios) >= max_pairs and ratio >= 1 - max_regression:
        outcome = "pass"
    else:
        outcome = "undecided"
    return {
        "outcome": outcome,
        "ratio": ratio,
        "median_ratio": median,
        "ci_low": lo,
        "ci_high": hi,
        "slower_ci_high": strict_hi,
        "pairs": len(ratios),
        "ratios": list(ratios),
        "set_aside": outliers(ratios),
        "confidence": confidence,
        "slower_confidence": level,
        "extended": extended,
    }


def paired_gate(
    run_baseline: Any,
    run_current: Any,
    max_regression: float = MAX_REGRESSION,
    confidence: float = CONFIDENCE,
    min_pairs: int = MIN_PAIRS,
    max_pairs: int = MAX_PAIRS,
    max_memory_growth: float = MAX_MEMORY_GROWTH,
    fail_on: str = FAIL_ON,
    allow_env_change: bool = False,
    notify: Any = lambda _: None,
    cpu_time: bool = False,
    extend_pairs: int | None = None,
    selection: Any = None,
) -> dict[str, Any]:
    """Measure baseline and current alternately (B C, C B, ...), each run a fresh process, and judge
    the throughput on the paired ratios; memory and findings on the last clean run of each side.
    A run's value is its median step's real tokens/s, over CPU time with `cpu_time`.

    The sequential extension: a gate still undecided at `max_pairs` whose ratio is below
    1 - max_regression (pointing to a slowdown the interval cannot yet confirm) measures on, up to
    `extend_pairs` pairs (default 2 x max_pairs; max_pairs or less: no extension). On the CI host's
    noise it catches 99.3% of 10% slowdowns instead of 96.1%, at the same false alarms
    (tests/test_gate.py); a gate not pointing to a slowdown still passes at `max_pairs`."""
    cap = max(max_pairs, 2 * max_pairs if extend_pairs is None else extend_pairs)
    opts = PairedOptions(min_gain=0.0, confidence=confidence, min_pairs=min_pairs, max_pairs=cap)
    res = interleaved(
        {"baseline": run_baseline, "current": run_current},
        "baseline",
        opts,
        notify=notify,
        judge=lambda r, final: slowdown_verdict(r, max_regression, confidence, final, max_pairs=max_pairs),
        value=lambda rep: step_throughput(rep, cpu_time),
    )
    arms = res["arms"]
    for side in ("baseline", "current"):
        if arms[side].failed is not None:
            rep = arms[side].failed
            raise UsageError(
                f"the {side} run did not finish cleanly (status {rep.get('status')}: "
                f"{(rep.get('error') or {}).get('message', '')[:300]}); nothing to compare"
            )
    base = validate_report(arms["baseline"].reports[-1], "baseline run")
    cur = validate_report(arms["current"].reports[-1], "current run")
    notes = check_comparable(base, cur, allow_env_change)
    d = res["decisions"]["current"]
    mb = statistics.median(v for v in arms["baseline"].values if v)
    mc = statistics.median(v for v in arms["current"].values if v)
    slower = d["outcome"] == "slower"
    interval = f"x{d['ratio']:.3f} [{d['ci_low']:.3f}-{d['ci_high']:.3f}] over {d['pairs']} pairs"
    numbers = f"{mb:,.0f} -> {mc:,.0f} real tokens/s ({(d['ratio'] - 1) * 100:+.1f}% paired, {interval})"
    if slower:
        detail = (
            f"{numbers}: slower than the {max_regression:.0%} allowed and beyond noise "
            f"({d['slower_confidence']:.1%} upper bound x{d['slower_ci_high']:.3f})"
        )
    elif d["ci_low"] > 1 - max_regression:
        detail = f"{numbers}: within the {max_regression:.0%} allowed"
    else:
        detail = f"{numbers}: not shown to be slower beyond the noise after {d['pairs']} pairs"
    if d.get("extended"):
        detail += f" (measured past --max-pairs {max_pairs}: the ratio pointed to a slowdown)"
    throughput = {
        "name": "throughput",
        "passed": not slower,
        "verdict": "fail" if slower else "pass",
        "detail": detail,
        "base_median": mb,
        "cur_median": mc,
        "ratio": d["ratio"],
        "median_ratio": d.get("median_ratio"),
        "ci_low": d["ci_low"],
        "ci_high": d["ci_high"],
        "slower_ci_high": d.get("slower_ci_high"),
        "slower_confidence": d.get("slower_confidence"),
        "pairs": d["pairs"],
        "ratios": d["ratios"],
        "max_pairs": max_pairs,
        "extend_pairs": cap,
        "extended": bool(d.get("extended")),
        "n_base": len(arms["baseline"].values),
        "n_cur": len(arms["current"].values),
        "base_values": arms["baseline"].values,
        "cur_values": arms["current"].values,
        "method": "paired-t on log ratios, fresh processes alternating",
        "samples": "per-run median step" + (" (CPU time)" if cpu_time else ""),
        "max_regression": max_regression,
        "confidence": confidence,
        "p": None,
        "significant": slower,
    }
    checks = [throughput, check_memory(base, cur, max_memory_growth), check_findings(base, cur, fail_on, selection)]
    failed = [c for c in checks if not c["passed"]]
    summary = (
        ("FAILED: " + "; ".join(f"{c['name']}: {c['detail']}" for c in failed))
        if failed
        else "PASSED: " + throughput["detail"]
    )
    knobs = as_report(base).knobs
    return {
        "passed": not failed,
        "checks": checks,
        "summary": summary,
        "notes": notes,
        "model": knobs.model,
        "stage": knobs.stage,
        "remeasured": True,
        "reports": {"baseline": arms["baseline"].reports, "current": arms["current"].reports},
    }


#: the variables that set torch's CPU intra-op threads in a fresh process
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def on_cpu(report: dict[str, Any]) -> bool:
    """The report's runs are on the CPU (its config says so, or an `auto` run found no GPU)."""
    r = as_report(report)
    device = r.knobs.device
    return device == "cpu" or (device in (None, "auto") and r.env is not None and r.env.device_type == "cpu")


def remeasure(
    base: dict[str, Any],
    baseline_python: str | None = None,
    baseline_env: dict[str, str] | None = None,
    timeout: float | None = None,
    diagnose: bool | None = None,
    cpu_threads: int = CPU_THREADS,
    baseline_cwd: str | None = None,
    current_command: Sequence[str] | None = None,
    launcher: Any = None,
    **judge: Any,
) -> dict[str, Any]:
    """The paired gate on the baseline report's config: the baseline side runs with `baseline_python`
    (another install: the code version the baseline stands for) and `baseline_env` (PYTHONPATH of
    its checkout, say); the current side with this interpreter and environment. The runs are
    diagnosed only when the baseline report was (`diagnose` None): without its findings there is
    nothing to compare new ones with, and a trace per run doubles a short run's time.

    On CPU both sides run with `cpu_threads` intra-op threads (0: torch's default, one per core).
    On a shared host a multi-threaded run waits at every parallel region for a thread the
    scheduler gave to a neighbour: on the 2-core CI machine at load 10 the tiny preset ran
    ~1,000 real tokens/s on one thread and ~150 on two, with 13 s steps among 80 ms ones."""
    from vlmdoctor.run.runner import run_isolated  # deferred: the runner imports torch

    r = as_report(base)
    source = r.knobs.source
    if source == "script":
        return remeasure_script(
            base,
            baseline_python,
            baseline_env,
            timeout,
            cpu_threads=cpu_threads,
            baseline_cwd=baseline_cwd,
            current_command=current_command,
            launcher=launcher,
            **judge,
        )
    if baseline_cwd or current_command:
        raise UsageError(
            "--baseline-cwd and --current-command apply to a baseline recorded by `vlmdoctor run`; "
            "for a vlmdoctor config use --baseline-python/--baseline-env"
        )
    if source in OWN_SOURCES:
        raise UsageError(
            f"the baseline measures your own training through the {source} way in, which records no command to "
            "run again; record the baseline with `vlmdoctor run -- python train.py ARGS`, which does"
        )
    if diagnose is None:
        diagnose = r.findings is not None

    cfg = RunConfig.from_dict(r.config or {}, source="baseline config")
    pinned = on_cpu(base) and cpu_threads > 0
    threads = {k: str(cpu_threads) for k in THREAD_VARS} if pinned else {}
    other = bool(baseline_python or baseline_env)  # another install: the checkout we stand in must not shadow it
    result = paired_gate(
        lambda: run_isolated(
            cfg,
            timeout,
            diagnose,
            python=baseline_python,
            env={**threads, **(baseline_env or {})} or None,
            own_cwd=other,
        ),
        lambda: run_isolated(cfg, timeout, diagnose, env=threads or None),
        cpu_time=pinned and cpu_threads == 1,
        **judge,
    )
    if pinned:
        result["notes"].insert(
            0,
            f"CPU runs on {cpu_threads} thread(s) a side (--cpu-threads)"
            + (
                ", judged on the CPU time of their steps, which a neighbour's load does not stretch"
                if cpu_threads == 1
                else ""
            ),
        )
    if not baseline_python and not baseline_env:
        result["notes"].insert(
            0,
            "baseline and current ran the same code and config: this measures the noise "
            "of the gate (pass --baseline-python/--baseline-env for another code version)",
        )
    return result


def recorded_command(base: dict[str, Any]) -> Script:
    """The command a `vlmdoctor run` baseline recorded, or a usage error saying how to record one."""
    script = as_report(base).script
    if script is None or not script.command:
        raise UsageError(
            "the baseline report records no command to run again (written by an older vlmdoctor); "
            "record it again with `vlmdoctor run -- python train.py ARGS`"
        )
    return script


def remeasure_script(
    base: dict[str, Any],
    baseline_python: str | None = None,
    baseline_env: dict[str, str] | None = None,
    timeout: float | None = None,
    cpu_threads: int = CPU_THREADS,
    baseline_cwd: str | None = None,
    current_command: Sequence[str] | None = None,
    current_cwd: str | None = None,
    launcher: Any = None,
    **judge: Any,
) -> dict[str, Any]:
    """The paired gate on a user's own training script, from the command `vlmdoctor run` recorded.

    Both sides run the script in fresh processes, alternating, each stopped after its timed window
    (untraced): the baseline side in `baseline_cwd` (a checkout of the baseline's code; default: the
    same folder as the current side) with `baseline_python`/`baseline_env`, the current side in
    `current_cwd` (default: the working folder) with `current_command` (default: the recorded one).
    A relative script path resolves in each side's folder, so each runs its own copy of the code.
    On CPU both run on `cpu_threads` threads and, on one, are judged on their steps' CPU time.

    `launcher` is `vlmdoctor.own.launch` (what starts a script under the step hook; the CLI passes it, since a
    gate sits upstream of the ways in): its `measure_script`, `parse_command` and `recorded_env`."""
    if launcher is None:
        raise UsageError("the gate on a training script needs the launcher of `vlmdoctor run`")
    measure_script, parse_command, recorded_env = (
        launcher.measure_script,
        launcher.parse_command,
        launcher.recorded_env,
    )
    script = recorded_command(base)
    command = list(script.command or [])
    cur_command = list(current_command) if current_command else command
    here = os.path.abspath(current_cwd or os.getcwd())
    there = os.path.abspath(baseline_cwd) if baseline_cwd else here
    if not os.path.isdir(there):
        raise UsageError(f"--baseline-cwd {baseline_cwd}: no such folder")
    parse_command(command, there)  # a missing script is a usage error now, not a failed run later
    parse_command(cur_command, here)
    knobs = as_report(base).knobs
    warmup = next(w for w in (script.warmup, knobs.warmup, WARMUP) if w is not None)  # else `vlmdoctor run`'s
    steps = script.steps or knobs.steps or STEPS
    pinned = on_cpu(base) and cpu_threads > 0
    threads = {k: str(cpu_threads) for k in THREAD_VARS} if pinned else {}
    result = paired_gate(
        lambda: measure_script(
            command, there, warmup, steps, baseline_python, {**threads, **(baseline_env or {})}, timeout
        ),
        lambda: measure_script(cur_command, here, warmup, steps, None, threads, timeout),
        cpu_time=pinned and cpu_threads == 1,
        **judge,
    )
    for check in result["checks"]:
        if check["name"] == "findings" and check["verdict"] == "skip":
            check["detail"] = "skipped: the paired runs of a script are timed, not traced; `vlmdoctor run` diagnoses it"
    notes = result["notes"]
    if pinned:
        notes.insert(0, f"CPU runs on {cpu_threads} thread(s) a side (--cpu-threads)")
    notes.insert(0, f"ran: baseline `{' '.join(command)}` in {there}; current `{' '.join(cur_command)}` in {here}")
    same = there == here and cur_command == command and not baseline_python and not baseline_env
    if same:
        notes.insert(
            1,
            "baseline and current ran the same code and command: this measures the noise of the gate "
            "(pass --baseline-cwd with a checkout of the baseline's code)",
        )
    now, then = recorded_env(), script.env or {}
    changed = sorted(k for k in set(now) | set(then) if now.get(k) != then.get(k) and k not in THREAD_VARS)
    if changed:
        notes.append(
            "environment differs from the recorded run (both sides ran with this job's): "
            + ", ".join(f"{k} {then.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        )
    return result


# --- statistics -------------------------------------------------------------------------------


def _ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Average ranks (1-based) and the sizes of the tie groups."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    ties: list[int] = []
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        ties.append(j - i + 1)
        i = j + 1
    return ranks, ties


def mann_whitney_u(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p-value).

    Normal approximation with tie correction and continuity correction (what scipy's
    `mannwhitneyu(..., method="asymptotic")` computes). Rank-based, so one slow outlier step
    cannot fake or hide a regression the way it can move a mean.
    """
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney_u needs at least one sample on each side")
    ranks, ties = _ranks([*x, *y])
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    mu = n1 * n2 / 2
    tie_term = sum(t**3 - t for t in ties) / (n * (n - 1)) if n > 1 else 0.0
    var = n1 * n2 / 12 * ((n + 1) - tie_term)
    if var <= 0:  # every value identical: no evidence of any difference
        return u1, 1.0
    z = max(abs(u1 - mu) - 0.5, 0.0) / math.sqrt(var)
    return u1, min(1.0, math.erfc(z / math.sqrt(2)))


def throughput_samples(report: dict[str, Any], per_step: bool) -> list[float]:
    """Real tokens/s samples: one per timed step when the report records step tokens, else one per repeat."""
    r = as_report(report)
    repeats = r.repeats or []
    if per_step:
        return [
            tok / (ms / 1000) for w in repeats for tok, ms in zip(w.step_real_tokens or [], w.step_ms or []) if ms > 0
        ]
    samples = [w.real_tokens_per_s for w in repeats if w.real_tokens_per_s is not None]
    if not samples and r.metrics is not None and r.metrics.real_tokens_per_s is not None:
        samples = [r.metrics.real_tokens_per_s]  # a report without windows: its one number
    return samples


def _has_step_tokens(report: dict[str, Any]) -> bool:
    repeats = as_report(report).repeats or []
    return bool(repeats) and all(len(r.step_real_tokens or []) == len(r.step_ms or []) > 0 for r in repeats)


def check_throughput(
    base: dict[str, Any], cur: dict[str, Any], max_regression: float = MAX_REGRESSION, alpha: float = ALPHA
) -> dict[str, Any]:
    """Fail only on a drop that is both large (ratio) and real (significant), as asv does."""
    per_step = _has_step_tokens(base) and _has_step_tokens(cur)
    b, c = throughput_samples(base, per_step), throughput_samples(cur, per_step)
    mb, mc = statistics.median(b), statistics.median(c)
    ratio = mc / mb if mb > 0 else math.inf
    p: float | None = None
    if min(len(b), len(c)) >= MIN_SAMPLES_FOR_TEST:
        method = "mann-whitney"
        p = mann_whitney_u(c, b)[1]
        significant = p < alpha
        evidence = f"Mann-Whitney p={p:.2g} ({'<' if significant else '>='} alpha {alpha:g})"
    else:
        method = "range-overlap"
        significant = max(c) < min(b) or min(c) > max(b)
        evidence = (
            f"ranges {'do not overlap' if significant else 'overlap'} "
            f"(too few samples for a test: {len(b)} vs {len(c)})"
        )
    slower = ratio < 1 - max_regression
    passed = not (slower and significant)
    change = f"{(ratio - 1) * 100:+.1f}%"
    numbers = f"{mb:,.0f} -> {mc:,.0f} real tokens/s ({change})"
    if not slower:
        reason = f"{numbers}: within the {max_regression:.0%} allowed" if ratio < 1 else f"{numbers}: no slowdown"
    elif significant:
        reason = f"{numbers}: slower than the {max_regression:.0%} allowed and beyond noise; {evidence}"
    else:
        reason = f"{numbers}: slower than the {max_regression:.0%} allowed, but not beyond noise; {evidence}"
    return {
        "name": "throughput",
        "passed": passed,
        "verdict": "pass" if passed else "fail",
        "detail": reason,
        "base_median": mb,
        "cur_median": mc,
        "ratio": ratio,
        "n_base": len(b),
        "n_cur": len(c),
        "samples": "per-step" if per_step else "per-repeat",
        "method": method,
        "p": p,
        "significant": significant,
        "max_regression": max_regression,
        "alpha": alpha,
    }


def check_memory(
    base: dict[str, Any], cur: dict[str, Any], max_memory_growth: float = MAX_MEMORY_GROWTH
) -> dict[str, Any]:
    """Memory growth eats the headroom that bigger batches need, so it fails even at equal speed."""
    b, c = as_report(base, "baseline").metrics, as_report(cur, "current").metrics
    mb, mc = b.peak_mem_gb if b else None, c.peak_mem_gb if c else None
    out: dict[str, Any] = {
        "name": "memory",
        "base_gb": mb,
        "cur_gb": mc,
        "growth": None,
        "max_memory_growth": max_memory_growth,
    }
    if not mb or mc is None:
        return out | {
            "passed": True,
            "verdict": "skip",
            "detail": "skipped: peak memory is not measured on CPU runs",
        }
    growth = mc / mb - 1
    passed = growth <= max_memory_growth
    detail = (
        f"peak allocated {mb:.2f} -> {mc:.2f} GiB ({growth * 100:+.1f}%): "
        + ("within" if passed else "more than")
        + f" the {max_memory_growth:.0%} allowed"
    )
    return out | {
        "growth": growth,
        "passed": passed,
        "verdict": "pass" if passed else "fail",
        "detail": detail,
    }


def _findings(report: RunReport) -> dict[str, Finding] | None:
    return None if report.findings is None else {f.id: f for f in report.findings}


def check_findings(
    base: dict[str, Any], cur: dict[str, Any], fail_on: str = FAIL_ON, selection: Any = None
) -> dict[str, Any]:
    """A new prescription (FP32 GEMMs back on the step, say) is a regression even before it shows in speed.

    A muted finding (the report's `muted`, or muted now by `selection`: --ignore, [tool.vlmdoctor])
    never fails the gate; it is listed under `muted`.
    """
    if fail_on not in SEVERITY_ORDER:
        raise UsageError(f"fail_on={fail_on!r} is not valid; choose one of: {', '.join(reversed(SEVERITY_ORDER))}")
    if selection:
        base, cur = (mute_report(copy.deepcopy(r), selection) for r in (base, cur))
    b, c = as_report(base, "baseline"), as_report(cur, "current")
    fb, fc = _findings(b), _findings(c)
    muted = [
        {"id": m.id, "severity": m.severity, "muted_by": m.muted_by}
        for m in (c.muted or (c.diagnosis.muted if c.diagnosis else []))
    ]
    out: dict[str, Any] = {
        "name": "findings",
        "fail_on": fail_on,
        "added": [],
        "gone": [],
        "failing": [],
        "muted": muted,
    }
    if fb is None or fc is None:
        which = "baseline" if fb is None else "current"
        return out | {
            "passed": True,
            "verdict": "skip",
            "detail": f"skipped: the {which} report has no diagnosis (run without --no-diagnose)",
        }
    threshold = SEVERITY_ORDER.index(fail_on)
    added = [i for i in fc if i not in fb]
    gone = [i for i in fb if i not in fc]
    failing = [
        i for i in added if fc[i].severity in SEVERITY_ORDER and SEVERITY_ORDER.index(fc[i].severity) >= threshold
    ]
    parts = []
    if failing:
        parts.append(
            f"new finding(s) of severity {fail_on} or above: " + ", ".join(f"{i} ({fc[i].severity})" for i in failing)
        )
    others = [i for i in added if i not in failing]
    if others:
        parts.append("new, below the bar: " + ", ".join(f"{i} ({fc[i].severity})" for i in others))
    if gone:
        parts.append("gone: " + ", ".join(gone))
    if muted:
        parts.append("muted: " + ", ".join(f"{m['id']} ({m['severity']})" for m in muted))
    detail = "; ".join(parts) if parts else "same findings as the baseline"
    passed = not failing
    return out | {
        "added": added,
        "gone": gone,
        "failing": failing,
        "passed": passed,
        "verdict": "pass" if passed else "fail",
        "detail": detail,
    }


def check_slowest_rank(
    base: dict[str, Any], cur: dict[str, Any], max_regression: float = MAX_REGRESSION
) -> dict[str, Any]:
    """Multi-rank reports: every rank waits for the slowest one, so a rank falling behind is a regression.

    Throughput (global tokens/s over the slowest rank's time) already judges the job; this check
    names the slowest rank and fails when the imbalance (slowest median step over the fastest's)
    grew by more than `max_regression`: the work became uneven across ranks.
    """
    sb, sc = slowest_rank(base), slowest_rank(cur)
    ib, ic = sb["imbalance"], sc["imbalance"]
    grew = ib is not None and ic is not None and ic - ib > max_regression
    detail = (
        f"slowest rank {sb['rank']} {sb['step_ms']:,.1f} ms/step -> rank {sc['rank']} {sc['step_ms']:,.1f} "
        f"ms/step; imbalance over the fastest rank "
        + (f"{ib * 100:.1f}% -> {ic * 100:.1f}%" if ib is not None and ic is not None else "unknown")
    )
    return {
        "name": "slowest rank",
        "passed": not grew,
        "verdict": "uneven" if grew else "ok",
        "detail": detail,
        "baseline": sb,
        "current": sc,
    }


# --- the verdict ------------------------------------------------------------------------------


def gate(
    base: dict[str, Any],
    cur: dict[str, Any],
    max_regression: float = MAX_REGRESSION,
    alpha: float = ALPHA,
    max_memory_growth: float = MAX_MEMORY_GROWTH,
    fail_on: str = FAIL_ON,
    notes: Sequence[str] = (),
    selection: Any = None,
) -> dict[str, Any]:
    """All checks and one verdict; call check_comparable first (it refuses, this one judges)."""
    checks = [
        check_throughput(base, cur, max_regression, alpha),
        check_memory(base, cur, max_memory_growth),
        check_findings(base, cur, fail_on, selection),
    ]
    if slowest_rank(base) and slowest_rank(cur):
        checks.append(check_slowest_rank(base, cur, max_regression))
    failed = [c for c in checks if not c["passed"]]
    if failed:
        summary = "FAILED: " + "; ".join(f"{c['name']}: {c['detail']}" for c in failed)
    else:
        summary = "PASSED: " + checks[0]["detail"]
    knobs = as_report(base).knobs
    return {
        "passed": not failed,
        "checks": checks,
        "summary": summary,
        "notes": list(notes),
        "model": knobs.model,
        "stage": knobs.stage,
    }


def _cell(text: Any) -> str:
    """Text from a report as Markdown that renders as that text and nothing else: an inline code span (no
    links, images, HTML or headings from a model name or a note), control characters shown escaped, a pipe
    escaped for the table it may sit in."""
    body = plain(str(text)).replace("\r", " ").replace("\n", " ").replace("|", "\\|")
    run = max((len(r) for r in re.findall(r"`+", body)), default=0)
    fence = "`" * (run + 1)
    pad = " " if body.startswith("`") or body.endswith("`") or not body.strip() else ""
    return f"{fence}{pad}{body}{pad}{fence}"


def markdown(result: dict[str, Any]) -> str:
    """For $GITHUB_STEP_SUMMARY: the verdict first, then one row per check. Every text that came from a
    report is a code span (`_cell`): a report is input, and the summary is rendered as Markdown and HTML."""
    head = "passed" if result["passed"] else "FAILED"
    icon = "\u2705" if result["passed"] else "\u274c"
    lines = [
        f"## {icon} vlmdoctor gate {head}",
        "",
        f"{_cell(result.get('model'))} stage {_cell(result.get('stage'))}: {_cell(result['summary'])}",
        "",
        "| check | verdict | detail |",
        "|---|---|---|",
    ]
    for c in result["checks"]:
        lines.append(f"| {_cell(c['name'])} | {_cell(c['verdict'])} | {_cell(c['detail'])} |")
    if result.get("notes"):
        lines += ["", "Notes:", *(f"- {_cell(n)}" for n in result["notes"])]
    return "\n".join(lines) + "\n"


def junit_xml(result: dict[str, Any]) -> str:
    """For CI test-report viewers: each check a test case, so the failed one is named in the PR UI.

    Text from the reports (finding ids, versions) goes in as `plain` text: XML 1.0 has no way to hold most
    control characters, even escaped, so a raw one would make the whole file unreadable."""
    checks = result["checks"]
    suite = ET.Element(
        "testsuite",
        name="vlmdoctor-gate",
        tests=str(len(checks)),
        failures=str(sum(not c["passed"] for c in checks)),
        errors="0",
        skipped=str(sum(c["verdict"] == "skip" for c in checks)),
    )
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="vlmdoctor.gate", name=c["name"])
        if not c["passed"]:
            failure = ET.SubElement(case, "failure", message=plain(c["detail"]), type=f"{c['name']}-regression")
            failure.text = plain(c["detail"])
        elif c["verdict"] == "skip":
            ET.SubElement(case, "skipped", message=plain(c["detail"]))
        else:
            ET.SubElement(case, "system-out").text = plain(c["detail"])
    if result.get("notes"):
        ET.SubElement(suite, "system-out").text = "\n".join(plain(n) for n in result["notes"])
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"
