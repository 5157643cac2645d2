"""Trace -> tables: one streaming pass over the events into compact typed columns the facts read."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.kernels import classify
from vlmdoctor.trace.read import TraceError, iter_events, read_metadata

LOGITS_OPS = ("aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax")
SDPA_OP = "aten::scaled_dot_product_attention"  # inputs (batch, heads, length, head_dim)
#: ops whose operand shapes and dtypes the LoRA and DPO facts read (trace/modes.py): GEMMs and casts
OPERAND_OPS = frozenset(("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_to_copy"))
SHAPE_OPS = ("aten::embedding",)  # its first input is the token-id batch: (batch, length)
MODULE_PREFIX = "nn.Module: "  # python_function events of with_stack/with_modules traces: `nn.Module: Qwen2Model_0`
COMM_OPS = (
    "record_param_comms",
    "nccl:",
    "gloo:",
    "c10d::",
)  # host ops of collectives whose args trace/comms.py reads
COMM_KERNELS = ("ncclDevKernel", "ncclKernel")


@dataclass
class Tables:
    """The trace, reduced to what the facts need (names as categoricals, numbers as typed arrays)."""

    path: Path
    meta: dict[str, Any]
    steps: pd.DataFrame  # name, ts, end
    gpu: pd.DataFrame  # name, cat, cls, ts, dur, end, corr, bytes
    ops: pd.DataFrame  # name, tid, ts, dur, end, seq, fwd_tid
    runtime: pd.DataFrame  # name, tid, ts, dur, end, corr
    shapes: list[tuple[float, str, Any]] = field(default_factory=list)  # (ts, op, input dims) of a few ops
    types: dict[str, Any] = field(default_factory=dict)
    memory: dict[int, list[float]] = field(default_factory=dict)  # device type -> [max allocated, max reserved]
    recorded: dict[str, bool] = field(
        default_factory=dict
    )  # which profiler options left their marks (shapes, memory, stack)
    comm: list[tuple[str, str, int, float, float, dict[str, Any]]] = field(
        default_factory=list
    )  # (kind, name, tid, ts, dur, args) of collectives (trace/comms.py)
    operands: list[tuple[str, float, float, int, Any, Any]] = field(
        default_factory=list
    )  # (name, ts, dur, tid, input dims, input types) of GEMMs and casts (trace/modes.py)


class _Column:
    """Interned names + typed number columns: a few bytes per event instead of Python objects."""

    def __init__(self, numeric: tuple[str, ...]) -> None:
        self.codes = array("i")
        self.num = {k: array("d") for k in numeric}

    def frame(self, names: list[str]) -> pd.DataFrame:
        df = pd.DataFrame(
            {k: np.frombuffer(v, dtype=np.float64) if len(v) else np.zeros(0) for k, v in self.num.items()}
        )
        df.insert(
            0,
            "name",
            pd.Categorical.from_codes(
                np.frombuffer(self.codes, dtype=np.int32) if len(self.codes) else np.zeros(0, dtype=np.int32),
                categories=names,
            ),
        )
        return df


def load_tables(path: Path) -> Tables:
    meta = read_metadata(path)  # first: it rejects files that are not JSON objects with a clear message
    names: dict[str, int] = {}
    gpu = _Column(("ts", "dur", "corr", "bytes", "cat"))
    ops = _Column(("tid", "ts", "dur", "seq", "fwd_tid"))
    rt = _Column(("tid", "ts", "dur", "corr"))
    tids: dict[Any, int] = {}
    steps: list[tuple[str, float, float]] = []
    shapes: list[tuple[float, str, Any]] = []
    types: dict[str, Any] = {}
    gpu_cats = {"kernel": 0.0, "gpu_memcpy": 1.0, "gpu_memset": 2.0}
    memory: dict[int, list[float]] = {}
    recorded = {"shapes": False, "memory": False, "stack": False}
    comm: list[tuple[str, str, int, float, float, dict[str, Any]]] = []
    operands: list[tuple[str, float, float, int, Any, Any]] = []
    count = 0
    try:
        for count, ev in enumerate(iter_events(path), 1):
            if not isinstance(ev, dict):
                raise TraceError(
                    f"{path}: traceEvents item {count} is a JSON {type(ev).__name__}, not an event object; "
                    "expected a torch.profiler Chrome trace"
                )
            _take(
                ev,
                names,
                gpu,
                ops,
                rt,
                tids,
                steps,
                shapes,
                types,
                gpu_cats,
                memory,
                recorded,
                comm,
                operands,
            )
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise TraceError(
            f"{path}: event {count} is not a torch.profiler event ({type(e).__name__}: {e}); expected "
            "objects with a name, a category and numeric ts/dur"
        ) from None
    categories = list(names)
    steps_df = pd.DataFrame(steps, columns=["name", "ts", "end"]).sort_values("ts").reset_index(drop=True)
    gpu_df = gpu.frame(categories)
    gpu_df["cat"] = np.array(["kernel", "gpu_memcpy", "gpu_memset"])[gpu_df["cat"].to_numpy().astype(int)]
    gpu_df["end"] = gpu_df["ts"] + gpu_df["dur"]
    gpu_df["corr"] = gpu_df["corr"].astype(np.int64)
    pairs = list(zip(gpu_df["name"].cat.codes.to_numpy(), gpu_df["cat"]))
    cls_of = {(c, k): classify(categories[c], k) for c, k in set(pairs)}
    gpu_df["cls"] = [cls_of[pk] for pk in pairs]
    ops_df = ops.frame(categories)
    ops_df["end"] = ops_df["ts"] + ops_df["dur"]
    for col in ("tid", "seq", "fwd_tid"):
        ops_df[col] = ops_df[col].astype(np.int64)
    rt_df = rt.frame(categories)
    rt_df["end"] = rt_df["ts"] + rt_df["dur"]
    for col in ("tid", "corr"):
        rt_df[col] = rt_df[col].astype(np.int64)
    return Tables(path, meta, steps_df, gpu_df, ops_df, rt_df, shapes, types, memory, recorded, comm, operands)


def _take(
    ev: dict[str, Any],
    names: dict[str, int],
    gpu: _Column,
    ops: _Column,
    rt: _Column,
    tids: dict[Any, int],
    steps: list[tuple[str, float, float]],
    shapes: list[tuple[float, str, Any]],
    types: dict[str, Any],
    gpu_cats: dict[str, float],
    memory: dict[int, list[float]],
    recorded: dict[str, bool],
    comm: list[tuple[str, str, int, float, float, dict[str, Any]]],
    operands: list[tuple[str, float, float, int, Any, Any]],
) -> None:
    """One trace event into the tables (a non-object or a non-numeric time raises, and the caller says where)."""
    intern = names.setdefault
    cat = ev.get("cat")
    if cat is None or ev.get("ph") != "X":
        if ev.get("name") == "[memory]":  # recorded with profile_memory: running totals per device type
            a = ev.get("args") or {}
            m = memory.setdefault(int(a.get("Device Type", -1)), [0.0, 0.0])
            m[0] = max(m[0], float(a.get("Total Allocated", 0) or 0))
            m[1] = max(m[1], float(a.get("Total Reserved", 0) or 0))
            recorded["memory"] = True
        return
    if cat == "python_function":  # with_stack / with_modules: keep the module ranges only, never every frame
        recorded["stack"] = True
        name = ev.get("name", "")
        if name.startswith(MODULE_PREFIX):
            _op_row(
                ops,
                intern(name, len(names)),
                tids.setdefault(ev.get("tid"), len(tids)),
                float(ev.get("ts", 0.0)),
                float(ev.get("dur", 0.0)),
                -1,
                -1,
            )
        return
    if cat == "cpu_op" or cat == "user_annotation":
        name = ev.get("name", "")
        ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if name.startswith("ProfilerStep#"):
            steps.append((name, ts, ts + dur))
            return
        args = ev.get("args") or {}
        tid = tids.setdefault(ev.get("tid"), len(tids))
        _op_row(
            ops,
            intern(name, len(names)),
            tid,
            ts,
            dur,
            int(args.get("Sequence number", -1)),
            int(args.get("Fwd thread id", -1)),
        )
        if name.startswith(COMM_OPS):
            comm.append(("op", name, tid, ts, dur, args))
        if "Input Dims" in args:
            recorded["shapes"] = True
            if name in SHAPE_OPS or name in LOGITS_OPS or name == SDPA_OP:
                shapes.append((ts, name, args["Input Dims"]))
                types[name] = args.get("Input type")
            elif name in OPERAND_OPS:
                operands.append((name, ts, dur, tid, args["Input Dims"], args.get("Input type")))
    elif cat == "cuda_runtime" or cat == "cuda_driver":
        args = ev.get("args") or {}
        rt.codes.append(intern(ev.get("name", ""), len(names)))
        n = rt.num
        n["tid"].append(tids.setdefault(ev.get("tid"), len(tids)))
        n["ts"].append(float(ev.get("ts", 0.0)))
        n["dur"].append(float(ev.get("dur", 0.0)))
        n["corr"].append(args.get("correlation", -1))
    elif cat in gpu_cats:
        args = ev.get("args") or {}
        gpu.codes.append(intern(ev.get("name", ""), len(names)))
        n = gpu.num
        n["ts"].append(float(ev.get("ts", 0.0)))
        n["dur"].append(float(ev.get("dur", 0.0)))
        n["corr"].append(args.get("correlation", -1))
        n["bytes"].append(args.get("bytes", 0) or 0)
        n["cat"].append(gpu_cats[cat])
        if cat == "kernel" and ev.get("name", "").startswith(COMM_KERNELS):
            comm.append(("kernel", ev["name"], -1, n["ts"][-1], n["dur"][-1], args))


def _op_row(ops: _Column, code: int, tid: int, ts: float, dur: float, seq: int, fwd_tid: int) -> None:
    ops.codes.append(code)
    n = ops.num
    n["tid"].append(tid)
    n["ts"].append(ts)
    n["dur"].append(dur)
    n["seq"].append(seq)
    n["fwd_tid"].append(fwd_tid)
