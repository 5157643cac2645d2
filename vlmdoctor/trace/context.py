"""The context of every host op and kernel launch: its model part, its phase, the backward node it runs under.

A sweep over each host thread's nesting gives every kernel the context it was launched in, through
its runtime call's correlation id:
  - model part: the `vlmdoctor::vision|projector|llm` range around the launching op, the loss ops
    (cross entropy, Liger's fused linear cross entropy), `Optimizer.step`; backward kernels take
    the part of the forward op that created their autograd node (sequence number + forward thread);
  - phase: forward, backward, recompute, optimizer. Recompute is a forward op (one that records
    a sequence number with forward thread 0) running under a backward node. This holds for both
    checkpoint flavours: `use_reentrant=True` re-runs the forward inside CheckpointFunctionBackward,
    `use_reentrant=False` inside the saved-tensor unpack of some backward node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.run.parts import part_of_class
from vlmdoctor.trace.intervals import Intervals, intersect, subtract, union
from vlmdoctor.trace.read import TraceError
from vlmdoctor.trace.tables import MODULE_PREFIX, SHAPE_OPS, Tables

PART_RANGES = {"vlmdoctor::vision": "vision", "vlmdoctor::projector": "projector", "vlmdoctor::llm": "llm"}
LOSS_OPS = re.compile(r"^aten::(?:cross_entropy_loss|nll_loss|nll_loss_nd|nll_loss2d)$|CrossEntropy", re.IGNORECASE)
BACKWARD_NODE = "autograd::engine::evaluate_function"
# runtime calls that make the host wait for the device (aten::item on a CPU tensor is no sync: not here)
SYNC_CALLS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cuStreamSynchronize"
    r"|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH)$"
)
#: runtime calls that allocate or free device or pinned host memory (the caching allocator growing, empty_cache)
ALLOCATOR = re.compile(
    r"^(?:cudaMalloc|cudaFree|cuMemAlloc|cuMemFree|cudaMallocHost|cudaFreeHost|cudaHostAlloc|cudaMallocAsync"
    r"|cudaFreeAsync|cuMem(?:Create|Map|Unmap|Release|AddressReserve|AddressFree|SetAccess)|cudaHostRegister"
    r"|cudaHostUnregister|cuMemHostAlloc|cuMemFreeHost)"
)

Windows = list[tuple[float, float]]  # the analyzed steps: (start, end) in trace microseconds
#: the deepest nesting of host ops on one thread that is read (each level is a pass over the thread's ops);
#: the recorded traces nest at most a few tens deep
MAX_NESTING = 256


# --- nesting of host ops, vectorized --------------------------------------------------------------


def nesting(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth and parent of intervals sorted by (start, -end), treated as a laminar family.

    depth = intervals started before this one minus those already ended; parent = the nearest
    earlier interval one level up.
    """
    n = len(ts)
    depth = np.arange(n) - np.searchsorted(np.sort(end), ts, side="right")
    depth = np.clip(depth, 0, None)
    if n and int(depth.max()) >= MAX_NESTING:  # each level is a pass over the ops: bound the passes
        raise TraceError(
            f"host ops nested {int(depth.max()) + 1:,} deep on one thread (torch.profiler's nest some tens; at most "
            f"{MAX_NESTING} are read): not a trace vlmdoctor can analyze"
        )
    parent = np.full(n, -1, dtype=np.int64)
    for d in range(1, int(depth.max(initial=0)) + 1):
        here = np.flatnonzero(depth == d)
        up = np.flatnonzero(depth == d - 1)
        if len(up) == 0:
            continue
        pos = np.searchsorted(up, here) - 1
        ok = pos >= 0
        parent[here[ok]] = up[pos[ok]]
    return depth, parent


