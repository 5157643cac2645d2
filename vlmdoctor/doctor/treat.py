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
   the paired ratio) and adopt the best one that is kept or likely; then compose again. With
   `--trial-gpus N` a round's pairs run on N GPUs at once, a pair's two runs on one GPU;
5. rediagnose: before it stops for want of prescriptions, the adopted config is run once more with
   a trace and diagnosed again (one diagnosed run decides whether a noisy threshold trips: on the
   H100 the 0.5b batch-22 config ran 82-86% GPU busy against the batch rule's 85%), and wherever
   the measured peak memory leaves room for a larger batch, the batch ceiling is probed;
6. ablate: each adopted change's own contribution by leave-one-out in the final config, every
   change given a pair where the time holds one each (a share of the budget is kept for it once a
   change is adopted: `reserve`), few pairs judged with the treatment's pooled spread. A change
   shown to stay below `min_gain` is dropped; one whose interval is still open stays. Before it, the
   arms that the composition's runs measured in their own process (run/arms.py) decide the changes
   they show to pay (`_plan_arms`, `treat_ablation.in_process_contributions`).

"kept" means the gain is shown (the interval's lower bound above 1, or the sign test). A
composition taken on two pairs both beyond 1.5x (`decide.large_effect`) whose interval still
reaches below 1, or a likely gain at the limit (every pair above the bar, too few to decide), is
"adopted": the ladder moves on with it and its changes stay for the ablation to measure.

A trial is one arm of a comparison (a composition, or one ablation); each keeps the rules' expected
gain beside the measured one (`expected_x`, and the result's `calibration`). Ctrl-C ends the
treatment and keeps what was measured.

Here: the state machine. Its parts: a round's compositions (treat_compose.py), the batch ceiling
(treat_batch.py), a trial's record (treat_trials.py), the final ablation (treat_ablation.py).
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from vlmdoctor import SCHEMA_VERSION, __version__, supervise
from vlmdoctor.doctor.decide import ArmResult, interleaved, throughput, verdict
from vlmdoctor.doctor.treat_ablation import (
    ADOPTED_LIKELY,
    ADOPTED_OPEN,
    IN_ONE_PROCESS,
    NOT_ABLATED,
    TO_ABLATE,
    final_ablation,
    in_process_arms,
    in_process_contributions,
)
from vlmdoctor.doctor.treat_attribution import attribute, unseparable
from vlmdoctor.doctor.treat_batch import (
    PROBE_MAX_FACTOR,
    PROBE_MIN_STEP,
    PROBE_RULE,
    MemoryModel,
    family,
    with_probe,
)
from vlmdoctor.doctor.treat_compose import apply, compose, config_key, merged_patch, smaller_batch
from vlmdoctor.doctor.treat_options import TreatOptions  # the limits, declared in a light module
from vlmdoctor.doctor.treat_trials import (
    STOPPED_BY_BUDGET,
    adopted_outcome,
    composed_x,
    is_shown,
    likely_why,
    outcome_of,
    record_trial,
    summary,
)
from vlmdoctor.errors import UsageError
from vlmdoctor.run.arms import ARMS_MARGIN_S, ARMS_S, MAX_ARMS, MIN_ARMS_S, TWO_ROUNDS_S, switch_patch
from vlmdoctor.run.config import RunConfig
from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

#: run(cfg, diagnose, timeout[, device]) -> a profile report; treat calls run_isolated through the CLI. `device`
#: (the GPU to pin the run to) is passed only where runs go to several GPUs at once (sizing's first step, compare's
#: lanes, the ablation)
Runner = Callable[..., dict[str, Any]]
#: runs in several threads at once (--trial-gpus) record their seconds and memory one at a time
_RECORDING = threading.Lock()
Notify = Callable[[str], None]
#: the most runs a composition's batch sizing takes: its first run, one raised to the ceiling, one bisection
SIZE_MAX_RUNS = 3
#: on N GPUs, the first sizing step's batches: b0, 2 b0, 4 b0 on GPUs 0-2 (on two GPUs b0 and 4 b0), the memory
#: line through the two largest. Two small ones misread it: on four H200s (qwen2-vl-2b, 2026-11-28) batches 11 and
#: 22 read 1.41 GiB a sample and promised batch 81, which ran out of memory; batches 22 to 73 take 1.56-1.67. On two
#: H200s the same day, 11 and 22 promised 80, which ran at the memory wall (WALL_SLOWER)
SIZE_POINTS = 3
#: a rule's estimate this far from the measured ratio, either way, is called far off in the calibration
FAR_OFF = 1.25


def _label(patch: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in patch.items())


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
    fam = family(cfg)
    ceiling = mem.ceiling(cfg)
    if fam in mem.flat:
        parts.append(f"batch {mem.flat[fam]} measured no better than {cfg.batch_size}")
    elif fam in mem.oom:
        parts.append(f"batch {cfg.batch_size}; {mem.over_words(fam, mem.oom[fam])}")
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
ONE_PROCESS = "one_process"  # a later round with no room for fresh pairs: its compositions as arms of one run
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
    "are measured by leave-one-out in the final config: in its own process where their knobs switch there, and "
    "in fresh processes (only these drop a change); a later round with no room for fresh pairs, whose compositions "
    "switch in one process, is measured as windows of the current config and of each composition in turn in one run, "
    "and adopted only where the interval (not the limit's lean) shows the gain"
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
        from vlmdoctor.run.runner import check as validate  # deferred: the runner imports torch
    if opts.trial_gpus != 1:
        opts = replace(opts, trial_gpus=resolve_trial_gpus(opts.trial_gpus, cfg))
    return _Treatment(cfg, run, opts, notify, validate).go()


def resolve_trial_gpus(n: int, cfg: RunConfig) -> int:
    """The GPUs a round's pairs and the final ablation run on at once: `n` (0: every visible one), at most those
    visible; 1 on a CPU, where parallel runs would share the cores they time, and for a distributed config, whose
    runs use the GPUs."""
    if cfg.nproc_per_node > 1 or cfg.device == "cpu":
        return 1
    import torch  # deferred: --trial-gpus 1, the default, needs no torch here

    if cfg.device == "auto" and not torch.cuda.is_available():
        return 1
    visible = torch.cuda.device_count()
    return max(1, min(n, visible) if n else visible)


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
        self.first_run_s: list[float] = []  # wall time of each config's first run (`new_run_s`)
        self.ran: set[str] = set()  # the configs run so far
        self.mem = MemoryModel()  # peak memory against the batch, from every run: where the batch ceiling is
        self.current_cfg = cfg
        self.current: dict[str, Any] = {}
        self.start_report: dict[str, Any] = {}  # the start config's diagnosed run (the trace attribution's first)
        self.speedup = 1.0
        self.tried: set[str] = set()
        self.rediagnosed: set[str] = set()  # configs diagnosed a second time before the treatment could stop on them
        self.pending: list[dict[str, Any]] = []  # a composition to retry with a smaller batch after an OOM
        self.adopted: list[list[dict[str, Any]]] = []  # each adopted round's changes, in order
        # the adopted config's last clean run on each of compare's lanes (lane g: GPU g), and that config's key: the
        # final ablation's GPU g >= 1 takes it as its final arm's first run instead of running the config again
        self.final_by_lane: dict[int, dict[str, Any]] = {}
        self.final_by_lane_cfg: str | None = None
        self.live: dict[str, Any] = {}  # what the round in flight has measured, for Ctrl-C
        self.comps: list[dict[str, Any]] = []  # the round's compositions
        self.first: dict[str, dict[str, Any]] = {}  # a composition's sizing run: its first run of the comparison
        self.first_s: dict[str, float] = {}
        # lane g >= 1's runs made already of the round's arms on GPU g (the current config, a composition at its
        # sized batch): its first pair, or half of it, in the comparison (`interleaved`'s lane_first)
        self.lane_first: dict[int, dict[str, dict[str, Any]]] = {}
        self.sized_on: dict[tuple[str, int], tuple[dict[str, Any], float]] = {}  # (config, GPU): a sizing run
        self.reserved = 0.0  # the most seconds kept for the ablation
        # in-process arms (run/arms.py), by the config's key: a composition's, and what each run of it measured
        self.arms_by_cfg: dict[str, dict[str, dict[str, Any]]] = {}
        self.in_process: dict[str, list[dict[str, Any]]] = {}
        self.arm_turns: dict[str, int] = {}  # runs of a config that took a share of its arms (`_share`)
        self.last_s: dict[str, float] = {}  # each config's last run's seconds: what its next run is expected to take
        # the adopted rounds whose config `current`'s trace is of (a round adopted in one process has no trace), and
        # the round whose leave-one-out arms the ablation reads from its config's runs (its index, the config's key)
        self.traced_rounds = 0
        self.arms_round: tuple[int, str] | None = None
        self.current_key: str | None = None  # the config `current` is a run of (after a round in one process: older)
        self.machine = Machine(self.t0, lambda: len(self.run_s))

    # --- the clock and the runs ---

    def time_left(self) -> float:
        return math.inf if self.opts.time_budget_s is None else self.opts.time_budget_s - (time.time() - self.t0)

    def mean_run_s(self) -> float:
        return statistics.fmean(self.run_s) if self.run_s else 0.0

    def new_run_s(self) -> float:
        """What the first run of a config not yet run is expected to take: the mean of such runs so far (they pay the
        compilation a later run finds cached), else of every run. An ablation arm is such a run: on the H200, 0.5b
        arms took about 80 s where the treatment's runs had averaged 50 s, and the last one ran past the budget."""
        return statistics.fmean(self.first_run_s) if self.first_run_s else self.mean_run_s()

    def runner(
        self, c: RunConfig, diagnose: bool, device: int | None = None, arms: dict[str, dict[str, Any]] | None = None
    ) -> Callable[[], dict[str, Any]]:
        """A run of `c` in a fresh process; `device`: the GPU it is pinned to (compare's lanes, the ablation on
        several GPUs: then runs of other threads record beside it, one at a time); `arms`: the in-process arms it
        measures (default: those planned for its config, `_arms_for`)."""

        def go() -> dict[str, Any]:
            # the budget is a limit on the runs' ends: a run is stopped where the budget ends. On two H200s
            # (2026-11-27) a run could go 20 s past it and a treatment with --time-budget 500 ended at 522 s
            left = self.time_left()
            limit = self.opts.trial_timeout_s
            by_budget = left < limit
            if by_budget and left <= 0:
                return {"status": STOPPED_BY_BUDGET, "error": {"message": "the time budget ended before it started"}}
            if by_budget:
                limit = left
            key = config_key(c)
            asked = self._arms_for(key, limit, arms)
            t = time.time()
            where = () if device is None else (device,)
            rep = self.run(c, diagnose, limit, *where, **asked)
            if by_budget and rep.get("status") == "timeout":  # the budget stopped it, not its config's slowness
                rep = {**rep, "status": STOPPED_BY_BUDGET}
            took = time.time() - t
            with _RECORDING:
                self.run_s.append(took)
                self.last_s[key] = took - asked.get("in_process_s", 0.0)
                if key not in self.ran:
                    self.ran.add(key)
                    self.first_run_s.append(took)
                self.mem.observe(c, rep)
                got = rep.get("in_process") or {}
                if asked and got.get("arms"):
                    self.in_process.setdefault(key, []).append(got)
            return rep

        return go

    def _open_arms(self, key: str) -> dict[str, dict[str, Any]]:
        """The leave-one-out arms planned for config `key` (`_plan_arms`) that no run has measured in two rounds or
        more yet. On one GPU a run measures the first MAX_ARMS of them, and one such run closes them all."""
        arms = self.arms_by_cfg.get(key) or {}
        runs = [r for r in self.in_process.get(key, []) if (r.get("rounds") or 0) >= 2]
        if self.opts.trial_gpus <= 1:
            return {} if runs else arms
        done = {name for r in runs for name in r.get("arms") or {}}
        return {name: patch for name, patch in arms.items() if name not in done}

    def _share(self, key: str, arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """The arms one run of config `key` measures, at most MAX_ARMS: on one GPU the first; on --trial-gpus N the
        runs of one config take the open arms' groups of MAX_ARMS in turn, so that lanes running it at once measure
        different changes. Why: on four H200s (llava-siglip2-0.5b, 2026-11-28) the three lanes' runs of the adopted
        composition each measured the same three arms (two of them out of memory at once), and the loader's
        workers, padding to 64 and to a multiple, which switch in one process too, had no time left for an arm."""
        items = list(arms.items())
        if self.opts.trial_gpus <= 1 or len(items) <= MAX_ARMS:
            return dict(items[:MAX_ARMS])
        groups = [items[i : i + MAX_ARMS] for i in range(0, len(items), MAX_ARMS)]
        with _RECORDING:  # the lanes ask at once, from their threads
            turn = self.arm_turns.get(key, 0)
            self.arm_turns[key] = turn + 1
        return dict(groups[turn % len(groups)])

    def _arms_for(self, key: str, limit: float | None, arms: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The in-process arms a run of config `key` is asked to measure (the run's keyword arguments), and in how many
        seconds: what its limit leaves after the run itself is expected to end (its config's last run, else a new
        config's), at most ARMS_S; none below MIN_ARMS_S or without arms. `arms` default: `_open_arms`."""
        arms = self._share(key, self._open_arms(key)) if arms is None else arms
        if not arms:
            return {}
        seconds = self._arms_seconds(key, limit)
        return {"in_process": arms, "in_process_s": seconds} if seconds >= MIN_ARMS_S else {}

    def _arms_seconds(self, key: str, limit: float | None) -> float:
        """What a run of config `key` under `limit` leaves its arms after the run itself is expected to end (its
        config's last run, else a new config's) and ARMS_MARGIN_S, at most ARMS_S."""
        expected = self.last_s.get(key, self.new_run_s())
        return min(ARMS_S, (math.inf if limit is None else limit) - expected - ARMS_MARGIN_S)

    def _plan_arms(self, comp: dict[str, Any]) -> None:
        """The composition's leave-one-out arms that a run of it can measure in its own process (run/arms.py), in
        order (a run takes MAX_ARMS of them: `_share`): first the changes whose target the traces cannot give them
        alone (`unseparable`: the trace attribution measures the others' targets), then the largest expected gain. A
        one-change composition's own pairs are its change's worth: none."""
        changes = comp["changes"]
        if len(changes) < 2:
            return
        need = unseparable(self.start_report, changes, self.opts.rules_dirs)
        order = sorted(changes, key=lambda x: (x["rule"] not in need, -(composed_x([x]) or 1.0)))
        arms = in_process_arms(self.current_cfg, comp["config"], changes, order)
        if arms:
            self.arms_by_cfg[config_key(comp["config"])] = arms

    def reserve(self) -> float:
        """Seconds kept for the final ablation: its share of the budget, at most what ablating every adopted change
        in min_pairs pairs takes at the mean run so far (on --trial-gpus N, each GPU ablates a share of the changes
        at once); none before a change is adopted, or without a budget."""
        if self.opts.time_budget_s is None or not self.run_s:
            return 0.0
        k = sum(c["contribution"]["how"] in TO_ABLATE for changes in self.adopted for c in changes)
        p = self.opts.min_pairs
        arms = math.ceil(k / max(1, self.opts.trial_gpus))  # the most arms one GPU runs
        kept = (
            min(self.opts.ablation_share * self.opts.time_budget_s, (arms * p + p - 1) * self.mean_run_s())
            if k
            else 0.0
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
            ONE_PROCESS: self.one_process,
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
        self.current = self.start_report = current
        self.current_key = config_key(self.cfg)
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
        comps = [c for c in found if config_key(c["config"]) not in self.tried][:budget]
        if not comps:
            if config_key(self.current_cfg) in self.rediagnosed:
                return self.stop(STOP_NOTHING_LEFT, _nothing_left(out, found, self.current_cfg, self.mem))
            if self.run_s and self.time_left() - self.reserve() < 2 * self.mean_run_s():
                return self.stop(
                    STOP_TIME,
                    f"{self._budget_words()}: too little left to diagnose the adopted config again and measure "
                    "another round",
                )
            return REDIAGNOSE
        if not self._round_fits(comps):
            switched = self._one_process_arms(comps)
            if switched and self.arms_s() >= TWO_ROUNDS_S:
                self._open_round([c for c in comps if c["name"] in switched])
                return ONE_PROCESS
            return self.stop(
                STOP_TIME,
                f"{self._budget_words()}: a round of {len(comps)} new composition(s) does not fit beside the "
                f"{self.reserve():.0f} s kept for the ablation",
            )
        self._open_round(comps)
        return SIZE if self.mem.total_gb else COMPARE

    def _open_round(self, comps: list[dict[str, Any]]) -> None:
        """A new round of `comps` in the result, each marked tried."""
        self.comps, self.first, self.first_s, self.sized_on = comps, {}, {}, {}
        self.lane_first = {g: {"current": r} for g, r in self._current_on_lanes().items()}
        self.out["rounds"].append(
            {
                "round": len(self.out["rounds"]) + 1,
                "started_s": time.time() - self.t0,
                "current_config": self.current_cfg.to_dict(),
                "compositions": [],
            }
        )
        for c in comps:
            self.tried.add(config_key(c["config"]))

    def _round_fits(self, comps: list[dict[str, Any]]) -> bool:
        """A later round of new compositions starts only when its pairs fit beside the ablation's reserve: two
        pairs where every composition is expected to beat the large-effect factor, else min_pairs. Round 1
        always starts (nothing is adopted yet, so nothing is reserved). On --trial-gpus N the pairs run in lanes,
        N at a time: a round of every arm per lane takes as long as one lane's."""
        if self.opts.time_budget_s is None or not self.run_s or not self.adopted:
            return True
        large = all((composed_x(c["changes"]) or 1.0) >= self.po.large_effect for c in comps)
        pairs = 2 if large and self.po.large_effect > 1 else self.po.min_pairs
        lanes = max(1, self.opts.trial_gpus)
        runs = len(comps) * pairs + pairs - 1 if lanes == 1 else math.ceil(pairs / lanes) * (len(comps) + 1)
        need = runs * self.mean_run_s()
        return need <= self.time_left() - self.reserve()

    def size(self) -> str:
        """Each composition's batch sized in its own round: the memory model's ceiling for the composition's own
        family (its first run's peak), bisected on out of memory, not a round later."""
        self.out["rounds"][-1]["sizing"] = []
        sized = []
        for comp in self.comps:
            chosen = self._size(comp)
            if chosen is None:
                sized.append(comp)
                continue
            comp = chosen
            sized.append(comp)
            # each GPU's run of it: that lane's first run of the arm (lane 0's also where it failed: the comparison
            # records the failure without running it again)
            for g in range(max(1, self.opts.trial_gpus)):
                run = self.sized_on.get((config_key(comp["config"]), g))
                if run is not None and g == 0:
                    self.first[comp["name"]], self.first_s[comp["name"]] = run
                elif run is not None and _sized_ok(run[0]):
                    self.lane_first.setdefault(g, {})[comp["name"]] = run[0]
        self.comps = sized
        return COMPARE

    def _current_on_lanes(self) -> dict[int, dict[str, Any]]:
        """Lane g >= 1's last clean run of the current config (compare's, of the config it adopted), by GPU."""
        if self.final_by_lane_cfg != config_key(self.current_cfg):
            return {}
        return {g: r for g, r in self.final_by_lane.items() if g}

    def _size(self, comp: dict[str, Any]) -> dict[str, Any] | None:
        """The composition at the batch its memory allows (None: no run fitted); its runs are in `sized_on`.

        Its first run, at the batch the rules chose, measures its family's memory; where the ceiling is 25% or more
        above that batch, the batch is raised to it and run again; an out-of-memory run is bisected between the
        largest batch that ran and it (or its batch step halved). On --trial-gpus N the first step runs N batches
        at once (`_size_at_once`) and the steps after it go on from the largest that ran. The comparison pairs the
        largest batch that ran (the runs it took stay in the round's `sizing`).

        On N GPUs a step after the first runs its batch on every GPU at once, GPU 0's run traced and diagnosed (the
        next round composes from it): where that batch is the one chosen, every lane holds its first run of it
        (`size`), and the comparison's first round needs no run where a lane holds the current config's too."""
        best = last = None
        runs = SIZE_MAX_RUNS
        nxt: dict[str, Any] | None = comp
        n = self.opts.trial_gpus
        if n > 1:
            if not self._new_run_fits():
                return None
            got = self._size_at_once(comp)
            within, ceiling = self._within_ceiling(got)
            best = max(within, key=lambda r: r[0]["config"].batch_size, default=None)
            last = best or got[0]  # none ran: go on from the rules' batch, as on one GPU
            if best is not None and ceiling is not None:
                self.out["rounds"][-1]["sized_at_once"] = {
                    "batch_size": best[0]["config"].batch_size,
                    "how": ceiling[1],
                }
            nxt, runs = self._next_size(last[0], last[1]), SIZE_MAX_RUNS - 1
        for _ in range(runs):
            if nxt is None or not self._new_run_fits():
                break
            comp = nxt
            b = comp["config"].batch_size
            on = f" on {n} GPUs at once (each lane's first run of it)" if n > 1 else ""
            self.notify(f"round {len(self.out['rounds'])}: sizing {comp['name']} at batch {b}{on}")
            rep, took = self._size_step(comp) if n > 1 else self._size_one(comp)
            last = (comp, rep, took, 0)
            if self._fits(comp, rep):
                best = last
            nxt = self._next_size(comp, rep)
        chosen = best or last
        return None if chosen is None else chosen[0]

    def _timed(self, c: RunConfig, diagnose: bool, gpu: int) -> Callable[[], tuple[dict[str, Any], float]]:
        """A run of `c` on GPU `gpu` (0: lane 0's, unpinned) that returns its report and seconds."""

        def go() -> tuple[dict[str, Any], float]:
            t = time.time()
            rep = self.runner(c, diagnose, gpu or None)()
            return rep, time.time() - t

        return go

    def _size_one(self, comp: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """A sizing run on one GPU (lane 0's), recorded; its report and seconds."""
        rep, took = self._timed(comp["config"], False, 0)()
        self._record_sizing(comp, rep, 0, took)
        return rep, took

    def _size_step(self, comp: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """A sizing step after the first on N GPUs: the batch on every GPU at once, GPU 0's run (unpinned, as lane 0's
        every run) traced and diagnosed; each run recorded with its GPU; GPU 0's report and seconds. Why: on four
        GPUs, this step ran on GPU 0 alone and the comparison's first round then ran both arms on GPUs 1-3, about
        120 s in the chain to the adopted config."""
        jobs = [self._timed(comp["config"], g == 0, g) for g in range(self.opts.trial_gpus)]
        done = supervise.at_once(jobs, "sizing-gpu")  # Ctrl-C stops every run
        for g, (rep, took) in enumerate(done):
            self._record_sizing(comp, rep, g, took)
        return done[0]

    def _fits(self, comp: dict[str, Any], rep: dict[str, Any]) -> bool:
        """A sizing run that ran, measured a throughput, and not at the memory wall (`MemoryModel.too_large`)."""
        return _sized_ok(rep) and not self.mem.at_wall(comp["config"])

    def _new_run_fits(self) -> bool:
        """A run of a config not run before ends within the budget (`new_run_s`): a sizing run that the budget would
        stop measures nothing."""
        left = self.time_left()
        return left > 0 and left >= self.new_run_s()

    def _within_ceiling(
        self, got: list[tuple[dict[str, Any], dict[str, Any], float, int]]
    ) -> tuple[list[tuple[dict[str, Any], dict[str, Any], float, int]], tuple[int, str] | None]:
        """The runs of the parallel step that ran cleanly at a batch the memory model's ceiling (its headroom
        included) holds, the smallest clean one where none does; and that ceiling (None: none ran, or no memory
        facts). A batch that ran its few steps near the card's limit is not chosen: a longer sequence bucket later
        in training would run out of memory."""
        ok = [r for r in got if self._fits(r[0], r[1])]
        ceiling = self.mem.ceiling(got[0][0]["config"]) if ok else None
        if ceiling is None:
            return ok, None
        within = [r for r in ok if r[0]["config"].batch_size <= ceiling[0]]
        return within or sorted(ok, key=lambda r: r[0]["config"].batch_size)[:1], ceiling

    def _size_at_once(self, comp: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any], float, int]]:
        """The first sizing step on --trial-gpus N GPUs at once, one run each: the rules' batch b0 on GPU 0 (lane 0,
        unpinned, as every other run of the treatment), b0 * `_point_x` on GPU g < SIZE_POINTS (the line's points);
        on GPU g >= SIZE_POINTS, the current config where lane g holds no run of it (its first pair's reference run,
        kept in `lane_first`), else b0 * 2**g; at most PROBE_MAX_FACTOR x b0 (a batch tried already, or an invalid
        config, leaves its GPU idle). Each run's memory feeds the memory model (`runner`). Why: sized one run at a
        time, a composition took 2-3 runs of 45-70 s each on four H200s (2026-11-27) while the other GPUs idled; with
        every GPU sizing, the comparison's first round then ran both arms on GPUs 1-3. Returns the sizing runs."""
        n, b0 = self.opts.trial_gpus, comp["config"].batch_size
        lanes: list[tuple[int, dict[str, Any] | None]] = [(0, comp)]  # None: the current config, lane g's reference
        for g in range(1, n):
            if g >= SIZE_POINTS and "current" not in self.lane_first.get(g, {}):
                lanes.append((g, None))
                continue
            how = f"tried at once on GPU {g} while the rules' batch ran: {n} batches sized in one step"
            spec = self._with_batch(comp, min(b0 * _point_x(g, n), PROBE_MAX_FACTOR * b0), how)
            if spec is not None:
                self.tried.add(config_key(spec["config"]))
                lanes.append((g, spec))
        batches = ", ".join(str(c["config"].batch_size) for _, c in lanes if c is not None)
        refs = [str(g) for g, c in lanes if c is None]
        also = f"; the current config on GPU {', '.join(refs)} (each lane's first reference run)" if refs else ""
        self.notify(f"round {len(self.out['rounds'])}: sizing {comp['name']} at batch {batches}{also}")

        jobs = [self._timed(self.current_cfg if c is None else c["config"], False, g) for g, c in lanes]
        done = supervise.at_once(jobs, "sizing-gpu")  # Ctrl-C stops every run
        got = []
        for (g, c), (rep, took) in zip(lanes, done):
            if c is None:
                if _sized_ok(rep):
                    self.lane_first.setdefault(g, {})["current"] = rep
                continue
            got.append((c, rep, took, g))
            self._record_sizing(c, rep, g, took)
        return got

    def _record_sizing(self, comp: dict[str, Any], rep: dict[str, Any], gpu: int, took: float) -> None:
        """A sizing run in the round's `sizing` (on --trial-gpus N with the GPU it ran on) and in `sized_on`."""
        self.sized_on[(config_key(comp["config"]), gpu)] = (rep, took)
        self.out["rounds"][-1]["sizing"].append(
            {
                "name": comp["name"],
                "batch_size": comp["config"].batch_size,
                "status": rep.get("status"),
                "peak_mem_gb": (rep.get("metrics") or {}).get("peak_mem_gb"),
                "real_tokens_per_s": throughput(rep),
                **({"alloc_retries": r} if (r := (rep.get("metrics") or {}).get("alloc_retries")) is not None else {}),
                **({"device": gpu} if self.opts.trial_gpus > 1 else {}),
            }
        )

    def _next_size(self, comp: dict[str, Any], rep: dict[str, Any]) -> dict[str, Any] | None:
        """After a sizing run of `comp`: the composition at the next batch to try (marked tried), or None."""
        wall = self.mem.at_wall(comp["config"])
        ran = _sized_ok(rep) and not wall
        if not ran and rep.get("status") != "oom" and not wall:
            return None  # a failure other than memory: the comparison records it
        nxt = self._resized(comp, ran)
        if nxt is not None:
            self.tried.add(config_key(nxt["config"]))
        return nxt

    def _resized(self, comp: dict[str, Any], ran: bool) -> dict[str, Any] | None:
        """The composition at its next batch to try, or None: after a run, the ceiling when it is a step worth
        pairs; after an out-of-memory run, the middle between what ran and what did not, else half the step."""
        cfg = comp["config"]
        fam = family(cfg)
        ceiling = self.mem.ceiling(cfg)
        if ran:
            if fam in self.mem.flat and self.mem.flat[fam] > cfg.batch_size:
                return None  # a larger batch of this family was measured and did not pay
            if ceiling is None or ceiling[0] < math.ceil(PROBE_MIN_STEP * cfg.batch_size):
                return None
            return self._with_batch(comp, *ceiling)
        if ceiling is not None and self.current_cfg.batch_size < ceiling[0] < cfg.batch_size:
            return self._with_batch(comp, *ceiling)
        smaller = smaller_batch(self.current_cfg, comp)
        return smaller if smaller is not None and config_key(smaller["config"]) not in self.tried else None

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
        if config_key(config) in self.tried:
            return None
        base = comp["name"].split(" (batch")[0]
        return {"name": f"{base} (batch {target}, sized from memory)", "changes": changes, "config": config}

    def compare(self) -> str:
        out, opts, comps = self.out, self.opts, self.comps
        rnd = out["rounds"][-1]
        held = [self.first, *self.lane_first.values()]
        diagnosed = {  # shared by the lanes; a composition's held run traced already (`_size_step`) is its diagnosis
            c["name"]: _first_diagnosed(
                self.runner, c["config"], any((h.get(c["name"]) or {}).get("findings") is not None for h in held)
            )
            for c in comps
        }

        def lane_arms(g: int | None) -> dict[str, Callable[[], dict[str, Any]]]:
            """The arms of lane g, pinned to GPU g (lane 0: None, as every other run of the treatment)."""
            return {"current": self.runner(self.current_cfg, False, g), **{n: d(g) for n, d in diagnosed.items()}}

        for c in comps:
            self._plan_arms(c)
        lanes = max(1, opts.trial_gpus)
        on = f" (pairs on {lanes} GPUs at once)" if lanes > 1 else ""
        self.notify(
            f"round {rnd['round']}: " + "; ".join(f"{c['name']} ({len(c['changes'])} changes)" for c in comps) + on
        )
        self.live.clear()
        res = interleaved(
            lane_arms(None),
            "current",
            self.po,
            self.time_left,
            first={
                **({"current": self.current} if self.current_key == config_key(self.current_cfg) else {}),
                **self.first,
            },
            first_s=self.first_s,
            notify=self.notify,
            on_round=lambda r: self.live.update(arms=r, kind="composition", comps=comps),
            reserve_s=self.reserve(),
            lanes=lanes,
            lane_arms=lane_arms,
            new_run_s=self.new_run_s(),
            partial_pairs=True,
            lane_first=self.lane_first,
        )
        self.live.clear()
        rnd["lanes"], rnd["pairs"] = res["lanes"], res["pairs"]
        best = None
        for c in comps:
            d, arm = res["decisions"][c["name"]], res["arms"][c["name"]]
            d = d | likely_why(d)
            entry = record_trial(
                out, "composition", c["name"], c["changes"], adopted_outcome(outcome_of(d, arm), d), d, arm
            )
            rnd["compositions"].append(entry["trial"])
            if entry["outcome"] in ("kept", "adopted") and (best is None or d["ratio"] > best[1]["ratio"]):
                best = (c, d, arm)
            probe = next((ch for ch in c["changes"] if ch["rule"] == PROBE_RULE), None)
            if probe and len(c["changes"]) == 1 and entry["outcome"] not in ("kept", "adopted", "oom"):
                self.mem.flat[family(self.current_cfg)] = probe["config_patch"]["batch_size"]  # it did not pay
        if best is None:
            rnd["adopted"] = None
            oom = next((c for c in comps if res["decisions"][c["name"]].get("outcome") == "oom"), None)
            retry = smaller_batch(self.current_cfg, oom) if oom else None
            if retry is not None and config_key(retry["config"]) not in self.tried:
                # the batch was sized from the current config's memory; the composition's other changes (no
                # checkpointing, say) need more per sample: halve the batch step and measure again
                self.pending = [retry]
                out["stopped_because"] = "no composition paid off"
                return COMPOSE
            open_ = any(res["decisions"][c["name"]].get("outcome") == "undecided" for c in comps)
            if open_ and opts.time_budget_s is not None and res["pairs"] < self.po.max_pairs:
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
                shown = is_shown(d)
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
            self._rung(
                comp,
                d,
                changes,
                {**summary(composed_report), "real_tokens_per_s": throughput(composed_report)},
                "paired ratio of the composition vs the rung before",
            )
        )
        self.adopted.append(changes)
        self.traced_rounds = len(self.adopted) if composed_report.get("findings") is not None else self.traced_rounds
        self.arms_round = (len(self.adopted) - 1, config_key(comp["config"]))
        self.current_cfg, self.current = comp["config"], composed_report
        self.current_key = config_key(comp["config"])
        # a new config: each lane's last clean run of it replaces the previous config's
        self.final_by_lane = {g: r for g, r in zip(arm.lanes, arm.reports) if r.get("status") == "ok" and throughput(r)}
        self.final_by_lane_cfg = config_key(comp["config"])

    # --- a later round in one process ---

    def _one_process_arms(self, comps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Each composition whose config differs from the current one only in knobs a run switches in its own process
        (run/arms.py: the loader's, regional compile off), by name, with those knobs; at most MAX_ARMS."""
        arms = {}
        for c in comps:
            patch = switch_patch(self.current_cfg, c["config"])
            if patch:
                arms[c["name"]] = patch
        return dict(list(arms.items())[:MAX_ARMS])

    def arms_s(self) -> float:
        """Seconds of windows a run of the current config can still give arms: what its limit (the time left, at most
        --trial-timeout) leaves after the run itself (its config's last run) and ARMS_MARGIN_S, at most ARMS_S, as
        `_arms_for` asks them. The ablation's reserve is not kept from them in a later round in one process: the run
        also measures the current config's own leave-one-out arms where they are open."""
        return self._arms_seconds(config_key(self.current_cfg), min(self.time_left(), self.opts.trial_timeout_s))

    def one_process(self) -> str:
        """The round's compositions, for which fresh-process pairs leave no room, as arms of one run of the current
        config: windows of the current config and of each composition in turn (run/switch.py), each window pair a
        ratio. The best composition whose interval shows its gain is adopted on those pairs; a lean at the limit is
        not enough here. Why: on qwen2-vl-2b (one H200, 2026-11-28) the adopted config waited 68.7 ms of a 931 ms
        step on the loader, and the round that would add workers (three fresh pairs, five runs of about 78 s) did
        not fit the 102 s left; the same change measured x1.14 in another run's ablation."""
        out, rnd = self.out, self.out["rounds"][-1]
        key = config_key(self.current_cfg)
        arms = self._one_process_arms(self.comps)
        loo = list(self._open_arms(key).items())[: max(0, MAX_ARMS - len(arms))]
        rnd["in_one_process"] = True
        self.notify(f"round {rnd['round']}: {', '.join(arms)}, in one run of the current config (no room for pairs)")
        rep = self.runner(self.current_cfg, False, arms={**arms, **dict(loo)})()
        got = ((rep.get("in_process") or {}).get("arms")) or {}
        best = None
        for c in self.comps:
            measured = got.get(c["name"]) or {}
            d = _one_process_verdict(measured, self.opts)
            arm = ArmResult(c["name"], [], list(measured.get("tokens_per_s") or []))
            entry = record_trial(out, "composition", c["name"], c["changes"], d["outcome"], d, arm)
            entry["in_process"] = True
            rnd["compositions"].append(entry["trial"])
            if is_shown(d) and (best is None or d["ratio"] > best[0]["ratio"]):
                best = (d, c, entry)
        rnd["adopted"] = None
        if best is not None:
            self._adopt_in_one_process(*best)
        return COMPOSE

    def _adopt_in_one_process(self, d: dict[str, Any], comp: dict[str, Any], entry: dict[str, Any]) -> None:
        """The composition adopted on its pairs in one process: its rung's tokens/s are its windows' median; no run of
        it is traced, so the trace attribution and the next diagnosis stay with the rung before."""
        rnd = self.out["rounds"][-1]
        self.speedup *= d["ratio"]
        rnd["adopted"], rnd["ended_s"] = comp["name"], time.time() - self.t0
        own = {k: d[k] for k in ("ratio", "ci_low", "ci_high", "pairs")}
        changes = [
            {
                **ch,
                "contribution": (
                    {"outcome": "kept", "how": IN_ONE_PROCESS, "in_process": True, **own}
                    if len(comp["changes"]) == 1
                    else {"outcome": "undecided", "how": NOT_ABLATED}
                ),
            }
            for ch in comp["changes"]
        ]
        self.out["ladder"].append(
            self._rung(
                comp,
                d,
                changes,
                {"status": "ok", "real_tokens_per_s": entry.get("real_tokens_per_s")},
                "paired windows in one process: the composition against the rung before, in turn",
            )
            | {"in_process": True}
        )
        self.adopted.append(changes)
        self.current_cfg = comp["config"]

    def _rung(
        self,
        comp: dict[str, Any],
        d: dict[str, Any],
        changes: list[dict[str, Any]],
        numbers: dict[str, Any],
        how: str,
    ) -> dict[str, Any]:
        """The ladder's rung of an adopted composition: its knobs, its numbers, its paired ratio and changes."""
        return {
            "step": len(self.out["ladder"]),
            "change": _label(merged_patch(comp["changes"])),
            "rule": ", ".join(ch["rule"] for ch in comp["changes"]),
            "config_patch": merged_patch(comp["changes"]),
            **numbers,
            "speedup": self.speedup,
            "paired_ratio": d["ratio"],
            "ci": [d["ci_low"], d["ci_high"]],
            "speedup_how": how,
            "composed_of": [ch["rule"] for ch in comp["changes"]],
            "dropped": [],
            "changes": changes,
            "elapsed_s": time.time() - self.t0,
        }

    def rediagnose(self) -> str:
        """One diagnosed run decided that nothing is left: diagnose the adopted config again, with a trace (one
        diagnosed run decides whether a noisy threshold trips)."""
        self.rediagnosed.add(config_key(self.current_cfg))
        self.notify("nothing new to try: diagnosing the adopted config again, with a trace")
        again = self.runner(self.current_cfg, True)()
        if again.get("status") == "ok" and again.get("findings") is not None and throughput(again):
            self.current, self.traced_rounds = again, len(self.adopted)
            self.current_key = config_key(self.current_cfg)
            self.out.setdefault("rediagnosed", []).append(
                {"round": len(self.out["rounds"]), "findings": [f["id"] for f in again["findings"]]}
            )
        return COMPOSE

    def ablate(self) -> str:
        traced = self.adopted[: self.traced_rounds]
        if traced:  # each traced round's change's target in the start and the adopted config's traces: no run
            att = attribute(self.start_report, self.current, traced, self.opts.rules_dirs)
            if att is not None:
                self.out["trace_attribution"] = att
        measured = self.in_process.get(self.arms_round[1], []) if self.arms_round else []
        if measured:  # the last fresh-adopted round's changes, from the arms its composition's runs measured
            self.out["in_process"] = measured
            in_process_contributions(self.adopted[self.arms_round[0]], measured, self.opts)
        if self.current:  # its diagnosed run is the final arm's first where it is of the final config
            final_run = self.current if self.current_key == config_key(self.current_cfg) else None
            self.current_cfg = final_ablation(self, self.cfg, self.adopted, self.current_cfg, final_run)
        return DONE


def _one_process_verdict(arm: dict[str, Any], opts: TreatOptions) -> dict[str, Any]:
    """A composition measured as an arm of one run: its pairs' ratios are the arm's windows over the current config's
    (the inverse of what the arm records: the run's own over the arm's). Two pairs or more are judged as a round's,
    not at the limit; out of memory before two pairs is "oom"; fewer pairs is undecided."""
    gains = [1 / r for r in arm.get("ratios") or [] if r > 0]
    if len(gains) >= 2:
        return verdict(gains, opts.min_gain, opts.confidence) | {"why": f"{len(gains)} pairs of windows in one process"}
    if arm.get("status") == "oom":
        return {"outcome": "oom", "why": "out of memory in one process"}
    if arm.get("status") == "error":
        return {"outcome": "error", "why": arm.get("error") or "its windows failed in one process"}
    return {"outcome": "undecided", "why": f"{len(gains)} pair(s) of windows in one process: too few to decide"}


def _point_x(g: int, n: int) -> int:
    """GPU g's multiple of the rules' batch in the first sizing step on n GPUs: the SIZE_POINTS points span 1x to
    4x whatever n (two GPUs: 1x and 4x), past them 2**g."""
    k = min(n, SIZE_POINTS)
    return 2 ** round(2 * g / (k - 1)) if g < k else 2**g


def _sized_ok(rep: dict[str, Any]) -> bool:
    """A sizing run that ran and measured a throughput."""
    return rep.get("status") == "ok" and throughput(rep) is not None


# --- calibration: the rules' expected gains against what was measured ------------------------------------------


def calibration(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured trial's expected gain (a change's rule's estimate; a composition's, composed_x of its
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


def _first_diagnosed(
    runner: Callable[[RunConfig, bool, int | None], Callable[[], dict[str, Any]]],
    cfg: RunConfig,
    diagnosed: bool = False,
) -> Callable[[int | None], Callable[[], dict[str, Any]]]:
    """A composition's arm on each lane (GPU; None: the first, unpinned): its first run, on whichever lane comes
    first, is traced and diagnosed (the next round needs its findings) unless a run of it was (`diagnosed`); the
    pairs after it, on every lane, are timed only, which saves the trace window and its analysis. One count for
    every lane, under a lock: the lanes run at once."""
    lock, calls = threading.Lock(), {"n": int(diagnosed)}

    def on(device: int | None) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            with lock:
                calls["n"] += 1
                diagnose = calls["n"] == 1
            return runner(cfg, diagnose, device)()

        return go

    return on
