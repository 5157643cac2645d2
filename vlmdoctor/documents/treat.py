"""The treat result (treat.json): the start, each kept rung of the ladder, every trial with its decision's
numbers, the treatment's states and budget, and each trial's expected against measured gain."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from vlmdoctor.documents.base import (
    CompileS,
    Count,
    Doc,
    Fraction,
    Layer,
    Mfu,
    PadFraction,
    PeakMemGb,
    RealTokensPerS,
    Seconds,
    StepMs,
    Tool,
    Version,
    WarmupS,
)
from vlmdoctor.documents.diagnosis import ExpectedGain
from vlmdoctor.documents.run_report import Env, InProcess


class TreatDecision(Doc, kw_only=True):
    """The rule a change had to pass to be kept."""

    min_gain: Annotated[float | None, Meta(description="the smallest gain kept (0.02: 2%)")] = None
    confidence: Annotated[float, Meta(gt=0, lt=1, description="the paired interval's level")] | None = None
    min_pairs: Annotated[Count, Meta(description="paired runs before a decision")] | None = None
    max_pairs: Annotated[Count, Meta(description="paired runs at most")] | None = None
    rule: Annotated[str | None, Meta(description="the decision rule, in words")] = None


class RunSummary(Doc, kw_only=True):
    """One run's numbers as treat keeps them (doctor/treat.py `summary`)."""

    status: Annotated[str | None, Meta(description="how the run ended")] = None
    real_tokens_per_s: RealTokensPerS | None = None
    tokens_per_s_repeats: Annotated[list[float | None] | None, Meta(description="each timed window's")] = None
    step_ms: StepMs | None = None
    mfu: Mfu | None = None
    pad_fraction: PadFraction | None = None
    peak_mem_gb: PeakMemGb | None = None
    compile_s: CompileS | None = None
    warmup_s: WarmupS | None = None
    findings: Annotated[list[str] | None, Meta(description="ids of the run's findings")] = None
    warnings: Annotated[list[str] | None, Meta(description="the run's warnings")] = None
    error: Annotated[str | None, Meta(description="how the run failed")] = None
    profile: Annotated[dict[str, Any] | None, Meta(description="a few facts of the run's trace")] = None


