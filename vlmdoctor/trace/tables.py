"""The trace reduced to tables in one streaming pass: GPU events, host ops, runtime calls, steps.

Two checks happen on the way in (docs/files.md, "Reading"). An event's time must be usable: a
missing, NaN, infinite, negative or absurd duration (over MAX_EVENT_US, or a GPU event longer than
the whole trace), a start below 0 or past MAX_TS_US, or a time that is not a number leaves the
event out of the tables, counted in `Tables.invalid`, and the facts say so in a warning; it never
reaches GPU busy or a finding. And what the tables keep is bounded by the file's size on disk
(MEMORY_PER_FILE_BYTE): a small gzip of a huge repetitive trace is refused, not read into
gigabytes of memory.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from vlmdoctor.trace.kernels import classify
from vlmdoctor.trace.metadata import check_metadata
from vlmdoctor.trace.read import Span, TraceError, iter_batches, json_size, read_metadata, split_points
from vlmdoctor.trace.worker import idle_cores, run_all

LOGITS_OPS = ("aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax")
#: Liger's fused linear cross entropy: inputs (hidden [rows, h], LM head weight [vocab, h], targets), no logits
FCE_OP = "LigerFusedLinearCrossEntropyFunction"
SDPA_OP = "aten::scaled_dot_product_attention"
CUDA_DEVICE = (
    1  # the profiler's [memory] events: Device Type 0 is the CPU, 1 CUDA  # inputs (batch, heads, length, head_dim)
)
#: ops whose operand shapes and dtypes the LoRA and DPO facts read (trace/modes.py): GEMMs and casts
OPERAND_OPS = frozenset(("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_to_copy"))
SHAPE_OPS = ("aten::embedding",)  # its first input is the token-id batch: (batch, length)
#: MoE expert GEMMs: (rows of routed tokens, hidden) x (experts, hidden, out); trace/families/moe.py reads them
MOE_OPS = ("aten::_grouped_mm",)
MODULE_PREFIX = "nn.Module: "  # python_function events of with_stack/with_modules traces: `nn.Module: Qwen2Model_0`
COMM_OPS = (
    "record_param_comms",
    "nccl:",
    "gloo:",
    "c10d::",
)  # host ops of collectives whose args trace/comms.py reads
COMM_KERNELS = ("ncclDevKernel", "ncclKernel")
#: a rank folder of this much JSON text (plain, or inflated from .gz) is analyzed a file to a process
#: (facts.analyze): a process costs about 0.5 s of CPU to start (imports), a rank's analysis about 30 s per GiB
PARALLEL_MIN_BYTES = 64 * 2**20
#: one trace file of this much JSON text is read in parts by several processes (load_tables): reading alone
#: is about 10 s of CPU per GiB, and a part read elsewhere also costs its process's start and its tables'
#: trip back (pickled); on a 0.11 GiB trace two processes took more CPU and no less time than one
SPLIT_MIN_BYTES = 256 * 2**20
MAX_EVENT_US = 86_400e6  # no event of a profiled trace lasts a day: a longer duration is not a measurement
#: the latest start a trace's clock can write: past 2^53 us a float no longer holds a microsecond (Kineto's
#: starts are about 5e12 us, the host's time since a base)
MAX_TS_US = float(2**53)
#: memory the analysis takes per event it keeps (tables, frames, the facts' intermediates): about 360 bytes
#: measured on a 0.26 GiB H100 trace (627k kept events, 324 MB peak RSS with the imports)
ROW_BYTES = 400
ENTRY_BYTES = 200  # a distinct name or thread: its dict entry, its key, its category
#: what the tables keep may take at most this many times the file's size on disk (a recorded trace: about
#: 12x its gzip size, under 2x its plain size), or MEMORY_FLOOR for small files
MEMORY_PER_FILE_BYTE = 100
MEMORY_FLOOR = 512 * 2**20
#: host threads and ProfilerStep markers a trace may hold: the facts walk each (a recorded trace has a few
#: threads and steps; a trace of 50,000 steps took minutes)
MAX_THREADS = 4096
MAX_STEPS = 10_000
#: how an event's time can be unusable, as the warning names it
INVALID_WHY = {
    "missing": "no ts or dur",
    "not_number": "ts or dur not a number",
    "not_finite": "NaN or infinite",
    "negative": "negative",
    "bad_start": "a start below 0 or past 2^53 us",
    "too_long": "over 24 h",
    "longer_than_trace": "longer than the whole trace",
    "duplicate": "the same event twice (name, time, duration, thread or stream): counted once",
}
INVALID_KINDS = {"gpu": "GPU events", "host": "host ops and runtime calls", "step": "ProfilerStep markers"}


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
    cuda_memory: list[tuple[float, int, int, float, float]] = field(
        default_factory=list
    )  # (ts, tid, addr, bytes, total allocated) of each CUDA [memory] event (trace/families/memory_live.py)
    invalid: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # events left out for an unusable time: kind (gpu, host, step) -> why (INVALID_WHY) -> count

    def invalid_warning(self) -> str | None:
        """The events left out for their times, in words (trace.warnings), or None."""
        parts = []
        for kind, whys in self.invalid.items():
            n = sum(whys.values())
            detail = ", ".join(f"{c:,} {INVALID_WHY[w]}" for w, c in whys.items())
            parts.append(f"{n:,} {INVALID_KINDS[kind]} ({detail})")
        if not parts:
            return None
        head = "events with an unusable time were left out of every fact (GPU busy, kernels, steps): "
        return head + "; ".join(parts)


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


def load_tables(path: Path, workers: int = 1) -> Tables:
    """The tables of one trace file; a file of SPLIT_MIN_BYTES or more of JSON is read by up to
    `workers` processes (as many as there are idle cores), each a part of whole events, and the parts
    joined in order: the same tables."""

    meta = read_metadata(path)  # first: it rejects files that are not JSON objects with a clear message
    check_metadata(meta, path)
    b = _read_parts(path, workers) if workers > 1 else None
    return (b or _read(path)).tables(path, meta)


def memory_limit(path: Path) -> int:
    """The most memory (bytes, as ROW_BYTES per kept row plus the objects kept) a trace file may make the
    analysis take: MEMORY_PER_FILE_BYTE times its size on disk."""
    return max(MEMORY_FLOOR, MEMORY_PER_FILE_BYTE * path.stat().st_size)


def _read(path: Path, span: Span | None = None) -> _Builder:
    """One pass over the events (or a span of them); chunks are decoded into _Event structs that hold
    only what the tables keep. Chunks the structs refuse (unexpected types) go event by event through _take."""
    b = _Builder()
    limit = memory_limit(path)
    count = 0
    try:
        for typed, events, text in iter_batches(path, _EVENTS.decode, span=span):
            if typed:
                b.take(events, text)
                count += len(events)
            else:
                before = count
                for count, ev in enumerate(events, before + 1):
                    if not isinstance(ev, dict):
                        raise TraceError(
                            f"{path}: traceEvents item {count} is a JSON {type(ev).__name__}, not an event object; "
                            "expected a torch.profiler Chrome trace"
                        )
                    _take(ev, b)
            if len(b.tids) > MAX_THREADS or len(b.steps) > MAX_STEPS:
                what = f"{len(b.tids):,} host threads" if len(b.tids) > MAX_THREADS else f"{len(b.steps):,} steps"
                raise TraceError(
                    f"{path}: more than {what} (at most {MAX_THREADS:,} threads and {MAX_STEPS:,} ProfilerStep "
                    "markers are read; a recorded trace has a few of each): profile fewer steps"
                )
            if b.weight() > limit:
                raise TraceError(
                    f"{path}: after {count:,} events the analysis would need more than "
                    f"{limit / 2**20:,.0f} MiB, {MEMORY_PER_FILE_BYTE}x the file's size on disk (a recorded "
                    "trace needs about 12x its gzip size): not read (a small file of a huge repetitive trace?)"
                )
    except (AttributeError, TypeError, ValueError, KeyError) as e:
        raise TraceError(
            f"{path}: event {count} is not a torch.profiler event ({type(e).__name__}: {str(e)[:200]}); expected "
            "objects with a name, a category and numeric ts/dur"
        ) from None
    return b


def _read_parts(path: Path, workers: int) -> _Builder | None:
    """The file read in parts by `workers` processes (this one among them); None where it is not
    split (small, no second idle core, no place to cut) or any part fails: the caller reads it whole, and that read says
    what is wrong with the file. Each part of a .gz inflates the file up to its own end (zlib is
    about a seventh of the reading's time), so the parts overlap in inflation, not in decoding."""
    workers = min(workers, idle_cores())
    if workers < 2 or json_size(path) < SPLIT_MIN_BYTES:
        return None
    spans = split_points(path, workers)
    if len(spans) < 2:
        return None
    try:
        parts = run_all([(_read, (path, span)) for span in spans], here=1)
    except Exception:  # SplitError, a malformed part, a worker that died: read it whole
        return None
    for later in parts[1:]:
        parts[0].merge(later)
    return parts[0]


def event_time(ev: dict[str, Any]) -> tuple[float, float] | str:
    """(ts, dur) of a complete event, or why they are unusable (a key of INVALID_WHY): a time that is not a
    JSON number (a string, true) is never converted into one."""
    ts, dur = ev.get("ts"), ev.get("dur")
    if ts is None or dur is None:
        return "missing"
    if not (_is_number(ts) and _is_number(dur)):
        return "not_number"
    try:
        ts, dur = float(ts), float(dur)
    except OverflowError:  # an integer past the largest float
        return "not_finite"
    if not (math.isfinite(ts) and math.isfinite(dur)):
        return "not_finite"
    if dur < 0:
        return "negative"
    if not 0 <= ts <= MAX_TS_US:
        return "bad_start"
    if dur > MAX_EVENT_US:
        return "too_long"
    return ts, dur


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _take(ev: dict[str, Any], b: _Builder) -> None:
    """One trace event into the tables (a non-object or a non-numeric time raises, and the caller says where).

    The event-by-event reader: the reference that `_Builder.take` reproduces a chunk at a time, and the
    reader of the chunks msgspec's structs refuse (values of unexpected types)."""
    names, gpu, ops, rt, tids = b.names, b.gpu, b.ops, b.rt, b.tids
    intern = names.setdefault
    cat = ev.get("cat")
    if cat is None or ev.get("ph") != "X":
        if ev.get("name") == "[memory]":  # recorded with profile_memory: running totals per device type
            a = ev.get("args") or {}
            m = b.memory.setdefault(int(a.get("Device Type", -1)), [0.0, 0.0])
            m[0] = max(m[0], float(a.get("Total Allocated", 0) or 0))
            m[1] = max(m[1], float(a.get("Total Reserved", 0) or 0))
            b.recorded["memory"] = True
            if int(a.get("Device Type", -1)) == CUDA_DEVICE:
                b.cuda_memory.append(
                    (
                        float(ev.get("ts", 0.0)),
                        tids.setdefault(ev.get("tid"), len(tids)),
                        int(a.get("Addr", 0) or 0),
                        float(a.get("Bytes", 0) or 0),
                        float(a.get("Total Allocated", 0) or 0),
                    )
                )
        return
    if cat == "python_function":  # with_stack / with_modules: keep the module ranges only, never every frame
        b.recorded["stack"] = True
        name = ev.get("name", "")
        if name.startswith(MODULE_PREFIX):
            time = event_time(ev)
            if isinstance(time, str):
                b.invalid_one("host", time)
                return
            b.extra += len(name) if name not in names else 0
            _op_row(ops, intern(name, len(names)), tids.setdefault(ev.get("tid"), len(tids)), *time, -1, -1)
        return
    if cat == "cpu_op" or cat == "user_annotation":
        name = ev.get("name", "")
        time = event_time(ev)
        if isinstance(time, str):
            b.invalid_one("step" if name.startswith("ProfilerStep#") else "host", time)
            return
        ts, dur = time
        if name.startswith("ProfilerStep#"):
            b.steps.append((name, ts, ts + dur))
            return
        args = ev.get("args") or {}
        tid = tids.setdefault(ev.get("tid"), len(tids))
        b.extra += len(name) if name not in names else 0
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
            b.comm.append(("op", name, tid, ts, dur, args))
            b.extra += _weight(args)
        if "Input Dims" in args:
            b.recorded["shapes"] = True
            if name in SHAPE_OPS or name in LOGITS_OPS or name in MOE_OPS or name == SDPA_OP or name == FCE_OP:
                b.shapes.append((ts, name, args["Input Dims"]))
                b.types[name] = args.get("Input type")
                b.extra += _weight(args["Input Dims"])
            elif name in OPERAND_OPS:
                b.operands.append((name, ts, dur, tid, args["Input Dims"], args.get("Input type")))
                b.extra += _weight(args["Input Dims"]) + _weight(args.get("Input type"))
    elif cat == "cuda_runtime" or cat == "cuda_driver":
        time = event_time(ev)
        if isinstance(time, str):
            b.invalid_one("host", time)
            return
        args = ev.get("args") or {}
        name = ev.get("name", "")
        b.extra += len(name) if name not in names else 0
        rt.codes.append(intern(name, len(names)))
        n = rt.num
        n["tid"].append(tids.setdefault(ev.get("tid"), len(tids)))
        n["ts"].append(time[0])
        n["dur"].append(time[1])
        n["corr"].append(args.get("correlation", -1))
    elif cat in b.gpu_cats:
        time = event_time(ev)
        if isinstance(time, str):
            b.invalid_one("gpu", time)
            return
        args = ev.get("args") or {}
        name = ev.get("name", "")
        b.extra += len(name) if name not in names else 0
        gpu.codes.append(intern(name, len(names)))
        n = gpu.num
        n["ts"].append(time[0])
        n["dur"].append(time[1])
        n["corr"].append(args.get("correlation", -1))
        n["bytes"].append(args.get("bytes", 0) or 0)
        n["cat"].append(b.gpu_cats[cat])
        if cat == "kernel" and name.startswith(COMM_KERNELS):
            b.comm.append(("kernel", name, -1, n["ts"][-1], n["dur"][-1], args))
            b.extra += _weight(args)


def _weight(value: Any) -> int:
    """About the bytes a kept JSON value takes in memory (ten times its text)."""
    try:
        return 10 * len(json.dumps(value, default=str))
    except (TypeError, ValueError, RecursionError):
        return 10_000


def _op_row(ops: _Column, code: int, tid: int, ts: float, dur: float, seq: int, fwd_tid: int) -> None:
    ops.codes.append(code)
    n = ops.num
    n["tid"].append(tid)
    n["ts"].append(ts)
    n["dur"].append(dur)
    n["seq"].append(seq)
    n["fwd_tid"].append(fwd_tid)


# --- the fast path: chunks of events decoded into structs, taken column by column -----------------

_ABSENT = msgspec.Raw(b"")  # a key the event does not have (JSON null is b"null")


class _Args(msgspec.Struct, gc=False):
    """The args keys the tables read, typed as _take reads them; a value of another type sends its
    chunk to _take, which says what is wrong with it."""

    correlation: float = -1.0
    bytes: float | None = 0.0
    seq: int = msgspec.field(default=-1, name="Sequence number")
    fwd_tid: int = msgspec.field(default=-1, name="Fwd thread id")
    dims: msgspec.Raw = msgspec.field(default=_ABSENT, name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=_ABSENT, name="Input type")
    device: int = msgspec.field(default=-1, name="Device Type")
    allocated: float | None = msgspec.field(default=0.0, name="Total Allocated")
    reserved: float | None = msgspec.field(default=0.0, name="Total Reserved")
    addr: int = msgspec.field(default=0, name="Addr")
    block: float | None = msgspec.field(default=0.0, name="Bytes")


_NO_TIME = -math.inf  # the default of a missing ts or dur: JSON cannot write it, so it means "missing"


class _Event(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str = ""
    ts: float = _NO_TIME
    dur: float = _NO_TIME
    tid: int | float | str | None = None
    args: _Args = msgspec.field(default_factory=_Args)  # JSON null: _take's chunk


class _RawArgs(msgspec.Struct, gc=False):
    args: msgspec.Raw = _ABSENT


_EVENTS = msgspec.json.Decoder(list[_Event])
_RAW_ARGS = msgspec.json.Decoder(list[_RawArgs])
_ANY = msgspec.json.Decoder()
_OP, _RUNTIME, _GPU, _MODULE = 1, 2, 3, 4
_KIND = {
    "cpu_op": _OP,
    "user_annotation": _OP,
    "cuda_runtime": _RUNTIME,
    "cuda_driver": _RUNTIME,
    "kernel": _GPU,
    "gpu_memcpy": _GPU,
    "gpu_memset": _GPU,
    "python_function": _MODULE,
}
# what a name is, once per distinct name: bits of _Fast's flag table
_STEP, _MODULE_RANGE, _COMM_OP, _COMM_KERNEL, _SHAPE, _OPERAND = 1, 2, 4, 8, 16, 32
_SHAPE_NAMES = frozenset((*SHAPE_OPS, *LOGITS_OPS, *MOE_OPS, SDPA_OP, FCE_OP))
_cat, _ph, _name, _ts, _dur, _tid = (attrgetter(k) for k in ("cat", "ph", "name", "ts", "dur", "tid"))
_seq, _fwd_tid, _corr, _bytes, _dims = (
    attrgetter(f"args.{k}") for k in ("seq", "fwd_tid", "correlation", "bytes", "dims")
)


class _Codes(dict):
    """Interning: a new key gets the next code."""

    def __missing__(self, key: Any) -> int:
        code = self[key] = len(self)
        return code


def _flags(name: str) -> int:
    return (
        _STEP * name.startswith("ProfilerStep#")
        | _MODULE_RANGE * name.startswith(MODULE_PREFIX)
        | _COMM_OP * name.startswith(COMM_OPS)
        | _COMM_KERNEL * name.startswith(COMM_KERNELS)
        | _SHAPE * (name in _SHAPE_NAMES)
        | _OPERAND * (name in OPERAND_OPS)
    )


def _value(raw: msgspec.Raw) -> Any:
    """A kept args value, as json decodes it."""
    try:
        return _ANY.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError):
        return json.loads(bytes(raw).decode("utf-8", "replace"))


def _pick(items: list[Any], idx: np.ndarray) -> list[Any]:
    if len(idx) > 1:
        return list(itemgetter(*idx.tolist())(items))
    return [items[int(i)] for i in idx]


def _floats(col: array, getter: Callable[[Any], Any], evs: list[Any]) -> np.ndarray:
    values = np.fromiter(map(getter, evs), dtype=np.float64, count=len(evs))
    col.frombytes(values.tobytes())
    return values


class _Builder:
    """The tables as they are read: _take's state, filled a chunk at a time by `take`.

    `take` does what _take does, for a whole chunk of _Event structs: the same rows in the same
    order, built column by column at C speed (map, itemgetter, numpy) instead of one Python call
    per event. Every distinct name gets a private code and its flags (a step, a module range, a
    collective, an op whose shapes are kept) once; public codes (the categories) are given in
    event order to the names of kept rows, exactly as _take interns them.
    """

    def __init__(self) -> None:
        self.names: dict[str, int] = _Codes()
        self.gpu = _Column(("ts", "dur", "corr", "bytes", "cat"))
        self.ops = _Column(("tid", "ts", "dur", "seq", "fwd_tid"))
        self.rt = _Column(("tid", "ts", "dur", "corr"))
        self.tids: dict[Any, int] = _Codes()
        self.steps: list[tuple[str, float, float]] = []
        self.shapes: list[tuple[float, str, Any]] = []
        self.types: dict[str, Any] = {}
        self.gpu_cats = {"kernel": 0.0, "gpu_memcpy": 1.0, "gpu_memset": 2.0}
        self.memory: dict[int, list[float]] = {}
        self.recorded = {"shapes": False, "memory": False, "stack": False}
        self.comm: list[tuple[str, str, int, float, float, dict[str, Any]]] = []
        self.operands: list[tuple[str, float, float, int, Any, Any]] = []
        self.cuda_memory: list[tuple[float, int, int, float, float]] = []
        self.private: dict[str, int] = _Codes()
        self.flag = np.zeros(0, dtype=np.int8)  # private code -> flags
        self.public = np.zeros(0, dtype=np.int32)  # private code -> public code, -1 before its first kept row
        self.invalid: dict[str, dict[str, int]] = {}  # events left out for their times (Tables.invalid)
        self.extra = 0  # bytes of the kept names and Python objects (args, shapes), for weight()

    def weight(self) -> int:
        """About the memory the analysis of what is kept so far takes (bytes): rows, distinct names and threads,
        and the Python objects kept (`extra`)."""
        rows = len(self.gpu.codes) + len(self.ops.codes) + len(self.rt.codes)
        entries = len(self.names) + len(self.tids) + len(self.private) + len(self.cuda_memory)
        return ROW_BYTES * rows + ENTRY_BYTES * entries + self.extra

    def invalid_one(self, kind: str, why: str, n: int = 1) -> None:
        whys = self.invalid.setdefault(kind, {})
        whys[why] = whys.get(why, 0) + n

    def tables(self, path: Path, meta: dict[str, Any]) -> Tables:
        categories = list(self.names)
        steps_df = pd.DataFrame(self.steps, columns=["name", "ts", "end"]).sort_values("ts").reset_index(drop=True)
        gpu_df = self._once(self.gpu.frame(categories), "gpu")
        gpu_df = self._within_trace(gpu_df)
        gpu_df["cat"] = np.array(["kernel", "gpu_memcpy", "gpu_memset"])[gpu_df["cat"].to_numpy().astype(int)]
        gpu_df["end"] = gpu_df["ts"] + gpu_df["dur"]
        gpu_df["corr"] = gpu_df["corr"].astype(np.int64)
        pairs = list(zip(gpu_df["name"].cat.codes.to_numpy(), gpu_df["cat"]))
        cls_of = {(c, k): classify(categories[c], k) for c, k in set(pairs)}
        gpu_df["cls"] = [cls_of[pk] for pk in pairs]
        ops_df = self._once(self.ops.frame(categories), "host")
        ops_df["end"] = ops_df["ts"] + ops_df["dur"]
        for col in ("tid", "seq", "fwd_tid"):
            ops_df[col] = ops_df[col].astype(np.int64)
        rt_df = self._once(self.rt.frame(categories), "host")
        rt_df["end"] = rt_df["ts"] + rt_df["dur"]
        for col in ("tid", "corr"):
            rt_df[col] = rt_df[col].astype(np.int64)
        return Tables(
            path,
            meta,
            steps_df,
            gpu_df,
            ops_df,
            rt_df,
            self.shapes,
            self.types,
            self.memory,
            self.recorded,
            self.comm,
            self.operands,
            self.cuda_memory,
            self.invalid,
        )

    def _once(self, df: pd.DataFrame, kind: str) -> pd.DataFrame:
        """Each event once: a row equal to another in every column (a trace concatenated with itself, an event
        written twice) is the same event and would be counted twice; the copies are left out and counted."""
        if df.empty:
            return df
        ts = df["ts"].to_numpy()
        order = np.argsort(ts, kind="stable")
        tie = np.diff(ts[order]) == 0
        if not tie.any():  # no two events start at the same time: none is a copy (the common case, and cheap)
            return df
        rows = np.unique(np.concatenate([order[1:][tie], order[:-1][tie]]))
        dup = df.iloc[rows].duplicated()
        n = int(dup.sum())
        if not n:
            return df
        self.invalid_one(kind, "duplicate", n)
        return df.drop(index=df.index[rows[dup.to_numpy()]]).reset_index(drop=True)

    def _within_trace(self, gpu_df: pd.DataFrame) -> pd.DataFrame:
        """The GPU events, less those longer than the whole trace's host side (ops and runtime calls, first
        start to last end): a kernel cannot outlast the program that launched it (counted as invalid)."""
        if gpu_df.empty:
            return gpu_df
        starts = [np.frombuffer(c.num["ts"], dtype=np.float64) for c in (self.ops, self.rt) if len(c.codes)]
        if not starts:
            return gpu_df
        ends = [
            np.frombuffer(c.num["ts"], dtype=np.float64) + np.frombuffer(c.num["dur"], dtype=np.float64)
            for c in (self.ops, self.rt)
            if len(c.codes)
        ]
        span = max(float(e.max()) for e in ends) - min(float(t.min()) for t in starts)
        dur = gpu_df["dur"].to_numpy()
        bad = dur > span
        if span <= 0 or not bad.any():
            return gpu_df
        self.invalid_one("gpu", "longer_than_trace", int(bad.sum()))
        return gpu_df.loc[~bad].reset_index(drop=True)

    def merge(self, later: _Builder) -> None:
        """Append the rows of the part of the file after this one, its names and threads interned
        after this part's, as one pass over both would have."""
        name = np.array([self.names[k] for k in later.names], dtype=np.int32)
        tid = np.array([self.tids[k] for k in later.tids], dtype=np.float64)
        for mine, theirs in ((self.gpu, later.gpu), (self.ops, later.ops), (self.rt, later.rt)):
            if len(theirs.codes):
                mine.codes.frombytes(name[np.frombuffer(theirs.codes, dtype=np.int32)].tobytes())
            for k, v in theirs.num.items():
                if k == "tid" and len(v):
                    mine.num[k].frombytes(tid[np.frombuffer(v, dtype=np.float64).astype(np.int64)].tobytes())
                else:
                    mine.num[k].extend(v)
        t = tid.astype(np.int64).tolist()
        self.steps += later.steps
        self.shapes += later.shapes
        self.types.update(later.types)
        for device, (alloc, reserved) in later.memory.items():
            m = self.memory.setdefault(device, [0.0, 0.0])
            m[0], m[1] = max(m[0], alloc), max(m[1], reserved)
        for k, v in later.recorded.items():
            self.recorded[k] = self.recorded[k] or v
        self.comm += [(kind, n, t[i] if i >= 0 else i, *rest) for kind, n, i, *rest in later.comm]
        self.operands += [(n, ts, dur, t[i], *rest) for n, ts, dur, i, *rest in later.operands]
        self.cuda_memory += [(ts, t[i], *rest) for ts, i, *rest in later.cuda_memory]
        for kind, whys in later.invalid.items():
            for why, count in whys.items():
                self.invalid_one(kind, why, count)
        self.extra += later.extra

    def take(self, evs: list[_Event], text: bytes) -> None:
        n = len(evs)
        kinds = np.fromiter(map(_KIND.get, map(_cat, evs), repeat(0, n)), dtype=np.int8, count=n)
        kinds[np.array(list(map(_ph, evs)), dtype=object) != "X"] = 0
        other = np.flatnonzero(kinds == 0)
        if len(other):
            self._memory([e for e in _pick(evs, other) if e.name == "[memory]" and (e.cat is None or e.ph != "X")])
        at = np.flatnonzero(kinds)
        sel = _pick(evs, at)
        kind = kinds[at]
        pc = np.fromiter(map(self.private.__getitem__, map(_name, sel)), dtype=np.int64, count=len(sel))
        self._grow()
        flag = self.flag[pc]
        module = kind == _MODULE
        if module.any():  # with_stack / with_modules: the module ranges only, never every frame
            self.recorded["stack"] = True
            kind[module & (flag & _MODULE_RANGE == 0)] = 0
        live = np.flatnonzero(kind)
        if len(live) < len(kind):  # frames of with_stack traces: never kept, never timed
            kind, pc, flag, sel, at = kind[live], pc[live], flag[live], _pick(sel, live), at[live]
        step = (kind == _OP) & (flag & _STEP != 0)
        ts = np.fromiter(map(_ts, sel), dtype=np.float64, count=len(sel))
        dur = np.fromiter(map(_dur, sel), dtype=np.float64, count=len(sel))
        with np.errstate(invalid="ignore"):
            ok = (  # NaN fails every comparison
                np.isfinite(ts) & (ts >= 0) & (ts <= MAX_TS_US) & (dur >= 0) & (dur <= MAX_EVENT_US)
            )
        if not ok.all():
            self._invalid(np.flatnonzero(~ok), kind, step, ts, dur)
            kind[~ok], step[~ok] = 0, False
        for i in np.flatnonzero(step).tolist():
            self.steps.append((sel[i].name, float(ts[i]), float(ts[i] + dur[i])))
        kind[step] = 0
        keep = np.flatnonzero(kind)
        kind, pc, flag, sel, ts, dur = kind[keep], pc[keep], flag[keep], _pick(sel, keep), ts[keep], dur[keep]
        codes = self._public(pc)
        host = kind != _GPU
        hsel = _pick(sel, np.flatnonzero(host))
        tids = self.tids
        tid = np.fromiter(map(tids.__getitem__, map(_tid, hsel)), dtype=np.float64, count=len(hsel))
        hkind = kind[host]
        is_op = (kind == _OP) | (kind == _MODULE)
        op = np.flatnonzero(is_op)
        self._ops(sel, op, codes, tid[hkind != _RUNTIME], kind[is_op], flag[is_op], ts[op], dur[op])
        rt = np.flatnonzero(kind == _RUNTIME)
        self._runtime(_pick(sel, rt), codes[rt], tid[hkind == _RUNTIME], ts[rt], dur[rt])
        gpu = np.flatnonzero(kind == _GPU)
        self._gpu(_pick(sel, gpu), codes[gpu], ts[gpu], dur[gpu])
        comm = np.flatnonzero(((kind == _OP) & (flag & _COMM_OP != 0)) | ((kind == _GPU) & (flag & _COMM_KERNEL != 0)))
        if len(comm):
            self._comm(sel, comm, kind, tid, host, at[keep], text)

    def _invalid(self, bad: np.ndarray, kind: np.ndarray, step: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> None:
        """Count the kept events whose time is unusable, as event_time names why."""
        for i in bad.tolist():
            t, d = ts[i], dur[i]
            why = (
                "missing"
                if t == _NO_TIME or d == _NO_TIME
                else "not_finite"
                if not (math.isfinite(t) and math.isfinite(d))
                else "negative"
                if d < 0
                else "bad_start"
                if not 0 <= t <= MAX_TS_US
                else "too_long"
            )
            self.invalid_one("step" if step[i] else "gpu" if kind[i] == _GPU else "host", why)

    def _grow(self) -> None:
        """Flags and an unset public code for the names first seen in this chunk."""
        new = list(self.private)[len(self.flag) :]
        if new:
            self.extra += sum(map(len, new))
            self.flag = np.concatenate([self.flag, np.array([_flags(s) for s in new], dtype=np.int8)])
            self.public = np.concatenate([self.public, np.full(len(new), -1, dtype=np.int32)])

    def _public(self, pc: np.ndarray) -> np.ndarray:
        """Public codes of kept rows; names new to the categories are added in the order they first occur."""
        unset = self.public[pc] < 0
        if unset.any():
            first, where = np.unique(pc[unset], return_index=True)
            names, private = self.names, list(self.private)
            for p in first[np.argsort(where)].tolist():
                self.public[p] = names[private[p]]  # a name _take interned first keeps its code
        return self.public[pc]

    def _memory(self, evs: list[_Event]) -> None:
        memory = self.memory
        for e in evs:  # recorded with profile_memory: running totals per device type
            a = e.args
            m = memory.setdefault(a.device, [0.0, 0.0])
            m[0] = max(m[0], float(a.allocated or 0))
            m[1] = max(m[1], float(a.reserved or 0))
            self.recorded["memory"] = True
            if a.device == CUDA_DEVICE:
                ts = e.ts if e.ts != _NO_TIME else 0.0  # an instant: no duration to check
                self.cuda_memory.append(
                    (ts, self.tids[_tid(e)], int(a.addr or 0), float(a.block or 0), float(a.allocated or 0))
                )

    def _ops(self, sel, at, codes, tid, kind: np.ndarray, flag: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> None:
        evs = _pick(sel, at)
        col = self.ops
        col.codes.frombytes(codes[at].tobytes())
        n = col.num
        n["tid"].frombytes(tid.tobytes())
        n["ts"].frombytes(ts.tobytes())
        n["dur"].frombytes(dur.tobytes())
        module = kind == _MODULE
        seq = np.fromiter(map(_seq, evs), dtype=np.float64, count=len(evs))
        fwd = np.fromiter(map(_fwd_tid, evs), dtype=np.float64, count=len(evs))
        seq[module], fwd[module] = -1, -1
        n["seq"].frombytes(seq.tobytes())
        n["fwd_tid"].frombytes(fwd.tobytes())
        op = np.flatnonzero(~module)
        if not self.recorded["shapes"] and any(map(len, map(_dims, _pick(evs, op)))):
            self.recorded["shapes"] = True
        kept = op[flag[op] & (_SHAPE | _OPERAND) != 0]
        for i in kept.tolist():
            e = evs[i]
            a = e.args
            if not len(a.dims):
                continue
            types = _value(a.types) if len(a.types) else None
            if flag[i] & _SHAPE:
                self.shapes.append((e.ts, e.name, _value(a.dims)))
                self.types[e.name] = types
                self.extra += 10 * len(a.dims)
            else:
                self.operands.append((e.name, e.ts, e.dur, int(tid[i]), _value(a.dims), types))
                self.extra += 10 * (len(a.dims) + len(a.types))

    def _runtime(self, evs: list[_Event], codes: np.ndarray, tid: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> None:
        col = self.rt
        col.codes.frombytes(codes.tobytes())
        n = col.num
        n["tid"].frombytes(tid.tobytes())
        n["ts"].frombytes(ts.tobytes())
        n["dur"].frombytes(dur.tobytes())
        _floats(n["corr"], _corr, evs)

    def _gpu(self, evs: list[_Event], codes: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> None:
        col = self.gpu
        col.codes.frombytes(codes.tobytes())
        n = col.num
        n["ts"].frombytes(ts.tobytes())
        n["dur"].frombytes(dur.tobytes())
        _floats(n["corr"], _corr, evs)
        _floats(n["bytes"], lambda e: e.args.bytes or 0, evs)
        _floats(n["cat"], self.gpu_cats.__getitem__, list(map(_cat, evs)))

    def _comm(self, sel, at: np.ndarray, kind, tid, host, where: np.ndarray, text: bytes) -> None:
        """Collectives keep their whole args (trace/comms.py reads many keys): read again for these events."""
        raw = _RAW_ARGS.decode(b"[" + text + b"]")
        tid_of = np.full(len(sel), -1, dtype=np.int64)
        tid_of[host] = tid
        for i in at.tolist():
            e = sel[i]
            if kind[i] == _GPU and e.cat != "kernel":
                continue
            r = raw[int(where[i])].args
            args = (_value(r) if len(r) else None) or {}
            self.extra += 10 * len(r)
            if kind[i] == _OP:
                self.comm.append(("op", e.name, int(tid_of[i]), e.ts, e.dur, args))
            else:
                self.comm.append(("kernel", e.name, -1, e.ts, e.dur, args))
