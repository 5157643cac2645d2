"""A trial of `treat` (doctor/treat.py), one arm of a paired comparison, as the result keeps it: the arm's numbers,
its outcome in treat's words ("adopted" is not "kept": the gain must be shown to be kept), and the rules' expected
gain beside the measured one."""

from __future__ import annotations

import statistics
from typing import Any

from vlmdoctor.doctor.decide import ArmResult
from vlmdoctor.doctor.gain import composed_ratio
from vlmdoctor.doctor.treat_compose import merged_patch
from vlmdoctor.errors import EXIT_USAGE

#: the facts of a run's profile the ladder shows beside its throughput
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
#: what a comparison left open at its limit leans to (decide.lean)
LIKELY = ("likely_gain", "likely_loss")


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


def _arm_numbers(arm: ArmResult) -> dict[str, Any]:
    vals = [v for v in arm.values if v]
    ok = [r for r in arm.reports if r.get("status") == "ok"]
    last = ok[-1] if ok else (arm.reports[-1] if arm.reports else {})
    out = summary(last)
    out["real_tokens_per_s"] = statistics.median(vals) if vals else None
    out["tokens_per_s_runs"] = vals
    out["runs"] = len(arm.reports)
    return out


#: the status of a run that the time budget stopped (its limit set by the time left, not by --trial-timeout)
STOPPED_BY_BUDGET = "budget"


def outcome_of(decision: dict[str, Any], arm: ArmResult) -> str:
    """The decision's outcome, or "not_applicable" where the arm's run refused its config (a usage error), or
    "undecided" where the time budget stopped its run (not a failure of the config: it was not measured)."""
    o = decision.get("outcome", "error")
    if o == STOPPED_BY_BUDGET:
        return "undecided"
    failed = arm.failed or {}
    if (
        o not in ("kept", "harmful", "no_gain", "undecided", *LIKELY, "reference_failed")
        and failed.get("status") == "error"
        and (failed.get("error") or {}).get("exit_code") == EXIT_USAGE
    ):
        return "not_applicable"  # the run refused the config (a GPU-only knob on CPU, say)
    return o


def is_shown(decision: dict[str, Any]) -> bool:
    """A kept decision that excludes no gain: its interval's lower bound above 1, or the sign test."""
    by_sign = str(decision.get("how") or "").startswith("sign test")
    return decision.get("outcome") == "kept" and ((decision.get("ci_low") or 0.0) > 1 or by_sign)


def adopted_outcome(outcome: str, decision: dict[str, Any]) -> str:
    """ "kept" only when the gain is shown; a large effect decided on two pairs whose interval does not exclude
    no gain, or a likely gain at the limit (every pair above the bar, too few to decide), is "adopted": the
    ladder moves on with it, without calling it shown."""
    if (outcome == "kept" and not is_shown(decision)) or outcome == "likely_gain":
        return "adopted"
    return outcome


def likely_why(decision: dict[str, Any]) -> dict[str, Any]:
    """The words a likely gain is adopted with: its evidence, and that it is not shown."""
    if decision.get("outcome") != "likely_gain":
        return {}
    if decision.get("how") == "one pair":  # its words say it: its size, not a side of several pairs
        return {"why": decision["why"]}
    n, bar = decision["pairs"], 1 + decision["min_gain"]
    words = (
        f"likely gain: all {n} pairs above x{bar:g} (a {0.5**n:.0%} chance with no effect); "
        f"the {decision['confidence']:.0%} interval does not exclude no gain"
    )
    return {"why": "; ".join(w for w in (decision.get("why"), words) if w)}


def composed_x(changes: list[dict[str, Any]]) -> float | None:
    """The throughput factor the rules expected of these changes together (`gain.composed_ratio`: their shares of
    the step add, a speedup without a share multiplies), None where a change has no estimate (a batch probe)."""
    return composed_ratio([c.get("expected_gain") for c in changes])


def busy_frac(profile: dict[str, Any] | None) -> float | None:
    """The share of a run's timed step the GPU was busy: its traced GPU time over the untraced median step where the
    run measured both, else over the traced step."""
    p = profile or {}
    return p.get("measured.gpu.busy_frac") or p.get("gpu.busy_frac")


def final_config_x(
    change: dict[str, Any],
    start_batch: int | None,
    final_batch: int | None,
    final_step_ms: float | None,
    final_busy_frac: float | None = None,
) -> float | None:
    """The rules' expected ratio of the final config over the final config without `change` (its ablation), as
    the rule's `gain.per` says its saving moves (rules/README.md); any other estimate stays the start config's
    (`composed_x`).

    - `per: sample`: the cost read at the start's batch is moved to the final batch, over the final step. Why:
      the loader's wait read at qwen2-vl-2b's batch 4 expected x1.25 of the workers, and their ablation at batch
      52 measured x3.14. What is moved is the part each sample costs (`grows_ms_per_step`, the rule's
      `gain.grows_ms`) where the rule says it: the loader's wait in the step that had least of it, not a stall of
      10-80 ms that one step had (moved per sample, such a stall expected x8.7-10.5 of the workers at
      llava-siglip2-0.5b's batch 128, which measured x1.36-1.40).
    - `per: gpu`: GPU work that is the same share of the GPU's busy time in any config (`share_of_gpu`) adds
      share / (1 - share) of the final config's GPU time. Why: gradient checkpointing's recompute was 2% of the
      host-bound start step (x1.02 expected) and 14-16% of its GPU's work; turning it back on in the GPU-bound
      final config measured x1.28-1.29 (llava-siglip2-0.5b, batch 152: seven ablations on H200s, one pair each),
      where this says x1.16-1.18."""
    g = change.get("expected_gain") or {}
    saves = g.get("saves_ms_per_step")
    grows = g.get("grows_ms_per_step")
    grows = saves if grows is None else grows
    if g.get("per") == "sample" and saves and start_batch and final_batch and final_step_ms:
        return 1 + grows * final_batch / start_batch / final_step_ms
    share = g.get("share_of_gpu")
    if g.get("per") == "gpu" and share is not None and share < 1 and final_busy_frac:
        return 1 + share / (1 - share) * min(final_busy_frac, 1.0)
    return composed_x([change])


def record_trial(
    out: dict[str, Any],
    kind: str,
    name: str,
    changes: list[dict[str, Any]],
    outcome: str,
    decision: dict[str, Any],
    arm: ArmResult,
) -> dict[str, Any]:
    """The trial, appended to the result's `trials`: its changes, its arm's numbers, its decision's evidence."""
    entry = {
        "trial": len(out["trials"]) + 1,
        "kind": kind,
        "name": name,
        "rule": ", ".join(c["rule"] for c in changes) if kind == "composition" else changes[0]["rule"],
        "layer": min(c["layer"] for c in changes),
        "title": changes[0]["title"] if len(changes) == 1 else name,
        "config_patch": merged_patch(changes),
        "expected_gain": changes[0].get("expected_gain") if len(changes) == 1 else None,
        "expected_x": composed_x(changes),
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
