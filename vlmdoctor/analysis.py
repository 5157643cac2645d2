"""Trace -> tables -> facts: what the GPU did, step by step, and why it waited.

One streaming pass turns the trace into compact tables: GPU events, host ops, runtime calls and
steps. A sweep over each host thread's nesting then gives every kernel the context it was
launched in, through its runtime call's correlation id:
  - model part: the `vlmdoctor::vision|projector|llm` range around the launching op, the loss ops
    (cross entropy, Liger's fused linear cross entropy), `Optimizer.step`; backward kernels take
    the part of the forward op that created their autograd node (sequence number + forward thread);
  - phase: forward, backward, recompute, optimizer. Recompute is a forward op (one that records
    a sequence number with forward thread 0) running under a backward node. This holds for both
    checkpoint flavours: `use_reentrant=True` re-runs the forward inside CheckpointFunctionBackward,
    `use_reentrant=False` inside the saved-tensor unpack of some backward node.
Facts are one flat dict of named numbers. Which fact comes from where: docs/analysis.md.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .kernels import ATTENTION_CLASSES, GEMM_CLASSES, LIGER_CLASSES, classify, is_fp32_attention, memcpy_direction
from .tracefile import TraceError, iter_events, read_metadata, trace_files

PART_RANGES = {"vlmdoctor::vision": "vision", "vlmdoctor::projector": "projector", "vlmdoctor::llm": "llm"}
LOSS_OPS = re.compile(r"^aten::(cross_entropy_loss|nll_loss|nll_loss_nd|nll_loss2d)$|CrossEntropy", re.IGNORECASE)
LOGITS_OPS = ("aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax")
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
}
LAUNCH_CALLS = re.compile(r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx|cudaLaunchCooperativeKernel)")
SYNC_CALLS = re.compile(r"Synchronize|^aten::item$|^aten::_local_scalar_dense$")
DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}
TINY_KERNEL_US = 10.0  # under this a kernel is mostly launch overhead on current GPUs
SHAPE_OPS = ("aten::embedding",)  # its first input is the token-id batch: (batch, length)


@dataclass
class Tables:
    """The trace, reduced to what the facts need."""

    path: Path
    meta: dict[str, Any]
    steps: pd.DataFrame  # name, ts, end
    gpu: pd.DataFrame  # name, cat, cls, ts, dur, end, corr, bytes
    ops: pd.DataFrame  # name, tid, ts, dur, end, seq, fwd_tid
    runtime: pd.DataFrame  # name, tid, ts, dur, end, corr
    shapes: list[tuple[float, str, Any]] = field(default_factory=list)  # (ts, op, input dims) of a few ops
    types: dict[str, Any] = field(default_factory=dict)


def load_tables(path: Path) -> Tables:
    meta = read_metadata(path)  # first: it rejects files that are not JSON objects with a clear message
    gpu: dict[str, list] = defaultdict(list)
    ops: dict[str, list] = defaultdict(list)
    rt: dict[str, list] = defaultdict(list)
    steps: dict[str, list] = defaultdict(list)
    shapes: list[tuple[float, str, Any]] = []
    types: dict[str, Any] = {}
    for ev in iter_events(path):
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat")
        name = ev.get("name", "")
        ts = float(ev.get("ts", 0.0))
        dur = float(ev.get("dur", 0.0))
        args = ev.get("args") or {}
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu["name"].append(name)
            gpu["cat"].append(cat)
            gpu["ts"].append(ts)
            gpu["dur"].append(dur)
            gpu["corr"].append(args.get("correlation", -1))
            gpu["bytes"].append(args.get("bytes", 0))
        elif cat in ("cuda_runtime", "cuda_driver"):
            rt["name"].append(name)
            rt["tid"].append(ev.get("tid"))
            rt["ts"].append(ts)
            rt["dur"].append(dur)
            rt["corr"].append(args.get("correlation", -1))
        elif cat in ("cpu_op", "user_annotation"):
            if name.startswith("ProfilerStep#"):
                steps["name"].append(name)
                steps["ts"].append(ts)
                steps["end"].append(ts + dur)
                continue
            ops["name"].append(name)
            ops["tid"].append(ev.get("tid"))
            ops["ts"].append(ts)
            ops["dur"].append(dur)
            ops["seq"].append(args.get("Sequence number", -1))
            ops["fwd_tid"].append(args.get("Fwd thread id", -1))
            if (name in SHAPE_OPS or name in LOGITS_OPS) and "Input Dims" in args:
                shapes.append((ts, name, args["Input Dims"]))
                types[name] = args.get("Input type")
    if not steps["ts"]:
        steps_df = pd.DataFrame({"name": pd.Series(dtype=str), "ts": pd.Series(dtype=float), "end": pd.Series(dtype=float)})
    else:
        steps_df = pd.DataFrame(steps).sort_values("ts").reset_index(drop=True)
    gpu_df = pd.DataFrame(gpu, columns=["name", "cat", "ts", "dur", "corr", "bytes"])
    gpu_df["end"] = gpu_df["ts"] + gpu_df["dur"]
    gpu_df["cls"] = [classify(n, c) for n, c in zip(gpu_df["name"], gpu_df["cat"])]
    ops_df = pd.DataFrame(ops, columns=["name", "tid", "ts", "dur", "seq", "fwd_tid"])
    ops_df["end"] = ops_df["ts"] + ops_df["dur"]
    rt_df = pd.DataFrame(rt, columns=["name", "tid", "ts", "dur", "corr"])
    rt_df["end"] = rt_df["ts"] + rt_df["dur"]
    return Tables(path, meta, steps_df, gpu_df, ops_df, rt_df, shapes, types)


# --- launch context -----------------------------------------------------------------------------

def launch_context(t: Tables) -> pd.DataFrame:
    """For each runtime call: the model part and phase of the op that made it."""
    ops = t.ops
    names = ops["name"].to_numpy()
    seqs = ops["seq"].to_numpy()
    fwd = ops["fwd_tid"].to_numpy()
    seq_part: dict[int, str] = {}  # forward sequence number -> part ("Fwd thread id" is an internal id, not a tid)
    seq_alias: dict[int, int] = {}  # recomputed forward op -> the backward node it was recomputed for
    rt_ctx: dict[int, tuple] = {}  # runtime row -> (part, phase, backward key)
    # items per thread: ops (kind 0) and runtime calls (kind 1), by start time, outer ops first
    items = pd.concat([
        pd.DataFrame({"tid": ops["tid"], "ts": ops["ts"], "end": ops["end"], "kind": 0, "row": np.arange(len(ops))}),
        pd.DataFrame({"tid": t.runtime["tid"], "ts": t.runtime["ts"], "end": t.runtime["end"], "kind": 1,
                      "row": np.arange(len(t.runtime))}),
    ], ignore_index=True)
    items["neg_end"] = -items["end"]
    items = items.sort_values(["tid", "ts", "kind", "neg_end"], kind="mergesort")
    for tid, group in items.groupby("tid", sort=False):
        stack: list[tuple[float, tuple]] = []  # (end, ctx) ; ctx = (part, loss, opt, in_bwd, recompute, bwd_key)
        for ts, end, kind, row in zip(group["ts"].to_numpy(), group["end"].to_numpy(), group["kind"].to_numpy(),
                                      group["row"].to_numpy()):
            while stack and stack[-1][0] <= ts:
                stack.pop()
            parent = stack[-1][1] if stack else (None, False, False, False, False, None)
            if kind == 1:
                rt_ctx[row] = parent
                continue
            part, loss, opt, in_bwd, recompute, bwd_key = parent
            name = names[row]
            if name in PART_RANGES:
                part = PART_RANGES[name]
            elif name.startswith("Optimizer.step"):
                opt = True
            if LOSS_OPS.search(name):
                loss = True
            if name.startswith("autograd::engine::evaluate_function"):
                in_bwd = True
            seq, ftid = int(seqs[row]), int(fwd[row])
            if in_bwd and seq >= 0 and ftid > 0:
                bwd_key = seq
            elif in_bwd and seq >= 0 and ftid == 0:
                recompute = True
                if bwd_key is not None:  # reentrant: its own backward nodes later point at this new sequence number
                    seq_alias.setdefault(seq, bwd_key)
            elif not in_bwd and seq >= 0 and ftid == 0:
                seq_part.setdefault(seq, "loss" if loss else (part or "other"))
            ctx = (part, loss, opt, in_bwd, recompute, bwd_key)
            stack.append((end, ctx))
    def part_of(key: int | None) -> str | None:
        for _ in range(8):  # follow recompute aliases a few levels
            if key is None or key in seq_part:
                return seq_part.get(key) if key is not None else None
            key = seq_alias.get(key)
        return None

    parts, phases = [], []
    for row in range(len(t.runtime)):
        part, loss, opt, in_bwd, recompute, bwd_key = rt_ctx.get(row, (None, False, False, False, False, None))
        if opt:
            parts.append("optimizer")
            phases.append("optimizer")
            continue
        if in_bwd:
            p = part_of(bwd_key)
            parts.append(p or ("loss" if loss else part) or "other")
            phases.append("recompute" if recompute else "backward")
            continue
        parts.append("loss" if loss else (part or "other"))
        phases.append("forward")
    out = t.runtime[["corr", "ts", "name"]].copy()
    out["part"] = parts
    out["phase"] = phases
    return out


# --- interval arithmetic on sorted, disjoint intervals ----------------------------------------------

def union(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    order = np.argsort(starts, kind="mergesort")
    out: list[list[float]] = []
    for s, e in zip(starts[order], ends[order]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(a, b) for a, b in out]


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    j = 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def total(iv: list[tuple[float, float]]) -> float:
    return float(sum(e - s for s, e in iv))


# --- facts ------------------------------------------------------------------------------------------

def compute_facts(t: Tables, stage: int | None = None, model: str | None = None) -> dict[str, Any]:
    """One flat dict of named facts (times in ms per step unless the name says otherwise)."""
    facts: dict[str, Any] = {}
    warnings: list[str] = []
    vmeta = t.meta.get("vlmdoctor") or {}
    cfg = vmeta.get("config") or {}
    stage = stage if stage is not None else cfg.get("stage")
    model = model if model is not None else cfg.get("model")
    if stage is not None:
        facts["run.stage"] = int(stage)
    if model is not None:
        facts["run.model"] = model
    facts["trace.written_by_vlmdoctor"] = bool(vmeta)

    steps = t.steps
    if len(steps):
        windows = list(zip(steps["ts"], steps["end"]))
    else:
        lo = min(x for x in (t.ops["ts"].min(), t.gpu["ts"].min()) if pd.notna(x))
        hi = max(x for x in (t.ops["end"].max(), t.gpu["end"].max()) if pd.notna(x))
        windows = [(lo, hi)]
        warnings.append("no ProfilerStep markers: the whole trace is analyzed as one step (per-step numbers are "
                        "per trace); record with a torch.profiler schedule and prof.step() for per-step facts")
    n = len(windows)
    facts["trace.steps"] = n
    step_ms = [(e - s) / 1e3 for s, e in windows]
    facts["step.ms"] = float(np.mean(step_ms))
    facts["step.ms_list"] = [round(x, 3) for x in step_ms]

    if t.gpu.empty:
        warnings.append("no GPU kernels in the trace (a CPU-only run?): GPU, kernel and launch facts are left out")
        facts["trace.partial"] = True
        facts["trace.warnings"] = warnings
        _host_facts(t, facts, n)
        return facts
    facts["trace.partial"] = bool(warnings)

    g = t.gpu
    win = union(np.array([s for s, _ in windows]), np.array([e for _, e in windows]))
    busy = intersect(union(g["ts"].to_numpy(), g["end"].to_numpy()), win)
    idle = subtract(win, busy)
    facts["gpu.busy_ms"] = total(busy) / 1e3 / n
    facts["gpu.idle_ms"] = total(idle) / 1e3 / n
    facts["gpu.busy_frac"] = total(busy) / max(total(win), 1e-9)
    _idle_causes(t, idle, facts, n)

    # kernel classes
    gpu_time = float(g["dur"].sum())
    by_cls = g.groupby("cls")["dur"].agg(["sum", "count"])
    for cls, row in by_cls.iterrows():
        facts[f"kernels.{cls}.ms"] = row["sum"] / 1e3 / n
        facts[f"kernels.{cls}.count"] = row["count"] / n
        facts[f"kernels.{cls}.share"] = row["sum"] / gpu_time
    gemm = by_cls.reindex(list(GEMM_CLASSES))["sum"].fillna(0.0)
    facts["gemm.ms"] = float(gemm.sum()) / 1e3 / n
    facts["gemm.fp32_share"] = float(gemm["gemm_fp32_simt"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.tf32_share"] = float(gemm["gemm_tf32"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.fp32_share_of_gpu"] = float(gemm["gemm_fp32_simt"]) / gpu_time
    fp32_names = Counter(g.loc[g["cls"] == "gemm_fp32_simt", "name"])
    facts["gemm.fp32_top_kernels"] = [k for k, _ in fp32_names.most_common(3)]
    att = g[g["cls"].isin(ATTENTION_CLASSES)]
    facts["attention.fp32_kernels"] = int(sum(is_fp32_attention(x) for x in att["name"])) / n
    for cls in LIGER_CLASSES:
        facts[f"liger.{cls.removeprefix('liger_')}.launches"] = float(by_cls["count"].get(cls, 0)) / n
    facts["triton_compiled.launches"] = float(by_cls["count"].get("triton_compiled", 0)) / n

    # launches
    kern = g[g["cat"] == "kernel"]
    facts["launch.kernels"] = len(kern) / n
    facts["launch.tiny_kernel_frac"] = float((kern["dur"] < TINY_KERNEL_US).mean()) if len(kern) else 0.0
    rt = t.runtime
    launches = rt[rt["name"].str.match(LAUNCH_CALLS)]
    facts["launch.api_ms"] = float(launches["dur"].sum()) / 1e3 / n
    joined = kern.merge(rt[["corr", "ts"]].rename(columns={"ts": "rt_ts"}), on="corr", how="inner")
    delay = (joined["ts"] - joined["rt_ts"]).to_numpy()
    if len(delay):
        facts["launch.delay_us_median"] = float(np.median(delay))
        facts["launch.delay_us_p90"] = float(np.percentile(delay, 90))

    # parts and phases
    ctx = launch_context(t)
    g2 = g.merge(ctx[["corr", "part", "phase"]], on="corr", how="left")
    g2["part"] = g2["part"].fillna("unattributed")
    g2["phase"] = g2["phase"].fillna("unattributed")
    for part, v in g2.groupby("part")["dur"].sum().items():
        facts[f"part.{part}.ms"] = v / 1e3 / n
        facts[f"part.{part}.share"] = v / gpu_time
    for phase, v in g2.groupby("phase")["dur"].sum().items():
        facts[f"phase.{phase}.ms"] = v / 1e3 / n
    rec = float(g2.loc[g2["phase"] == "recompute", "dur"].sum())
    facts["recompute.ms"] = rec / 1e3 / n
    facts["recompute.share"] = rec / gpu_time
    names = set(t.ops["name"].unique())
    if rec > 0:
        facts["recompute.kind"] = "reentrant" if any("CheckpointFunction" in x for x in names) else "non_reentrant"
    else:
        facts["recompute.kind"] = "none"
    facts["part.fp32_gemm_parts"] = sorted(set(g2.loc[g2["cls"] == "gemm_fp32_simt", "part"]))

    # copies
    mc = g[g["cat"] == "gpu_memcpy"]
    for direction, grp in mc.groupby(mc["name"].map(memcpy_direction)):
        facts[f"memcpy.{direction}.bytes"] = float(grp["bytes"].sum()) / n
        facts[f"memcpy.{direction}.ms"] = float(grp["dur"].sum()) / 1e3 / n
    facts["memcpy.pageable_count"] = int(mc["name"].str.contains("Pageable").sum()) / n
    _host_facts(t, facts, n)
    facts["trace.warnings"] = warnings
    return facts


def _idle_causes(t: Tables, idle: list[tuple[float, float]], facts: dict[str, Any], n: int) -> None:
    """GPU idle time, attributed to what the host was doing meanwhile, in priority order."""
    ops, rt = t.ops, t.runtime

    def spans(df: pd.DataFrame) -> list[tuple[float, float]]:
        return union(df["ts"].to_numpy(), df["end"].to_numpy()) if len(df) else []

    causes = [
        ("data_loader", spans(ops[ops["name"].str.contains("DataLoader", regex=False)])),
        ("sync", spans(pd.concat([ops[ops["name"].str.contains(SYNC_CALLS)], rt[rt["name"].str.contains(SYNC_CALLS)]]))),
        ("memcpy", spans(rt[rt["name"].str.startswith("cudaMemcpy")])),
        ("optimizer_host", spans(ops[ops["name"].str.startswith("Optimizer.step")])),
    ]
    left = idle
    idle_total = max(total(idle), 1e-9)
    for name, iv in causes:
        hit = intersect(left, iv)
        facts[f"idle.{name}.ms"] = total(hit) / 1e3 / n
        facts[f"idle.{name}.share"] = total(hit) / idle_total
        left = subtract(left, hit)
    facts["idle.other_host.ms"] = total(left) / 1e3 / n
    facts["idle.other_host.share"] = total(left) / idle_total
    # the host work running while the GPU waited: the innermost op or runtime call at each moment, any thread
    per_name: Counter = Counter()
    for name, segs in _exclusive_segments(t).items():
        per_name[name] = total(intersect(idle, union(segs[0], segs[1])))
    facts["idle.top_host_ops"] = [
        {"op": k, "ms": v / 1e3 / n, "share": v / idle_total} for k, v in per_name.most_common(8) if v > 0
    ]


def _exclusive_segments(t: Tables) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each op's and runtime call's own time on its thread, children excluded: (starts, ends) per name."""
    items = pd.concat([t.ops[["name", "tid", "ts", "end"]], t.runtime[["name", "tid", "ts", "end"]]], ignore_index=True)
    items = items.sort_values(["tid", "ts", "end"], ascending=[True, True, False], kind="mergesort")
    out: dict[str, tuple[list, list]] = defaultdict(lambda: ([], []))
    for _, grp in items.groupby("tid", sort=False):
        stack: list[list] = []  # [name, end]
        cursor = -np.inf
        for name, ts, end in zip(grp["name"].to_numpy(), grp["ts"].to_numpy(), grp["end"].to_numpy()):
            while stack and stack[-1][1] <= ts:  # ops that end before this one starts
                top_name, top_end = stack.pop()
                if top_end > cursor:
                    out[top_name][0].append(cursor)
                    out[top_name][1].append(top_end)
                    cursor = top_end
            if stack and ts > cursor:  # the enclosing op ran alone until now
                out[stack[-1][0]][0].append(cursor)
                out[stack[-1][0]][1].append(ts)
            cursor = ts
            stack.append([name, end])
        while stack:
            top_name, top_end = stack.pop()
            if top_end > cursor:
                out[top_name][0].append(cursor)
                out[top_name][1].append(top_end)
                cursor = top_end
    return {k: (np.array(a), np.array(b)) for k, (a, b) in out.items()}


