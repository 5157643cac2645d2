"""Compose the prescriptions, verify the composition, measure each change's own worth by ablation.

A doctor whose advice is never checked is a blog post. Trying prescriptions one at a time (what
`treat` did first) spends a whole time budget on the first few rungs and judges each change
in a config where the others are missing (bf16 weights measured no gain at batch 4, where the
step was host-bound, and +30% at batch 48). So `treat` is a state machine (`_Treatment`; each
visit, its seconds and runs are kept in the result's `states` and `budget`):

1. start: the start config measured and diagnosed;
2. compose: every prescription the diagnosis supports applied at once, in layer order (a finding
   the diagnosis marked superseded stays out); where two findings are declared alternatives
   (torch.compile and Liger's kernels), both compositions are built and measured;
3. size (where runs measure memory): each composition's batch sized in its own round, from the
   memory its first run measured (`MemoryModel`, bisected on out of memory), not a round later;
4. compare: each composition against the current config on paired evidence
   (`vlmdoctor.doctor.decide`: interleaved fresh-process runs, a t-interval and a sign test on
   the paired ratio) and adopt the best one that is kept or likely; then compose again;
5. rediagnose: before it stops for want of prescriptions, the adopted config is run once more with
   a trace and diagnosed again (one diagnosed run decides whether a noisy threshold trips: on the
   H100 the 0.5b batch-22 config ran 82-86% GPU busy against the batch rule's 85%), and wherever
   the measured peak memory leaves room for a larger batch, the batch ceiling is probed;
6. ablate: each adopted change's own contribution by leave-one-out in the final config, every
   change given a pair where the time holds one each (a share of the budget is kept for it once a
   change is adopted: `reserve`), few pairs judged with the treatment's pooled spread. A change
   shown to stay below `min_gain` is dropped; one whose interval is still open stays.

"kept" means the gain is shown (the interval's lower bound above 1, or the sign test). A
composition taken on two pairs both beyond 1.5x (`decide.large_effect`) whose interval still
reaches below 1, or a likely gain at the limit (every pair above the bar, too few to decide), is
"adopted": the ladder moves on with it and its changes stay for the ablation to measure.

A trial is one arm of a comparison (a composition, or one ablation); each keeps the rules' expected
gain beside the measured one (`expected_x`, and the result's `calibration`). Ctrl-C ends the
treatment and keeps what was measured.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmdoctor import SCHEMA_VERSION, __version__
from vlmdoctor.doctor.decide import (
    ArmResult,
    interleaved,
    pooled_log_sd,
    pooled_verdict,
    throughput,
)
from vlmdoctor.doctor.treat_options import TreatOptions  # the limits, declared in a light module
from vlmdoctor.errors import EXIT_USAGE, UsageError
from vlmdoctor.run.config import RunConfig

#: run(cfg, diagnose, timeout) -> a profile report; treat calls run_isolated through the CLI
Runner = Callable[[RunConfig, bool, "float | None"], dict[str, Any]]
PROFILE_FACTS = (
    "gpu.busy_frac",
    "measured.gpu.busy_frac",
    "gpu.busy_tflops",
    "launch.kernels",
    "idle.other_host.ms",
    "idle.data_loader.ms",
    "idle.op.cudnn_attention.ms",
    "gemm.ms",
    "gpu.busy_ms",
    "step.ms",
)
Notify = Callable[[str], None]
#: knobs that only say how a run is measured, never what it trains: a patch may raise them (compile needs a
#: longer warm-up) and an ablation does not remove them
MEASUREMENT_KNOBS = ("warmup", "steps", "repeats")
#: what an ablation arm that failed says of the change it left out: the final config needs it
BROKEN_WITHOUT = {
    "oom": "out of memory without it",
    "nan_loss": "NaN loss without it",
    "error": "the run fails without it",
    "timeout": "the run timed out without it",
}
NOT_ABLATED = "not ablated: --max-trials or the time budget left no room"
#: a one-change composition adopted on two pairs whose interval still reaches below 1: the ablation may decide it
ADOPTED_OPEN = "the composition, adopted on two pairs beyond 1.5x; its interval does not exclude no gain"
#: a one-change composition adopted as a likely gain at the limit (every pair above the bar, too few to decide)
ADOPTED_LIKELY = "the composition, adopted as a likely gain: every pair above the bar, too few pairs to decide"
#: the contributions the final ablation measures: what no comparison of that change alone decided
TO_ABLATE = (NOT_ABLATED, ADOPTED_OPEN, ADOPTED_LIKELY)
#: what a comparison left open at its limit leans to (decide.lean)
LIKELY = ("likely_gain", "likely_loss")
#: the least degrees of freedom of the treatment's pooled spread before an ablation arm with fewer than min_pairs
#: pairs is judged with it (two comparisons of three pairs): below, its few pairs stay undecided or likely
POOLED_MIN_DF = 4
#: the most runs a composition's batch sizing takes: its first run, one raised to the ceiling, one bisection
SIZE_MAX_RUNS = 3
#: a rule's estimate this far from the measured ratio, either way, is called far off in the calibration
FAR_OFF = 1.25


def tokens(report: dict[str, Any]) -> list[float]:
    """Real tokens/s of each timed window of a run."""
    return [r["real_tokens_per_s"] for r in report.get("repeats") or []]


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """What the ladder shows of one run."""
    m = report.get("metrics") or {}
    facts = report.get("facts") or {}
    return {
        "status": report.get("status"),
        "real_tokens_per_s": m.get("real_tokens_per_s"),
        "profile": {k: facts.get(k) for k in PROFILE_FACTS if k in facts},
        "tokens_per_s_repeats": tokens(report),
        "step_ms": m.get("step_ms"),
        "mfu": m.get("mfu"),
        "peak_mem_gb": m.get("peak_mem_gb"),
        "pad_fraction": m.get("pad_fraction"),
        "compile_s": m.get("compile_s"),
        "warmup_s": m.get("warmup_s"),
        "findings": [f["id"] for f in report.get("findings") or []],
        "warnings": report.get("warnings") or [],
        "error": (report.get("error") or {}).get("message"),
    }


def _label(patch: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in patch.items())


# --- composing ----------------------------------------------------------------------------------


def _change(f: dict[str, Any], cfg: RunConfig) -> dict[str, Any] | None:
    patch = {k: v for k, v in f["config_patch"].items() if getattr(cfg, k, None) != v}
    if not {k for k in patch if k not in MEASUREMENT_KNOBS}:
        return None
    return {
        "rule": f["id"],
        "layer": f["layer"],
        "title": f["title"],
        "config_patch": patch,
        "expected_gain": f.get("expected_gain"),
    }


def apply(cfg: RunConfig, changes: list[dict[str, Any]]) -> RunConfig:
    """The config with every change's patch; an earlier (lower-layer) change wins a knob both set."""
    merged: dict[str, Any] = {}
    for c in changes:
        for k, v in c["config_patch"].items():
            if k in MEASUREMENT_KNOBS and k in merged:
                merged[k] = max(merged[k], v)
            merged.setdefault(k, v)
    return cfg.replace(source="composed prescriptions", **merged)


