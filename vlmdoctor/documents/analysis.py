"""The trace analysis (`vlmdoctor analyze --json`): each trace file's facts, the accounts of its step, which
optimizations took effect and its diagnosis; for a folder of rank traces, the job's cross-rank facts."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from vlmdoctor.documents.base import Count, Doc, Version
from vlmdoctor.documents.diagnosis import Diagnosis, Finding
from vlmdoctor.documents.run_report import CrossRank


class AccountRow(Doc, kw_only=True):
    """One account of the traced step (trace/accounts.py)."""

    account: Annotated[str, Meta(description="its name")]
    side: Annotated[str | None, Meta(description="GPU busy or GPU idle")] = None
    meaning: Annotated[str | None, Meta(description="what it holds, in words")] = None
    ms: Annotated[float, Meta(description="its ms per traced step")] = 0.0
    share: Annotated[float, Meta(description="its share of the traced step")] = 0.0


class StepAccounts(Doc, kw_only=True):
    """Every ms of the traced step in a named account, largest first, and what no event explains."""

    window: Annotated[str | None, Meta(description="traced: the window the accounts are of")] = None
    step_ms: Annotated[float, Meta(description="the traced step")] = 0.0
    steps: Annotated[Count, Meta(description="traced steps")] | None = None
    rows: list[AccountRow] = []
    unattributed_ms: Annotated[float, Meta(description="GPU idle under no host event")] = 0.0
    unattributed_share: Annotated[float, Meta(description="that time over the step")] = 0.0
    residual_ms: Annotated[float | None, Meta(description="the arithmetic's gap (0 by construction)")] = None


class Effect(Doc, kw_only=True):
    """One optimization and whether it took effect in the traced step, from the facts (trace/effects.py)."""

    name: Annotated[str, Meta(description="compile, liger, attention, fused_loss, optimizer or precision")]
    state: Annotated[str, Meta(description="on, off, partial or unknown")]
    brief: Annotated[str | None, Meta(description="its words in the one-line summary (`in effect: ...`)")] = None
    seen: Annotated[str, Meta(description="the evidence, with its numbers")] = ""
    why: Annotated[
        str | None, Meta(description="why it is off or partial (or unknown), when the facts say; else null")
    ] = None


class AnalyzedFile(Doc, kw_only=True):
    """One trace file's facts, and their diagnosis."""

    file: Annotated[str, Meta(description="the trace file")]
    facts: Annotated[dict[str, Any], Meta(description="fact name -> value (docs/analysis.md)")]
    meta: Annotated[dict[str, Any] | None, Meta(description="the trace's metadata the facts read")] = None
    rank: Annotated[int, Meta(ge=0, description="the rank that wrote the trace")] | None = None
    accounts: StepAccounts | None = None
    effects: Annotated[list[Effect], Meta(description="which optimizations took effect (trace/effects.py)")] = []
    diagnosis: Diagnosis | None = None
    findings: Annotated[list[Finding] | None, Meta(description="the diagnosis' findings")] = None
    muted: Annotated[list[Finding] | None, Meta(description="the diagnosis' muted findings")] = None


class Analysis(Doc, kw_only=True):
    """`vlmdoctor analyze --json`: the facts of a trace, or of a folder of rank traces, and the diagnosis."""

    schema_version: Version
    kind: Annotated[str | None, Meta(description="analysis")] = None
    path: Annotated[str | None, Meta(description="the trace or folder analyzed")] = None
    files: Annotated[list[AnalyzedFile], Meta(description="each trace file's facts")] = []
    cross_rank: CrossRank | None = None