def innermost(ts: np.ndarray, end: np.ndarray, parent: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Index of the innermost interval containing each point (-1 for none)."""
    j = np.searchsorted(ts, points, side="right") - 1
    for _ in range(MAX_NESTING):
        bad = (j >= 0) & (end[np.maximum(j, 0)] <= points)
        if not bad.any():
            break
        j[bad] = parent[j[bad]]
    return j


def op_context(t: Tables) -> pd.DataFrame:
    """For each host op: its model part and phase, and the backward node it runs under (row, -1 for none).

    Parts come from the innermost `vlmdoctor::<part>` range or, in a user's trace recorded with
    with_stack/with_modules, the innermost `nn.Module: <Class>_<n>` range whose class names a
    part; backward ops take the part of the forward op that created their autograd node.
    """
    ops = t.ops
    cats = pd.Series(ops["name"].cat.categories, dtype=object).astype(str)
    part_names = ["", "vision", "projector", "llm"]
    code_part = np.zeros(len(cats), dtype=np.int8)
    for rng, label in PART_RANGES.items():
        code_part[(cats == rng).to_numpy()] = part_names.index(label)
    if not code_part.any():  # no vlmdoctor ranges: the module hierarchy, where the trace has it
        for k, c in enumerate(cats):
            if c.startswith(MODULE_PREFIX):
                label = part_of_class(re.sub(r"_\d+$", "", c[len(MODULE_PREFIX) :]))
                code_part[k] = part_names.index(label) if label in part_names else 0
    codes = ops["name"].cat.codes.to_numpy()
    own_part = code_part[codes] if len(codes) else np.zeros(0, dtype=np.int8)

    def flag(mask_of_cats: pd.Series) -> np.ndarray:
        return np.isin(codes, np.flatnonzero(mask_of_cats.to_numpy()))

    own_opt = flag(cats.str.startswith("Optimizer.step"))
    own_loss = flag(cats.str.contains(LOSS_OPS))
    own_bwd = flag(cats.str.startswith(BACKWARD_NODE))
    seq = ops["seq"].to_numpy()
    ftid = ops["fwd_tid"].to_numpy()
    rows_all = np.arange(len(ops))

    part = np.zeros(len(ops), dtype=np.int8)
    opt = np.zeros(len(ops), dtype=bool)
    loss = np.zeros(len(ops), dtype=bool)
    in_bwd = np.zeros(len(ops), dtype=bool)
    recompute = np.zeros(len(ops), dtype=bool)
    bwd_key = np.full(len(ops), -1, dtype=np.int64)
    node = np.full(len(ops), -1, dtype=np.int64)
    inner = np.full(len(ops), -1, dtype=np.int64)  # per thread: the position in (start, -end) order and its parent's,
    parent_pos = np.full(len(ops), -1, dtype=np.int64)  # so runtime calls find their op without a second sweep
    tid_all = ops["tid"].to_numpy()
    for tid in np.unique(tid_all):
        sel = np.flatnonzero(tid_all == tid)
        order = sel[np.lexsort((-ops["end"].to_numpy()[sel], ops["ts"].to_numpy()[sel]))]
        ts, end = ops["ts"].to_numpy()[order], ops["end"].to_numpy()[order]
        depth, par = nesting(ts, end)
        for d in range(int(depth.max(initial=0)) + 1):  # context flows from parents to children, level by level
            lvl = np.flatnonzero(depth == d)
            rows = order[lvl]
            p = par[lvl]
            has = p >= 0
            prow = np.where(has, order[np.maximum(p, 0)], 0)
            pp, po, pl, pb, pr, pk, pn = (
                np.where(has, arr[prow], default)
                for arr, default in (
                    (part, 0),
                    (opt, False),
                    (loss, False),
                    (in_bwd, False),
                    (recompute, False),
                    (bwd_key, -1),
                    (node, -1),
                )
            )
            part[rows] = np.where(own_part[rows] > 0, own_part[rows], pp)
            opt[rows] = po | own_opt[rows]
            loss[rows] = pl | own_loss[rows]
            b = pb | own_bwd[rows]
            in_bwd[rows] = b
            s, f = seq[rows], ftid[rows]
            is_node = b & (s >= 0) & (f > 0)
            is_rec = b & (s >= 0) & (f == 0)
            bwd_key[rows] = np.where(is_node, s, pk)
            recompute[rows] = pr | is_rec
            node[rows] = np.where(own_bwd[rows], rows_all[rows], pn)
        inner[order] = np.arange(len(order))
        parent_pos[order] = par

    fwd_ops = (~in_bwd) & (seq >= 0) & (ftid == 0)
    part_label = np.array(part_names, dtype=object)[part]
    own_label = np.where(loss, "loss", np.where(part_label == "", "other", part_label))
    seq_part = pd.Series(own_label[fwd_ops], index=seq[fwd_ops])
    seq_part = seq_part[~seq_part.index.duplicated(keep="first")]
    rec_ops = in_bwd & (seq >= 0) & (ftid == 0) & (bwd_key >= 0)
    alias = pd.Series(bwd_key[rec_ops], index=seq[rec_ops])
    alias = alias[~alias.index.duplicated(keep="first")]
    key = pd.Series(np.where(in_bwd, bwd_key, -1))
    resolved = pd.Series([None] * len(key), dtype=object)
    for _ in range(8):  # follow recompute aliases a few levels
        found = key.map(seq_part)
        resolved = resolved.where(resolved.notna(), found)
        key = key.map(alias).fillna(-1).astype(np.int64)
    parts = np.where(opt, "optimizer", np.where(in_bwd & resolved.notna().to_numpy(), resolved.to_numpy(), own_label))
    phases = np.where(opt, "optimizer", np.where(in_bwd, np.where(recompute, "recompute", "backward"), "forward"))
    return pd.DataFrame(
        {
            "part": parts,
            "phase": phases,
            "node": node,
            "recompute": recompute,
            "in_bwd": in_bwd,
            "fwd": fwd_ops,
            "order": inner,
            "parent": parent_pos,
        }
    )


def runtime_rows(t: Tables, ctx: pd.DataFrame) -> np.ndarray:
    """For each runtime call: the innermost host op around it on its thread (its row in t.ops, -1 for none)."""
    ops, rt_t = t.ops, t.runtime
    rt_row = np.full(len(rt_t), -1, dtype=np.int64)
    tid_all = ops["tid"].to_numpy()
    for tid in np.unique(tid_all):
        rsel = np.flatnonzero(rt_t["tid"].to_numpy() == tid)
        if not len(rsel):
            continue
        sel = np.flatnonzero(tid_all == tid)
        order = sel[np.argsort(ctx["order"].to_numpy()[sel])]
        ts, end = ops["ts"].to_numpy()[order], ops["end"].to_numpy()[order]
        par = ctx["parent"].to_numpy()[order]
        j = innermost(ts, end, par, rt_t["ts"].to_numpy()[rsel])  # the innermost op around each runtime call
        rt_row[rsel] = np.where(j >= 0, order[np.maximum(j, 0)], -1)
    return rt_row


def launch_context(t: Tables, ctx: pd.DataFrame | None = None) -> pd.DataFrame:
    """For each runtime call: the model part and phase of the op that made it."""
    ctx = op_context(t) if ctx is None else ctx
    rt_row = runtime_rows(t, ctx)
    has_ctx = rt_row >= 0
    r = np.maximum(rt_row, 0)
    part = ctx["part"].to_numpy()
    phase = ctx["phase"].to_numpy()
    out = t.runtime[["corr", "ts"]].copy()
    out["part"] = np.where(has_ctx, part[r] if len(part) else "other", "other")
    out["phase"] = np.where(has_ctx, phase[r] if len(phase) else "forward", "forward")
    return out


def part_source(t: Tables) -> str:
    """Where the model-part attribution comes from: vlmdoctor's own ranges, the module hierarchy, or nowhere."""
    cats = [str(c) for c in t.ops["name"].cat.categories]
    if any(c in PART_RANGES for c in cats):
        return "vlmdoctor ranges"
    if any(c.startswith(MODULE_PREFIX) and part_of_class(re.sub(r"_\d+$", "", c[len(MODULE_PREFIX) :])) for c in cats):
        return "module hierarchy"
    return "none"


def token_batches(t: Tables) -> list[tuple[int, ...]]:
    """Token-id batch shapes, one per LLM embedding call: aten::embedding(weight, indices) on the largest table."""
    emb = [(d[0][0], tuple(d[1])) for _, name, d in t.shapes if name in SHAPE_OPS and len(d) > 1 and d[0] and d[1]]
    vocab = max((v for v, _ in emb), default=None)
    return [idx for v, idx in emb if v == vocab]


@dataclass
class Reading:
    """One trace as the fact families read it: its tables, its steps, and the context computed once for all."""

    t: Tables
    windows: Windows
    stage: int | None = None
    model: str | None = None

    @property
    def n(self) -> int:
        return len(self.windows)

    @cached_property
    def vmeta(self) -> dict[str, Any]:
        return self.t.meta.get("vlmdoctor") or {}

    @cached_property
    def cfg(self) -> dict[str, Any]:
        cfg = self.vmeta.get("config") or {}
        return cfg if isinstance(cfg, dict) else {}

    @cached_property
    def ctx(self) -> pd.DataFrame:
        return op_context(self.t)

    @cached_property
    def parents(self) -> np.ndarray:
        """Each host op's enclosing op (its row in t.ops, -1 for none): who called an op says whose code it is."""
        ctx, tid_all = self.ctx, self.t.ops["tid"].to_numpy()
        out = np.full(len(ctx), -1, dtype=np.int64)
        pos, par = ctx["order"].to_numpy(), ctx["parent"].to_numpy()
        for tid in np.unique(tid_all):
            sel = np.flatnonzero(tid_all == tid)
            by_pos = np.empty(len(sel), dtype=np.int64)
            by_pos[pos[sel]] = sel  # positions are 0..len(sel)-1 within a thread
            has = par[sel] >= 0
            out[sel[has]] = by_pos[par[sel][has]]
        return out

    @cached_property
    def span(self) -> Intervals:
        """The steps' union."""
        ws, we = np.array([s for s, _ in self.windows]), np.array([e for _, e in self.windows])
        return union(ws, we)

    @cached_property
    def busy(self) -> Intervals:
        """GPU busy time (any kernel, memcpy or memset) inside the steps."""
        g = self.t.gpu
        return intersect(union(g["ts"].to_numpy(), g["end"].to_numpy()), self.span)

    @cached_property
    def idle(self) -> Intervals:
        return subtract(self.span, self.busy)

    @cached_property
    def gpu_time(self) -> float:
        return float(self.t.gpu["dur"].sum())

    @cached_property
    def attributed(self) -> pd.DataFrame:
        """GPU events with the model part and phase of the op that launched them ("unattributed" for none)."""
        lctx = launch_context(self.t, self.ctx)
        lctx = lctx.loc[lctx["corr"] >= 0].drop_duplicates("corr")
        g2 = self.t.gpu.merge(lctx[["corr", "part", "phase"]], on="corr", how="left")
        g2["part"] = g2["part"].fillna("unattributed")
        g2["phase"] = g2["phase"].fillna("unattributed")
        return g2
