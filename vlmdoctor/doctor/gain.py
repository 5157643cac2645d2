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


def gain_ratio(gain: dict[str, Any] | None) -> float | None:
    """The expected throughput ratio of a finding (x1.25: a quarter more tokens/s), or None where not computable.

    A speedup where the rule gives one, else the saved share of the step (1 / (1 - share)).
    """
    gain = gain or {}
    x = gain.get("throughput_x")
    if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0:
        return float(x)
    share = gain.get("share_of_step")
    if isinstance(share, (int, float)) and not isinstance(share, bool) and math.isfinite(share) and share < 1:
        return 1 / (1 - share)
    return None


def gain_severity(ratio: float | None, cap: str) -> tuple[str, str]:
    """(severity, "gain" or "rule"): the severity the expected gain earns, never above the rule's own."""
    if ratio is None:
        return cap, "rule"
    earned = next((sev for sev, at_least in GAIN_SEVERITY if ratio >= at_least), "low")
    return max(earned, cap, key=SEVERITIES.index), "gain"