def compose(
    cfg: RunConfig,
    report: dict[str, Any],
    skipped: list[dict[str, Any]],
    validate: Callable[[RunConfig], Any] = lambda c: None,
) -> list[dict[str, Any]]:
    """The compositions a diagnosis supports: the findings in layer order, and for each alternative
    (a superseded finding whose patch contradicts the one that superseded it, like Liger on vs
    torch.compile with Liger off) one more composition with the alternative instead.

    A change that would make an invalid config, or one this machine refuses (`validate`: a GPU-only
    knob on a CPU), is left out and reported in `skipped`, so one such change cannot sink the others.
    """
    from vlmdoctor.doctor.rules import in_apply_order

    findings = in_apply_order(report.get("findings") or [])  # listed by gain; composed in layer order
    superseded = report.get("superseded") or []

    def skip(f: dict[str, Any], why: str) -> None:
        entry = {"rule": f["id"], "config_patch": f["config_patch"], "why": why}
        if entry not in skipped:
            skipped.append(entry)

    def build(chosen: list[dict[str, Any]], note: bool) -> tuple[list[dict[str, Any]], RunConfig] | None:
        changes: list[dict[str, Any]] = []
        for f in chosen:
            c = _change(f, cfg)
            if c is None:
                if note:
                    skip(f, "the config already has it")
                continue
            try:
                validate(apply(cfg, changes + [c]))
            except UsageError as e:
                if note:
                    skip(f, e.message)
                continue
            changes.append(c)
        return (changes, apply(cfg, changes)) if changes else None

    out = []
    primary = build(findings, note=True)
    if primary:
        out.append({"name": "composition", "changes": primary[0], "config": primary[1]})
    ids = [f["id"] for f in findings]
    for s in superseded:
        by = next((f for f in findings if f["id"] == s.get("superseded_by")), None)
        if by is None or all(by["config_patch"].get(k, object()) == v for k, v in s["config_patch"].items()):
            continue  # a repeat of the earlier fix, not an alternative to it
        alt = build([s if f["id"] == by["id"] else f for f in findings], note=False)
        if alt and all(alt[1] != o["config"] for o in out):
            out.append(
                {
                    "name": f"composition with {s['id']} instead of {by['id']}",
                    "changes": alt[0],
                    "config": alt[1],
                }
            )
        if len(out) >= 3 or s["id"] in ids:
            break
    return out


# --- the batch ceiling ------------------------------------------------------------------------------

#: the rule id a batch probe is recorded under (not a rule file: treat's own search, from measured memory)
PROBE_RULE = "treat-batch-probe"
#: share of the card the probe sizes the batch for, in allocated (live) memory. Higher than the batch rule's
#: HEADROOM (0.7, the rule's one guess): the probe is a first guess that an out-of-memory run bisects. On the H100
#: (2026-11-26) llava-siglip2-0.5b ran batch 112 at 76.2 of 79.2 GiB allocated (96%) and ran out at 144; sized for
#: 70%, treat's 0.5b stage-2 batch would stop a quarter short of what fits
PROBE_HEADROOM = 0.9
#: the probe runs only when the memory model leaves room for this much more batch: a smaller step is not worth
#: a round of paired runs
PROBE_MIN_STEP = 1.25
#: the most a probe multiplies the batch by, as the batch rule does: memory per sample is extrapolated
PROBE_MAX_FACTOR = 8