def _host_facts(t: Tables, facts: dict[str, Any], n: int) -> None:
    ops = t.ops
    counts = ops["name"].value_counts()
    for op, backend in SDPA_BACKENDS.items():
        if op in counts:
            facts[f"attention.backend.{backend}.calls"] = float(counts[op]) / n
    facts["ops.fused_linear_cross_entropy"] = bool(ops["name"].str.contains("FusedLinearCrossEntropy").any())
    facts["ops.checkpoint_reentrant"] = bool(ops["name"].str.contains("CheckpointFunction").any())
    facts["host.sync_calls"] = float(ops["name"].str.contains(SYNC_CALLS).sum()
                                     + t.runtime["name"].str.contains(SYNC_CALLS).sum()) / n
    # aten::embedding(weight, indices): the token batch is the indices of the largest table (the LLM's vocabulary)
    emb = [(d[0][0], tuple(d[1])) for _, name, d in t.shapes if name in SHAPE_OPS and len(d) > 1 and d[0] and d[1]]
    vocab = max((v for v, _ in emb), default=None)
    token_shapes = [idx for v, idx in emb if v == vocab]
    if token_shapes:
        facts["shapes.distinct_token_batches"] = len(set(token_shapes))
        facts["shapes.token_batches"] = sorted({"x".join(map(str, s)) for s in set(token_shapes)})
    logits = [(name, d[0]) for _, name, d in t.shapes if name in LOGITS_OPS and d and d[0]]
    if logits:
        name, dims = max(logits, key=lambda x: int(np.prod(x[1])))
        tp = (t.types.get(name) or ["float"])[0]
        facts["loss.logits_elements"] = int(np.prod(dims))
        facts["loss.logits_gb"] = int(np.prod(dims)) * DTYPE_BYTES.get(tp, 4) / 2**30
        facts["loss.logits_dtype"] = tp


def analyze(path: str | Path, stage: int | None = None, model: str | None = None) -> dict[str, Any]:
    """Facts of every trace file a path names (one per rank in a folder)."""
    files = trace_files(path)
    results = []
    for f in files:
        t = load_tables(f)
        if t.ops.empty and t.gpu.empty:
            raise TraceError(f"{f}: the trace holds no CPU ops and no GPU events; expected a torch.profiler trace")
        results.append({"file": str(f), "facts": compute_facts(t, stage, model), "meta": {
            k: t.meta[k] for k in ("vlmdoctor", "deviceProperties", "distributedInfo") if k in t.meta}})
    return {"path": str(path), "files": results}
