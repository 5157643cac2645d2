"""The final ablation of `treat` (doctor/treat.py): each adopted change's own contribution, by leave-one-out in the
final config, and the config without the changes shown not to pay. In the final config, not in the round that
adopted it: a change's worth depends on the others (bf16 weights measured no gain at batch 4 and +30% at batch 48)."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from vlmdoctor import supervise
from vlmdoctor.doctor.decide import ArmResult, PairedOptions, interleaved, pooled_log_sd, pooled_verdict, verdict
from vlmdoctor.doctor.treat_attribution import separable
from vlmdoctor.doctor.treat_compose import apply, config_key
from vlmdoctor.doctor.treat_options import TreatOptions
from vlmdoctor.doctor.treat_trials import (
    LIKELY,
    STOPPED_BY_BUDGET,
    busy_frac,
    final_config_x,
    is_shown,
    outcome_of,
    record_trial,
    summary,
)
from vlmdoctor.errors import UsageError
from vlmdoctor.run.arms import MAX_ARMS, TWO_ROUNDS_S, switch_patch
from vlmdoctor.run.config import RunConfig

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
#: a change's own worth from the arms a run of the final config measured in its own process (run/switch.py)
IN_PROCESS = "leave-one-out in one process: windows of the final config and windows without the change, in turn"
#: the same, where those pairs did not show a gain: a change is dropped on fresh-process pairs only, so the final
#: ablation's fresh-process arm decides where the time holds one
IN_PROCESS_OPEN = IN_PROCESS + "; not shown to pay there: a fresh-process arm decides where the time holds one"
#: a change adopted alone in a later round measured in one process (doctor/treat.py `one_process`): its own pairs
IN_ONE_PROCESS = "the composition, in one process: windows of it and of the rung before, in turn"
#: the contributions the final ablation measures: what no comparison of that change alone decided
TO_ABLATE = (NOT_ABLATED, ADOPTED_OPEN, ADOPTED_LIKELY, IN_PROCESS_OPEN)
#: the least degrees of freedom of the treatment's pooled spread before an ablation arm with fewer than min_pairs
#: pairs is judged with it (two comparisons of three pairs): below, its few pairs stay undecided or likely
POOLED_MIN_DF = 4


class Treatment(Protocol):
    """What the ablation reads and writes of the treatment in flight (doctor/treat.py's state machine)."""

    out: dict[str, Any]
    opts: TreatOptions
    po: PairedOptions
    t0: float
    run_s: list[float]
    live: dict[str, Any]
    notify: Callable[[str], None]
    final_by_lane: dict[int, dict[str, Any]]  # the adopted config's last clean run on each of compare's lanes
    final_by_lane_cfg: str | None  # the config those runs measured (`config_key`)
    in_process: dict[str, list[dict[str, Any]]]  # by config: its runs' in-process arms (run/arms.py)

    def time_left(self) -> float: ...

    def arms_s(self) -> float: ...

    def mean_run_s(self) -> float: ...

    def new_run_s(self) -> float: ...

    def runner(
        self, c: RunConfig, diagnose: bool, device: int | None = None, arms: dict[str, dict[str, Any]] | None = None
    ) -> Callable[[], dict[str, Any]]: ...


def _rebuild(start: RunConfig, adopted: list[list[dict[str, Any]]], leave_out: list[dict[str, Any]]) -> RunConfig:
    """The final config built again round by round without some changes (a later round's knob wins)."""
    cfg = start
    for changes in adopted:
        keep = [c for c in changes if not any(c is x for x in leave_out)]
        if keep:
            cfg = apply(cfg, keep)
    return cfg


def final_ablation(
    tr: Treatment,
    start: RunConfig,
    adopted: list[list[dict[str, Any]]],
    final_cfg: RunConfig,
    final_report: dict[str, Any] | None,
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
    _in_one_run(tr, start, adopted, final_cfg)
    cands = _candidates(tr, start, adopted, final_cfg)
    if not cands:
        return final_cfg
    # without a run of the final config to reuse (its last round was adopted in one process), on one GPU
    gpus = min(max(1, tr.opts.trial_gpus), len(cands)) if final_report is not None else 1
    tr.out["trial_gpus"] = gpus
    on = f" on {gpus} GPUs, one comparison each" if gpus > 1 else ""
    tr.notify(f"ablation of {len(cands)} changes in the final config{on}")
    ab = (
        _compare(tr, cands, final_cfg, final_report)
        if gpus == 1
        else _on_gpus(tr, cands, final_cfg, final_report, gpus)
    )
    spreads = [t["ratios"] for t in tr.out["trials"] if t.get("ratios")]
    spreads += [ab["decisions"][f"without {c['rule']}"].get("ratios") or [] for c, _ in cands]
    pooled = pooled_log_sd(spreads)
    sizes = _sizes(tr, start, final_cfg)
    undo = _undo_x(tr, cands, final_report)  # read in the final trace where the rule says how; else moved there
    expected = {
        c["rule"]: (undo[c["rule"]], "final_trace") if c["rule"] in undo else (final_config_x(c, *sizes), "final")
        for c, _ in cands
    }
    trials = [_judge(tr, c, ab, pooled, *expected[c["rule"]]) for c, _ in cands]
    dropped = _dropped(tr.out["ladder"], adopted)
    tr.out["final_ablation"] = {
        "trials": trials,
        "dropped": [c["rule"] for c in dropped],
        "pooled_log_sd": pooled[0] if pooled else None,
        "pooled_df": pooled[1] if pooled else None,
    }
    if not dropped:
        return final_cfg
    cfg = _rebuild(start, adopted, dropped)
    tr.out["ladder"].append(_rung_without(tr, dropped, ab))
    return cfg


def _compare(
    tr: Treatment,
    cands: list[tuple[dict[str, Any], RunConfig]],
    final_cfg: RunConfig,
    final_report: dict[str, Any] | None,
    device: int | None = None,
    notify: Callable[[str], None] | None = None,
    on_round: Callable[[dict[str, ArmResult]], None] | None = None,
    time_left: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """One paired comparison of the final config against each config without one change, on one GPU (`device`;
    None: as every other run of the treatment). `final_report` is reused as the final arm's first run."""
    arms = {"final": tr.runner(final_cfg, False, device)}
    arms.update({f"without {c['rule']}": tr.runner(w, False, device) for c, w in cands})
    return interleaved(
        arms,
        "final",
        tr.po,
        time_left or tr.time_left,
        contribution=True,
        first={"final": final_report} if final_report is not None else None,
        notify=notify or tr.notify,
        on_round=on_round or (lambda r: tr.live.update(arms=r, kind="ablation")),
        new_run_s=tr.new_run_s(),
        partial_pairs=True,
    )


def _on_gpus(
    tr: Treatment,
    cands: list[tuple[dict[str, Any], RunConfig]],
    final_cfg: RunConfig,
    final_report: dict[str, Any],
    gpus: int,
) -> dict[str, Any]:
    """The arms dealt round-robin to `gpus` comparisons run at once, one GPU each, each with its own final arm so
    that every pair is measured on one GPU; merged into one comparison's result. Each GPU's round 1 reuses a run of
    the final config made on that GPU: the first GPU's, the treatment's diagnosed run (`final_report`, on the first
    visible GPU); GPU g's, compare's last run of the adopted composition on its lane g (`_reused_finals`). A GPU
    without one runs the final config first: another GPU's run would pair runs of two GPUs. Threads suffice: each
    run is a subprocess. Wall time counts once: every comparison reads the one clock (`tr.time_left`)."""
    groups = [cands[g::gpus] for g in range(gpus)]
    reused = _reused_finals(tr, final_cfg, gpus)
    lock, stop = threading.Lock(), threading.Event()
    live: dict[str, ArmResult] = {}

    def say(g: int) -> Callable[[str], None]:
        def notify(msg: str) -> None:
            with lock:  # the console's progress follows one message at a time
                tr.notify(f"{msg} (GPU {g})")

        return notify

    def seen(g: int) -> Callable[[dict[str, ArmResult]], None]:
        def on_round(res: dict[str, ArmResult]) -> None:
            with lock:  # what Ctrl-C keeps: every comparison's arms, each GPU's final arm by its own name
                live.update({(n if n != "final" or g == 0 else f"final (GPU {g})"): a for n, a in res.items()})
                tr.live.update(arms=dict(live), kind="ablation")

        return on_round

    def left() -> float:  # no run starts once the treatment was interrupted
        return -1.0 if stop.is_set() else tr.time_left()

    def job(g: int, grp: list[tuple[dict[str, Any], RunConfig]]) -> Callable[[], dict[str, Any]]:
        first = final_report if g == 0 else reused.get(g)
        return lambda: _compare(tr, grp, final_cfg, first, g, say(g), seen(g), left)

    # Ctrl-C: every run in progress stops, no further run starts (`left` reads `stop`)
    results = supervise.at_once([job(g, grp) for g, grp in enumerate(groups)], "ablation-gpu", stop)
    return {
        "rounds": max(r["rounds"] for r in results),
        "arms": {n: a for r in reversed(results) for n, a in r["arms"].items()},  # "final": the first GPU's
        "decisions": {n: d for r in results for n, d in r["decisions"].items()},
    }


def _reused_finals(tr: Treatment, final_cfg: RunConfig, gpus: int) -> dict[int, dict[str, Any]]:
    """GPU g's (1 <= g < gpus) run of the final config already made: compare's last clean run of the adopted
    composition on lane g, pinned to GPU g, a timed run like an ablation arm's. None where the final config is not
    the config those runs measured. On four H200s (llava-siglip2-0.5b, --time-budget 380, 2026-11-27), the ablation
    had 104 s left; GPUs 1-3 each spent ~45 s running the final config again, which compare's last round had just
    run on them, and then had no time for their arm: 1 of 3 arms measured."""
    if tr.final_by_lane_cfg is None or tr.final_by_lane_cfg != config_key(final_cfg):
        return {}
    return {g: r for g, r in tr.final_by_lane.items() if 1 <= g < gpus}


def in_process_arms(
    current: RunConfig, config: RunConfig, changes: list[dict[str, Any]], among: list[dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """The leave-one-out arms of a composition (`config`: `changes` applied to `current`) that a run of it can switch
    to in its own process (run/arms.py): each change of `among` (default: every one), in its order, whose config
    without it differs in such knobs only, by arm name ("without RULE"), with the knobs it sets."""
    arms: dict[str, dict[str, Any]] = {}
    for ch in changes if among is None else among:
        try:
            without = apply(current, [x for x in changes if x is not ch])
        except UsageError:
            continue
        patch = switch_patch(config, without)
        if patch:
            arms[f"without {ch['rule']}"] = patch
    return arms


def _in_one_run(tr: Treatment, start: RunConfig, adopted: list[list[dict[str, Any]]], final_cfg: RunConfig) -> None:
    """The changes still to ablate whose final config without them a run switches to in its own process (run/arms.py:
    the loader's knobs, regional compile off), as arms of one run of the final config, before any fresh-process arm:
    at most MAX_ARMS, those no pair measured yet first, then the largest expected in the final config; only where
    the time left does not give every change to ablate min_pairs fresh pairs (fresh pairs can also show a change
    not to pay, and drop it; pairs in one process only keep). Their pairs are pooled with the final config's
    earlier runs' (`in_process_contributions`); what they leave open goes on to the fresh-process arms where the
    time holds them. Why: on two H200s (qwen2-vl-2b, 2026-11-28) the final
    ablation had 185 s: two fresh arms at about 90 s a run gave one pair each (loader workers x3.14, shape churn
    x1.09), and the budget cut the third."""
    todo = [c for changes in adopted for c in changes if c["contribution"]["how"] in TO_ABLATE]
    arms: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for c in todo:
        try:
            patch = switch_patch(final_cfg, _rebuild(start, adopted, [c]))
        except UsageError:
            continue
        if patch:
            arms.append((c, patch))
    fresh_runs = len(todo) * tr.opts.min_pairs + 1  # min_pairs each, and a run of the final config
    if not arms or tr.time_left() >= fresh_runs * tr.new_run_s() or tr.arms_s() < TWO_ROUNDS_S:
        return
    sizes = _sizes(tr, start, final_cfg)
    arms.sort(key=lambda ca: (bool(ca[0]["contribution"].get("ratios")), -(final_config_x(ca[0], *sizes) or 1.0)))
    asked = {f"without {c['rule']}": patch for c, patch in arms[:MAX_ARMS]}
    tr.notify(f"ablation in one run of the final config: {', '.join(asked)}")
    tr.runner(final_cfg, False, arms=asked)()
    results = tr.in_process.get(config_key(final_cfg), [])
    before = tr.out.get("in_process") or []  # the runs of round 1's composition, where it is the final config
    tr.out["in_process"] = before + [r for r in results if not any(r is m for m in before)]
    in_process_contributions([c for c, _ in arms], results, tr.opts)


def _undo_x(tr: Treatment, cands: list, final_report: dict[str, Any] | None) -> dict[str, float]:
    """The expected ratio of each ablation whose rule says what undoing its change costs (`gain.undo_ms`), read in
    the final config's own trace: (its traced step + that cost) / its traced step. Why: gradient checkpointing's
    recompute was 14-16% of the start's GPU work and 22.5% of the final config's (llava-siglip2-0.5b, batch 152, one
    H200): carried from the start (`per: gpu`) it said x1.16-1.18, and turning checkpointing on measured x1.27-1.30
    in fresh processes, where the final trace's LLM forward, what it re-runs, says x1.27."""
    facts = (final_report or {}).get("facts") or {}
    step = facts.get("step.ms")
    if not isinstance(step, (int, float)) or step <= 0:
        return {}
    from vlmdoctor.doctor.rules import load_rules, undo_ms  # deferred: the rule engine loads pandas

    by_id = {r.id: r for r in load_rules(*tr.opts.rules_dirs)[0]}
    out = {}
    for c, _ in cands:
        rule = by_id.get(c["rule"])
        ms = undo_ms(rule, facts) if rule else None
        if ms is not None and ms >= 0:
            out[c["rule"]] = 1 + ms / step
    return out


def _sizes(tr: Treatment, start: RunConfig, final_cfg: RunConfig) -> tuple[int, int, float | None, float | None]:
    """The start and final batches, the final config's step and its GPU's busy share (its rung is the ladder's last
    while it is ablated), for `final_config_x`."""
    final = tr.out["ladder"][-1]
    return start.batch_size, final_cfg.batch_size, final.get("step_ms"), busy_frac(final.get("profile"))


def in_process_contributions(changes: list[dict[str, Any]], results: list[dict[str, Any]], opts: TreatOptions) -> None:
    """Each change's contribution from the in-process arms that runs of the final config measured (`results`: their
    reports' `in_process`, the pairs pooled over the runs), where no comparison of it alone decided it: two pairs or
    more are judged as the ablation's are, at the limit; out of memory without it before two pairs, it is needed (on
    one H200 the arm without qwen2-vl-2b's labeled-rows head ran two windows at batch 52, then ran out of memory: its
    pairs stand). One pair, or an arm that failed otherwise, leaves the contribution as it was."""
    for c in changes:
        if c["contribution"]["how"] not in TO_ABLATE:
            continue
        name = f"without {c['rule']}"
        arms = [r["arms"][name] for r in results if name in (r.get("arms") or {})]
        ratios = [x for a in arms for x in a.get("ratios") or []]
        oom = any(a.get("status") == "oom" for a in arms)
        if oom and len(ratios) < 2:  # out of memory before it measured two pairs: the final config needs it
            c["contribution"] = {
                "outcome": "kept",
                "how": IN_PROCESS,
                "why": "out of memory without it (in one process)",
                "in_process": True,
            }
        elif len(ratios) >= 2:
            d = verdict(ratios, opts.min_gain, opts.confidence, final=True)
            c["contribution"] = (
                {k: d[k] for k in ("ratio", "ci_low", "ci_high", "pairs", "ratios")}
                | {
                    "outcome": d["outcome"],
                    "how": IN_PROCESS if d["outcome"] == "kept" else IN_PROCESS_OPEN,
                    "decided_by": d["how"],
                    "in_process": True,
                }
                | ({"why": "ran out of memory in a later window (in one process)"} if oom else {})
            )


def _candidates(
    tr: Treatment, start: RunConfig, adopted: list[list[dict[str, Any]]], final_cfg: RunConfig
) -> list[tuple[dict[str, Any], RunConfig]]:
    """The changes to ablate, each with the final config without it, as many as fit; a change the others need,
    or whose knobs a later round set again, is decided here without a run."""
    cands: list[tuple[dict[str, Any], RunConfig]] = []
    for c in (c for changes in adopted for c in changes):
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
    # each arm is a config not run before: it takes what such runs took (`new_run_s`), its compilation included
    runs_left = (tr.time_left() / tr.new_run_s()) if tr.run_s and tr.new_run_s() > 0 else math.inf
    # each GPU runs as many; each but the first without a run of the final config to reuse runs it once more
    gpus = max(1, tr.opts.trial_gpus)
    runs_left = runs_left * gpus - (gpus - 1 - len(_reused_finals(tr, final_cfg, gpus)))
    return _ablations_that_fit(cands, max(0, tr.opts.max_trials - len(tr.out["trials"])), runs_left)


def _judge(
    tr: Treatment,
    c: dict[str, Any],
    ab: dict[str, Any],
    pooled: tuple[float, int] | None,
    expected_x: float | None = None,
    expected_at: str = "final",
) -> int:
    """One ablation arm's trial, and the change's contribution from it (`expected_x`: the rules' estimate of it in
    the final config, `final_config_x`, or read in the final trace, `_undo_x`: `expected_at`); returns the trial's
    number."""
    opts = tr.opts
    name = f"without {c['rule']}"
    dd, a = ab["decisions"][name], ab["arms"][name]
    o = outcome_of(dd, a)
    # a change whose removal breaks the run is needed: on the H100 the 0.5b batch-83 config ran out of
    # memory without compile, whose fused loss never holds the fp32 logits (an 11.8 GiB allocation)
    broke = BROKEN_WITHOUT.get(o)
    why = {"why": broke} if broke else {}
    if dd.get("outcome") == STOPPED_BY_BUDGET:
        why = {"why": "the time budget stopped its run: not measured"}
    few = dd.get("ratios") and len(dd["ratios"]) < opts.min_pairs
    if not broke and few and pooled and pooled[1] >= POOLED_MIN_DF and o in ("kept", "undecided", *LIKELY):
        dd = pooled_verdict(dd["ratios"], pooled, opts.min_gain, opts.confidence) | {"why": dd.get("why")}
        o = dd["outcome"]
    if o == "kept" and not broke and not is_shown(dd):
        o = "likely_gain"  # two pairs beyond 1.5x, but their interval does not exclude no gain: not shown
    o = "kept" if broke else o
    entry = record_trial(tr.out, "ablation", name, [c], o, dd | why, a)
    if expected_x is not None and (expected_x != entry["expected_x"] or expected_at != "final"):
        entry |= {"expected_x": expected_x, "expected_at": expected_at}
    prior = c["contribution"]
    if o == "undecided" and prior.get("ratio") is not None:  # its composition's own pairs say more
        prior["ablation"] = f"trial {entry['trial']}: undecided in {dd.get('pairs') or 0} pair(s)"
        return entry["trial"]
    c["contribution"] = (
        {k: dd.get(k) for k in ("ratio", "ci_low", "ci_high", "pairs", "ratios")}
        | {"outcome": o, "how": "leave-one-out ablation in the final config", "trial": entry["trial"]}
        | {"decided_by": dd.get("how")}
        | why
    )
    return entry["trial"]


def _dropped(ladder: list[dict[str, Any]], adopted: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The changes shown not to pay, each named on its rung; a round none of whose changes paid alone, though the
    round did, keeps them as the group it measured."""
    dropped: list[dict[str, Any]] = []
    for rung, changes in zip(ladder[1:], adopted):
        out_ = [
            c
            for c in changes
            if c["contribution"]["outcome"] in ("no_gain", "harmful") and c["contribution"]["how"] != IN_PROCESS_OPEN
        ]
        if out_ and len(out_) == len(changes) and all(c["contribution"]["outcome"] == "no_gain" for c in out_):
            for c in out_:  # the round paid, but no change of it could be resolved alone: kept as the group measured
                c["contribution"]["kept_as_group"] = True
            continue
        rung["dropped"] = [c["rule"] for c in out_]
        dropped += out_
    return dropped


def _rung_without(tr: Treatment, dropped: list[dict[str, Any]], ab: dict[str, Any]) -> dict[str, Any]:
    """The ladder's last rung: the final config without the dropped changes, measured where one change was
    dropped (its ablation arm), else the last rung's speedup times 1/contribution of each."""
    last = tr.out["ladder"][-1]
    adjust = math.prod(1 / c["contribution"]["ratio"] for c in dropped if c["contribution"].get("ratio"))
    measured = ab["arms"][f"without {dropped[0]['rule']}"] if len(dropped) == 1 else None
    report = next((r for r in reversed(measured.reports) if r.get("status") == "ok"), None) if measured else None
    return {
        "step": len(tr.out["ladder"]),
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


def _ablations_that_fit(
    cands: list[tuple[dict[str, Any], RunConfig]], most: int, runs_left: float
) -> list[tuple[dict[str, Any], RunConfig]]:
    """The ablations to run: every change when --max-trials and one pair each fit (k arms take k runs: the
    final config's first run is the last round's), else as many as fit: the changes no comparison measured
    alone first, then those whose target the traces cannot give them alone (`treat_attribution.separable`), then
    the largest expected gain first (one pair resolves only a large contribution). An
    ablation that decides nothing leaves a one-change round's own evidence standing. The comparison then
    measures more pairs while the time lasts. Before, ablations were sized for three pairs each: on the
    H100 a 0.5b ladder ended with 183 s left at 39 s a run and ablated nothing, and in every ladder most
    of round 1's changes stayed "undecided": the user never learned which change mattered."""
    # a change no comparison measured alone first (a one-change round's own pairs already say something), then one
    # whose target the traces cannot give it alone (doctor/treat_attribution.py: another change reads the same cost)
    order = sorted(
        cands,
        key=lambda cw: (cw[0]["contribution"].get("ratio") is not None, separable(cw[0]), -_expected_x(cw[0])),
    )
    n = most if math.isinf(runs_left) else min(most, int(runs_left))
    return order[: max(0, n)]


def _expected_x(change: dict[str, Any]) -> float:
    """The throughput factor the rule expected (1 when it gave none): ablations start with the smallest."""
    g = change.get("expected_gain") or {}
    return float(g.get("throughput_x") or 1.0)