def _family(cfg: RunConfig) -> str:
    """The config without its batch and its measurement knobs: runs of one family differ in memory by the batch."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("batch_size", *MEASUREMENT_KNOBS)}
    return json.dumps(d, sort_keys=True, default=str)


@dataclass
class MemoryModel:
    """Peak allocated memory against the batch, per config family, from every run of the treatment.

    The batch a family can hold is (usable - fixed) / per_sample: from two measured batches, the line
    through them; from one, per_sample = peak / batch (fixed taken as 0, which overestimates the memory a
    sample needs and so underestimates the batch). An out-of-memory run bounds it from above; the next
    guess after one is the middle between the largest batch that ran and the smallest that did not."""

    points: dict[str, dict[int, float]] = field(default_factory=dict)
    oom: dict[str, int] = field(default_factory=dict)
    flat: dict[str, int] = field(default_factory=dict)  # a larger batch measured and not kept: saturated
    total_gb: float | None = None

    def observe(self, cfg: RunConfig, report: dict[str, Any]) -> None:
        fam, b = _family(cfg), cfg.batch_size
        m = report.get("metrics") or {}
        if report.get("status") == "oom":
            self.oom[fam] = min(self.oom.get(fam, b), b)
            return
        if report.get("status") != "ok" or not m.get("peak_mem_gb") or not m.get("device_mem_total_gb"):
            return
        self.total_gb = float(m["device_mem_total_gb"])
        pts = self.points.setdefault(fam, {})
        pts[b] = max(pts.get(b, 0.0), float(m["peak_mem_gb"]))

    def ceiling(self, cfg: RunConfig) -> tuple[int, str] | None:
        """The largest batch the family should hold, and how that was worked out; None without memory facts."""
        fam = _family(cfg)
        pts = sorted(self.points.get(fam, {}).items())
        if not pts or not self.total_gb:
            return None
        usable = PROBE_HEADROOM * self.total_gb
        (b1, p1), (b2, p2) = (pts[-2], pts[-1]) if len(pts) >= 2 else (pts[-1], pts[-1])
        per = (p2 - p1) / (b2 - b1) if b2 > b1 else 0.0
        if per > 0:
            fixed = max(0.0, p2 - per * b2)
            how = f"{per:.2f} GiB a sample + {fixed:.1f} GiB fixed (batches {b1} and {b2})"
        else:
            per, fixed = p2 / b2, 0.0
            how = f"{p2:.1f} GiB at batch {b2}: at most {per:.2f} GiB a sample"
        target = int((usable - fixed) // per)
        how += f"; {PROBE_HEADROOM:.0%} of {self.total_gb:.0f} GiB holds batch {target}"
        target = min(target, PROBE_MAX_FACTOR * cfg.batch_size)
        if fam in self.oom and target >= self.oom[fam]:
            fits = max([b for b, _ in pts if b < self.oom[fam]], default=cfg.batch_size)
            target = (fits + self.oom[fam]) // 2
            how += f"; out of memory at batch {self.oom[fam]}: bisected to {target}"
        return target, how


def batch_probe(cfg: RunConfig, mem: MemoryModel) -> dict[str, Any] | None:
    """A change to the batch the measured memory allows, when that is well above the current one and the family
    did not already show that a larger batch does not pay."""
    fam = _family(cfg)
    if fam in mem.flat and mem.flat[fam] > cfg.batch_size:
        return None
    ceiling = mem.ceiling(cfg)
    if ceiling is None:
        return None
    target, how = ceiling
    if target < math.ceil(PROBE_MIN_STEP * cfg.batch_size):
        return None
    return {
        "rule": PROBE_RULE,
        "layer": 2,
        "title": "probe the batch ceiling: memory left room",
        "config_patch": {"batch_size": target},
        "expected_gain": None,
        "why": how,
    }


def _raises_batch(comp: dict[str, Any], cfg: RunConfig) -> bool:
    return any((ch["config_patch"].get("batch_size") or 0) > cfg.batch_size for ch in comp["changes"])


def _key(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), sort_keys=True)


def with_probe(
    found: list[dict[str, Any]],
    cfg: RunConfig,
    mem: MemoryModel,
    validate: Callable[[RunConfig], Any],
    tried: set[str] = frozenset(),  # type: ignore[assignment]
) -> list[dict[str, Any]]:
    """The compositions with the batch probe: in the first one (a larger batch is tried with the other changes
    of its round), or alone when there is no other or that joint config was measured already. Unchanged
    when a composition already raises the batch (the batch rule sized it) or memory leaves no room."""
    if any(_raises_batch(c, cfg) for c in found):
        return found
    probe = batch_probe(cfg, mem)
    if probe is None:
        return found
    options = []
    if found:
        joint = sorted([*found[0]["changes"], probe], key=lambda ch: ch["layer"])
        options.append(({"name": found[0]["name"], "changes": joint}, found[1:]))
    options.append(({"name": "batch probe", "changes": [probe]}, []))
    for comp, others in options:
        try:
            comp["config"] = apply(cfg, comp["changes"])
            validate(comp["config"])
        except UsageError:
            continue
        if _key(comp["config"]) not in tried:
            return [comp, *others]
    return found


# --- the treatment ------------------------------------------------------------------------------


def _arm_numbers(arm: ArmResult) -> dict[str, Any]:
    vals = [v for v in arm.values if v]
    ok = [r for r in arm.reports if r.get("status") == "ok"]
    last = ok[-1] if ok else (arm.reports[-1] if arm.reports else {})
    out = summary(last)
    out["real_tokens_per_s"] = statistics.median(vals) if vals else None
    out["tokens_per_s_runs"] = vals
    out["runs"] = len(arm.reports)
    return out


def _outcome(decision: dict[str, Any], arm: ArmResult) -> str:
    o = decision.get("outcome", "error")
    failed = arm.failed or {}
    if (
        o not in ("kept", "harmful", "no_gain", "undecided", *LIKELY, "reference_failed")
        and failed.get("status") == "error"
        and (failed.get("error") or {}).get("exit_code") == EXIT_USAGE
    ):
        return "not_applicable"  # the run refused the config (a GPU-only knob on CPU, say)
    return o


def _shown(decision: dict[str, Any]) -> bool:
    """A kept decision that excludes no gain: its interval's lower bound above 1, or the sign test."""
    by_sign = str(decision.get("how") or "").startswith("sign test")
    return decision.get("outcome") == "kept" and ((decision.get("ci_low") or 0.0) > 1 or by_sign)


def _adopted(outcome: str, decision: dict[str, Any]) -> str:
    """ "kept" only when the gain is shown; a large effect decided on two pairs whose interval does not exclude
    no gain, or a likely gain at the limit (every pair above the bar, too few to decide), is "adopted": the
    ladder moves on with it, without calling it shown."""
    if (outcome == "kept" and not _shown(decision)) or outcome == "likely_gain":
        return "adopted"
    return outcome


def _likely_why(decision: dict[str, Any]) -> dict[str, Any]:
    """The words a likely gain is adopted with: its evidence, and that it is not shown."""
    if decision.get("outcome") != "likely_gain":
        return {}
    n, bar = decision["pairs"], 1 + decision["min_gain"]
    words = (
        f"likely gain: all {n} pairs above x{bar:g} (a {0.5**n:.0%} chance with no effect); "
        f"the {decision['confidence']:.0%} interval does not exclude no gain"
    )
    return {"why": "; ".join(w for w in (decision.get("why"), words) if w)}


def _nothing_left(out: dict[str, Any], found: list[dict[str, Any]], cfg: RunConfig, mem: MemoryModel) -> str:
    """Why the treatment stops with time left: what was tried, and what is left and why it is not tried."""
    comps = [t for t in out["trials"] if t["kind"] == "composition"]
    adopted = sum(r.get("adopted") is not None for r in out["rounds"])
    parts = [
        f"no prescription left: the adopted config was diagnosed again with a trace; "
        f"{len(comps)} composition(s) tried in {len(out['rounds'])} round(s), {adopted} adopted"
    ]
    left = sorted({ch["rule"] for c in found for ch in c["changes"]})
    if left:
        parts.append(f"left, already measured in this config: {', '.join(left)}")
    fam = _family(cfg)
    ceiling = mem.ceiling(cfg)
    if fam in mem.flat:
        parts.append(f"batch {mem.flat[fam]} measured no better than {cfg.batch_size}")
    elif fam in mem.oom:
        parts.append(f"batch {cfg.batch_size}; out of memory at {mem.oom[fam]}")
    elif ceiling is not None:
        parts.append(f"batch {cfg.batch_size}, memory model ceiling {ceiling[0]}")
    else:
        parts.append("no memory measured: no batch probe")
    skipped = sorted({s["rule"] for s in out["skipped"]})
    if skipped:
        parts.append(f"not applicable here: {', '.join(skipped)}")
    return "; ".join(parts)


# --- the treatment as a state machine ------------------------------------------------------------------

