"""Collective communication in one rank's trace: what was sent, how fast, and how much of it the step waited for.

Two kinds of trace hold collectives:
  - NCCL (GPU): the work is a kernel `ncclDevKernel_*` / `ncclKernel_*` on a communication stream.
    Its size comes from the kernel's own args where newer torch copies them there ("Collective
    name", "In msg nelems", "Out msg nelems", "dtype", "Group size"), else from the host op that
    launched it (`record_param_comms` with the same args, or the older `nccl:<collective>`
    annotation with the input's dims and type).
  - gloo (CPU): the work is a `gloo:<collective>` range on one of gloo's worker threads. The
    collective the user asked for and its size come from the `c10d::<op>_` host op that enqueued
    it, matched in issue order (gloo runs a reduce-scatter as an all-reduce, so its own name can
    mislead).
Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): the message size is the larger of input
and output, algbw = size / time, busbw = algbw * 2(n-1)/n for all-reduce, * (n-1)/n for
all-gather, reduce-scatter and all-to-all, * 1 for broadcast, reduce and send/recv.
Exposed communication is collective time during which no compute ran: no other GPU kernel (NCCL),
or no op on a compute thread (gloo). The rest is hidden (overlapped).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.intervals import Intervals, _measure, intersect, subtract, total, union
from vlmdoctor.trace.tables import Tables

PRODUCES = by_producer(__name__)

#: normalized collective name (lower case, no underscores) -> the name facts use
KINDS = (
    ("allreduce", "all_reduce"),
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("sendrecv", "send_recv"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("barrier", "barrier"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
)
DTYPE_BYTES = {
    "float": 4,
    "float32": 4,
    "f32": 4,
    "bfloat16": 2,
    "c10::bfloat16": 2,
    "bf16": 2,
    "half": 2,
    "c10::half": 2,
    "float16": 2,
    "f16": 2,
    "double": 8,
    "float64": 8,
    "long": 8,
    "int64": 8,
    "int": 4,
    "int32": 4,
    "byte": 1,
    "char": 1,
    "unsigned char": 1,
    "signed char": 1,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
GRAD_SYNC = ("all_reduce", "reduce_scatter")  # the collectives that synchronize gradients (DDP, FSDP)
MICRO_MARKS = {"ddp": ("DistributedDataParallel.forward",), "fsdp2": ("FSDP::root_pre_forward",)}
FSDP_AG = re.compile(r"^FSDP::all_gather \((.+)\)$")
FSDP_USE = re.compile(r"^FSDP::pre_(forward|backward) \((.+)\)$")


def _names_where(col: pd.Series, test) -> np.ndarray:
    """A mask of the rows whose (categorical) name passes `test`, tested once per distinct name, not per row."""
    cats = col.cat.categories
    good = np.array([bool(test(str(c))) for c in cats], dtype=bool)
    codes = col.cat.codes.to_numpy()
    return good[codes] & (codes >= 0) if len(cats) else np.zeros(len(col), dtype=bool)


def kind_of(name: str) -> str:
    """The collective a kernel, host op or "Collective name" names, in the facts' spelling."""
    key = re.sub(r"[^a-z]", "", name.lower().split("(")[0])
    for drop in (
        "ncclkernel",
        "nccldevkernel",
        "nccl",
        "gloo",
        "cd",
        "base",
        "coalesced",
        "intotensor",
        "tensor",
    ):
        key = key.replace(drop, "")
    for k, v in KINDS:
        if key.startswith(k):
            return v
    return "other"


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw for a collective over n ranks."""
    if n < 1:
        return 1.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _elem_bytes(dtype: Any) -> int:
    if isinstance(dtype, list):
        dtype = next((d for d in dtype if d), "float")
    return DTYPE_BYTES.get(str(dtype or "float").lower().removeprefix("c10::").removeprefix("torch."), 4)


def _nelems(dims: Any) -> int:
    """The largest tensor (or tensor list, summed) among an op's inputs."""
    best = 0
    for d in dims or []:
        if isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            best = max(best, sum(int(np.prod(x)) if x else 0 for x in d))
        elif isinstance(d, list) and d and all(isinstance(x, (int, float)) for x in d):
            best = max(best, int(np.prod(d)))
    return best


