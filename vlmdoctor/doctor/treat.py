"""Compose the prescriptions, verify the composition, confirm each change by ablation.

A doctor whose advice is never checked is a blog post. Trying prescriptions one at a time (what
`treat` did first) spends a whole time budget on the first few rungs and judges each change
in a config where the others are missing (bf16 weights measured no gain at batch 4, where the
step was host-bound, and +30% at batch 48). So a round of `treat`:

1. diagnoses the current config and applies every prescription it supports at once, in layer
   order (a finding the diagnosis marked superseded stays out); where two findings are declared
   alternatives (torch.compile and Liger's kernels), both compositions are built and measured;
2. compares each composition with the current config on paired evidence
   (`vlmdoctor.doctor.decide`: interleaved fresh-process runs, a t-interval on the paired
   ratio) and adopts the best one that is kept;
3. re-diagnoses the adopted config and repeats while prescriptions, time and `--max-trials` last.
   Before it stops for want of prescriptions, the adopted config is run once more with a trace and
   diagnosed again (one diagnosed run decides whether a noisy threshold trips: on the H100 the 0.5b
   batch-22 config ran 82-86% GPU busy against the batch rule's 85%), and wherever the measured
   peak memory leaves room for a larger batch, the batch ceiling is probed (`MemoryModel`) whatever
   the busy share says;
4. then confirms each adopted change by leave-one-out ablation in the final config: the final
   config minus that change, paired against the final config. A change whose own contribution is
   shown to stay below `min_gain` is dropped; one whose interval the time or the pairs left open
   stays, marked undecided (the composition it came in was measured to pay).

"kept" means the paired interval excludes no gain (its lower bound is above 1). A composition taken
on two pairs both beyond 1.5x (`decide.large_effect`, to save a third run of a slow config) whose
two-pair interval still reaches below 1 is "adopted": the ladder moves on with it, and its changes
are undecided until an ablation decides them.

A trial is one arm of a comparison (a composition, or one ablation). Ctrl-C ends the treatment
and keeps what was measured.
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
from vlmdoctor.doctor.decide import ArmResult, PairedOptions, interleaved, throughput
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


@dataclass
class TreatOptions:
    max_trials: int = 24
    time_budget_s: float | None = 540.0  # 9 minutes: with the runs' own limit, one treatment ends within 10
    min_gain: float = 0.02
    trial_timeout_s: float = 900.0
    rules_dirs: list[str] = field(default_factory=list)
    confidence: float = 0.95
    min_pairs: int = 3
    max_pairs: int = 6

    def paired(self) -> PairedOptions:
        return PairedOptions(self.min_gain, self.confidence, self.min_pairs, self.max_pairs)


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
        o not in ("kept", "harmful", "no_gain", "undecided", "reference_failed")
        and failed.get("status") == "error"
        and (failed.get("error") or {}).get("exit_code") == EXIT_USAGE
    ):
        return "not_applicable"  # the run refused the config (a GPU-only knob on CPU, say)
    return o


def _adopted(outcome: str, decision: dict[str, Any]) -> str:
    """ "kept" only when the interval excludes no gain; a large effect decided on two pairs whose interval does
    not is "adopted": the ladder moves on with it, without calling it shown."""
    if outcome == "kept" and (decision.get("ci_low") or 0.0) <= 1:
        return "adopted"
    return outcome


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
    t0 = time.time()
    po = opts.paired()
    out: dict[str, Any] = {
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
            "rule": "paired: candidate and current run alternately in fresh processes; the ratio "
            "candidate/current of each pair; kept when the lower bound of the t-interval on the "
            "mean log ratio is above 1 + min_gain, harmful when its upper bound is below 1; "
            "changes of a kept composition are confirmed by leave-one-out ablation",
        },
        "ladder": [],
        "trials": [],
        "rounds": [],
        "skipped": [],
        "interrupted": False,
    }

    def time_left() -> float:
        return math.inf if opts.time_budget_s is None else opts.time_budget_s - (time.time() - t0)

    run_s: list[float] = []  # wall time of each run, to size what still fits in the budget
    mem = MemoryModel()  # peak memory against the batch, from every run: where the batch ceiling is

    def runner(c: RunConfig, diagnose: bool) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            left = time_left()
            limit = opts.trial_timeout_s if math.isinf(left) else max(30.0, min(opts.trial_timeout_s, left + 60))
            t = time.time()
            rep = run(c, diagnose, limit)
            run_s.append(time.time() - t)
            mem.observe(c, rep)
            return rep

        return go

    current_cfg = cfg
    speedup = 1.0
    tried: set[str] = set()
    rediagnosed: set[str] = set()  # configs diagnosed a second time before the treatment could stop on them
    pending: list[dict[str, Any]] = []  # a composition to retry with a smaller batch after an OOM
    adopted: list[list[dict[str, Any]]] = []  # each adopted round's changes, in order
    live: dict[str, Any] = {}  # what the round in flight has measured, for Ctrl-C
    try:
        notify("measuring the start config")
        current = runner(cfg, True)()
        out["env"] = current.get("env")
        out["start"] = summary(current)
        if current.get("status") != "ok" or throughput(current) is None:
            why = (current.get("error") or {}).get("message") or "it measured no throughput"
            out["stopped_because"] = f"the start config did not run ({current.get('status') or 'no report'}): {why}"
            out["final_config"] = cfg.to_dict()
            out["wall_s"] = time.time() - t0
            return out
        out["ladder"].append(
            {
                "step": 0,
                "change": "start",
                "rule": None,
                "config_patch": {},
                **summary(current),
                "speedup": 1.0,
                "elapsed_s": time.time() - t0,
            }
        )
        out["stopped_because"] = "no prescription left"
        while True:
            budget = opts.max_trials - len(out["trials"])
            if budget <= 0:
                out["stopped_because"] = f"--max-trials {opts.max_trials} reached"
                break
            if time_left() <= 0:
                out["stopped_because"] = f"--time-budget {opts.time_budget_s:.0f} s spent"
                break
            found = pending or with_probe(
                compose(current_cfg, current, out["skipped"], validate), current_cfg, mem, validate, tried
            )
            pending = []
            comps = [c for c in found if _key(c["config"]) not in tried][:budget]
            if not comps:
                if _key(current_cfg) in rediagnosed:
                    out["stopped_because"] = _nothing_left(out, found, current_cfg, mem)
                    break
                if run_s and time_left() < 2 * statistics.fmean(run_s):
                    out["stopped_because"] = (
                        f"--time-budget {opts.time_budget_s:.0f} s: too little left to diagnose the adopted config "
                        "again and measure another round"
                    )
                    break
                # one diagnosed run decided that nothing is left: diagnose the adopted config again, with a trace
                rediagnosed.add(_key(current_cfg))
                notify("nothing new to try: diagnosing the adopted config again, with a trace")
                again = runner(current_cfg, True)()
                if again.get("status") == "ok" and again.get("findings") is not None and throughput(again):
                    current = again
                    out.setdefault("rediagnosed", []).append(
                        {"round": len(out["rounds"]), "findings": [f["id"] for f in again["findings"]]}
                    )
                continue
            rnd: dict[str, Any] = {
                "round": len(out["rounds"]) + 1,
                "started_s": time.time() - t0,
                "current_config": current_cfg.to_dict(),
                "compositions": [],
            }
            out["rounds"].append(rnd)
            for c in comps:
                tried.add(_key(c["config"]))
            # 1. the compositions against the current config
            arms = {"current": runner(current_cfg, False)}
            arms.update({c["name"]: _first_diagnosed(runner, c["config"]) for c in comps})
            notify(f"round {rnd['round']}: " + "; ".join(f"{c['name']} ({len(c['changes'])} changes)" for c in comps))
            live.clear()
            res = interleaved(
                arms,
                "current",
                po,
                time_left,
                first={"current": current},
                notify=notify,
                on_round=lambda r, comps=comps: live.update(arms=r, kind="composition", comps=comps),
            )
            live.clear()
            best = None
            for c in comps:
                d, arm = res["decisions"][c["name"]], res["arms"][c["name"]]
                entry = _trial(out, "composition", c["name"], c["changes"], _adopted(_outcome(d, arm), d), d, arm)
                rnd["compositions"].append(entry["trial"])
                if entry["outcome"] in ("kept", "adopted") and (best is None or d["ratio"] > best[1]["ratio"]):
                    best = (c, d, arm)
                probe = next((ch for ch in c["changes"] if ch["rule"] == PROBE_RULE), None)
                if probe and len(c["changes"]) == 1 and entry["outcome"] not in ("kept", "adopted", "oom"):
                    mem.flat[_family(current_cfg)] = probe["config_patch"]["batch_size"]  # a larger batch did not pay
            if best is None:
                rnd["adopted"] = None
                oom = next((c for c in comps if res["decisions"][c["name"]].get("outcome") == "oom"), None)
                retry = _smaller_batch(current_cfg, oom) if oom else None
                if retry is not None:
                    # the batch was sized from the current config's memory; the composition's other changes (no
                    # checkpointing, say) need more per sample: halve the batch step and measure again
                    pending = [retry]
                    out["stopped_because"] = "no composition paid off"
                    continue
                if any(res["decisions"][c["name"]].get("outcome") == "undecided" for c in comps):
                    out["stopped_because"] = f"--time-budget {opts.time_budget_s:.0f} s: too little left to decide"
                    break
                out["stopped_because"] = "no composition paid off"
                continue  # the same diagnosis yields nothing new: compose() finds every config tried and stops
            comp, d, arm = best
            composed_cfg = comp["config"]
            # its diagnosed run: the next round composes from its findings
            composed_report = next(
                (r for r in arm.reports if r.get("findings") is not None),
                next(r for r in reversed(arm.reports) if r.get("status") == "ok"),
            )
            speedup *= d["ratio"]
            rnd["adopted"] = comp["name"]
            rnd["ended_s"] = time.time() - t0
            changes = []
            for ch in comp["changes"]:
                if len(comp["changes"]) == 1:  # its own contribution is the composition's
                    k = {
                        "outcome": "kept" if d["ci_low"] > 1 else "undecided",
                        "ratio": d["ratio"],
                        "ci_low": d["ci_low"],
                        "ci_high": d["ci_high"],
                        "pairs": d["pairs"],
                        "how": "the composition" if d["ci_low"] > 1 else ADOPTED_OPEN,
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
                    "speedup": speedup,
                    "paired_ratio": d["ratio"],
                    "ci": [d["ci_low"], d["ci_high"]],
                    "speedup_how": "paired ratio of the composition vs the rung before",
                    "composed_of": [ch["rule"] for ch in comp["changes"]],
                    "dropped": [],
                    "changes": changes,
                    "elapsed_s": time.time() - t0,
                }
            )
            adopted.append(changes)
            current_cfg, current = composed_cfg, composed_report
        # 3. each change's own contribution, in the final config: without it, against the final config
        current_cfg = _final_ablation(
            out,
            cfg,
            adopted,
            current_cfg,
            current,
            runner,
            opts,
            time_left,
            run_s,
            notify,
            live,
            lambda: time.time() - t0,
        )
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM (the child run was stopped with it): keep what was measured
        from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

        out["interrupted"] = True
        out["stopped_because"] = describe_interruption(e)
        out["exit_code"] = interrupted_exit_code(e)
        if live.get("arms"):
            out["interrupted_round"] = {n: [v for v in a.values] for n, a in live["arms"].items()}
    out["final_config"] = current_cfg.to_dict()
    out["wall_s"] = time.time() - t0
    return out


def _rebuild(start: RunConfig, adopted: list[list[dict[str, Any]]], leave_out: list[dict[str, Any]]) -> RunConfig:
    """The final config built again round by round without some changes (a later round's knob wins)."""
    cfg = start
    for changes in adopted:
        keep = [c for c in changes if not any(c is x for x in leave_out)]
        if keep:
            cfg = apply(cfg, keep)
    return cfg


def _final_ablation(
    out: dict[str, Any],
    start: RunConfig,
    adopted: list[list[dict[str, Any]]],
    final_cfg: RunConfig,
    final_report: dict[str, Any],
    runner: Callable[[RunConfig, bool], Callable[[], dict[str, Any]]],
    opts: TreatOptions,
    time_left: Callable[[], float],
    run_s: list[float],
    notify: Notify,
    live: dict[str, Any],
    elapsed: Callable[[], float],
) -> RunConfig:
    """Each adopted change's own contribution, by leave-one-out in the final config; the config without
    the changes that did not pay.

    In the final config, not in the round that adopted it: a change's worth depends on the others
    (bf16 weights measured no gain at batch 4 and +30% at batch 48 on the H100), and ablating after
    every round spent a 0.5b ladder's budget (400 of 535 s, one H100, 2026-11-23) before the round
    that would have raised the batch 6x. A change whose interval is still open when the pairs or the
    time run out stays: the composition it came in was measured to pay.
    """
    everything = [c for changes in adopted for c in changes]
    cands: list[tuple[dict[str, Any], RunConfig]] = []
    for c in everything:
        if c["contribution"]["how"] not in (NOT_ABLATED, ADOPTED_OPEN):
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
    cands = _ablations_that_fit(
        cands,
        max(0, opts.max_trials - len(out["trials"])),
        opts,
        (time_left() / statistics.fmean(run_s)) if run_s else math.inf,
    )
    if not cands:
        return final_cfg
    arms = {"final": runner(final_cfg, False)}
    arms.update({f"without {c['rule']}": runner(w, False) for c, w in cands})
    notify(f"ablation of {len(cands)} changes in the final config")
    ab = interleaved(
        arms,
        "final",
        opts.paired(),
        time_left,
        contribution=True,
        first={"final": final_report},
        notify=notify,
        on_round=lambda r: live.update(arms=r, kind="ablation"),
    )
    trials = []
    for c, _ in cands:
        name = f"without {c['rule']}"
        dd, a = ab["decisions"][name], ab["arms"][name]
        o = _outcome(dd, a)
        # a change whose removal breaks the run is needed: on the H100 the 0.5b batch-83 config ran out of
        # memory without compile, whose fused loss never holds the fp32 logits (an 11.8 GiB allocation)
        broke = BROKEN_WITHOUT.get(o)
        why = {"why": broke} if broke else {}
        if o == "kept" and not broke and (dd.get("ci_low") or 0.0) <= 1:
            o = "undecided"  # two pairs beyond 1.5x, but their interval does not exclude no gain: not shown to pay
        o = "kept" if broke else o
        if o == "no_gain" and (dd.get("ci_high") or 0.0) >= 1 + opts.min_gain:
            o = "undecided"  # the pairs or the time ran out with the interval still open
        entry = _trial(out, "ablation", name, [c], o, dd | why, a)
        trials.append(entry["trial"])
        c["contribution"] = (
            {k: dd.get(k) for k in ("ratio", "ci_low", "ci_high", "pairs", "ratios")}
            | {"outcome": o, "how": "leave-one-out ablation in the final config", "trial": entry["trial"]}
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
    out["final_ablation"] = {"trials": trials, "dropped": [c["rule"] for c in dropped]}
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
        "elapsed_s": elapsed(),
    }
    out["ladder"].append(rung)
    return cfg


def _ablations_that_fit(
    cands: list[tuple[dict[str, Any], RunConfig]], most: int, opts: TreatOptions, runs_left: float
) -> list[tuple[dict[str, Any], RunConfig]]:
    """The ablations to run: as many as --max-trials and the time allow, the most doubtful first.

    k arms decided in p pairs take k*p runs plus p-1 of the final config (its first run is the last
    round's). With room for min_pairs pairs, the changes with the smallest expected gain go first:
    they are the ones a composition may carry without paying. With room for two pairs only, a pair
    of rounds decides nothing under 1.5x, so only changes expected to be worth that much are ablated,
    the largest first: on the H100 a 0.5b ladder ended with 183 s left at 39 s a run, room for one
    arm in two pairs and none in three, and ablated nothing.
    """

    def arms(pairs: int) -> int:
        return max(0, min(most, int((runs_left - (pairs - 1)) // pairs))) if not math.isinf(runs_left) else most

    if arms(opts.min_pairs) >= 1 or opts.min_pairs <= 2:
        return sorted(cands, key=lambda cw: _expected_x(cw[0]))[: arms(opts.min_pairs)]
    large = [cw for cw in cands if _expected_x(cw[0]) >= opts.paired().large_effect]
    return sorted(large, key=lambda cw: -_expected_x(cw[0]))[: arms(2)]


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
        **_arm_numbers(arm),
        "outcome": outcome,
    }
    for k in ("ratio", "gain", "ci_low", "ci_high", "pairs", "ratios", "why"):
        if k in decision:
            entry[k] = decision[k]
    out["trials"].append(entry)
    return entry
