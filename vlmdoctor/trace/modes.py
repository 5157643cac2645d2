"""Facts of the training modes: LoRA's low-rank GEMMs, QLoRA's dequantization, DPO's reference forward.

All of them are measured in the trace, never read from the run config:

  lora.*   GEMM ops (aten::mm/addmm/bmm, with `record_shapes`) whose smallest dimension is a
           small rank (<= RANK_MAX) and at most 1/RANK_RATIO of each other dimension, the rank
           being the most frequent such dimension: the adapters' A (d_in -> r) and B (r -> d_out)
           products and their gradients (6 per adapted layer per step, 8 with checkpointing). Count per step, time
           (GPU: the kernels they launched; CPU: the ops), and the share of all GEMM time next to
           their share of GEMM FLOPs (2*M*N*K): tiny GEMMs that take far more time than FLOPs are
           launch-bound.
  qlora.*  bitsandbytes dequantization: kernels (GPU) or ops (CPU) whose name says dequantize
           (kDequantizeBlockwise..., dequantize_4bit), and their share of GPU (or step) time.
  dpo.*    the reference forward: the `vlmdoctor::reference` range the runner puts around it, or a
           range a user's own script names after it (record_function "ref_forward",
           "compute_ref_log_probs", "reference_model", ...: a word `ref`/`reference` between
           separators, REFERENCE_NAME); its time and share of the step; the backward it got
           (autograd nodes whose sequence number belongs to an op inside the range: a reference
           run with grad tracking); fp32 GEMMs and casts of fp32 matrices (the weights autocast
           casts, with shapes recorded) inside it: an fp32 reference under autocast casts every
           weight in every forward.

A second streaming pass over the trace reads the GEMM shapes (the tables keep only a few shapes).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.cpu_facts import union_ms

PRODUCES = by_producer(__name__)

REFERENCE_RANGE = "vlmdoctor::reference"
OP_NAMESPACES = ("aten::", "autograd::", "c10d::", "prim::", "cudnn", "nccl", "Optimizer.", "ProfilerStep")
# a user's range around the reference forward: `ref` or `reference` as a word of the name
# (compute_ref_log_probs, ref_forward, reference, dpo/ref_model), not inside one (prefetch, refine)
REFERENCE_NAME = re.compile(r"(?:^|[_:./ -])ref(?:erence)?(?:$|[_:./ -])", re.IGNORECASE)
GEMM_OPS = {"aten::mm": (0, 1), "aten::addmm": (1, 2), "aten::bmm": (0, 1), "aten::baddbmm": (1, 2)}
RANK_MAX = 64  # LoRA ranks in use: 4..64 (seed 003: r=16 typical, r=64 for all-linear)
RANK_RATIO = 8  # the low dimension is at most 1/8 of the largest: 16 vs 896 on the 0.5b LLM
DEQUANT = re.compile(r"dequant", re.IGNORECASE)
CASTS = ("aten::_to_copy",)
BACKWARD_NODE = "autograd::engine::evaluate_function"
FP32 = "float"


def _gemm_dims(name: str, dims: list[Any]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a GEMM op's two matrix inputs, or None when shapes are missing."""
    a, b = GEMM_OPS[name]
    try:
        x, w = dims[a], dims[b]
        if len(x) < 2 or len(w) < 2:
            return None
        batch = int(np.prod(x[:-2])) if len(x) > 2 else 1
        return batch, int(x[-2]), int(x[-1]), int(w[-1])
    except (IndexError, TypeError, ValueError):
        return None


