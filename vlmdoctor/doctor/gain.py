"""A finding's severities, its expected gain as one number, and the severity that gain earns: light (no trace
tables, no document declarations), so the command line, the pages and the console read them without importing
the rule engine.
"""

from __future__ import annotations

import math
from typing import Any

#: a finding's severities, highest first (a rule's `severity`, --fail-on, --select/--ignore by severity)
SEVERITIES = ("high", "medium", "low")
#: a finding's severity from its expected throughput ratio (x1.25: a quarter more tokens/s); below: low.
#: A rule's own `severity` caps it; a finding whose gain cannot be computed keeps the rule's severity.
GAIN_SEVERITY = (("high", 1.25), ("medium", 1.05))


#: the most of the step a composition's added shares may save: each share is estimated alone and they may overlap,
#: so the composed estimate never assumes more than 90% of the step goes away (the largest sum in the committed
#: treat results under bench/results is 0.81)
MAX_SAVED_SHARE = 0.9


def _number(v: Any) -> float | None:
    """v where it is a finite real number (a bool is not), else None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def share_of_gpu(saves_ms: Any, gpu_busy_ms: Any) -> float | None:
    """A saving as a share of the GPU's busy time in the same traced step (a rule's `gain.per: gpu`), never above 1;
    None where either is missing or the GPU was not busy."""
    saves, busy = _number(saves_ms), _number(gpu_busy_ms)
    return min(saves / busy, 1.0) if saves is not None and busy else None


def gain_ratio(gain: dict[str, Any] | None) -> float | None:
    """The expected throughput ratio of a finding (x1.25: a quarter more tokens/s), or None where not computable.

    A speedup where the rule gives one, else the saved share of the step (1 / (1 - share)).
    """
    gain = gain or {}
    x = _number(gain.get("throughput_x"))
    if x is not None and x > 0:
        return x
    share = _number(gain.get("share_of_step"))
    if share is not None and share < 1:
        return 1 / (1 - share)
    return None


def composed_ratio(gains: list[dict[str, Any] | None]) -> float | None:
    """The throughput ratio expected of several findings' fixes together, None where one has no estimate.

    The shares of the step (`share_of_step`) are parts of one traced step, so the time they save adds up:
    1 / (1 - sum), the sum capped at MAX_SAVED_SHARE. Multiplying their speedups underestimates: on the 4xH200
    qwen2-vl-2b runs of 2026-11-27 the ten-change composition was expected x6.85 by the product and measured
    x12.57; added shares give x14.3. A gain with only a speedup (`throughput_x`, the batch rule) multiplies."""
    if not gains:
        return None
    factor, saved = 1.0, 0.0
    for gain in gains:
        gain = gain or {}
        share, x = _number(gain.get("share_of_step")), _number(gain.get("throughput_x"))
        if share is not None and share < 1:
            saved += share
        elif x is not None and x > 0:
            factor *= x
        else:
            return None
    return factor / (1 - min(saved, MAX_SAVED_SHARE))


def gain_severity(ratio: float | None, cap: str) -> tuple[str, str]:
    """(severity, "gain" or "rule"): the severity the expected gain earns, never above the rule's own."""
    if ratio is None:
        return cap, "rule"
    earned = next((sev for sev, at_least in GAIN_SEVERITY if ratio >= at_least), "low")
    return max(earned, cap, key=SEVERITIES.index), "gain"
