"""The comparison (`vlmdoctor compare --json`): two reports side by side, metric by metric, finding by finding,
knob by knob, rank by rank."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from vlmdoctor.documents.base import Doc, Layer, Ms, Severity


class CompareSide(Doc, kw_only=True):
    """What one side of a comparison measured."""

    model: Annotated[str | None, Meta(description="its model")] = None
    stage: Annotated[int | None, Meta(description="its stage")] = None
    device: Annotated[str | None, Meta(description="the GPU, or CPU")] = None
    torch: Annotated[str | None, Meta(description="torch's version")] = None
    created_at: Annotated[str | None, Meta(description="when its report was written")] = None


class MetricRow(Doc, kw_only=True):
    """One metric of both sides."""

    key: Annotated[str, Meta(description="the metric's name in report.json `metrics`")]
    label: Annotated[str, Meta(description="its name as shown")]
    a: Annotated[float | None, Meta(description="A's value")] = None
    b: Annotated[float | None, Meta(description="B's value")] = None
    delta: Annotated[float | None, Meta(description="b - a")] = None
    rel: Annotated[float | None, Meta(description="(b - a) / |a|")] = None
    higher_is_better: Annotated[bool, Meta(description="the direction of better")]
    verdict: Annotated[str, Meta(description="better, worse, same (within 1%) or n/a")]


class FindingBrief(Doc, kw_only=True):
    """A finding, named."""

    id: Annotated[str, Meta(description="the rule's id")]
    title: Annotated[str | None, Meta(description="what it detects")] = None
    severity: Severity | None = None
    layer: Layer | None = None


class FindingsDiff(Doc, kw_only=True):
    """Findings new in B, gone in B, in both."""

    added: Annotated[list[FindingBrief], Meta(description="new in B")] = []
    gone: Annotated[list[FindingBrief], Meta(description="gone in B")] = []
    kept: Annotated[list[str], Meta(description="ids in both")] = []


class KnobRow(Doc, kw_only=True):
    """A knob that differs."""

    knob: Annotated[str, Meta(description="its name")]
    layer: Annotated[int, Meta(ge=0, le=5, description="its layer (0: a run setting)")]
    a: Annotated[Any, Meta(description="A's value")] = None
    b: Annotated[Any, Meta(description="B's value")] = None


class SlowestRank(Doc, kw_only=True):
    """The slowest rank of a job."""

    rank: Annotated[int | None, Meta(description="the rank")] = None
    step_ms: Annotated[Ms, Meta(description="its median step")] | None = None
    imbalance: Annotated[float | None, Meta(description="its median step over the fastest's, - 1")] = None


class RanksCompared(Doc, kw_only=True):
    """How many ranks each side ran."""

    a: Annotated[int, Meta(ge=1, description="A's ranks")]
    b: Annotated[int, Meta(ge=1, description="B's ranks")]
    slowest_a: SlowestRank | None = None
    slowest_b: SlowestRank | None = None


class Comparison(Doc, kw_only=True):
    """`vlmdoctor compare --json`: two reports side by side, A the reference."""

    labels: Annotated[list[str], Meta(description="the two reports' names")]
    a: CompareSide
    b: CompareSide
    notes: Annotated[list[str], Meta(description="what differs besides the numbers")] = []
    metrics: list[MetricRow] = []
    kernels: Annotated[
        list[dict[str, Any]] | None, Meta(description="GPU ms per step by kernel class, biggest change first")
    ] = None
    gpu: Annotated[dict[str, Any] | None, Meta(description="step, GPU busy and idle, and idle by host cause")] = None
    findings: FindingsDiff | None = None
    config: Annotated[list[KnobRow], Meta(description="the knobs that differ, in layer order")] = []
    ranks: RanksCompared | None = None
