"""Work a training step does beside the model's own forward, backward and update, read from the host ops.

Each is a habit a config flag hides and the trace shows:
  - an evaluation forward inside the step: model forwards under `torch.no_grad()` whose ops record no
    autograd sequence number, that end in a loss (a frozen tower or a rotary embedding under no_grad does
    not compute a loss);
  - `torch.use_deterministic_algorithms(True)`: it fills every new uninitialized tensor (a fill kernel
    under `aten::empty*`, which otherwise launches nothing);
  - `torch.amp.GradScaler`: its inf checks and unscale (`_amp_foreach_non_finite_check_and_unscale_`,
    `_amp_update_scale_`), needed for fp16 and for nothing bf16 does;
  - DDP's `find_unused_parameters=True`: the reducer's search range after each forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import LOSS_OPS, Reading
from vlmdoctor.trace.intervals import _member, intersect, total, union

PRODUCES = by_producer(__name__)
#: ops a model's linear layers and matmuls are called through from Python: one GEMM each
GEMM_CALLS = frozenset(
    ("aten::linear", "aten::matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::einsum")
)
#: the allocations `torch.utils.deterministic.fill_uninitialized_memory` fills when deterministic algorithms are on
EMPTY_OPS = frozenset(
    ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided")
)
FILL_OP = "aten::fill_"
SCALER_OPS = ("aten::_amp_foreach_non_finite_check_and_unscale_", "aten::_amp_update_scale_")
DDP_UNUSED_SEARCH = "torch.distributed.ddp.reducer::search_unused_parameters"


def produce(r: Reading, facts: dict[str, Any]) -> None:
    t, n = r.t, r.n
    ops = t.ops
    names = ops["name"].astype(str).to_numpy()
    in_step = _member(r.span, ops["ts"].to_numpy())
    _nograd(r, facts, names, in_step)
    parent = r.parents
    pname = np.where(parent >= 0, names[np.maximum(parent, 0)], "")
    fills = in_step & (names == FILL_OP) & np.isin(pname, list(EMPTY_OPS))
    scaler = in_step & np.isin(names, SCALER_OPS)
    facts["determinism.empty_fills"] = float(fills.sum()) / n
    facts["amp.scaler_calls"] = float(scaler.sum()) / n
    if not t.gpu.empty:  # GPU times: a CPU trace has none
        facts["determinism.fill_ms"] = _gpu_ms_under(r, fills) / n
        facts["amp.scaler_gpu_ms"] = _gpu_ms_under(r, scaler) / n
    search = in_step & (names == DDP_UNUSED_SEARCH)
    facts["ddp.unused_searches"] = float(search.sum()) / n
    facts["ddp.unused_search_ms"] = float(ops["dur"].to_numpy()[search].sum()) / 1e3 / n


def _nograd(r: Reading, facts: dict[str, Any], names: np.ndarray, in_step: np.ndarray) -> None:
    """Forwards under no_grad: runs of Python-called torch ops without a sequence number that hold GEMMs and a loss.

    With grad mode on, every differentiable op records its autograd sequence number, so a training forward is
    one run of ops that have it; under no_grad (or inference_mode) none has it. A run counts as a forward when
    it holds at least one GEMM call and a loss; its time is its wall span on the host and the GPU time of what
    it launched.
    """
    t, n, ctx = r.t, r.n, r.ctx
    ops = t.ops
    parent = r.parents
    top = np.char.startswith(names.astype(str), "aten::") & ~np.char.startswith(
        np.where(parent >= 0, names[np.maximum(parent, 0)], "").astype(str), "aten::"
    )
    top &= in_step & ~ctx["in_bwd"].to_numpy() & (ctx["phase"].to_numpy() != "optimizer")
    seq = ops["seq"].to_numpy()
    is_gemm = np.isin(names, list(GEMM_CALLS))
    is_loss = pd.Series(names).str.contains(LOSS_OPS).to_numpy()
    facts["nograd.gemm_calls"] = float((top & is_gemm & (seq < 0)).sum()) / n
    facts["autograd.gemm_calls"] = float((top & is_gemm & (seq >= 0)).sum()) / n  # the step trains
    facts["nograd.loss_calls"] = float((top & is_loss & (seq < 0)).sum()) / n
    starts, ends, forwards = [], [], 0
    tid_all = ops["tid"].to_numpy()
    for tid in np.unique(tid_all[top]):
        rows = np.flatnonzero(top & (tid_all == tid))
        rows = rows[np.argsort(ops["ts"].to_numpy()[rows], kind="mergesort")]
        nog = seq[rows] < 0
        edges = np.flatnonzero(np.diff(np.concatenate([[0], nog.astype(np.int8), [0]])))
        for a, b in zip(edges[::2], edges[1::2]):  # runs of consecutive ops without a sequence number
            run = rows[a:b]
            if is_gemm[run].any() and is_loss[run].any():
                forwards += 1
                starts.append(float(ops["ts"].to_numpy()[run].min()))
                ends.append(float(ops["end"].to_numpy()[run].max()))
    facts["nograd.forwards"] = float(forwards) / n
    spans = union(np.array(starts), np.array(ends))
    facts["nograd.forward_ms"] = total(spans) / 1e3 / n
    if not t.gpu.empty:
        facts["nograd.forward_gpu_ms"] = _gpu_ms_in(r, spans) / n


def _gpu_ms_under(r: Reading, mask: np.ndarray) -> float:
    """GPU ms of the kernels launched inside the host ops of `mask` (their runtime calls within the ops' spans)."""
    ops = r.t.ops
    if not mask.any():
        return 0.0
    rt = r.t.runtime
    hit = np.zeros(len(rt), dtype=bool)
    for tid in np.unique(ops["tid"].to_numpy()[mask]):
        sel = mask & (ops["tid"].to_numpy() == tid)
        spans = union(ops["ts"].to_numpy()[sel], ops["end"].to_numpy()[sel])
        on = rt["tid"].to_numpy() == tid
        hit[on] = _member(spans, rt["ts"].to_numpy()[on])
    return _gpu_ms_of(r, rt["corr"].to_numpy()[hit])


def _gpu_ms_in(r: Reading, spans: tuple[np.ndarray, np.ndarray]) -> float:
    """GPU ms of the kernels launched (any host thread) within these host spans."""
    if not len(spans[0]):
        return 0.0
    rt = r.t.runtime
    return _gpu_ms_of(r, rt["corr"].to_numpy()[_member(spans, rt["ts"].to_numpy())])


def _gpu_ms_of(r: Reading, corr: np.ndarray) -> float:
    g = r.t.gpu
    sel = g["corr"].isin(corr[corr >= 0]).to_numpy()
    return float(total(intersect(union(g["ts"].to_numpy()[sel], g["end"].to_numpy()[sel]), r.span))) / 1e3