#: the states of a treatment; each visit is kept in the result (`states`) with its round, seconds and runs
START = "start"  # measure and diagnose the start config
COMPOSE = "compose"  # build the round's compositions from the current diagnosis (no run)
SIZE = "size"  # run each composition once and size its batch from the memory that run measured
COMPARE = "compare"  # paired runs of the compositions against the current config; adopt the best
REDIAGNOSE = "rediagnose"  # nothing new to try: the adopted config diagnosed again, with a trace
ABLATE = "ablate"  # each adopted change's own contribution, leave-one-out in the final config
DONE = "done"
#: why a treatment stopped, as a code beside `stopped_because`'s sentence
STOP_NOTHING_LEFT = "nothing_left"
STOP_TIME = "time_budget"
STOP_TRIALS = "max_trials"
STOP_START_FAILED = "start_failed"
STOP_INTERRUPTED = "interrupted"
#: the decision rule, in the words treat.json keeps
DECISION_RULE = (
    "paired: candidate and current run alternately in fresh processes; the ratio candidate/current of each "
    "pair; kept when the lower bound of the t-interval on the mean log ratio is above 1 + min_gain, or when "
    "every one of 6 or more pairs (the sign test at 95%) is; harmful when its upper bound is below 1 (or every "
    "such pair is); no gain when its upper bound is below 1 + min_gain; at the limit, an open interval with "
    "every pair above 1 + min_gain is a likely gain, adopted but not kept; changes of an adopted composition "
    "are measured by leave-one-out ablation in the final config"
)


