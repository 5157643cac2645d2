"""Why the GPU waited: every moment of its idle time given to one cause, what the host was doing meanwhile.

Causes are tried in order and each takes the idle time it covers that no earlier cause took. The
first four are spans (a DataLoader call, a sync and the relaunch gap it opens, a blocking copy, the
optimizer's host work) whatever runs inside them. The rest read what each host thread was doing
at each moment: its innermost op or runtime call (a launch, an allocator call, cuDNN, compilation,
a torch op, a recorded range). Idle time under no host event at all, inside a ProfilerStep, is
Python outside torch ops (the training step's own code); outside any step marker nothing says what
the host did, and that time is `idle.unattributed`, never given to a cause.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import (
    ALLOCATOR,
    PART_RANGES,
    SYNC_CALLS,
    Reading,
    innermost,
    nesting,
    runtime_rows,
)
from vlmdoctor.trace.context import (
    BACKWARD_NODE as BACKWARD_RANGE,
)
from vlmdoctor.trace.intervals import Intervals, _measure, intersect, per_window, subtract, total, union
from vlmdoctor.trace.tables import COMM_OPS, MODULE_PREFIX, Tables

PRODUCES = by_producer(__name__)

#: the span causes, in the order idle time is given: cause -> (its ms fact, its share fact, what it means),
#: spelled out so that a search for a fact finds where it is computed
SPAN_CAUSES = {
    "data_loader": ("idle.data_loader.ms", "idle.data_loader.share", "building or fetching a batch (DataLoader)"),
    "sync": ("idle.sync.ms", "idle.sync.share", "sync calls and the relaunch gap they open"),
    "memcpy": ("idle.memcpy.ms", "idle.memcpy.share", "blocking cudaMemcpy calls"),
    "optimizer_host": ("idle.optimizer_host.ms", "idle.optimizer_host.share", "the optimizer's host work"),
}
#: the host causes under `idle.other_host`, in the order idle time is given to them: cause -> (its fact, what it
#: means)
HOST_CAUSES = {
    "ranks": ("idle.host.ranks.ms", "collectives and barriers (other ranks)"),
    "allocator": ("idle.host.allocator.ms", "cudaMalloc/cudaFree and pinned allocs"),
    "compile": ("idle.host.compile.ms", "torch.compile: compiling, guards, wrappers"),
    "cudnn": ("idle.host.cudnn.ms", "cuDNN calls (plans for new shapes)"),
    "launch": ("idle.host.launch.ms", "kernel launches (calls, compiled launchers)"),
    "runtime": ("idle.host.runtime.ms", "other CUDA runtime calls"),
    "dispatch": ("idle.host.dispatch.ms", "torch ops on the host (dispatch, CPU work)"),
    "python_model": ("idle.host.python_model.ms", "Python in model code (nn.Module)"),
    "python_range": ("idle.host.python_range.ms", "Python in a named range or autograd.Function"),
    "python": ("idle.host.python.ms", "the step's code outside torch ops"),
}
LAUNCH = re.compile(
    r"^(?:cudaLaunchKernel|cuLaunchKernel|cudaLaunchCooperativeKernel|cuLaunchCooperativeKernel|cudaGraphLaunch)"
)
COMPILE = re.compile(
    r"^(?:Torch-Compiled Region|TorchDynamo|CompiledFunction|Pregraph bytecode|"
    r"Postgraph bytecode|_compile\.|compile_fx|inductor|dynamo|OutputGraph|fx_codegen|async_compile|cudagraphify"
    r"|PythonDispatchMode|.*\(dynamo_timed\)$)",
    re.IGNORECASE,
)
BACKWARD_NODE = re.compile(r"Backward\d+$")  # a C++ autograd node (MmBackward0); Python Functions end in Backward
COMPILED_LAUNCHER = "## Call CompiledFxGraph"
RANKS = re.compile(r"barrier|ProcessGroup|^(?:" + "|".join(re.escape(p) for p in COMM_OPS) + ")")
#: the data-parallel wrappers' own ranges: a sync they make with no torch op between is their wait for the other
#: ranks (DDP's forward waiting on the last step's all-reduce), not a host read of a value
PARALLEL_RANGES = re.compile(r"^(?:DistributedDataParallel|FullyShardedDataParallel|FSDP)")
#: whose code made a sync, in words (idle.sync.by_code), in the order the idle time is told apart
SYNC_CODE = {
    "loop": "the training loop's own calls (outside the model's forward, backward and optimizer step)",
    "model": "the model's forward (its class's code)",
    "backward": "autograd's backward",
    "optimizer": "the optimizer step",
}
#: compiled code running (its wrappers): a sync under one is the compiled model's, not compilation's
COMPILED_RUNNING = ("Torch-Compiled Region", "CompiledFunction", COMPILED_LAUNCHER)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """GPU idle time given to causes in order; what none covers is said as unattributed."""
    t, idle, n = r.t, r.idle, r.n
    ops, rt = t.ops, t.runtime

    def spans(df: pd.DataFrame) -> Intervals:
        return union(df["ts"].to_numpy(), df["end"].to_numpy())

    syncs = rt[rt["name"].str.match(SYNC_CALLS)]
    owner = sync_owners(r, syncs.index.to_numpy())
    span_causes = {
        "data_loader": spans(ops[ops["name"].str.contains("DataLoader", regex=False)]),
        "sync": _sync_gaps(syncs[np.isin(owner, list(SYNC_CODE))], idle),
        "memcpy": spans(rt[rt["name"].str.startswith("cudaMemcpy")]),
        "optimizer_host": spans(ops[ops["name"].str.startswith("Optimizer.step")]),
    }
    inner, per_code, code_cause = _innermost(t, idle)
    host_causes = {
        "ranks": union(
            *(
                np.concatenate(x)
                for x in zip(
                    spans(ops[ops["name"].str.contains(RANKS)]),
                    inner["ranks"],
                    _sync_gaps(syncs[owner == "ranks"], idle),
                )
            )
        ),
        "compile": union(
            *(np.concatenate(x) for x in zip(inner["compile"], _sync_gaps(syncs[owner == "compile"], idle)))
        ),
        "allocator": spans(rt[rt["name"].str.match(ALLOCATOR)]),
        **{c: inner[c] for c in HOST_CAUSES if c not in ("ranks", "allocator", "compile", "python")},
    }
    # inside a step marker the host runs the step's own code even where no event is open; outside one, nothing
    # says what it did (unattributed)
    host_causes["python"] = r.span if len(t.steps) else (np.zeros(0), np.zeros(0))
    left = idle
    idle_total = max(total(idle), 1e-9)
    for cause, iv in span_causes.items():
        hit = intersect(left, iv)
        ms_fact, share_fact, _ = SPAN_CAUSES[cause]
        facts[ms_fact] = total(hit) / 1e3 / n
        facts[share_fact] = total(hit) / idle_total
        if cause == "sync":
            _sync_by_code(facts, syncs, owner, hit, idle, n)
        if cause == "data_loader":  # most steps' wait is the batch's work, now and then one stalls 10-80 ms
            # (docs/treat.md, `system-data-loader`): the least step's wait is the work every step paid
            facts["idle.data_loader.least_ms"] = float(per_window(hit, r.windows).min()) / 1e3
        left = subtract(left, hit)
    host_ms = 0.0
    for cause, iv in host_causes.items():
        hit = intersect(left, iv)
        facts[HOST_CAUSES[cause][0]] = total(hit) / 1e3 / n
        host_ms += total(hit)
        left = subtract(left, hit)
    facts["idle.other_host.ms"] = host_ms / 1e3 / n
    facts["idle.other_host.share"] = host_ms / idle_total
    facts["idle.unattributed.ms"] = total(left) / 1e3 / n
    facts["idle.unattributed.share"] = total(left) / idle_total
    # the host work running while the GPU waited: the innermost op or runtime call at each moment, any thread
    cats = t.ops["name"].cat.categories
    cudnn_att = np.flatnonzero(pd.Series(cats).str.contains("_cudnn_attention").to_numpy())
    facts["idle.op.cudnn_attention.ms"] = float(per_code[cudnn_att].sum()) / 1e3 / n  # cuDNN plans built on the host
    top = np.argsort(-per_code)[:12]
    facts["idle.top_host_ops"] = [
        {
            "op": str(cats[k]),
            "ms": float(per_code[k]) / 1e3 / n,
            "share": float(per_code[k]) / idle_total,
            "cause": str(code_cause[k]),
        }
        for k in top
        if per_code[k] > 0
    ]


def _sync_by_code(
    facts: dict[str, Any], syncs: pd.DataFrame, owner: np.ndarray, hit: Intervals, idle: Intervals, n: int
) -> None:
    """The sync account told apart by whose code made each sync: the training loop's, the model's, autograd's, ...

    The fix differs: a loop's `.item()` is the user's to move; a model class's data-dependent shapes are not.
    """
    left, rows = hit, []
    for code in SYNC_CODE:
        mine = intersect(left, _sync_gaps(syncs[owner == code], idle))
        left = subtract(left, mine)
        calls = float((owner == code).sum()) / n
        if calls:
            rows.append({"code": code, "calls": calls, "ms": total(mine) / 1e3 / n})
        if code == "loop":
            facts["idle.sync.loop_ms"] = total(mine) / 1e3 / n
    facts["idle.sync.by_code"] = sorted(rows, key=lambda x: -x["ms"])


def sync_owners(r: Reading, rt_rows: np.ndarray) -> np.ndarray:
    """Whose code made each synchronizing runtime call (rows of t.runtime): SYNC_CODE's names, "compile" or "ranks".

    Read from the ops around the call: compilation (autotuning benchmarks, constant folding: compile time), the
    optimizer step, a backward node, a data-parallel wrapper's own range with no torch op between (its wait for
    the other ranks: time the ranks account holds), the module hierarchy where recorded; otherwise the sync is
    the model's when it runs between two forward ops that autograd later differentiates (the model's forward),
    and the loop's when it does not (before the forward, after the loss, after backward).
    """
    t, ctx = r.t, r.ctx
    ops = t.ops
    out = np.full(len(rt_rows), "loop", dtype=object)
    if not len(rt_rows):
        return out
    names = ops["name"].astype(str).to_numpy()
    parent = r.parents
    inner = runtime_rows(t, ctx)[rt_rows]
    seq, fwd_tid = ops["seq"].to_numpy(), ops["fwd_tid"].to_numpy()
    in_bwd = ctx["in_bwd"].to_numpy()
    # an op records the sequence number autograd will give its next node; ops that create none share it with the
    # next one that does, so the op that made a backward node is the last to start with its number
    fwd = np.flatnonzero(ctx["fwd"].to_numpy() & np.isin(seq, seq[in_bwd & (seq >= 0) & (fwd_tid > 0)]))
    last = pd.Series(ops["ts"].to_numpy()[fwd], index=fwd).groupby(seq[fwd]).idxmax()
    order = last.to_numpy().astype(np.int64)
    order = order[np.argsort(ops["ts"].to_numpy()[order], kind="mergesort")]
    f_ts, f_end = ops["ts"].to_numpy()[order], ops["end"].to_numpy()[order]
    b_ts = np.sort(ops["ts"].to_numpy()[np.char.startswith(names.astype(str), BACKWARD_RANGE)])
    when = t.runtime["ts"].to_numpy()[rt_rows]
    for k, row in enumerate(inner):
        chain = []
        while row >= 0 and len(chain) < 256:
            chain.append(row)
            row = parent[row]
        chain_names = [names[c] for c in chain]
        aten = [c for c in chain if names[c].startswith("aten::")]
        if any(COMPILE.search(x) and not x.startswith(COMPILED_RUNNING) for x in chain_names):
            out[k] = "compile"
        elif any(x.startswith("Optimizer.step") for x in chain_names):
            out[k] = "optimizer"
        elif chain and in_bwd[chain[0]]:
            out[k] = "backward"
        elif not aten and any(PARALLEL_RANGES.match(x) or RANKS.search(x) for x in chain_names):
            out[k] = "ranks"
        elif any(x.startswith(MODULE_PREFIX) for x in chain_names):
            out[k] = "model"
        else:
            i = int(np.searchsorted(f_ts, when[k], side="right"))  # differentiated forward ops started by then
            inside = i > 0 and f_end[i - 1] >= when[k]
            between = 0 < i < len(f_ts) and not ((b_ts > f_ts[i - 1]) & (b_ts < f_ts[i])).any()
            out[k] = "model" if inside or between else "loop"
    return out


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


def name_cause(name: str, runtime: bool) -> str:
    """The host cause of time whose innermost event on a thread is this op or runtime call."""
    if RANKS.search(name) and not runtime:
        return "ranks"
    if name.startswith(COMPILED_LAUNCHER):  # Inductor's generated code launching its kernels one by one
        return "launch"
    if COMPILE.search(name):
        return "compile"
    if "cudnn" in name.lower():
        return "cudnn"
    if runtime:
        return "launch" if LAUNCH.match(name) else "runtime"
    if name.startswith(MODULE_PREFIX):
        return "python_model"
    if ("::" in name and name not in PART_RANGES) or BACKWARD_NODE.search(name):
        return "dispatch"
    return "python_range"  # a record_function range or an autograd.Function (Liger's): Python inside it


def _innermost(t: Tables, idle: Intervals) -> tuple[dict[str, Intervals], np.ndarray, np.ndarray]:
    """What each host thread was doing while the GPU idled: for each host cause, the moments whose innermost
    event on some thread has that cause; the idle time under each name (innermost op or call, any thread); and
    each name's cause."""
    cats = list(t.ops["name"].cat.categories)
    per_code = np.zeros(len(cats))
    code_cause = np.full(len(cats), "python", dtype=object)  # the cause of each name as an innermost event
    op_cause = np.array([name_cause(str(c), False) for c in cats], dtype=object)
    rt_cause = np.array([name_cause(str(c), True) for c in cats], dtype=object)
    found: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {c: [] for c in HOST_CAUSES}  # python: no event
    items = pd.concat([t.ops[["name", "tid", "ts", "end"]], t.runtime[["name", "tid", "ts", "end"]]], ignore_index=True)
    if len(idle[0]) and len(items):
        code_all = items["name"].cat.codes.to_numpy()
        is_rt = np.arange(len(items)) >= len(t.ops)
        tid_all = items["tid"].to_numpy()
        for tid in np.unique(tid_all):
            sel = np.flatnonzero(tid_all == tid)
            order = sel[np.lexsort((-items["end"].to_numpy()[sel], items["ts"].to_numpy()[sel]))]
            ts, end = items["ts"].to_numpy()[order], items["end"].to_numpy()[order]
            _, par = nesting(ts, end)
            bounds = np.unique(np.concatenate([ts, end]))
            if len(bounds) < 2:
                continue
            owner = innermost(ts, end, par, bounds[:-1])  # between consecutive bounds the innermost item is fixed
            idle_len = _measure(idle, bounds[1:]) - _measure(idle, bounds[:-1])
            ok = (owner >= 0) & (idle_len > 0)
            rows = order[owner[ok]]
            code = code_all[rows]
            per_code += np.bincount(code, weights=idle_len[ok], minlength=len(cats))
            cause = np.where(is_rt[rows], rt_cause[code], op_cause[code])
            code_cause[code] = cause
            lo, hi = bounds[:-1][ok], bounds[1:][ok]
            for c in np.unique(cause):
                m = cause == c
                found[c].append((lo[m], hi[m]))
    spans = {
        c: union(np.concatenate([a for a, _ in v]), np.concatenate([b for _, b in v]))
        if v
        else (np.zeros(0), np.zeros(0))
        for c, v in found.items()
    }
    return spans, per_code, code_cause
