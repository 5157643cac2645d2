"""The step's accounts: every millisecond of the traced step in one named account, read from the facts.

A GPU step is GPU busy plus GPU idle. Busy time is given to the kernel class running at each moment
(trace/families/busy.py), idle time to what the host was doing meanwhile (trace/families/idle.py).
The accounts add up to the traced step; what no cause covers is `unattributed`, shown on its own and
never folded into an account.
"""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.families.busy import BUSY_ACCOUNTS, WORK_ACCOUNTS
from vlmdoctor.trace.families.idle import HOST_CAUSES, SPAN_CAUSES

#: the largest unattributed share of the step that reads as accounted for
MAX_UNATTRIBUTED = 0.10
#: every account of the step, by the name rules give it in their `accounts` field
ACCOUNT_IDS = (
    *(f"busy.{a}" for a in BUSY_ACCOUNTS),
    *(f"idle.{c}" for c in SPAN_CAUSES),
    *(f"idle.host.{c}" for c in HOST_CAUSES),
)
WORK = frozenset(f"busy.{a}" for a in WORK_ACCOUNTS)
#: each account's fact: the milliseconds per step it holds
ACCOUNT_FACTS = {
    **{f"busy.{a}": fact for a, (fact, _, _) in BUSY_ACCOUNTS.items()},
    **{f"idle.{c}": fact for c, (fact, _, _) in SPAN_CAUSES.items()},
    **{f"idle.host.{c}": fact for c, (fact, _) in HOST_CAUSES.items()},
}


def _rows(facts: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for account, (fact, _, meaning) in BUSY_ACCOUNTS.items():
        rows.append({"account": f"busy.{account}", "side": "GPU busy", "meaning": meaning, "ms": facts.get(fact)})
    for cause, (ms_fact, _, meaning) in SPAN_CAUSES.items():
        rows.append({"account": f"idle.{cause}", "side": "GPU idle", "meaning": meaning, "ms": facts.get(ms_fact)})
    for cause, (fact, meaning) in HOST_CAUSES.items():
        rows.append({"account": f"idle.host.{cause}", "side": "GPU idle", "meaning": meaning, "ms": facts.get(fact)})
    return [r for r in rows if isinstance(r["ms"], (int, float))]


def step_accounts(facts: dict[str, Any]) -> dict[str, Any] | None:
    """The traced step's accounts, largest first, with each one's share of the step; None for a CPU-only trace
    (no GPU busy/idle to split)."""
    step = facts.get("step.ms")
    if not facts.get("trace.gpu_kernels") or not isinstance(step, (int, float)) or step <= 0:
        return None
    rows = _rows(facts)
    unattributed = float(facts.get("idle.unattributed.ms") or 0.0)
    for r in rows:
        r["share"] = r["ms"] / step
    named = sum(r["ms"] for r in rows)
    return {
        "window": "traced",
        "step_ms": float(step),
        "steps": facts.get("trace.steps"),
        "rows": sorted((r for r in rows if r["ms"] > 0), key=lambda r: -r["ms"]),
        "unattributed_ms": unattributed,
        "unattributed_share": unattributed / step,
        # the accounts add up to the step by construction; a gap here is a defect of the arithmetic, said
        "residual_ms": float(step) - named - unattributed,
    }