@dataclass
class Machine:
    """The states a treatment passed through: each visit's round, start, seconds, runs and the state it led to,
    and the seconds spent per state (the treat result's `states` and `budget.spent_s`)."""

    t0: float
    runs: Callable[[], int]
    visits: list[dict[str, Any]] = field(default_factory=list)
    runs_at: int = 0

    def enter(self, state: str, round_: int) -> None:
        self.close()
        self.runs_at = self.runs()
        self.visits.append({"state": state, "round": round_, "started_s": time.time() - self.t0, "spent_s": 0.0})

    def close(self) -> None:
        """The open visit's seconds and runs so far (called again, it counts again from its start)."""
        if self.visits:
            v = self.visits[-1]
            v["spent_s"] = time.time() - self.t0 - v["started_s"]
            v["runs"] = self.runs() - self.runs_at

    def spent(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for v in self.visits:
            out[v["state"]] = out.get(v["state"], 0.0) + v["spent_s"]
        return out


def treat(
    cfg: RunConfig,
    run: Runner,
    opts: TreatOptions,
    notify: Notify = lambda _: None,
    validate: Callable[[RunConfig], Any] | None = None,
) -> dict[str, Any]:
    """The ladder: each adopted round with its measured speedup and each change's own contribution,
    and every trial with its paired evidence. Ctrl-C returns what was measured, marked interrupted.

    `validate` refuses configs this machine cannot run (default: the runner's preflight check).
    """
    if validate is None:
        from vlmdoctor.run.runner import check as validate
    return _Treatment(cfg, run, opts, notify, validate).go()


class _Treatment:
    """One treatment as a state machine: each state is a method that does its work and returns the next state.

    start -> compose -> [size ->] compare -> compose ... ; compose -> rediagnose -> compose when nothing new is
    left (once per config); compose -> ablate when nothing is left, or the trials, the time or the budget kept
    for the ablation say stop; ablate -> done. `size` runs only where runs measure memory (a GPU)."""

    def __init__(
        self, cfg: RunConfig, run: Runner, opts: TreatOptions, notify: Notify, validate: Callable[[RunConfig], Any]
    ) -> None:
        self.cfg, self.run, self.opts, self.notify, self.validate = cfg, run, opts, notify, validate
        self.t0 = time.time()
        self.po = opts.paired()
        self.out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "kind": "treat",
            "tool": {"name": "vlmdoctor", "version": __version__},
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "start_config": cfg.to_dict(),
            "decision": {
                "min_gain": opts.min_gain,
                "confidence": opts.confidence,
                "min_pairs": opts.min_pairs,
                "max_pairs": opts.max_pairs,
                "rule": DECISION_RULE,
            },
            "ladder": [],
            "trials": [],
            "rounds": [],
            "skipped": [],
            "interrupted": False,
        }
        self.run_s: list[float] = []  # wall time of each run, to size what still fits in the budget
        self.mem = MemoryModel()  # peak memory against the batch, from every run: where the batch ceiling is
        self.current_cfg = cfg
        self.current: dict[str, Any] = {}
        self.speedup = 1.0
        self.tried: set[str] = set()
        self.rediagnosed: set[str] = set()  # configs diagnosed a second time before the treatment could stop on them
        self.pending: list[dict[str, Any]] = []  # a composition to retry with a smaller batch after an OOM
        self.adopted: list[list[dict[str, Any]]] = []  # each adopted round's changes, in order
        self.live: dict[str, Any] = {}  # what the round in flight has measured, for Ctrl-C
        self.comps: list[dict[str, Any]] = []  # the round's compositions
        self.first: dict[str, dict[str, Any]] = {}  # a composition's sizing run: its first run of the comparison
        self.first_s: dict[str, float] = {}
        self.reserved = 0.0  # the most seconds kept for the ablation
        self.machine = Machine(self.t0, lambda: len(self.run_s))

    # --- the clock and the runs ---

    def time_left(self) -> float:
        return math.inf if self.opts.time_budget_s is None else self.opts.time_budget_s - (time.time() - self.t0)

    def mean_run_s(self) -> float:
        return statistics.fmean(self.run_s) if self.run_s else 0.0

    def runner(self, c: RunConfig, diagnose: bool) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            left = self.time_left()
            limit = self.opts.trial_timeout_s
            if not math.isinf(left):
                limit = max(30.0, min(limit, left + 60))
            t = time.time()
            rep = self.run(c, diagnose, limit)
            self.run_s.append(time.time() - t)
            self.mem.observe(c, rep)
            return rep

        return go

    def reserve(self) -> float:
        """Seconds kept for the final ablation: its share of the budget, at most what ablating every adopted change
        in min_pairs pairs takes at the mean run so far; none before a change is adopted, or without a budget."""
        if self.opts.time_budget_s is None or not self.run_s:
            return 0.0
        k = sum(c["contribution"]["how"] in TO_ABLATE for changes in self.adopted for c in changes)
        p = self.opts.min_pairs
        kept = (
            min(self.opts.ablation_share * self.opts.time_budget_s, (k * p + p - 1) * self.mean_run_s()) if k else 0.0
        )
        self.reserved = max(self.reserved, kept)
        return kept

    def stop(self, code: str, why: str) -> str:
        self.out["stop_reason"], self.out["stopped_because"] = code, why
        return ABLATE

    def _budget_words(self) -> str:
        return f"--time-budget {self.opts.time_budget_s:.0f} s"

    # --- the machine ---

    def go(self) -> dict[str, Any]:
        out = self.out
        handlers = {
            START: self.start,
            COMPOSE: self.compose,
            SIZE: self.size,
            COMPARE: self.compare,
            REDIAGNOSE: self.rediagnose,
            ABLATE: self.ablate,
        }
        state = START
        try:
            while state != DONE:
                self.machine.enter(state, len(out["rounds"]))
                state = handlers[state]()
                self.machine.visits[-1]["next"] = state
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (the child run was stopped with it): keep what was measured
            from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

            out["interrupted"] = True
            out["stop_reason"] = STOP_INTERRUPTED
            out["stopped_because"] = describe_interruption(e)
            out["exit_code"] = interrupted_exit_code(e)
            if self.live.get("arms"):
                out["interrupted_round"] = {n: [v for v in a.values] for n, a in self.live["arms"].items()}
        self.machine.close()
        out["states"] = self.machine.visits
        out["budget"] = {
            "budget_s": self.opts.time_budget_s,
            "ablation_share": self.opts.ablation_share,
            "reserved_for_ablation_s": self.reserved,
            "spent_s": self.machine.spent(),
        }
        out["calibration"] = calibration(out["trials"])
        out["final_config"] = self.current_cfg.to_dict()
        out["wall_s"] = time.time() - self.t0
        return out

    def start(self) -> str:
        out = self.out
        self.notify("measuring the start config")
        current = self.runner(self.cfg, True)()
        out["env"] = current.get("env")
        out["start"] = summary(current)
        if current.get("status") != "ok" or throughput(current) is None:
            why = (current.get("error") or {}).get("message") or "it measured no throughput"
            out["stop_reason"] = STOP_START_FAILED
            out["stopped_because"] = f"the start config did not run ({current.get('status') or 'no report'}): {why}"
            return DONE
        out["ladder"].append(
            {
                "step": 0,
                "change": "start",
                "rule": None,
                "config_patch": {},
                **summary(current),
                "speedup": 1.0,
                "elapsed_s": time.time() - self.t0,
            }
        )
        self.current = current
        out["stop_reason"], out["stopped_because"] = STOP_NOTHING_LEFT, "no prescription left"
        return COMPOSE

    def compose(self) -> str:
        out, opts = self.out, self.opts
        budget = opts.max_trials - len(out["trials"])
        if budget <= 0:
            return self.stop(STOP_TRIALS, f"--max-trials {opts.max_trials} reached")
        if self.time_left() <= 0:
            return self.stop(STOP_TIME, f"{self._budget_words()} spent")
        found = self.pending or with_probe(
            compose(self.current_cfg, self.current, out["skipped"], self.validate),
            self.current_cfg,
            self.mem,
            self.validate,
            self.tried,
        )
        self.pending = []
        comps = [c for c in found if _key(c["config"]) not in self.tried][:budget]
        if not comps:
            if _key(self.current_cfg) in self.rediagnosed:
                return self.stop(STOP_NOTHING_LEFT, _nothing_left(out, found, self.current_cfg, self.mem))
            if self.run_s and self.time_left() - self.reserve() < 2 * self.mean_run_s():
                return self.stop(
                    STOP_TIME,
                    f"{self._budget_words()}: too little left to diagnose the adopted config again and measure "
                    "another round",
                )
            return REDIAGNOSE
        if not self._round_fits(comps):
            return self.stop(
                STOP_TIME,
                f"{self._budget_words()}: a round of {len(comps)} new composition(s) does not fit beside the "
                f"{self.reserve():.0f} s kept for the ablation",
            )
        self.comps, self.first, self.first_s = comps, {}, {}
        out["rounds"].append(
            {
                "round": len(out["rounds"]) + 1,
                "started_s": time.time() - self.t0,
                "current_config": self.current_cfg.to_dict(),
                "compositions": [],
            }
        )
        for c in comps:
            self.tried.add(_key(c["config"]))
        return SIZE if self.mem.total_gb else COMPARE

    def _round_fits(self, comps: list[dict[str, Any]]) -> bool:
        """A later round of new compositions starts only when its pairs fit beside the ablation's reserve: two
        pairs where every composition is expected to beat the large-effect factor, else min_pairs. Round 1
        always starts (nothing is adopted yet, so nothing is reserved)."""
        if self.opts.time_budget_s is None or not self.run_s or not self.adopted:
            return True
        large = all((_composed_x(c["changes"]) or 1.0) >= self.po.large_effect for c in comps)
        pairs = 2 if large and self.po.large_effect > 1 else self.po.min_pairs
        need = (len(comps) * pairs + pairs - 1) * self.mean_run_s()
        return need <= self.time_left() - self.reserve()

    def size(self) -> str:
        """Each composition's batch sized in its own round: the memory model's ceiling for the composition's own
        family (its first run's peak), bisected on out of memory, not a round later."""
        self.out["rounds"][-1]["sizing"] = []
        sized = []
        for comp in self.comps:
            got = self._size(comp)
            if got is None:
                sized.append(comp)
                continue
            comp, rep, took = got
            sized.append(comp)
            self.first[comp["name"]], self.first_s[comp["name"]] = rep, took
        self.comps = sized
        return COMPARE

    def _size(self, comp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], float] | None:
        """The composition at the batch its memory allows, with that run's report and seconds (None: no run fitted).

        Its first run, at the batch the rules chose, measures its family's memory; where the ceiling is 25% or more
        above that batch, the batch is raised to it and run again; an out-of-memory run is bisected between the
        largest batch that ran and it (or its batch step halved). The comparison pairs the largest batch that ran
        (the runs it took stay in the round's `sizing`)."""
        best = last = None
        for _ in range(SIZE_MAX_RUNS):
            if self.time_left() <= 0:
                break
            b = comp["config"].batch_size
            self.notify(f"round {len(self.out['rounds'])}: sizing {comp['name']} at batch {b}")
            t = time.time()
            rep = self.runner(comp["config"], False)()
            last = (comp, rep, time.time() - t)
            self.out["rounds"][-1]["sizing"].append(
                {
                    "name": comp["name"],
                    "batch_size": b,
                    "status": rep.get("status"),
                    "peak_mem_gb": (rep.get("metrics") or {}).get("peak_mem_gb"),
                }
            )
            ran = rep.get("status") == "ok" and throughput(rep) is not None
            if ran:
                best = last
            elif rep.get("status") != "oom":
                break  # a failure other than memory: the comparison records it
            nxt = self._resized(comp, ran)
            if nxt is None:
                break
            self.tried.add(_key(nxt["config"]))
            comp = nxt
        return best or last

    def _resized(self, comp: dict[str, Any], ran: bool) -> dict[str, Any] | None:
        """The composition at its next batch to try, or None: after a run, the ceiling when it is a step worth
        pairs; after an out-of-memory run, the middle between what ran and what did not, else half the step."""
        cfg = comp["config"]
        fam = _family(cfg)
        ceiling = self.mem.ceiling(cfg)
        if ran:
            if fam in self.mem.flat and self.mem.flat[fam] > cfg.batch_size:
                return None  # a larger batch of this family was measured and did not pay
            if ceiling is None or ceiling[0] < math.ceil(PROBE_MIN_STEP * cfg.batch_size):
                return None
            return self._with_batch(comp, *ceiling)
        if ceiling is not None and self.current_cfg.batch_size < ceiling[0] < cfg.batch_size:
            return self._with_batch(comp, *ceiling)
        smaller = _smaller_batch(self.current_cfg, comp)
        return smaller if smaller is not None and _key(smaller["config"]) not in self.tried else None

    def _with_batch(self, comp: dict[str, Any], target: int, how: str) -> dict[str, Any] | None:
        """The composition with the batch set to `target`: on the change that sets the batch (its rule's estimate
        was for the batch it chose: `sized` says so), else as a batch probe."""
        changes, found = [], False
        for ch in comp["changes"]:
            if "batch_size" in ch["config_patch"]:
                found = True
                was = (ch.get("sized") or {}).get("from", ch["config_patch"]["batch_size"])
                ch = {
                    **ch,
                    "config_patch": {**ch["config_patch"], "batch_size": target},
                    "sized": {"from": was, "to": target, "how": how},
                }
            changes.append(ch)
        if not found:
            probe = {
                "rule": PROBE_RULE,
                "layer": 2,
                "title": "the batch this composition's measured memory allows",
                "config_patch": {"batch_size": target},
                "expected_gain": None,
                "why": how,
            }
            changes = sorted([*changes, probe], key=lambda ch: ch["layer"])
        try:
            config = apply(self.current_cfg, changes)
            self.validate(config)
        except UsageError:
            return None
        if _key(config) in self.tried:
            return None
        base = comp["name"].split(" (batch")[0]
        return {"name": f"{base} (batch {target}, sized from memory)", "changes": changes, "config": config}

    def compare(self) -> str:
        out, opts, comps = self.out, self.opts, self.comps
        rnd = out["rounds"][-1]
        arms = {"current": self.runner(self.current_cfg, False)}
        arms.update({c["name"]: _first_diagnosed(self.runner, c["config"]) for c in comps})
        self.notify(f"round {rnd['round']}: " + "; ".join(f"{c['name']} ({len(c['changes'])} changes)" for c in comps))
        self.live.clear()
        res = interleaved(
            arms,
            "current",
            self.po,
            self.time_left,
            first={"current": self.current, **self.first},
            first_s=self.first_s,
            notify=self.notify,
            on_round=lambda r: self.live.update(arms=r, kind="composition", comps=comps),
            reserve_s=self.reserve(),
        )
        self.live.clear()
        best = None
        for c in comps:
            d, arm = res["decisions"][c["name"]], res["arms"][c["name"]]
            d = d | _likely_why(d)
            entry = _trial(out, "composition", c["name"], c["changes"], _adopted(_outcome(d, arm), d), d, arm)
            rnd["compositions"].append(entry["trial"])
            if entry["outcome"] in ("kept", "adopted") and (best is None or d["ratio"] > best[1]["ratio"]):
                best = (c, d, arm)
            probe = next((ch for ch in c["changes"] if ch["rule"] == PROBE_RULE), None)
            if probe and len(c["changes"]) == 1 and entry["outcome"] not in ("kept", "adopted", "oom"):
                self.mem.flat[_family(self.current_cfg)] = probe["config_patch"]["batch_size"]  # it did not pay
        if best is None:
            rnd["adopted"] = None
            oom = next((c for c in comps if res["decisions"][c["name"]].get("outcome") == "oom"), None)
            retry = _smaller_batch(self.current_cfg, oom) if oom else None
            if retry is not None and _key(retry["config"]) not in self.tried:
                # the batch was sized from the current config's memory; the composition's other changes (no
                # checkpointing, say) need more per sample: halve the batch step and measure again
                self.pending = [retry]
                out["stopped_because"] = "no composition paid off"
                return COMPOSE
            open_ = any(res["decisions"][c["name"]].get("outcome") == "undecided" for c in comps)
            if open_ and opts.time_budget_s is not None and res["rounds"] < self.po.max_pairs:
                return self.stop(STOP_TIME, f"{self._budget_words()}: too little left to decide")
            out["stopped_because"] = "no composition paid off"
            return COMPOSE  # the same diagnosis yields nothing new: compose() finds every config tried and stops
        self._adopt(*best)
        return COMPOSE

    def _adopt(self, comp: dict[str, Any], d: dict[str, Any], arm: ArmResult) -> None:
        out = self.out
        rnd = out["rounds"][-1]
        # its diagnosed run: the next round composes from its findings
        composed_report = next(
            (r for r in arm.reports if r.get("findings") is not None),
            next(r for r in reversed(arm.reports) if r.get("status") == "ok"),
        )
        self.speedup *= d["ratio"]
        rnd["adopted"] = comp["name"]
        rnd["ended_s"] = time.time() - self.t0
        changes = []
        for ch in comp["changes"]:
            if len(comp["changes"]) == 1:  # its own contribution is the composition's
                shown = _shown(d)
                how = "the composition" if shown else ADOPTED_LIKELY if d["outcome"] == "likely_gain" else ADOPTED_OPEN
                k = {
                    "outcome": "kept" if shown else "likely_gain" if d["outcome"] == "likely_gain" else "undecided",
                    "ratio": d["ratio"],
                    "ci_low": d["ci_low"],
                    "ci_high": d["ci_high"],
                    "pairs": d["pairs"],
                    "how": how,
                }
            else:
                k = {"outcome": "undecided", "how": NOT_ABLATED}
            changes.append({**ch, "contribution": k})
        out["ladder"].append(
            {
                "step": len(out["ladder"]),
                "change": _label(_merged(comp["changes"])),
                "rule": ", ".join(ch["rule"] for ch in comp["changes"]),
                "config_patch": _merged(comp["changes"]),
                **summary(composed_report),
                "real_tokens_per_s": throughput(composed_report),
                "speedup": self.speedup,
                "paired_ratio": d["ratio"],
                "ci": [d["ci_low"], d["ci_high"]],
                "speedup_how": "paired ratio of the composition vs the rung before",
                "composed_of": [ch["rule"] for ch in comp["changes"]],
                "dropped": [],
                "changes": changes,
                "elapsed_s": time.time() - self.t0,
            }
        )
        self.adopted.append(changes)
        self.current_cfg, self.current = comp["config"], composed_report

    def rediagnose(self) -> str:
        """One diagnosed run decided that nothing is left: diagnose the adopted config again, with a trace (one
        diagnosed run decides whether a noisy threshold trips)."""
        self.rediagnosed.add(_key(self.current_cfg))
        self.notify("nothing new to try: diagnosing the adopted config again, with a trace")
        again = self.runner(self.current_cfg, True)()
        if again.get("status") == "ok" and again.get("findings") is not None and throughput(again):
            self.current = again
            self.out.setdefault("rediagnosed", []).append(
                {"round": len(self.out["rounds"]), "findings": [f["id"] for f in again["findings"]]}
            )
        return COMPOSE

    def ablate(self) -> str:
        if self.current:
            self.current_cfg = _final_ablation(self, self.cfg, self.adopted, self.current_cfg, self.current)
        return DONE