def _size_from_args(args: dict[str, Any]) -> tuple[str | None, float | None, int | None]:
    """(kind, bytes, group size) from record_param_comms-style args, where present."""
    kind = kind_of(args["Collective name"]) if args.get("Collective name") else None
    group = args.get("Group size")
    group = int(group) if isinstance(group, (int, float)) and group > 0 else None
    if "In msg nelems" in args or "Out msg nelems" in args:
        nel = max(float(args.get("In msg nelems") or 0), float(args.get("Out msg nelems") or 0))
        return kind, nel * _elem_bytes(args.get("dtype")), group
    return kind, None, group


@dataclass
class RankComms:
    """One rank's collectives and step windows: the per-rank facts, and what the cross-rank join needs."""

    rank: int | None
    backend: str  # nccl, gloo, none
    world: int | None
    steps: pd.DataFrame  # name, ts, end
    work: pd.DataFrame  # kind, ts, dur, end, bytes, issue, group, step, exposed
    facts: dict[str, Any] = field(default_factory=dict)
    host: str | None = None
    per_step: pd.DataFrame | None = None  # step, ms, tokens, loader_ms, gap_ms, comm_ms, exposed_ms


def _host_comm_ops(t: Tables) -> list[tuple[str, str, int, float, float, dict[str, Any]]]:
    return [c for c in t.comm if c[0] == "op"]


def _nccl_work(t: Tables, world: int | None) -> list[dict[str, Any]]:
    """NCCL kernels with their collective and size (kernel args, else the launching host op)."""
    kernels = [c for c in t.comm if c[0] == "kernel"]
    if not kernels:
        return []
    host = _host_comm_ops(t)
    by_tid: dict[int, list[tuple[float, float, str, dict[str, Any]]]] = {}
    for _, name, tid, ts, dur, args in host:
        if name == "record_param_comms" or name.startswith("nccl:"):
            by_tid.setdefault(tid, []).append((ts, ts + dur, name, args))
    starts = {tid: [x[0] for x in sorted(v)] for tid, v in by_tid.items()}
    by_tid = {tid: sorted(v) for tid, v in by_tid.items()}
    launch = {}
    if len(t.runtime):
        rt = t.runtime[t.runtime["corr"] >= 0]
        launch = dict(zip(rt["corr"].to_numpy(), zip(rt["tid"].to_numpy(), rt["ts"].to_numpy())))
    out = []
    for _, name, _, ts, dur, args in kernels:
        kind, size, group = _size_from_args(args)
        # a kernel whose launch is not in the trace (launched in the profiler's warm-up step, run in the
        # first traced one) has no step: filed by its GPU start it counted twice in that step's collectives
        # (17.5 all-reduces a step instead of 12 on dist_gpu4/ddp_long_rank1) and broke the late-rank match
        issue = ts if not launch else float("nan")
        corr = args.get("correlation", -1)
        if corr in launch:
            tid, issue = launch[corr]
            if kind is None or size is None:
                ops = by_tid.get(int(tid), [])
                i = bisect_right(starts.get(int(tid), []), issue) - 1
                cands = []
                while i >= 0 and len(cands) < 4:  # the host ops around the launch: record_param_comms, nccl:*
                    o = ops[i]
                    if o[0] <= issue <= o[1]:
                        cands.append(o)
                    i -= 1
                for _o_ts, _o_end, o_name, o_args in cands:
                    k2, s2, g2 = _size_from_args(o_args)
                    kind = kind or k2 or (kind_of(o_name) if o_name.startswith("nccl:") else None)
                    group = group or g2
                    if size is None and s2 is not None:
                        size = s2
                    if size is None and o_name.startswith("nccl:") and o_args.get("Input Dims"):
                        size = _nelems(o_args["Input Dims"]) * _elem_bytes(o_args.get("Input type"))
                        if kind_of(o_name) == "all_gather":  # the input is one rank's shard
                            size *= group or world or 1
        out.append(
            {
                "kind": kind or kind_of(name),
                "ts": ts,
                "dur": dur,
                "bytes": size,
                "issue": issue,
                "group": group or world,
            }
        )
    return out


