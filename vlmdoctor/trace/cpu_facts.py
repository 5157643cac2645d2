"""Facts from the CPU ops of a trace with no GPU kernels: the CPU run as a patient of its own.

On a CPU the ops are the work, so the facts come from the ops themselves: the dtype casts that
autocast inserts, the matmuls and their dtypes (from `record_shapes`' "Input type" and "Input
Dims"), op time by model part, and the data loader's share of the step. Whether bf16 matmuls
are native on this CPU is not in the trace: the run's matmul probe (run/envinfo.py,
`matmul_probe`), carried in the trace's `vlmdoctor` metadata, measured it.

Times are ms per step; overlapping ops (a cast nested in a cast, two threads) are counted once.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import LOSS_OPS, PART_RANGES
from vlmdoctor.trace.read import iter_events
from vlmdoctor.trace.tables import event_time

PRODUCES = by_producer(__name__)
#: the dtypes' facts, spelled out so that a search for a fact finds where it is computed
PROBE_FACTS = {"fp32": "cpu.probe.fp32_gflops", "bf16": "cpu.probe.bf16_gflops", "fp16": "cpu.probe.fp16_gflops"}
MATMUL_FACTS = {  # (ms, GFLOP, GFLOP/s) of the matmuls in each dtype
    "fp32": ("cpu.matmul.fp32_ms", "cpu.matmul.fp32_gflop", "cpu.matmul.fp32_gflops"),
    "bf16": ("cpu.matmul.bf16_ms", "cpu.matmul.bf16_gflop", "cpu.matmul.bf16_gflops"),
    "fp16": ("cpu.matmul.fp16_ms", "cpu.matmul.fp16_gflop", "cpu.matmul.fp16_gflops"),
}

CAST_OPS = ("aten::to", "aten::_to_copy", "aten::copy_")
#: matmul ops and the positions of their two matrix inputs
MATMUL_OPS = {
    "aten::mm": (0, 1),
    "aten::addmm": (1, 2),
    "aten::bmm": (0, 1),
    "aten::baddbmm": (1, 2),
    "aten::_addmm_activation": (1, 2),
}
DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}
SCALAR_TYPE_CODES = {
    "5": "fp16",
    "6": "fp32",
    "7": "fp64",
    "15": "bf16",
}  # c10::ScalarType, as 'Concrete Inputs'
LOW = ("bf16", "fp16")
PARTS = PART_RANGES  # vlmdoctor's record_function range of each model part (trace/context.py)
#: the loss's backward nodes (its forward ops: trace/facts.py's LOSS_OPS)
LOSS_BACKWARD = re.compile(r"NllLoss\w*Backward|LogSoftmaxBackward|CrossEntropy\w*Backward")


def union_ms(spans: list[tuple[float, float]]) -> float:
    """Total length of a set of intervals (µs in, ms out), overlaps counted once."""
    if not spans:
        return 0.0
    arr = np.array(sorted(spans))
    total, start, end = 0.0, arr[0, 0], arr[0, 1]
    for s, e in arr[1:]:
        if s > end:
            total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return (total + end - start) / 1e3


def _cast_target(name: str, args: dict[str, Any]) -> tuple[str | None, str | None]:
    """(source dtype, target dtype) of a cast op, None where the trace does not say."""
    types = args.get("Input type") or []
    if name == "aten::copy_":  # copy_(self=destination, src)
        return (DTYPES.get(types[1]) if len(types) > 1 else None), (DTYPES.get(types[0]) if types else None)
    concrete = args.get("Concrete Inputs") or []
    src = DTYPES.get(types[0]) if types else None
    for pos in (1, 2):  # to(self, dtype, ...), _to_copy(self, dtype, ...), to(self, device, dtype, ...)
        if len(concrete) > pos and concrete[pos] in SCALAR_TYPE_CODES:
            return src, SCALAR_TYPE_CODES[concrete[pos]]
    return src, None


def _matmul_flop(name: str, dims: list[Any]) -> float:
    a, b = MATMUL_OPS[name]
    try:
        x, y = dims[a], dims[b]
        batch = x[0] if len(x) == 3 else 1
        return 2.0 * batch * x[-2] * x[-1] * y[-1]
    except (IndexError, TypeError):
        return 0.0


def cpu_facts(t: Any, windows: list[tuple[float, float]], facts: dict[str, Any]) -> dict[str, Any]:
    """Facts of a CPU-only trace (`t` is facts.Tables; `facts` the ones computed so far, for the vocabulary)."""

    n = max(len(windows), 1)
    lo, hi = min(s for s, _ in windows), max(e for _, e in windows)
    step_ms = facts.get("step.ms") or sum(e - s for s, e in windows) / 1e3 / n
    vocab = _vocab(t)
    casts: list[tuple[float, float]] = []
    cast_count = 0
    mm_spans: dict[str, list[tuple[float, float]]] = {}
    mm_flop: dict[str, float] = {}
    head: list[tuple[float, float]] = []
    ranges: list[tuple[float, float, str, Any]] = []  # (start, end, part, thread) of the vlmdoctor::<part> ranges
    fwd_ops: list[tuple[float, Any, Any]] = []  # (start, thread, sequence number) of ops that made autograd nodes
    bwd_nodes: list[tuple[Any, float]] = []  # (sequence number, duration) of the backward nodes run
    loader: list[tuple[float, float]] = []
    optimizer: list[
        tuple[float, float]
    ] = []  # the optimizer's steps and the loss: the split of the step (trace/split.py)
    loss_spans: list[tuple[float, float]] = []
    loss_bwd = 0.0
    for ev in iter_events(t.path):
        if ev.get("ph") != "X" or ev.get("cat") not in ("cpu_op", "user_annotation"):
            continue
        time = event_time(ev)
        if isinstance(time, str):  # an unusable time: left out, as the tables left it out (trace.warnings)
            continue
        ts, end = time[0], time[0] + time[1]
        if ts < lo or ts > hi:  # outside the profiled steps
            continue
        name = ev.get("name", "")
        args = ev.get("args") or {}
        if name in CAST_OPS:
            src, dst = _cast_target(name, args)
            if src and dst and src != dst and (src in LOW or dst in LOW):
                casts.append((ts, end))
                cast_count += name == "aten::copy_"  # each cast copies once, whichever op asked for it
        elif name in MATMUL_OPS:
            types = args.get("Input type") or []
            a = MATMUL_OPS[name][0]
            dtype = DTYPES.get(types[a] if len(types) > a else "", "other")
            mm_spans.setdefault(dtype, []).append((ts, end))
            dims = args.get("Input Dims") or []
            mm_flop[dtype] = mm_flop.get(dtype, 0.0) + _matmul_flop(name, dims)
            if vocab and any(vocab in (d or []) for d in dims[:3] if isinstance(d, list)):
                head.append((ts, end))
        elif name in PARTS:
            ranges.append((ts, end, PARTS[name], ev.get("tid")))
        elif "DataLoader" in name:
            loader.append((ts, end))
        elif name.startswith("Optimizer.step"):
            optimizer.append((ts, end))
        elif LOSS_OPS.search(name):
            loss_spans.append((ts, end))
        elif name.startswith("autograd::engine::evaluate_function") and LOSS_BACKWARD.search(name):
            loss_bwd += end - ts
        seq = args.get("Sequence number")
        if seq is not None:
            if name.startswith("autograd::engine::evaluate_function"):
                bwd_nodes.append((seq, end - ts))
            elif "Backward" not in name:
                fwd_ops.append((ts, ev.get("tid"), seq))

    out: dict[str, Any] = {"trace.cpu_only": True}
    env = (t.meta.get("vlmdoctor") or {}).get("env") or {}
    if env.get("cpu_capability"):
        out["cpu.capability"] = env["cpu_capability"]
    for dtype, rate in (env.get("cpu_matmul_gflops") or {}).items():
        if dtype in PROBE_FACTS:
            out[PROBE_FACTS[dtype]] = float(rate)
    out["cpu.cast.count"] = cast_count / n
    out["cpu.cast.ms"] = union_ms(casts) / n
    out["cpu.cast.share"] = out["cpu.cast.ms"] / step_ms
    all_mm = [s for spans in mm_spans.values() for s in spans]
    out["cpu.matmul.ms"] = union_ms(all_mm) / n
    out["cpu.matmul.share"] = out["cpu.matmul.ms"] / step_ms
    for dtype, (ms_name, gflop_name, gflops_name) in MATMUL_FACTS.items():
        ms = union_ms(mm_spans.get(dtype, [])) / n
        out[ms_name] = ms
        out[gflop_name] = mm_flop.get(dtype, 0.0) / 1e9 / n
        if ms > 0 and mm_flop.get(dtype):
            out[gflops_name] = mm_flop[dtype] / 1e9 / n / (ms / 1e3)
    out["cpu.matmul.dtypes"] = sorted(d for d in mm_spans if d != "other")
    # what bf16 / fp16 costs here: the casts plus the low-precision matmuls (union: casts never run inside a matmul)
    low = casts + mm_spans.get("bf16", []) + mm_spans.get("fp16", [])
    out["cpu.bf16_cost.ms"] = union_ms(low) / n
    out["cpu.bf16_cost.share"] = out["cpu.bf16_cost.ms"] / step_ms
    if vocab:
        out["cpu.lm_head.ms"] = union_ms(head) / n
    out.update(_part_facts(ranges, fwd_ops, bwd_nodes, n, step_ms))
    out["cpu.data_loader.ms"] = union_ms(loader) / n
    out["cpu.optimizer.ms"] = union_ms(optimizer) / n
    out["cpu.loss.ms"] = union_ms(loss_spans) / n + loss_bwd / 1e3 / n
    out["cpu.data_loader.share"] = out["cpu.data_loader.ms"] / step_ms
    return out


def _part_facts(
    ranges: list[tuple[float, float, str, Any]],
    fwd_ops: list[tuple[float, Any, Any]],
    bwd_nodes: list[tuple[Any, float]],
    n: int,
    step_ms: float,
) -> dict[str, Any]:
    """Host time per model part and step: forward from the part ranges, backward through the autograd nodes.

    Forward: a range's own time, less the other parts' ranges nested in it (Qwen2-VL's merger inside
    its tower). Backward: each autograd node's evaluation, given the part of the forward op that
    made the node (matched by sequence number; the innermost range around that op).
    """
    ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
    fwd = dict.fromkeys(PARTS.values(), 0.0)
    for i, (s, e, part, tid) in enumerate(ranges):
        nested = sum(e2 - s2 for s2, e2, p2, t2 in ranges[i + 1 :] if t2 == tid and s2 >= s and e2 <= e and p2 != part)
        fwd[part] += (e - s) - nested
    seq_part: dict[Any, str] = {}
    for ts, tid, seq in fwd_ops:
        inside = [r for r in ranges if r[3] == tid and r[0] <= ts <= r[1]]
        if inside:
            seq_part.setdefault(seq, min(inside, key=lambda r: r[1] - r[0])[2])
    bwd = dict.fromkeys(PARTS.values(), 0.0)
    for seq, dur in bwd_nodes:
        if seq in seq_part:
            bwd[seq_part[seq]] += dur
    out: dict[str, Any] = {}
    for part in sorted({r[2] for r in ranges}):
        out[f"cpu.part.{part}.forward_ms"] = fwd[part] / 1e3 / n
        out[f"cpu.part.{part}.backward_ms"] = bwd[part] / 1e3 / n
        out[f"cpu.part.{part}.ms"] = (fwd[part] + bwd[part]) / 1e3 / n
        if step_ms:
            out[f"cpu.part.{part}.share"] = out[f"cpu.part.{part}.ms"] / step_ms
    return out


def _vocab(t: Any) -> int | None:
    """The LM's vocabulary: rows of the largest embedding table the trace saw (recorded shapes)."""
    tables = [d[0][0] for _, name, d in t.shapes if name == "aten::embedding" and d and d[0]]
    return int(max(tables)) if tables else None