def _rebuild(start: RunConfig, adopted: list[list[dict[str, Any]]], leave_out: list[dict[str, Any]]) -> RunConfig:
    """The final config built again round by round without some changes (a later round's knob wins)."""
    cfg = start
    for changes in adopted:
        keep = [c for c in changes if not any(c is x for x in leave_out)]
        if keep:
            cfg = apply(cfg, keep)
    return cfg


def _final_ablation(
    tr: _Treatment,
    start: RunConfig,
    adopted: list[list[dict[str, Any]]],
    final_cfg: RunConfig,
    final_report: dict[str, Any],
) -> RunConfig:
    """Each adopted change's own contribution, by leave-one-out in the final config; the config without
    the changes shown not to pay.

    In the final config, not in the round that adopted it: a change's worth depends on the others
    (bf16 weights measured no gain at batch 4 and +30% at batch 48 on the H100), and ablating after
    every round spent a 0.5b ladder's budget (400 of 535 s, one H100, 2026-11-23) before the round
    that would have raised the batch 6x. Every change gets an arm when one pair each fits (the
    budget plan keeps time for it); the comparison goes on while the time lasts, each arm until it
    is decided. An arm left with fewer than min_pairs pairs is judged with the spread pooled over the
    treatment's pairs (`decide.pooled_verdict`, at POOLED_MIN_DF degrees of freedom or more): the
    assumption, said in `decided_by`, is that the pairs of one treatment share one noise level.
    A change whose interval is still open stays: the composition it came in was measured to pay.
    """
    out, opts = tr.out, tr.opts
    everything = [c for changes in adopted for c in changes]
    cands: list[tuple[dict[str, Any], RunConfig]] = []
    for c in everything:
        if c["contribution"]["how"] not in TO_ABLATE:
            continue
        try:
            without = _rebuild(start, adopted, [c])
        except UsageError:
            c["contribution"] = {
                "outcome": "kept",
                "how": "the other changes need it: the config is invalid without it",
            }
            continue
        if without == final_cfg:
            c["contribution"] = {"outcome": "superseded", "how": "a later round set its knobs again"}
            continue
        cands.append((c, without))
    runs_left = (tr.time_left() / tr.mean_run_s()) if tr.run_s and tr.mean_run_s() > 0 else math.inf
    cands = _ablations_that_fit(cands, max(0, opts.max_trials - len(out["trials"])), runs_left)
    if not cands:
        return final_cfg
    arms = {"final": tr.runner(final_cfg, False)}
    arms.update({f"without {c['rule']}": tr.runner(w, False) for c, w in cands})
    tr.notify(f"ablation of {len(cands)} changes in the final config")
    ab = interleaved(
        arms,
        "final",
        tr.po,
        tr.time_left,
        contribution=True,
        first={"final": final_report},
        notify=tr.notify,
        on_round=lambda r: tr.live.update(arms=r, kind="ablation"),
    )
    spreads = [t["ratios"] for t in out["trials"] if t.get("ratios")]
    spreads += [ab["decisions"][f"without {c['rule']}"].get("ratios") or [] for c, _ in cands]
    pooled = pooled_log_sd(spreads)
    trials = []
    for c, _ in cands:
        name = f"without {c['rule']}"
        dd, a = ab["decisions"][name], ab["arms"][name]
        o = _outcome(dd, a)
        # a change whose removal breaks the run is needed: on the H100 the 0.5b batch-83 config ran out of
        # memory without compile, whose fused loss never holds the fp32 logits (an 11.8 GiB allocation)
        broke = BROKEN_WITHOUT.get(o)
        why = {"why": broke} if broke else {}
        few = dd.get("ratios") and len(dd["ratios"]) < opts.min_pairs
        if not broke and few and pooled and pooled[1] >= POOLED_MIN_DF and o in ("kept", "undecided", *LIKELY):
            dd = pooled_verdict(dd["ratios"], pooled, opts.min_gain, opts.confidence) | {"why": dd.get("why")}
            o = dd["outcome"]
        if o == "kept" and not broke and not _shown(dd):
            o = "likely_gain"  # two pairs beyond 1.5x, but their interval does not exclude no gain: not shown
        o = "kept" if broke else o
        entry = _trial(out, "ablation", name, [c], o, dd | why, a)
        trials.append(entry["trial"])
        prior = c["contribution"]
        if o == "undecided" and prior.get("ratio") is not None:  # its composition's own pairs say more
            prior["ablation"] = f"trial {entry['trial']}: undecided in {dd.get('pairs') or 0} pair(s)"
            continue
        c["contribution"] = (
            {k: dd.get(k) for k in ("ratio", "ci_low", "ci_high", "pairs", "ratios")}
            | {"outcome": o, "how": "leave-one-out ablation in the final config", "trial": entry["trial"]}
            | {"decided_by": dd.get("how")}
            | why
        )
    dropped: list[dict[str, Any]] = []
    for rung, changes in zip(out["ladder"][1:], adopted):
        out_ = [c for c in changes if c["contribution"]["outcome"] in ("no_gain", "harmful")]
        if out_ and len(out_) == len(changes) and all(c["contribution"]["outcome"] == "no_gain" for c in out_):
            for c in out_:  # the round paid, but no change of it could be resolved alone: kept as the group measured
                c["contribution"]["kept_as_group"] = True
            continue
        rung["dropped"] = [c["rule"] for c in out_]
        dropped += out_
    out["final_ablation"] = {
        "trials": trials,
        "dropped": [c["rule"] for c in dropped],
        "pooled_log_sd": pooled[0] if pooled else None,
        "pooled_df": pooled[1] if pooled else None,
    }
    if not dropped:
        return final_cfg
    cfg = _rebuild(start, adopted, dropped)
    last = out["ladder"][-1]
    adjust = math.prod(1 / c["contribution"]["ratio"] for c in dropped if c["contribution"].get("ratio"))
    measured = ab["arms"][f"without {dropped[0]['rule']}"] if len(dropped) == 1 else None
    report = next((r for r in reversed(measured.reports) if r.get("status") == "ok"), None) if measured else None
    rung = {
        "step": len(out["ladder"]),
        "change": "without " + ", ".join(c["rule"] for c in dropped),
        "rule": None,
        "config_patch": {},
        **(summary(report) if report else {}),
        "real_tokens_per_s": statistics.median(v for v in measured.values if v)
        if measured
        else (last.get("real_tokens_per_s") or 0.0) * adjust,
        "speedup": last["speedup"] * adjust,
        "speedup_how": "the last rung's speedup times 1/contribution of each dropped change",
        "dropped": [c["rule"] for c in dropped],
        "elapsed_s": time.time() - tr.t0,
    }
    out["ladder"].append(rung)
    return cfg