def _gloo_work(t: Tables, world: int | None) -> tuple[list[dict[str, Any]], set[int]]:
    """gloo's worker-thread ranges, each matched in issue order to the c10d op that enqueued it."""
    host = _host_comm_ops(t)
    work = sorted((c for c in host if c[1].startswith("gloo:")), key=lambda c: c[3])
    if not work:
        return [], set()
    gloo_tids = {c[2] for c in work}
    issued = sorted((c for c in host if c[1].startswith("c10d::") and c[2] not in gloo_tids), key=lambda c: c[3])
    top, reach = [], {}
    for c in issued:  # outermost c10d op per thread only (a coalesced op wraps others)
        if c[3] < reach.get(c[2], -np.inf):
            continue
        reach[c[2]] = c[3] + c[4]
        top.append(c)
    top = [c for c in top if kind_of(c[1]) not in ("other",) and "wait" not in c[1]]
    matched = len(top) == len(work)
    out = []
    for i, (_, name, _, ts, dur, args) in enumerate(work):
        kind, size, issue = kind_of(name), None, ts
        if matched:
            _, iname, _, its, _, iargs = top[i]
            kind, issue = kind_of(iname), its
            size = _nelems(iargs.get("Input Dims")) * _elem_bytes(iargs.get("Input type"))
        elif args.get("Input Dims"):
            size = _nelems(args["Input Dims"]) * _elem_bytes(args.get("Input type"))
            if kind == "all_gather":
                size *= world or 1
        out.append({"kind": kind, "ts": ts, "dur": dur, "bytes": size, "issue": issue, "group": world})
    return out, gloo_tids


def _compute(t: Tables, backend: str, skip_tids: set[int]) -> Intervals:
    """When compute ran: non-NCCL kernels on a GPU trace, ops on the compute threads of a CPU trace."""
    if backend == "nccl":
        g = t.gpu[(t.gpu["cat"] == "kernel")]
        g = g[~_names_where(g["name"], lambda n: n.startswith(("ncclDevKernel", "ncclKernel")))]
        return union(g["ts"].to_numpy(), g["end"].to_numpy())
    o = t.ops[~t.ops["tid"].isin(list(skip_tids))]
    o = o[_names_where(o["name"], lambda n: n.startswith("aten::"))]
    return union(o["ts"].to_numpy(), o["end"].to_numpy())


def parallel_kind(t: Tables) -> str:
    """Which data-parallel wrapper ran, from its own markers in the trace (never from a config)."""
    names = [str(c) for c in t.ops["name"].cat.categories] if len(t.ops) else []
    if any(n.startswith("FSDP::") for n in names):
        return "fsdp2"
    if any(n.startswith("FullyShardedDataParallel") for n in names):
        return "fsdp1"
    if any(n.startswith("DistributedDataParallel") for n in names):
        return "ddp"
    return "none"


def rank_of(meta: dict[str, Any], name: str) -> int | None:
    """distributedInfo.rank, else a rank in the file name (trace_rank3.json.gz, rank-3.*, rank_3)."""
    info = meta.get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return info["rank"]
    m = re.search(r"rank[-_]?(\d+)", name, re.IGNORECASE)
    return int(m.group(1)) if m else None


