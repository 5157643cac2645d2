"""The gate verdict (`vlmdoctor gate --json`): passed or not, and each check with its numbers (docs/ci.md)."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from vlmdoctor.documents.base import Count, Doc, PeakMemGb, RealTokensPerS


class GateCheck(Doc, kw_only=True):
    """One check of the gate (throughput, memory, findings, slowest rank) and its numbers."""

    name: Annotated[str, Meta(description="throughput, memory, findings or slowest rank")]
    passed: Annotated[bool, Meta(description="the check passed")]
    verdict: Annotated[str, Meta(description="pass, fail, skip (slowest rank: ok, uneven)")]
    detail: Annotated[str, Meta(description="one line: the numbers and why")]
    base_median: Annotated[RealTokensPerS, Meta(description="throughput: the baseline's")] | None = None
    cur_median: Annotated[RealTokensPerS, Meta(description="throughput: the current run's")] | None = None
    ratio: Annotated[float, Meta(ge=0, description="throughput: current over baseline")] | None = None
    ci_low: Annotated[float | None, Meta(description="the ratio's interval, low end (paired)")] = None
    ci_high: Annotated[float | None, Meta(description="the ratio's interval, high end (paired)")] = None
    pairs: Annotated[Count, Meta(description="paired runs (--remeasure-baseline)")] | None = None
    p: Annotated[float, Meta(ge=0, le=1, description="Mann-Whitney p-value (reports as they are)")] | None = None
    significant: Annotated[bool | None, Meta(description="the change is beyond the noise")] = None
    method: Annotated[str | None, Meta(description="the statistical test used")] = None
    samples: Annotated[str | None, Meta(description="what a sample is: a step, a window, a run")] = None
    max_regression: Annotated[float | None, Meta(description="the slowdown allowed (0.05: 5%)")] = None
    base_gb: Annotated[PeakMemGb, Meta(description="memory: the baseline's peak")] | None = None
    cur_gb: Annotated[PeakMemGb, Meta(description="memory: the current run's peak")] | None = None
    growth: Annotated[float | None, Meta(description="memory: current over baseline, - 1")] = None
    added: Annotated[list[str] | None, Meta(description="findings: new in current")] = None
    gone: Annotated[list[str] | None, Meta(description="findings: gone in current")] = None
    failing: Annotated[list[str] | None, Meta(description="findings: new at or above --fail-on")] = None
    muted: Annotated[list[dict[str, Any]] | None, Meta(description="findings: muted, never failing")] = None


class GateVerdict(Doc, kw_only=True):
    """`vlmdoctor gate --json`: the verdict and each check (docs/ci.md)."""

    passed: Annotated[bool, Meta(description="every check passed (exit 0; else 1)")]
    checks: list[GateCheck]
    summary: Annotated[str, Meta(description="PASSED or FAILED, and why, in one line")]
    notes: Annotated[list[str], Meta(description="what differs between the runs, besides the code")] = []
    model: Annotated[str | None, Meta(description="the baseline's model")] = None
    stage: Annotated[int | None, Meta(description="the baseline's stage")] = None
    remeasured: Annotated[bool | None, Meta(description="the baseline was measured again, in pairs")] = None