def _in_windows(ts: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    ok = np.zeros(len(ts), dtype=bool)
    for s, e in windows:
        ok |= (ts >= s) & (ts < e)
    return ok


def _union_us(spans: list[tuple[float, float]]) -> float:
    return union_ms(spans) * 1e3


class _Launches:
    """GPU time of the kernels launched inside host intervals (runtime calls -> correlation -> kernels)."""

    def __init__(self, t: Any) -> None:
        rt = t.runtime
        self.ok = not t.gpu.empty and not rt.empty
        if not self.ok:
            return
        by_corr = t.gpu.groupby("corr")["dur"].sum()
        dur = rt["corr"].map(by_corr).fillna(0.0).to_numpy()
        self.tids = {}
        for tid in np.unique(rt["tid"].to_numpy()):
            sel = np.flatnonzero(rt["tid"].to_numpy() == tid)
            order = sel[np.argsort(rt["ts"].to_numpy()[sel])]
            self.tids[int(tid)] = (rt["ts"].to_numpy()[order], np.concatenate([[0.0], np.cumsum(dur[order])]))

    def us(self, tid: int, spans: list[tuple[float, float]]) -> float:
        """Kernel µs launched from runtime calls within these (disjoint) spans on one thread."""
        if not self.ok or tid not in self.tids:
            return 0.0
        ts, cum = self.tids[tid]
        total = 0.0
        for s, e in spans:
            lo, hi = np.searchsorted(ts, s, side="left"), np.searchsorted(ts, e, side="right")
            total += cum[hi] - cum[lo]
        return total


def mode_facts(t: Any, windows: list[tuple[float, float]], facts: dict[str, Any]) -> dict[str, Any]:
    """lora.*, qlora.* and dpo.* facts (times in ms per step)."""
    out: dict[str, Any] = {}
    n = max(1, len(windows))
    gpu = not t.gpu.empty
    launches = _Launches(t)
    ops = t.ops
    names = ops["name"].astype(str).to_numpy()
    in_win = _in_windows(ops["ts"].to_numpy(), windows)
    denominator = facts.get("gpu.busy_ms") if gpu else facts.get("step.ms")

    gemms, cast_dims = _read_shapes(t, windows) if t.recorded.get("shapes") else ([], None)
    if gemms:
        _lora_facts(gemms, launches, gpu, n, out)
    _qlora_facts(t, names, in_win, windows, n, gpu, denominator, facts, out)
    _dpo_facts(t, names, in_win, gemms, cast_dims, launches, gpu, n, denominator, out)
    return out


def _read_shapes(t: Any, windows: list[tuple[float, float]]) -> tuple[list[dict[str, Any]], dict[float, int]]:
    """GEMM ops with their dimensions and input dtype; the input rank of each cast (by start time).

    From the operands the trace's one pass kept (`Tables.operands`), not from a second read of the file."""
    gemms = []
    cast_dims: dict[float, int] = {}
    for name, ts, dur, tid, dims, types in t.operands:
        if not any(s <= ts < e for s, e in windows):
            continue
        if name in CASTS:  # an fp32 matrix (weight) or (batch, length, hidden) activation: its rank, else 0
            dims, types = dims or [[]], types or [""]
            fp32 = bool(types) and types[0] == FP32
            cast_dims[round(ts, 3)] = len(dims[0]) if fp32 and dims and isinstance(dims[0], list) else 0
            continue
        if name not in GEMM_OPS:
            continue
        d = _gemm_dims(name, dims or [])
        if d is None:
            continue
        a = GEMM_OPS[name][0]
        types = types or []
        gemms.append(
            {
                "ts": ts,
                "end": ts + dur,
                "dur": dur,
                "dims": d,
                "tid": tid,
                "fp32": len(types) > a and types[a] == FP32,
            }
        )
    return gemms, cast_dims


def _low_rank(d: tuple[int, int, int, int]) -> int | None:
    """The small dimension of a GEMM whose two other dimensions are both at least RANK_RATIO times larger."""
    small, middle, _ = sorted(d[1:])
    return small if small <= RANK_MAX and middle >= RANK_RATIO * small else None


def _lora_facts(gemms: list[dict[str, Any]], launches: _Launches, gpu: bool, n: int, out: dict[str, Any]) -> None:
    for g in gemms:
        g["us"] = launches.us(g["tid"], [(g["ts"], g["end"])]) if gpu else g["dur"]
        b, m, k, nn = g["dims"]
        g["flops"] = 2.0 * b * m * k * nn
    ranks = Counter(r for r in (_low_rank(g["dims"]) for g in gemms) if r)
    rank = ranks.most_common(1)[0][0] if ranks else None  # the adapters' rank: the most frequent small dimension
    low = [g for g in gemms if rank is not None and _low_rank(g["dims"]) == rank]
    all_us = sum(g["us"] for g in gemms)
    all_flops = sum(g["flops"] for g in gemms)
    out["lora.lowrank_gemm_count"] = len(low) / n
    out["lora.gemm_count"] = len(gemms) / n
    out["lora.lowrank_gemm_ms"] = sum(g["us"] for g in low) / 1e3 / n
    out["lora.lowrank_gemm_share"] = sum(g["us"] for g in low) / all_us if all_us else 0.0
    out["lora.lowrank_flop_share"] = sum(g["flops"] for g in low) / all_flops if all_flops else 0.0
    if rank is not None:
        out["lora.rank"] = rank


def _qlora_facts(
    t: Any,
    names: np.ndarray,
    in_win: np.ndarray,
    windows: list[tuple[float, float]],
    n: int,
    gpu: bool,
    denominator: float | None,
    facts: dict[str, Any],
    out: dict[str, Any],
) -> None:
    if gpu:
        g = t.gpu
        sel = g[g["name"].astype(str).str.contains(DEQUANT) & _in_windows(g["ts"].to_numpy(), windows)]
        out["qlora.dequant_count"] = len(sel) / n
        out["qlora.dequant_ms"] = float(sel["dur"].sum()) / 1e3 / n
    else:
        rows = (
            np.flatnonzero(np.array([bool(DEQUANT.search(x)) for x in names], dtype=bool) & in_win)
            if len(names)
            else np.zeros(0, dtype=int)
        )
        ops = t.ops
        out["qlora.dequant_count"] = len(rows) / n
        out["qlora.dequant_ms"] = (
            _union_us([(float(ops["ts"].iat[r]), float(ops["end"].iat[r])) for r in rows]) / 1e3 / n
        )
    out["qlora.dequant_share"] = out["qlora.dequant_ms"] / denominator if denominator else 0.0
    params = (((t.meta.get("vlmdoctor") or {}).get("model") or {}).get("params") or {}).get("llm")
    if isinstance(params, (int, float)) and params > 0:  # bf16 base weights need 2 bytes a weight, NF4 about 0.5
        out["qlora.bf16_extra_gb"] = 1.5 * params / 2**30
    if facts.get("memory.device_total_gb") and facts.get("memory.peak_reserved_gb") is not None:
        out["memory.headroom_gb"] = facts["memory.device_total_gb"] - facts["memory.peak_reserved_gb"]


def _dpo_facts(
    t: Any,
    names: np.ndarray,
    in_win: np.ndarray,
    gemms: list[dict[str, Any]],
    cast_dims: dict[float, int] | None,
    launches: _Launches,
    gpu: bool,
    n: int,
    denominator: float | None,
    out: dict[str, Any],
) -> None:
    ops = t.ops
    ref_rows = np.flatnonzero(_reference_ranges(names) & in_win)
    if not len(ref_rows):
        if not t.meta.get("vlmdoctor"):  # a user's trace without a named range: the reference cannot be told apart
            return
        # vlmdoctor's runner always names the reference forward: none in the traced steps is measured as none
        out.update(
            {
                f"dpo.reference_{k}": 0.0
                for k in (
                    "count",
                    "ms",
                    "share",
                    "backward_nodes",
                    "backward_ms",
                    "backward_share",
                    "weight_casts",
                    "cast_ms",
                    "cast_share",
                )
            }
        )
        return
    ts, end, tid = ops["ts"].to_numpy(), ops["end"].to_numpy(), ops["tid"].to_numpy()
    seq, ftid = ops["seq"].to_numpy(), ops["fwd_tid"].to_numpy()
    ranges = _outermost([(int(tid[r]), float(ts[r]), float(end[r])) for r in ref_rows])  # nested names once
    inside = np.zeros(len(ops), dtype=bool)
    for th, s, e in ranges:
        inside |= (tid == th) & (ts >= s) & (end <= e)
    ref_seq = set(seq[inside & (seq >= 0) & (ftid <= 0)].tolist())
    is_node = np.array([x.startswith(BACKWARD_NODE) for x in names], dtype=bool)
    bwd_rows = np.flatnonzero(is_node & np.isin(seq, list(ref_seq)) & in_win) if ref_seq else np.zeros(0, dtype=int)
    bwd_spans = _outermost([(int(tid[r]), float(ts[r]), float(end[r])) for r in bwd_rows])
    cast_rows = np.flatnonzero(inside & np.isin(names, CASTS))
    if cast_dims is not None:  # casts of fp32 weights (matrices); activations are (batch, length, ...) tensors
        cast_rows = np.array([r for r in cast_rows if cast_dims.get(round(float(ts[r]), 3)) == 2], dtype=int)
    cast_spans = _outermost([(int(tid[r]), float(ts[r]), float(end[r])) for r in cast_rows])

    def time_us(spans: list[tuple[int, float, float]]) -> float:
        if gpu:
            return sum(launches.us(th, [(s, e)]) for th, s, e in spans)
        return _union_us([(s, e) for _, s, e in spans])

    ref_us = time_us(ranges)
    out["dpo.reference_count"] = len(ranges) / n
    out["dpo.reference_ms"] = ref_us / 1e3 / n
    out["dpo.reference_share"] = out["dpo.reference_ms"] / denominator if denominator else 0.0
    out["dpo.reference_backward_nodes"] = len(bwd_rows) / n
    out["dpo.reference_backward_ms"] = time_us(bwd_spans) / 1e3 / n
    out["dpo.reference_backward_share"] = out["dpo.reference_backward_ms"] / denominator if denominator else 0.0
    out["dpo.reference_weight_casts"] = len(cast_rows) / n
    out["dpo.reference_cast_ms"] = time_us(cast_spans) / 1e3 / n
    out["dpo.reference_cast_share"] = out["dpo.reference_cast_ms"] / out["dpo.reference_ms"] if ref_us else 0.0
    ref_gemms = [g for g in gemms if any(th == g["tid"] and s <= g["ts"] and g["end"] <= e for th, s, e in ranges)]
    if ref_gemms:
        w = [(g.get("us", g["dur"]), g["fp32"]) for g in ref_gemms]
        tot = sum(x for x, _ in w)
        out["dpo.reference_fp32_gemm_share"] = sum(x for x, f in w if f) / tot if tot else 0.0


def _reference_ranges(names: np.ndarray) -> np.ndarray:
    """Rows of the reference forward's range: vlmdoctor's own, else a user's range named after it."""
    own = names == REFERENCE_RANGE
    if own.any():
        return own
    unique = np.unique(names)
    named = [x for x in unique if not x.startswith(OP_NAMESPACES) and REFERENCE_NAME.search(x)]
    return np.isin(names, named) if named else own


def _outermost(spans: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """Spans not inside another span of the same thread (nested nodes or casts counted once)."""
    out: list[tuple[int, float, float]] = []
    for th, s, e in sorted(spans, key=lambda x: (x[0], x[1], -x[2])):
        if out and out[-1][0] == th and s >= out[-1][1] and e <= out[-1][2]:
            continue
        out.append((th, s, e))
    return out