def _ablations_that_fit(
    cands: list[tuple[dict[str, Any], RunConfig]], most: int, runs_left: float
) -> list[tuple[dict[str, Any], RunConfig]]:
    """The ablations to run: every change when --max-trials and one pair each fit (k arms take k runs: the
    final config's first run is the last round's), else as many as fit: the changes no comparison measured
    alone first, then the largest expected gain first (one pair resolves only a large contribution). An
    ablation that decides nothing leaves a one-change round's own evidence standing. The comparison then
    measures more pairs while the time lasts. Before, ablations were sized for three pairs each: on the
    H100 a 0.5b ladder ended with 183 s left at 39 s a run and ablated nothing, and in every ladder most
    of round 1's changes stayed "undecided": the user never learned which change mattered."""
    # a change no comparison measured alone first (a one-change round's own pairs already say something)
    order = sorted(cands, key=lambda cw: (cw[0]["contribution"].get("ratio") is not None, -_expected_x(cw[0])))
    n = most if math.isinf(runs_left) else min(most, int(runs_left))
    return order[: max(0, n)]


# --- calibration: the rules' expected gains against what was measured ------------------------------------------


def _composed_x(changes: list[dict[str, Any]]) -> float | None:
    """The throughput factor the rules expected of these changes together (the product of theirs), None where a
    change has no estimate (a batch probe)."""
    xs = [(c.get("expected_gain") or {}).get("throughput_x") for c in changes]
    return math.prod(xs) if xs and all(x for x in xs) else None