class Rung(RunSummary, kw_only=True):
    """A step of the ladder: the start config, then each kept round, with its speedup over the start."""

    step: Annotated[Count, Meta(description="0: the start config")] | None = None
    change: Annotated[str | None, Meta(description="what this round changed")] = None
    rule: Annotated[str | None, Meta(description="the finding(s) whose fix it applied")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs it set")] = None
    speedup: Annotated[float, Meta(ge=0, description="tokens/s over the start config's")] | None = None
    speedup_how: Annotated[str | None, Meta(description="how the speedup was found")] = None
    paired_ratio: Annotated[float, Meta(ge=0, description="paired ratio over the previous rung")] | None = None
    composed_of: Annotated[list[str] | None, Meta(description="the findings the round applied together")] = None
    elapsed_s: Annotated[Seconds, Meta(description="since the treatment started")] | None = None
    changes: Annotated[
        list[dict[str, Any]] | None,
        Meta(description="each change of the round: its leave-one-out contribution, its target in both traces"),
    ] = None
    in_process: Annotated[
        bool | None,
        Meta(description="adopted on pairs of windows in one run (a later round with no room for fresh pairs)"),
    ] = None


class Trial(RunSummary, kw_only=True):
    """One candidate change or composition, measured against the current config in paired runs."""

    trial: Annotated[int, Meta(ge=1, description="its number")]
    rule: Annotated[str | None, Meta(description="the finding(s) whose fix it tried")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs it set")] = None
    kind: Annotated[str | None, Meta(description="single or composition")] = None
    name: Annotated[str | None, Meta(description="what it tried")] = None
    title: Annotated[str | None, Meta(description="the finding's title")] = None
    layer: Layer | None = None
    expected_gain: ExpectedGain | None = None
    outcome: Annotated[str | None, Meta(description="kept, harmful, no gain, failed, ...")] = None
    ratio: Annotated[float, Meta(ge=0, description="paired candidate/current tokens/s ratio")] | None = None
    gain: Annotated[float | None, Meta(description="the ratio - 1")] = None
    ci_low: Annotated[float | None, Meta(description="the ratio's interval, low end")] = None
    ci_high: Annotated[float | None, Meta(description="the ratio's interval, high end")] = None
    pairs: Annotated[Count, Meta(description="paired runs")] | None = None
    ratios: Annotated[list[float] | None, Meta(description="each pair's ratio")] = None
    runs: Annotated[Count, Meta(description="runs of the candidate")] | None = None
    tokens_per_s_runs: Annotated[list[float] | None, Meta(description="each run's tokens/s")] = None
    why: Annotated[str | None, Meta(description="the decision, in words")] = None
    margin: Annotated[float | None, Meta(description="an older treat.json: the spread-based margin")] = None
    expected_x: (
        Annotated[
            float,
            Meta(
                gt=0, description="the rules' expected ratio (a composition: composed_x, its shares of the step added)"
            ),
        ]
        | None
    ) = None
    expected_at: (
        Annotated[
            Literal["final", "final_trace"],
            Meta(
                description="final: expected_x is moved to the final config (an ablation of a cost of each sample, "
                "or of a share of the GPU's work); final_trace: read in the final config's own trace (gain.undo_ms)"
            ),
        ]
        | None
    ) = None
    decided_by: Annotated[str | None, Meta(description="t-interval, sign test, pooled spread, the limit's lean")] = None
    p_sign: Annotated[Fraction, Meta(description="0.5^pairs: every pair on one side with no effect")] | None = None
    in_process: Annotated[
        bool | None, Meta(description="measured as an arm of one run of the current config, not in fresh processes")
    ] = None


class TreatState(Doc, kw_only=True):
    """One visit of the treatment's state machine (doctor/treat.py): start, compose, size, compare, one_process,
    rediagnose, ablate."""

    state: Annotated[str, Meta(description="the state")]
    round: Annotated[Count, Meta(description="the rounds started before it ended")] | None = None
    started_s: Annotated[Seconds, Meta(description="since the treatment started")] | None = None
    spent_s: Annotated[Seconds, Meta(description="wall time in this visit")] | None = None
    runs: Annotated[Count, Meta(description="runs started in this visit")] | None = None
    next: Annotated[str | None, Meta(description="the state it led to")] = None


class TreatBudget(Doc, kw_only=True):
    """How the time budget was planned and spent."""

    budget_s: Annotated[Seconds, Meta(description="--time-budget (null: none)")] | None = None
    ablation_share: Annotated[Fraction, Meta(description="share kept for the ablation")] | None = None
    reserved_for_ablation_s: Annotated[Seconds, Meta(description="the most seconds kept for it")] | None = None
    spent_s: Annotated[dict[str, float], Meta(description="seconds spent per state")] = {}


class CalibrationRow(Doc, kw_only=True):
    """A measured trial's expected gain (the rules' estimate) beside its paired ratio."""

    trial: Annotated[int, Meta(ge=1, description="the trial")]
    kind: Annotated[str | None, Meta(description="composition or ablation")] = None
    rule: Annotated[str | None, Meta(description="the rule(s) whose changes it measured")] = None
    expected_x: Annotated[float, Meta(gt=0, description="the rules' expected tokens/s ratio")] | None = None
    measured_x: Annotated[float, Meta(ge=0, description="the paired ratio measured")] | None = None
    ci_low: Annotated[float | None, Meta(description="the measured ratio's interval, low end")] = None
    ci_high: Annotated[float | None, Meta(description="the measured ratio's interval, high end")] = None
    pairs: Annotated[Count, Meta(description="paired runs")] | None = None
    outcome: Annotated[str | None, Meta(description="the trial's outcome")] = None
    off: Annotated[float, Meta(ge=0, description="measured / expected")] | None = None
    far_off: Annotated[bool | None, Meta(description="off beyond treat.FAR_OFF either way")] = None


class TraceAttribution(Doc, kw_only=True):
    """The start and the adopted config's traced steps that every adopted change's target is read in (each
    change's `trace` in its rung: doctor/treat_attribution.py)."""

    how: Annotated[str, Meta(description="where the numbers come from")]
    start_us_per_token: Annotated[float, Meta(gt=0, description="the start config's timed step per real token")]
    final_us_per_token: Annotated[float, Meta(gt=0, description="the adopted config's timed step per real token")]
    saved_us_per_token: Annotated[float, Meta(description="start - final: what the changes' targets make up")]
    start_step_ms: Annotated[float, Meta(gt=0, description="the start config's traced step, ms")]
    final_step_ms: Annotated[float, Meta(gt=0, description="the adopted config's traced step, ms")]
    explained_share: (
        Annotated[float, Meta(description="the targets' drops together over the time per token saved")] | None
    ) = None


class TreatResult(Doc, kw_only=True):
    """treat.json of `vlmdoctor treat`: prescriptions applied one round at a time, each re-measured (docs/treat.md)."""

    schema_version: Version
    kind: Annotated[str | None, Meta(description="treat")] = None
    tool: Tool | None = None
    created_at: Annotated[str | None, Meta(description="local time the treatment started")] = None
    env: Env | None = None
    start_config: Annotated[dict[str, Any] | None, Meta(description="the config treated (every knob)")] = None
    final_config: Annotated[dict[str, Any] | None, Meta(description="the config with every kept change")] = None
    decision: TreatDecision | None = None
    start: Annotated[RunSummary | None, Meta(description="the start config's run")] = None
    ladder: Annotated[list[Rung], Meta(description="the start, then each kept round")] = []
    trials: Annotated[list[Trial], Meta(description="every change tried, kept or not")] = []
    rounds: Annotated[list[dict[str, Any]], Meta(description="each round's compositions and what was adopted")] = []
    skipped: Annotated[list[Any], Meta(description="prescriptions not tried, and why")] = []
    final_ablation: Annotated[dict[str, Any] | None, Meta(description="changes dropped by leave-one-out")] = None
    trace_attribution: TraceAttribution | None = None
    in_process: Annotated[
        list[InProcess] | None,
        Meta(description="the leave-one-out arms runs of the final config measured in their own process, each run's"),
    ] = None
    rediagnosed: Annotated[list[dict[str, Any]] | None, Meta(description="findings after each round")] = None
    stopped_because: Annotated[str | None, Meta(description="why the treatment ended")] = None
    stop_reason: Annotated[
        str | None, Meta(description="nothing_left, time_budget, max_trials, start_failed or interrupted")
    ] = None
    states: Annotated[list[TreatState], Meta(description="each visit of the treatment's states, in order")] = []
    budget: TreatBudget | None = None
    calibration: Annotated[list[CalibrationRow], Meta(description="each measured trial: expected vs measured")] = []
    interrupted: Annotated[bool, Meta(description="Ctrl-C or a signal ended it")] = False
    exit_code: Annotated[int | None, Meta(description="the exit code an interruption gives")] = None
    wall_s: Annotated[Seconds, Meta(description="the treatment's wall time")] | None = None
    trial_gpus: Annotated[Count, Meta(description="GPUs the final ablation ran on at once (--trial-gpus)")] | None = (
        None
    )
    outputs: Annotated[dict[str, str] | None, Meta(description="the files written, by kind")] = None
