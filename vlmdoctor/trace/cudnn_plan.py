"""cuDNN attention planning: GPU idle time while the host sits inside cuDNN attention calls, from any trace.

SDPA's cuDNN backend builds an execution plan on the host for each new input shape (a sequence length
it has not seen) and caches it; a cached call costs about 0.1 ms of host time, a plan build tens of ms
while the GPU waits. These facts need no recorded shapes: they read the op spans and the GPU's idle time.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.intervals import Intervals, intersect, total, union

PRODUCES = by_producer(__name__)

#: host ops and calls of cuDNN attention: SDPA's cuDNN ops (forward, backward and their wrappers) and,
#: where a trace shows them, the cuDNN frontend's graph-build and plan calls
CUDNN_ATTENTION = re.compile(r"_cudnn_attention|^cudnn_frontend|^cudnnBackend(?:Finalize|Execute|Create)")
#: a call that kept the host this long built a plan: cached calls took 0.08-0.16 ms, plan builds
#: 3-120 ms on one H100 80GB (fixtures/user_traces/paligemma_healthy_s2, gemma3_healthy_s2)
PLAN_CALL_MS = 1.0


def _outermost(ts: np.ndarray, end: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """The calls not nested in another matched call of the same thread (a wrapper and its inner op are one call)."""
    keep = np.zeros(len(ts), dtype=bool)
    order = np.lexsort((-end, ts, tid))
    reach, last_tid = -np.inf, None
    for k in order:
        if tid[k] != last_tid:
            reach, last_tid = -np.inf, tid[k]
        if ts[k] >= reach:
            keep[k] = True
            reach = end[k]
        else:
            reach = max(reach, end[k])
    return keep


def cudnn_plan_facts(ops: pd.DataFrame, runtime: pd.DataFrame, idle: Intervals, n: int, step_ms: float) -> dict:
    """cuDNN attention calls per step, the long ones (plan builds), and the GPU idle time spent inside them."""
    rows = pd.concat([ops[["name", "tid", "ts", "end"]], runtime[["name", "tid", "ts", "end"]]], ignore_index=True)
    hit = rows[rows["name"].astype(str).str.contains(CUDNN_ATTENTION)]
    if hit.empty:
        return {"cudnn_plan.calls": 0.0, "cudnn_plan.long_calls": 0.0, "cudnn_plan.idle_ms": 0.0,
                "cudnn_plan.step_share": 0.0}  # fmt: skip
    ts, end, tid = hit["ts"].to_numpy(), hit["end"].to_numpy(), hit["tid"].to_numpy()
    top = _outermost(ts, end, tid)
    dur_ms = (end[top] - ts[top]) / 1e3
    inside = total(intersect(idle, union(ts, end))) / 1e3 / n
    facts: dict[str, Any] = {
        "cudnn_plan.calls": float(top.sum()) / n,
        "cudnn_plan.long_calls": float((dur_ms >= PLAN_CALL_MS).sum()) / n,
        "cudnn_plan.idle_ms": inside,
        "cudnn_plan.step_share": inside / step_ms if step_ms else 0.0,
    }
    return facts
