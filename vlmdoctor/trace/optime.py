"""Host ops as a tree, and the device time each op's interval launched: what the cause facts weigh."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from vlmdoctor.trace.tables import Tables


@dataclass
class OpTree:
    """Each host op's parent row (-1 at the top) and name; kernels launched per thread, in launch order.

    `time_ms` weighs an op's interval by the GPU time its launches ran (a GPU trace) or by its own
    host time (a CPU trace, where the op is the work).
    """

    names: np.ndarray
    parent: np.ndarray
    tid: np.ndarray
    ts: np.ndarray
    end: np.ndarray
    seq: np.ndarray
    fwd_tid: np.ndarray
    gpu: bool
    launch_ts: dict[int, np.ndarray]
    launch_cum: dict[int, np.ndarray]

    def ancestors(self, row: int) -> list[int]:
        """Rows of the ops around `row`, innermost first."""
        out = []
        p = int(self.parent[row])
        while p >= 0 and len(out) < 256:
            out.append(p)
            p = int(self.parent[p])
        return out

    def time_us(self, tid: int, start: float, stop: float) -> float:
        """Device time launched from one thread within [start, stop] (GPU), or the span itself (CPU)."""
        if not self.gpu:
            return max(stop - start, 0.0)
        ts = self.launch_ts.get(tid)
        if ts is None or not len(ts):
            return 0.0
        cum = self.launch_cum[tid]
        lo, hi = np.searchsorted(ts, start, side="left"), np.searchsorted(ts, stop, side="right")
        return float(cum[hi] - cum[lo])


def op_tree(t: Tables, ctx: pd.DataFrame) -> OpTree:
    """The parent of every op (from op_context's per-thread order) and per-thread launch time sums."""
    ops = t.ops
    n = len(ops)
    parent = np.full(n, -1, dtype=np.int64)
    tid_all = ops["tid"].to_numpy()
    order = ctx["order"].to_numpy()
    ppos = ctx["parent"].to_numpy()
    for tid in np.unique(tid_all):
        sel = np.flatnonzero(tid_all == tid)
        by_pos = np.empty(len(sel), dtype=np.int64)
        by_pos[order[sel]] = sel
        p = ppos[sel]
        parent[sel] = np.where(p >= 0, by_pos[np.maximum(p, 0)], -1)
    launch_ts: dict[int, np.ndarray] = {}
    launch_cum: dict[int, np.ndarray] = {}
    gpu = not t.gpu.empty
    if gpu:
        kern = t.gpu[(t.gpu["corr"] >= 0) & (t.gpu["cat"] == "kernel")]  # copies between devices are no work here
        dur_by_corr = kern.groupby("corr")["dur"].sum()
        rt = t.runtime[t.runtime["corr"] >= 0]
        dur = rt["corr"].map(dur_by_corr).fillna(0.0).to_numpy()
        rts, rtid = rt["ts"].to_numpy(), rt["tid"].to_numpy()
        for tid in np.unique(rtid):
            sel = np.flatnonzero(rtid == tid)
            o = sel[np.argsort(rts[sel], kind="mergesort")]
            launch_ts[int(tid)] = rts[o]
            launch_cum[int(tid)] = np.concatenate([[0.0], np.cumsum(dur[o])])
    return OpTree(
        names=ops["name"].astype(str).to_numpy(),
        parent=parent,
        tid=tid_all,
        ts=ops["ts"].to_numpy(),
        end=ops["end"].to_numpy(),
        seq=ops["seq"].to_numpy(),
        fwd_tid=ops["fwd_tid"].to_numpy(),
        gpu=gpu,
        launch_ts=launch_ts,
        launch_cum=launch_cum,
    )


def backward_nodes(tree: OpTree, in_bwd: np.ndarray) -> dict[int, list[int]]:
    """Sequence number -> rows of the backward ops autograd ran for the forward op of that number."""
    rows = np.flatnonzero(in_bwd & (tree.seq >= 0) & (tree.fwd_tid > 0))
    out: dict[int, list[int]] = {}
    for r in rows:
        out.setdefault(int(tree.seq[r]), []).append(int(r))
    return out