def calibration(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured trial's expected gain (a change's rule's estimate; a composition's, the product of its
    changes') beside its paired ratio: `off` = measured / expected, far off beyond FAR_OFF either way."""
    rows = []
    for t in trials:
        exp, got = t.get("expected_x"), t.get("ratio")
        if not exp or not got:
            continue
        rows.append(
            {
                "trial": t["trial"],
                "kind": t["kind"],
                "rule": t["rule"],
                "expected_x": exp,
                "measured_x": got,
                "ci_low": t.get("ci_low"),
                "ci_high": t.get("ci_high"),
                "pairs": t.get("pairs"),
                "outcome": t["outcome"],
                "off": got / exp,
                "far_off": not 1 / FAR_OFF <= got / exp <= FAR_OFF,
            }
        )
    return rows


def _smaller_batch(cfg: RunConfig, comp: dict[str, Any]) -> dict[str, Any] | None:
    """The composition with its batch-size step halved (dropped when that reaches the current batch): from
    batch 22 a step to 55 that ran out of memory is measured again at 38, not at 27."""
    changes = []
    found = False
    for ch in comp["changes"]:
        bs = ch["config_patch"].get("batch_size")
        if isinstance(bs, int) and bs > cfg.batch_size:
            found = True
            smaller = cfg.batch_size + (bs - cfg.batch_size) // 2  # half the step, not half the batch
            if smaller == cfg.batch_size:
                rest = {k: v for k, v in ch["config_patch"].items() if k != "batch_size"}
                if rest:
                    changes.append({**ch, "config_patch": rest})
                continue
            ch = {**ch, "config_patch": {**ch["config_patch"], "batch_size": smaller}}
        changes.append(ch)
    if not found or not changes:
        return None
    try:
        config = apply(cfg, changes)
    except UsageError:
        return None
    base = comp["name"].split(" (batch")[0]
    return {"name": f"{base} (batch halved after OOM)", "changes": changes, "config": config}


def _first_diagnosed(
    runner: Callable[[RunConfig, bool], Callable[[], dict[str, Any]]], cfg: RunConfig
) -> Callable[[], dict[str, Any]]:
    """A composition's first run is traced and diagnosed (the next round needs its findings); the
    pairs after it are timed only, which saves the trace window and its analysis."""
    calls = {"n": 0}

    def go() -> dict[str, Any]:
        calls["n"] += 1
        return runner(cfg, calls["n"] == 1)()

    return go


def _expected_x(change: dict[str, Any]) -> float:
    """The throughput factor the rule expected (1 when it gave none): ablations start with the smallest."""
    g = change.get("expected_gain") or {}
    return float(g.get("throughput_x") or 1.0)


def _merged(changes: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for c in changes:
        for k, v in c["config_patch"].items():
            merged.setdefault(k, v)
    return merged


def _trial(
    out: dict[str, Any],
    kind: str,
    name: str,
    changes: list[dict[str, Any]],
    outcome: str,
    decision: dict[str, Any],
    arm: ArmResult,
) -> dict[str, Any]:
    entry = {
        "trial": len(out["trials"]) + 1,
        "kind": kind,
        "name": name,
        "rule": ", ".join(c["rule"] for c in changes) if kind == "composition" else changes[0]["rule"],
        "layer": min(c["layer"] for c in changes),
        "title": changes[0]["title"] if len(changes) == 1 else name,
        "config_patch": _merged(changes),
        "expected_gain": changes[0].get("expected_gain") if len(changes) == 1 else None,
        "expected_x": _composed_x(changes),
        **_arm_numbers(arm),
        "outcome": outcome,
    }
    for k in ("ratio", "gain", "ci_low", "ci_high", "pairs", "ratios", "why", "p_sign"):
        if decision.get(k) is not None:
            entry[k] = decision[k]
    if decision.get("how"):
        entry["decided_by"] = decision["how"]
    out["trials"].append(entry)
    return entry
