"""Why the GPU waited: its idle time, attributed to what the host was doing meanwhile."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import SYNC_CALLS, Reading, innermost, nesting
from vlmdoctor.trace.intervals import Intervals, _measure, intersect, subtract, total, union
from vlmdoctor.trace.tables import Tables

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """GPU idle time, attributed to what the host was doing meanwhile, in priority order."""
    t, idle, n = r.t, r.idle, r.n
    ops, rt = t.ops, t.runtime

    def spans(df: pd.DataFrame) -> Intervals:
        return union(df["ts"].to_numpy(), df["end"].to_numpy())

    causes = [  # (ms fact, share fact, the host spans), in the order idle time is attributed
        (
            "idle.data_loader.ms",
            "idle.data_loader.share",
            spans(ops[ops["name"].str.contains("DataLoader", regex=False)]),
        ),
        ("idle.sync.ms", "idle.sync.share", _sync_gaps(rt[rt["name"].str.match(SYNC_CALLS)], idle)),
        ("idle.memcpy.ms", "idle.memcpy.share", spans(rt[rt["name"].str.startswith("cudaMemcpy")])),
        (
            "idle.optimizer_host.ms",
            "idle.optimizer_host.share",
            spans(ops[ops["name"].str.startswith("Optimizer.step")]),
        ),
    ]
    left = idle
    idle_total = max(total(idle), 1e-9)
    for ms_name, share_name, iv in causes:
        hit = intersect(left, iv)
        facts[ms_name] = total(hit) / 1e3 / n
        facts[share_name] = total(hit) / idle_total
        left = subtract(left, hit)
    facts["idle.other_host.ms"] = total(left) / 1e3 / n
    facts["idle.other_host.share"] = total(left) / idle_total
    # the host work running while the GPU waited: the innermost op or runtime call at each moment, any thread
    per_code = _idle_by_innermost(t, idle)
    cats = t.ops["name"].cat.categories
    cudnn_att = np.flatnonzero(pd.Series(cats).str.contains("_cudnn_attention").to_numpy())
    facts["idle.op.cudnn_attention.ms"] = float(per_code[cudnn_att].sum()) / 1e3 / n  # cuDNN plans built on the host
    top = np.argsort(-per_code)[:8]
    facts["idle.top_host_ops"] = [
        {"op": str(cats[k]), "ms": float(per_code[k]) / 1e3 / n, "share": float(per_code[k]) / idle_total}
        for k in top
        if per_code[k] > 0
    ]


def _sync_gaps(sync: pd.DataFrame, idle: Intervals) -> Intervals:
    """A sync drains the device queue; the idle gap it opens lasts until the host launches again.

    So each synchronizing call covers its own span and the rest of the idle gap that is open when
    it returns (the host's relaunch latency, which a sync-free step would hide).
    """
    s, e = sync["ts"].to_numpy(), sync["end"].to_numpy()
    if len(s) == 0 or len(idle[0]) == 0:
        return union(s, e)
    k = np.searchsorted(idle[0], e, side="right") - 1
    inside = (k >= 0) & (idle[1][np.maximum(k, 0)] > e)
    stretched = np.where(inside, idle[1][np.maximum(k, 0)], e)
    return union(s, stretched)


def _idle_by_innermost(t: Tables, idle: Intervals) -> np.ndarray:
    """Idle time under each name: between consecutive boundaries the innermost op of a thread is fixed."""
    cats = t.ops["name"].cat.categories
    out = np.zeros(len(cats))
    if len(idle[0]) == 0:
        return out
    items = pd.concat([t.ops[["name", "tid", "ts", "end"]], t.runtime[["name", "tid", "ts", "end"]]], ignore_index=True)
    code = items["name"].cat.codes.to_numpy()
    tid_all = items["tid"].to_numpy()
    for tid in np.unique(tid_all):
        sel = np.flatnonzero(tid_all == tid)
        order = sel[np.lexsort((-items["end"].to_numpy()[sel], items["ts"].to_numpy()[sel]))]
        ts, end = items["ts"].to_numpy()[order], items["end"].to_numpy()[order]
        _, par = nesting(ts, end)
        bounds = np.unique(np.concatenate([ts, end]))
        if len(bounds) < 2:
            continue
        owner = innermost(ts, end, par, bounds[:-1])
        idle_len = _measure(idle, bounds[1:]) - _measure(idle, bounds[:-1])
        ok = (owner >= 0) & (idle_len > 0)
        out += np.bincount(code[order[owner[ok]]], weights=idle_len[ok], minlength=len(cats))
    return out