def rank_comms(t: Tables) -> RankComms:
    """The collectives of one trace and the facts about them (empty facts when it ran none)."""
    info = t.meta.get("distributedInfo") or {}
    world = info.get("world_size") if isinstance(info.get("world_size"), int) else None
    steps = (
        t.steps
        if len(t.steps)
        else pd.DataFrame(  # no ProfilerStep: the whole trace is one window
            {
                "name": ["trace"],
                "ts": [pd.Series([t.ops["ts"].min(), t.gpu["ts"].min()]).min()],
                "end": [pd.Series([t.ops["end"].max(), t.gpu["end"].max()]).max()],
            }
        )
    )
    work = _nccl_work(t, world)
    backend, skip = ("nccl", set()) if work else ("gloo", set())
    if not work:
        work, skip = _gloo_work(t, world)
        if not work:
            backend = "none"
    rc = RankComms(
        rank_of(t.meta, t.path.name),
        backend,
        world,
        steps.reset_index(drop=True),
        pd.DataFrame(work, columns=["kind", "ts", "dur", "bytes", "issue", "group"]),
        host=t.meta.get("host_name"),
    )
    _per_step(t, rc, skip)
    w = rc.work
    w["end"] = w["ts"] + w["dur"]
    s0, s1 = steps["ts"].to_numpy(), steps["end"].to_numpy()
    k = np.searchsorted(s0, w["issue"].to_numpy(), side="right") - 1
    inside = (k >= 0) & (w["issue"].to_numpy() < s1[np.maximum(k, 0)])
    w["step"] = np.where(inside, k, -1)
    if backend == "none":
        w["exposed"] = np.zeros(0)
        return rc
    windows = union(s0, s1)
    compute = intersect(_compute(t, backend, skip), windows)
    a, b = (
        w["ts"].to_numpy(),
        w["end"].to_numpy(),
    )  # each collective's own exposed time: its length less compute in it
    w["exposed"] = (b - a) - (_measure(compute, b) - _measure(compute, a)) if len(w) else np.zeros(0)
    comm = intersect(union(w["ts"].to_numpy(), w["end"].to_numpy()), windows)
    n = len(steps)
    f = rc.facts
    f["comm.backend"] = backend
    f["comm.parallel"] = parallel_kind(t)
    f["comm.world_size"] = int(w["group"].dropna().max()) if w["group"].notna().any() else world
    f["comm.ms"] = total(comm) / 1e3 / n
    f["comm.exposed_ms"] = total(subtract(comm, compute)) / 1e3 / n
    f["comm.hidden_ms"] = f["comm.ms"] - f["comm.exposed_ms"]
    f["comm.overlap_frac"] = f["comm.hidden_ms"] / f["comm.ms"] if f["comm.ms"] else None
    step_ms = float((s1 - s0).mean()) / 1e3
    f["comm.exposed_share"] = f["comm.exposed_ms"] / step_ms if step_ms else None
    f["comm.count"] = float((w["step"] >= 0).sum()) / n
    kinds = []
    for kind, g in w[w["step"] >= 0].groupby("kind"):
        kinds.append(kind)
        p = f"comm.{kind}"
        f[f"{p}.count"] = len(g) / n
        f[f"{p}.ms"] = float(g["dur"].sum()) / 1e3 / n
        f[f"{p}.exposed_ms"] = float(g["exposed"].sum()) / 1e3 / n
        sized = g[g["bytes"].notna() & (g["dur"] > 0)]
        if len(sized):
            f[f"{p}.bytes"] = float(sized["bytes"].sum()) / n
            algbw = float(sized["bytes"].sum()) / (float(sized["dur"].sum()) * 1e-6) / 1e9  # GB/s
            group = int(sized["group"].dropna().max()) if sized["group"].notna().any() else (world or 1)
            f[f"{p}.algbw_gbps"] = algbw
            f[f"{p}.busbw_gbps"] = algbw * bus_factor(kind, group)
    f["comm.kinds"] = sorted(kinds)
    _fsdp_prefetch(t, f, n)
    _grad_sync(t, rc, f)
    return rc


def _per_step(t: Tables, rc: RankComms, skip: set[int]) -> None:
    """Per step: time, real tokens, data-loader time and host gaps (main-thread time no op covered)."""
    ops = t.ops
    loader = ops[_names_where(ops["name"], lambda n: "DataLoader" in n)]
    tables = [(ts, d) for ts, name, d in t.shapes if name == "aten::embedding" and len(d) > 1 and d[0] and d[1]]
    vocab = max((d[0][0] for _, d in tables), default=None)  # the LLM's token table, the largest
    emb = [(ts, int(np.prod(d[1])), d[1][0]) for ts, d in tables if d[0][0] == vocab]
    # the thread that ran the step: the one with the most op time (nested ops included), not a gloo worker
    cpu = ops[~ops["tid"].isin(list(skip)) & ~_names_where(ops["name"], lambda n: n.startswith(("gloo:", "nccl:")))]
    main_tid = int(cpu.groupby("tid")["dur"].sum().idxmax()) if len(cpu) else -1
    mo = cpu[cpu["tid"] == main_tid]
    busy = union(mo["ts"].to_numpy(), mo["end"].to_numpy())
    rows = []
    for name, a, b in zip(rc.steps["name"], rc.steps["ts"], rc.steps["end"]):
        lw = loader[(loader["ts"] >= a) & (loader["ts"] < b)]
        rows.append(
            {
                "step": str(name),
                "ms": (b - a) / 1e3,
                "tokens": sum(n for ts, n, _ in emb if a <= ts < b) or None,
                "batch": max((bs for ts, _, bs in emb if a <= ts < b), default=None),
                "loader_ms": total(union(lw["ts"].to_numpy(), lw["end"].to_numpy())) / 1e3,
                "gap_ms": float((b - a) - (_measure(busy, np.array([b])) - _measure(busy, np.array([a])))[0]) / 1e3,
            }
        )
    rc.per_step = pd.DataFrame(rows)


