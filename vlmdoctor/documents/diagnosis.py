"""The diagnosis: the findings in the order to apply them, with their expected gains, and what the rules did
besides prescribing (muted, superseded, not evaluated, not applicable), and the verdict on each account of the step."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from vlmdoctor.documents.base import Doc, Layer, Severity

#: how the time a fix saves grows with the micro-batch (a rule's `gain.per`, the first the default): a cost of each
#: step, of each sample, or GPU work that stays its share of the GPU's busy time in any config (gradient
#: checkpointing's recompute: 2% of a host-bound start step, 15% of the GPU's work, x1.28 in a GPU-bound final one)
GainPer = Literal["step", "sample", "gpu"]


class ExpectedGain(Doc, kw_only=True):
    """What a finding's fix is expected to win, measured on the traced step."""

    throughput_x: Annotated[float | None, Meta(description="expected tokens/s ratio (x1.25: a quarter more)")] = None
    saves_ms_per_step: Annotated[float | None, Meta(description="ms of the traced step the fix removes")] = None
    share_of_step: Annotated[float | None, Meta(description="that time over the traced step")] = None
    step_ms: Annotated[float | None, Meta(description="the traced step the ms and share are of")] = None
    window: Annotated[str | None, Meta(description="traced: the step the gain is measured on")] = None
    how: Annotated[str | None, Meta(description="where the expected gain comes from")] = None
    per: (
        Annotated[
            GainPer,
            Meta(
                description="the saved time is a cost of each step, of each sample (it grows with the batch), or "
                "a share of the GPU's work (it stays that share)"
            ),
        ]
        | None
    ) = None
    grows_ms_per_step: Annotated[
        float | None,
        Meta(description="the part of saves_ms_per_step that each sample costs (per: sample); default all of it"),
    ] = None
    share_of_gpu: (
        Annotated[
            float, Meta(ge=0, le=1, description="that time over the GPU's busy time in the traced step (per: gpu)")
        ]
        | None
    ) = None


class Finding(Doc, kw_only=True):
    """A rule that matched the measured facts, and its prescription (docs/rules.md)."""

    id: Annotated[str, Meta(description="the rule's id")]
    title: Annotated[str | None, Meta(description="what the rule detects, in one line")] = None
    layer: Layer | None = None
    layer_name: Annotated[str | None, Meta(description="the layer's name")] = None
    severity: Severity | None = None
    severity_from: Annotated[str | None, Meta(description="what set the severity")] = None
    rule_severity: Annotated[str | None, Meta(description="the rule's own cap on the severity")] = None
    evidence: Annotated[list[str] | None, Meta(description="the measured facts, as text")] = None
    fix: Annotated[str | None, Meta(description="the prescription, as text")] = None
    config_patch: Annotated[dict[str, Any] | None, Meta(description="the knobs the fix sets")] = None
    expected_gain: ExpectedGain | None = None
    sources: Annotated[list[str] | None, Meta(description="where the rule's knowledge comes from")] = None
    rank: Annotated[int, Meta(ge=1, description="1: the biggest expected win")] | None = None
    apply_order: Annotated[int, Meta(ge=1, description="the order the fixes apply in (layer order)")] | None = None
    advice: Annotated[dict[str, Any] | None, Meta(description="the fix in the user's terms")] = None
    muted_by: Annotated[str | None, Meta(description="a muted finding: what muted it (--ignore, ...)")] = None
    superseded_by: Annotated[str | None, Meta(description="a superseded finding: the finding that wins")] = None


class NotEvaluated(Doc, kw_only=True):
    """A rule that could not be evaluated: the facts it needs are missing."""

    id: Annotated[str, Meta(description="the rule's id")]
    missing: Annotated[list[str] | None, Meta(description="the facts it needs that the trace lacks")] = None
    hint: Annotated[str | None, Meta(description="how to record them")] = None


class NotApplicable(Doc, kw_only=True):
    """A rule that does not apply to this run, and why."""

    id: Annotated[str, Meta(description="the rule's id")]
    why: Annotated[str | None, Meta(description="why it does not apply")] = None
    measured: Annotated[bool | None, Meta(description="it fired on the measurement; the fix cannot be applied")] = None


class AccountVerdict(Doc, kw_only=True):
    """A large account of the step and what the diagnosis says of it (doctor/rules.py `account_verdicts`)."""

    account: Annotated[str, Meta(description="the account's name (idle.host.cudnn, busy.gemm_bf16, ...)")]
    meaning: Annotated[str | None, Meta(description="what the account holds, in words")] = None
    ms: Annotated[float | None, Meta(description="its ms per traced step")] = None
    share: Annotated[float | None, Meta(description="its share of the traced step")] = None
    verdict: Annotated[str | None, Meta(description="prescribed, work, or no prescription known")] = None
    findings: Annotated[list[str], Meta(description="the findings that speak to it")] = []
    where: Annotated[list[str], Meta(description="where in the code the time goes, or how to find out")] = []


class Diagnosis(Doc, kw_only=True):
    """The rules run on the facts: what fired, and what did not and why (doctor/rules.py `diagnose`)."""

    findings: Annotated[list[Finding], Meta(description="biggest expected gain first")] = []
    superseded: Annotated[list[Finding], Meta(description="fired, but another finding's fix covers it")] = []
    muted: Annotated[list[Finding], Meta(description="fired, but muted (--ignore, [tool.vlmdoctor])")] = []
    not_evaluated: list[NotEvaluated] = []
    not_applicable: list[NotApplicable] = []
    problems: Annotated[list[str], Meta(description="rule files that failed to load or to evaluate")] = []
    accounts: Annotated[list[AccountVerdict], Meta(description="each large account of the step, said")] = []