def _fsdp_prefetch(t: Tables, f: dict[str, Any], n: int) -> None:
    """FSDP2 all-gathers issued ahead of the module that needs them (prefetched) or inside its own pre-hook."""
    ops = t.ops
    ag = ops[_names_where(ops["name"], FSDP_AG.match)]
    use = ops[_names_where(ops["name"], FSDP_USE.match)]
    if not len(ag):
        return
    use_by_mod: dict[str, list[tuple[float, float, str]]] = {}
    for name, ts, end in zip(use["name"].astype(str), use["ts"], use["end"]):
        m = FSDP_USE.match(name)
        use_by_mod.setdefault(m.group(2), []).append((ts, end, m.group(1)))
    ahead = {"forward": [0, 0], "backward": [0, 0]}
    for name, ts in zip(ag["name"].astype(str), ag["ts"]):
        mod = FSDP_AG.match(name).group(1)
        # the use this gather serves: the module's first pre-hook ending after the gather was issued
        nxt = sorted((u for u in use_by_mod.get(mod, []) if u[1] >= ts), key=lambda u: u[0])
        if not nxt:
            continue
        u0, _, phase = nxt[0]
        ahead[phase][1] += 1
        ahead[phase][0] += int(ts < u0)
    gathers = sum(v[1] for v in ahead.values())
    if not gathers:
        return
    f["comm.fsdp.all_gathers"] = gathers / n
    f["comm.fsdp.prefetched_frac"] = sum(v[0] for v in ahead.values()) / gathers
    for phase, (a, c) in ahead.items():
        if c:
            f[f"comm.fsdp.{phase}_prefetched_frac"] = a / c


def _grad_sync(t: Tables, rc: RankComms, f: dict[str, Any]) -> None:
    """Micro-batches per step and how many of them synchronized gradients (only the last one needs to)."""
    kind = f.get("comm.parallel")
    marks = MICRO_MARKS.get(kind or "")
    if not marks:
        return
    ops = t.ops
    fw = ops[_names_where(ops["name"], lambda n: n in marks)]
    starts = np.sort(fw["ts"].to_numpy())
    w = rc.work[rc.work["kind"].isin(GRAD_SYNC) & (rc.work["step"] >= 0)]
    micro, synced, extra_ms, extra_bytes = [], [], 0.0, 0.0
    for a, b in zip(rc.steps["ts"], rc.steps["end"]):
        s = starts[(starts >= a) & (starts < b)]
        if not len(s):
            continue
        bounds = np.append(s, b)
        ws = w[(w["issue"] >= a) & (w["issue"] < b)]
        which = np.searchsorted(bounds, ws["issue"].to_numpy(), side="right") - 1
        micro.append(len(s))
        synced.append(len(set(which[(which >= 0) & (which < len(s))].tolist())))
        early = ws[(which >= 0) & (which < len(s) - 1)]
        extra_ms += float(early["dur"].sum()) / 1e3
        extra_bytes += float(early["bytes"].fillna(0).sum())
    if not micro:
        return
    m = len(micro)
    f["comm.micro_batches_per_step"] = sum(micro) / m
    f["comm.synced_micro_batches_per_step"] = sum(synced) / m
    f["comm.grad_sync.extra_ms"] = extra_ms / m
    f["comm.grad_sync.extra_bytes"] = extra_bytes / m
