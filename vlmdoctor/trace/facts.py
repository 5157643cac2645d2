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
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.run.parts import part_of_class
from vlmdoctor.trace.kernels import (
    ATTENTION_CLASSES,
    GEMM_CLASSES,
    LIGER_CLASSES,
    is_fp32_attention,
    memcpy_direction,
)
from vlmdoctor.trace.read import TraceError, trace_files
from vlmdoctor.trace.tables import (  # noqa: F401  (re-exported: the tables are read through this module too)
    COMM_KERNELS,
    COMM_OPS,
    LOGITS_OPS,
    MODULE_PREFIX,
    OPERAND_OPS,
    SDPA_OP,
    SHAPE_OPS,
    Tables,
    _Column,
    load_tables,
)

PART_RANGES = {"vlmdoctor::vision": "vision", "vlmdoctor::projector": "projector", "vlmdoctor::llm": "llm"}
LOSS_OPS = re.compile(r"^aten::(?:cross_entropy_loss|nll_loss|nll_loss_nd|nll_loss2d)$|CrossEntropy", re.IGNORECASE)
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
}
LAUNCH_CALLS = re.compile(
    r"^(cudaLaunchKernel|cuLaunchKernel|cudaLaunchKernelExC|cuLaunchKernelEx|cudaLaunchCooperativeKernel)"
)
# runtime calls that make the host wait for the device (aten::item on a CPU tensor is no sync: not here)
SYNC_CALLS = re.compile(
    r"^(cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cudaMemcpy|cuStreamSynchronize"
    r"|cuCtxSynchronize|cuEventSynchronize|cuMemcpyDtoH)$"
)
EAGER_SOFTMAX = ("aten::_softmax",)  # attention written out as matmul + softmax (eager / math paths)
DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}
TINY_KERNEL_US = 10.0  # under this a kernel is mostly launch overhead on current GPUs
BACKWARD_NODE = "autograd::engine::evaluate_function"
HTA_MAX_MB = 200  # the traceinsight cross-check runs on rank folders up to this size on disk (docs/analysis.md)
LINEAR_BACKWARD = re.compile(
    r": (?:Mm|Addmm)Backward0$"
)  # a linear layer's backward: grad input, + grad weight if trained


# --- nesting of host ops, vectorized --------------------------------------------------------------


def nesting(ts: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depth and parent of intervals sorted by (start, -end), treated as a laminar family.

    depth = intervals started before this one minus those already ended; parent = the nearest
    earlier interval one level up.
    """
    n = len(ts)
    depth = np.arange(n) - np.searchsorted(np.sort(end), ts, side="right")
    depth = np.clip(depth, 0, None)
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
    for _ in range(256):
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
    flag = lambda mask_of_cats: np.isin(codes, np.flatnonzero(mask_of_cats.to_numpy()))
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


def launch_context(t: Tables, ctx: pd.DataFrame | None = None) -> pd.DataFrame:
    """For each runtime call: the model part and phase of the op that made it."""
    ops, rt_t = t.ops, t.runtime
    ctx = op_context(t) if ctx is None else ctx
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
    has_ctx = rt_row >= 0
    r = np.maximum(rt_row, 0)
    part = ctx["part"].to_numpy()
    phase = ctx["phase"].to_numpy()
    out = t.runtime[["corr", "ts"]].copy()
    out["part"] = np.where(has_ctx, part[r] if len(part) else "other", "other")
    out["phase"] = np.where(has_ctx, phase[r] if len(phase) else "forward", "forward")
    return out


# --- interval arithmetic on sorted, disjoint intervals, vectorized ----------------------------------

Intervals = tuple[np.ndarray, np.ndarray]


def union(starts: np.ndarray, ends: np.ndarray) -> Intervals:
    if len(starts) == 0:
        return np.zeros(0), np.zeros(0)
    o = np.argsort(starts, kind="mergesort")
    s, e = np.asarray(starts, dtype=float)[o], np.asarray(ends, dtype=float)[o]
    reach = np.maximum.accumulate(e)
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > reach[:-1]  # a new run starts where nothing before reaches this start
    return s[new], np.maximum.reduceat(e, np.flatnonzero(new))


def _member(iv: Intervals, x: np.ndarray) -> np.ndarray:
    if len(iv[0]) == 0:  # an empty set (no data-loader ops, no syncs, no kernels): nothing is a member
        return np.zeros(len(x), dtype=bool)
    k = np.searchsorted(iv[0], x, side="right") - 1
    return (k >= 0) & (x < iv[1][np.maximum(k, 0)])


def _combine(a: Intervals, b: Intervals, keep) -> Intervals:
    pts = np.unique(np.concatenate([a[0], a[1], b[0], b[1]]))
    if len(pts) < 2:
        return np.zeros(0), np.zeros(0)
    lo, hi = pts[:-1], pts[1:]
    mid = (lo + hi) / 2
    m = keep(_member(a, mid), _member(b, mid))
    return union(lo[m], hi[m])


def intersect(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, lambda x, y: x & y)


def subtract(a: Intervals, b: Intervals) -> Intervals:
    return _combine(a, b, lambda x, y: x & ~y)


def total(iv: Intervals) -> float:
    return float(np.sum(iv[1] - iv[0]))


def _measure(iv: Intervals, x: np.ndarray) -> np.ndarray:
    """Length of iv inside (-inf, x], for many x at once."""
    s, e = iv
    if len(s) == 0:
        return np.zeros(len(np.atleast_1d(x)))
    cum = np.concatenate([[0.0], np.cumsum(e - s)])
    k = np.searchsorted(s, x, side="right")
    over = np.where(k > 0, np.maximum(e[np.maximum(k - 1, 0)] - x, 0.0), 0.0)
    return cum[k] - over


# --- facts ------------------------------------------------------------------------------------------


def compute_facts(t: Tables, stage: int | None = None, model: str | None = None) -> dict[str, Any]:
    """One flat dict of named facts (times in ms per step unless the name says otherwise)."""
    facts: dict[str, Any] = {}
    warnings: list[str] = []
    vmeta = t.meta.get("vlmdoctor") or {}
    cfg = vmeta.get("config") or {}
    if not isinstance(cfg, dict):
        cfg = {}
    for (
        knob,
        value,
    ) in cfg.items():  # what the run asked for: rules read it for exceptions, never as the trigger
        facts[f"config.{knob}"] = value
    facts["trace.written_by_vlmdoctor"] = bool(vmeta)
    for what, seen in t.recorded.items():  # which profiler options left their marks
        facts[f"trace.recorded.{what}"] = seen
    ctx = op_context(t)
    facts["part.source"] = part_source(t)

    steps = t.steps
    facts["trace.windows_from"] = "ProfilerStep" if len(steps) else "whole trace"
    if len(steps):
        windows = list(zip(steps["ts"], steps["end"]))
    else:
        lo = min(x for x in (t.ops["ts"].min(), t.gpu["ts"].min()) if pd.notna(x))
        hi = max(x for x in (t.ops["end"].max(), t.gpu["end"].max()) if pd.notna(x))
        windows = [(lo, hi)]
        warnings.append(
            "no ProfilerStep markers: the whole trace is analyzed as one step (per-step numbers are "
            "per trace); record with a torch.profiler schedule and prof.step() for per-step facts"
        )
    n = len(windows)
    facts["trace.steps"] = n
    step_ms = [(e - s) / 1e3 for s, e in windows]
    facts["step.ms"] = float(np.mean(step_ms))
    facts["step.ms_list"] = [round(x, 3) for x in step_ms]
    _run_identity(t, ctx, facts, stage, model, cfg, warnings)

    if t.gpu.empty:
        warnings.append("no GPU kernels in the trace (a CPU-only run?): GPU, kernel and launch facts are left out")
        facts["trace.gpu_kernels"] = False
        facts["trace.partial"] = True
        facts["trace.warnings"] = warnings
        _host_facts(t, facts, n)
        _micro_batch_estimate(t, ctx, windows, facts)
        _attention_shape_facts(t, facts, n, ctx)  # head dims come from the host's shapes: no GPU needed
        from vlmdoctor.trace.cpu_facts import (
            cpu_facts,
        )  # it reads this module's tables: imported here, not at the top

        facts.update(cpu_facts(t, windows, facts))
        _mode_facts(t, windows, facts)
        return facts
    facts["trace.gpu_kernels"] = True
    facts["trace.partial"] = bool(warnings)

    g = t.gpu
    ws, we = np.array([s for s, _ in windows]), np.array([e for _, e in windows])
    win = union(ws, we)
    busy = intersect(union(g["ts"].to_numpy(), g["end"].to_numpy()), win)
    idle = subtract(win, busy)
    facts["gpu.busy_ms"] = total(busy) / 1e3 / n
    facts["gpu.busy_ms_list"] = [round(x, 3) for x in ((_measure(busy, we) - _measure(busy, ws)) / 1e3).tolist()]
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
    facts["gemm.count"] = float(by_cls.reindex(list(GEMM_CLASSES))["count"].fillna(0.0).sum()) / n
    facts["gemm.fp32_share"] = float(gemm["gemm_fp32_simt"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.tf32_share"] = float(gemm["gemm_tf32"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.fp32_share_of_gpu"] = float(gemm["gemm_fp32_simt"]) / gpu_time
    # FP8 (torchao.float8): the share of GEMM time already in FP8, and the bf16/fp16 tensor-core GEMM time it could take
    facts["gemm.fp8_share"] = float(gemm["gemm_fp8"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.fp8_ms"] = float(gemm["gemm_fp8"]) / 1e3 / n
    facts["gemm.bf16_ms"] = float(gemm["gemm_tensor_core"]) / 1e3 / n
    facts["gemm.bf16_share_of_gpu"] = float(gemm["gemm_tensor_core"]) / gpu_time
    # how wide the GEMMs are, from the trace alone: FP8's casts grow with a GEMM's inputs, its saving with the FLOPs
    bf16_count = float(by_cls["count"].get("gemm_tensor_core", 0))
    facts["gemm.bf16_mean_ms"] = float(gemm["gemm_tensor_core"]) / 1e3 / bf16_count if bf16_count else 0.0
    fp32_names = Counter(g.loc[g["cls"] == "gemm_fp32_simt", "name"])
    facts["gemm.fp32_top_kernels"] = [k for k, _ in fp32_names.most_common(3)]
    att = g[g["cls"].isin(ATTENTION_CLASSES)]
    facts["attention.fp32_kernels"] = int(sum(is_fp32_attention(x) for x in att["name"])) / n
    facts["attention.kernel_share"] = float(att["dur"].sum()) / gpu_time if gpu_time else 0.0
    for cls in LIGER_CLASSES:
        facts[f"liger.{cls.removeprefix('liger_')}.launches"] = float(by_cls["count"].get(cls, 0)) / n
    facts["triton_compiled.launches"] = float(by_cls["count"].get("triton_compiled", 0)) / n
    opt_names = g.loc[g["cls"] == "optimizer", "name"].astype(str)
    facts["optimizer.fused"] = bool(opt_names.str.contains("FusedOptimizer|FusedAdam", regex=True).any())

    # launches
    kern = g[g["cat"] == "kernel"]
    facts["launch.kernels"] = len(kern) / n
    facts["launch.tiny_kernel_frac"] = float((kern["dur"] < TINY_KERNEL_US).mean()) if len(kern) else 0.0
    rt = t.runtime
    launches = rt[rt["name"].str.match(LAUNCH_CALLS)]
    facts["launch.api_ms"] = float(launches["dur"].sum()) / 1e3 / n
    rtc = rt.loc[rt["corr"] >= 0, ["corr", "ts"]].drop_duplicates("corr")
    joined = kern[kern["corr"] >= 0].merge(rtc.rename(columns={"ts": "rt_ts"}), on="corr", how="inner")
    delay = (joined["ts"] - joined["rt_ts"]).to_numpy()
    if len(delay):
        facts["launch.delay_us_median"] = float(np.median(delay))
        facts["launch.delay_us_p90"] = float(np.percentile(delay, 90))

    # parts and phases
    lctx = launch_context(t, ctx)
    lctx = lctx.loc[lctx["corr"] >= 0].drop_duplicates("corr")
    g2 = g.merge(lctx[["corr", "part", "phase"]], on="corr", how="left")
    g2["part"] = g2["part"].fillna("unattributed")
    g2["phase"] = g2["phase"].fillna("unattributed")
    for part, v in g2.groupby("part")["dur"].sum().items():
        facts[f"part.{part}.ms"] = v / 1e3 / n
        facts[f"part.{part}.share"] = v / gpu_time
    for phase, v in g2.groupby("phase")["dur"].sum().items():
        facts[f"phase.{phase}.ms"] = v / 1e3 / n
    for part in g2["part"].unique():  # every phase of a part that ran, zero where it launched nothing
        for phase in ("forward", "backward", "recompute"):
            facts[f"part.{part}.{phase}_ms"] = 0.0
    for (part, phase), v in g2.groupby(["part", "phase"])["dur"].sum().items():
        facts[f"part.{part}.{phase}_ms"] = v / 1e3 / n
    att_k = g2[g2["cls"].isin(ATTENTION_CLASSES) | ((g2["cls"] == "softmax") & (g2["part"] != "loss"))]
    for (part, phase), v in att_k.groupby(["part", "phase"])["dur"].sum().items():
        facts[f"attention.{part}.{phase}_ms"] = v / 1e3 / n
    rec = float(g2.loc[g2["phase"] == "recompute", "dur"].sum())
    facts["recompute.ms"] = rec / 1e3 / n
    facts["recompute.share"] = rec / gpu_time
    names = set(t.ops["name"].astype(str).unique())
    if rec > 0:
        facts["recompute.kind"] = "reentrant" if any("CheckpointFunction" in x for x in names) else "non_reentrant"
    else:
        facts["recompute.kind"] = "none"
    facts["part.fp32_gemm_parts"] = sorted(set(g2.loc[g2["cls"] == "gemm_fp32_simt", "part"]))
    if (
        facts["part.source"] != "none"
    ):  # the LLM's bf16 GEMMs: what the fp8 knob converts (and its LM head, which it does not)
        facts["gemm.bf16_llm_ms"] = (
            float(g2.loc[(g2["cls"] == "gemm_tensor_core") & (g2["part"] == "llm"), "dur"].sum()) / 1e3 / n
        )

    # copies
    mc = g[g["cat"] == "gpu_memcpy"]
    for direction, grp in mc.groupby(mc["name"].map(memcpy_direction)):
        facts[f"memcpy.{direction}.bytes"] = float(grp["bytes"].sum()) / n
        facts[f"memcpy.{direction}.ms"] = float(grp["dur"].sum()) / 1e3 / n
    facts["memcpy.pageable_count"] = int(mc["name"].str.contains("Pageable").sum()) / n
    _host_facts(t, facts, n)
    _micro_batch_estimate(t, ctx, windows, facts)
    _attention_shape_facts(t, facts, n, ctx)
    _memory_facts(t, facts)
    _device_facts(t, facts, vmeta)
    _flop_facts(t, facts, cfg)
    _mode_facts(t, windows, facts)
    facts["trace.warnings"] = warnings
    return facts


def _mode_facts(t: Tables, windows: list[tuple[float, float]], facts: dict[str, Any]) -> None:
    """LoRA, QLoRA and DPO facts (trace/modes.py)."""
    from vlmdoctor.trace.modes import mode_facts

    facts.update(mode_facts(t, windows, facts))


def part_source(t: Tables) -> str:
    """Where the model-part attribution comes from: vlmdoctor's own ranges, the module hierarchy, or nowhere."""
    cats = [str(c) for c in t.ops["name"].cat.categories]
    if any(c in PART_RANGES for c in cats):
        return "vlmdoctor ranges"
    if any(c.startswith(MODULE_PREFIX) and part_of_class(re.sub(r"_\d+$", "", c[len(MODULE_PREFIX) :])) for c in cats):
        return "module hierarchy"
    return "none"


def estimate_stage(t: Tables, ctx: pd.DataFrame) -> tuple[int | None, str]:
    """Stage 2 when the LLM's linear layers compute weight gradients in backward, stage 1 when they do not.

    A linear layer's backward node (MmBackward0 / AddmmBackward0) runs one GEMM for the input
    gradient and a second for the weight gradient only when the weight trains. Recompute GEMMs
    (checkpointing) are not counted. Without part attribution every linear layer counts (the LLM's
    are most of them). None when the trace has no backward (inference) or no linear backward.
    """
    if not ctx["in_bwd"].any():
        return None, "no backward pass in the trace (inference only?)"
    names = t.ops["name"].astype(str).to_numpy()
    node = ctx["node"].to_numpy()
    mm = (names == "aten::mm") & ctx["in_bwd"].to_numpy() & ~ctx["recompute"].to_numpy() & (node >= 0)
    per_node = np.bincount(node[mm], minlength=len(names)) if mm.any() else np.zeros(len(names), dtype=np.int64)
    linear = np.flatnonzero(
        pd.Series(names).str.contains(LINEAR_BACKWARD).to_numpy()
        & pd.Series(names).str.startswith(BACKWARD_NODE).to_numpy()
    )
    if not len(linear):
        return None, "no linear-layer backward nodes (MmBackward0 / AddmmBackward0) in the trace"
    in_llm = linear[ctx["part"].to_numpy()[linear] == "llm"]
    use, where = (in_llm, "LLM") if len(in_llm) else (linear, "model (no LLM attribution)")
    trained = float((per_node[use] >= 2).mean())
    stage = 2 if trained >= 0.5 else 1
    return stage, (
        f"estimated: {trained * 100:.0f}% of the {where} linear-layer backward nodes compute a weight "
        f"gradient ({'LLM trains' if stage == 2 else 'LLM frozen'})"
    )


def _run_identity(
    t: Tables,
    ctx: pd.DataFrame,
    facts: dict[str, Any],
    stage: int | None,
    model: str | None,
    cfg: dict[str, Any],
    warnings: list[str],
) -> None:
    """run.stage / run.model and where each came from; --stage / --model override, and say when they contradict."""
    notes: list[str] = []
    est, why = estimate_stage(t, ctx)
    if est is not None:
        facts["run.stage_estimate"] = est
    facts["run.stage_estimate_why"] = why
    recorded_stage = cfg.get("stage")
    if stage is not None:
        facts["run.stage"], facts["run.stage_source"] = int(stage), "--stage"
        if recorded_stage is not None and int(recorded_stage) != int(stage):
            notes.append(f"--stage {stage} overrides stage {recorded_stage} recorded in the trace's run config")
        elif recorded_stage is None and est is not None and est != int(stage):
            notes.append(f"--stage {stage} contradicts the trace: {why}")
    elif recorded_stage is not None:
        facts["run.stage"], facts["run.stage_source"] = int(recorded_stage), "run config in the trace"
    elif est is not None:
        facts["run.stage"], facts["run.stage_source"] = est, why
    recorded_model = cfg.get("model")
    if model is not None:
        facts["run.model"], facts["run.model_source"] = model, "--model"
        if recorded_model is not None and recorded_model != model:
            notes.append(f"--model {model} overrides model {recorded_model} recorded in the trace's run config")
    elif recorded_model is not None:
        facts["run.model"], facts["run.model_source"] = recorded_model, "run config in the trace"
    facts["run.notes"] = notes
    warnings.extend(notes)


def _micro_batch_estimate(
    t: Tables, ctx: pd.DataFrame, windows: list[tuple[float, float]], facts: dict[str, Any]
) -> None:
    """Micro-batches per step where no token-batch shapes measured them: forward->backward transitions, or loss calls."""
    key = "shapes.micro_batches_per_step"
    if key in facts:
        facts[f"{key}.source"] = "measured: one LLM embedding call per micro-batch (record_shapes)"
        return
    ops = t.ops
    if ops.empty:
        return
    ws = np.array([s for s, _ in windows])
    we = np.array([e for _, e in windows])

    def in_windows(x: np.ndarray) -> np.ndarray:
        k = np.searchsorted(ws, x, side="right") - 1
        return (k >= 0) & (x <= we[np.maximum(k, 0)])

    names = ops["name"].astype(str)
    ts = ops["ts"].to_numpy()
    fwd = ctx["fwd"].to_numpy()
    node = names.str.startswith(BACKWARD_NODE).to_numpy()
    if node.any() and fwd.any():
        tid = ops["tid"].to_numpy()
        main = np.bincount(tid[fwd]).argmax()  # the training thread: most forward ops that autograd records
        f_ts, b_ts = ts[fwd & (tid == main)], ts[node]
        when = np.concatenate([f_ts, b_ts])
        kind = np.concatenate([np.zeros(len(f_ts), dtype=bool), np.ones(len(b_ts), dtype=bool)])
        o = np.lexsort((kind, when))
        when, kind = when[o], kind[o]
        starts = kind & np.concatenate([[True], ~kind[:-1]])  # a backward node right after forward work
        count = int((starts & in_windows(when)).sum())
        if count:
            facts[key] = count / len(windows)
            facts[f"{key}.source"] = "estimated from forward/backward boundaries; record_shapes=True measures it"
            return
    loss = names.str.contains(LOSS_OPS).to_numpy() & ~ctx["in_bwd"].to_numpy()
    if loss.any():
        order = np.argsort(ts[loss])
        l_ts, l_end = ts[loss][order], ops["end"].to_numpy()[loss][order]
        outer = np.ones(len(l_ts), dtype=bool)
        outer[1:] = l_ts[1:] >= np.maximum.accumulate(l_end)[:-1]  # not nested in the previous loss op
        count = int((outer & in_windows(l_ts)).sum())
        if count:
            facts[key] = count / len(windows)
            facts[f"{key}.source"] = "estimated from loss computations; record_shapes=True measures it"


CUDA_DEVICE_TYPE = 1  # the profiler's [memory] events: 0 CPU, 1 CUDA


def _memory_facts(t: Tables, facts: dict[str, Any]) -> None:
    props = t.meta.get("deviceProperties") or []
    if props and props[0].get("totalGlobalMem"):
        facts["memory.device_total_gb"] = props[0]["totalGlobalMem"] / 2**30
        facts["device.name"] = props[0].get("name")
    if CUDA_DEVICE_TYPE in t.memory:
        alloc, reserved = t.memory[CUDA_DEVICE_TYPE]
        facts["memory.peak_allocated_gb"] = alloc / 2**30
        facts["memory.peak_reserved_gb"] = reserved / 2**30
        _memory_fractions(facts)


def _memory_fractions(facts: dict[str, Any]) -> None:
    """Peak memory as a share of the card, allocated and reserved, wherever both numbers are known."""
    for kind in ("allocated", "reserved"):
        if facts.get(f"memory.peak_{kind}_gb") and facts.get("memory.device_total_gb"):
            facts[f"memory.peak_{kind}_frac"] = facts[f"memory.peak_{kind}_gb"] / facts["memory.device_total_gb"]


def _device_facts(t: Tables, facts: dict[str, Any], vmeta: dict[str, Any]) -> None:
    """The GPU's compute capability (8.9 and up have FP8 tensor cores): the profiler's deviceProperties, else
    the environment vlmdoctor recorded with the run."""
    props = t.meta.get("deviceProperties") or []
    major, minor = (
        (props[0].get("computeMajor"), props[0].get("computeMinor"))
        if props and isinstance(props[0], dict)
        else (None, None)
    )
    if isinstance(major, int) and isinstance(minor, int) and major > 0:
        facts["device.compute_capability"] = major + minor / 10
        return
    cc = _env_capability(vmeta)
    if cc is not None:
        facts["device.compute_capability"] = cc


def _env_capability(meta: dict[str, Any]) -> float | None:
    """The compute capability vlmdoctor recorded with a run (run/envinfo.py: "9.0"), if any."""
    env = meta.get("env") if isinstance(meta.get("env"), dict) else {}
    try:
        return float(str(env["compute_capability"]))
    except (KeyError, ValueError):
        return None


def _flop_facts(t: Tables, facts: dict[str, Any], cfg: dict[str, Any]) -> None:
    """Model FLOPs from the token batches the trace saw, counted as if no token were padding: an upper bound."""
    from vlmdoctor.errors import UsageError
    from vlmdoctor.run.flops import flop_model, peak_flops

    if "run.model" not in facts or "run.stage" not in facts or not t.shapes:
        return
    try:
        fm = flop_model(facts["run.model"], cfg)
    except UsageError:
        return
    batches = [b for b in token_batches(t) if len(b) == 2]
    if not batches:
        return
    cached = bool(cfg.get("cache_vision_features", False))
    from vlmdoctor.run.flops import Mode

    # LoRA's frozen base gets no weight-grad GEMMs (adapters left out: under 1% at rank 16); with DPO the
    # reference's batches are among these, counted as policy work: an upper bound, as the name says
    mode = Mode(train=str(cfg.get("train", "full")))
    total_flops = sum(fm.step([L] * B, facts["run.stage"], cached, mode=mode)["total"] for B, L in batches)
    per_step = total_flops / facts["trace.steps"]
    facts["flops.model_tflop_per_step_upper"] = per_step / 1e12
    # the LM head on every position of the token batches, forward and backward (as computed unless labeled-only)
    positions = sum(B * L for B, L in batches) / facts["trace.steps"]
    facts["flops.lm_head_tflop_per_step"] = (
        2.0 * fm.llm_head_params * positions * (3 if facts["run.stage"] == 2 else 2) / 1e12
    )
    # the tower's forward for this step's images (one per row unless packed), whether it ran or was cached
    if not cfg.get("packing"):
        facts["flops.vision_tflop_per_step"] = (
            fm.vision_forward(sum(B for B, _ in batches)) / 1e12 / facts["trace.steps"]
        )
    if facts.get("gpu.busy_ms"):
        facts["gpu.busy_tflops"] = per_step / 1e12 / (facts["gpu.busy_ms"] / 1e3)
    peak, _ = peak_flops(facts.get("device.name"))
    if peak:
        facts["mfu.upper_bound"] = per_step / (facts["step.ms"] / 1e3) / peak


def _idle_causes(t: Tables, idle: list[tuple[float, float]], facts: dict[str, Any], n: int) -> None:
    """GPU idle time, attributed to what the host was doing meanwhile, in priority order."""
    ops, rt = t.ops, t.runtime

    def spans(df: pd.DataFrame) -> Intervals:
        return union(df["ts"].to_numpy(), df["end"].to_numpy())

    causes = [
        ("data_loader", spans(ops[ops["name"].str.contains("DataLoader", regex=False)])),
        ("sync", _sync_gaps(rt[rt["name"].str.match(SYNC_CALLS)], idle)),
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
    per_code = _idle_by_innermost(t, idle)
    cats = t.ops["name"].cat.categories
    cudnn_att = np.flatnonzero(pd.Series(cats).str.contains("_cudnn_attention").to_numpy())
    facts["idle.op.cudnn_attention.ms"] = float(per_code[cudnn_att].sum()) / 1e3 / n  # cuDNN plans built on the host
    top = np.argsort(-per_code)[:8]
    facts["idle.top_host_ops"] = [
        {"op": str(cats[k]), "ms": float(per_code[k]) / 1e3 / n, "share": float(per_code[k]) / idle_total}
        for k in top
        if per_code[k] > 0
    ]


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


def _sync_ops(t: Tables, mask: np.ndarray, n: int) -> list[dict[str, Any]]:
    """The ops that synchronized: the outermost aten op around each synchronizing runtime call."""
    rt = t.runtime[mask]
    ops = t.ops
    aten = ops[ops["name"].astype(str).str.startswith("aten::")]
    found: Counter = Counter()
    for tid, grp in rt.groupby("tid"):
        cand = aten[aten["tid"] == tid]
        if cand.empty:
            found.update(["(no op)"] * len(grp))
            continue
        cs, ce = cand["ts"].to_numpy(), cand["end"].to_numpy()
        names = cand["name"].astype(str).to_numpy()
        for ts in grp["ts"].to_numpy():
            hit = np.flatnonzero((cs <= ts) & (ce >= ts))
            found[names[hit[np.argmin(cs[hit])]] if len(hit) else "(no op)"] += 1
    return [{"op": k, "calls": v / n} for k, v in found.most_common(5)]


def _attention_shape_facts(t: Tables, facts: dict[str, Any], n: int, ctx: pd.DataFrame | None = None) -> None:
    """Head dims and forward attention FLOPs per model part, from the recorded SDPA input shapes.

    The part is the vlmdoctor range around the call or, in a user's trace with the module
    hierarchy, the part op_context gave the SDPA op (its forward calls only).
    """
    if not t.shapes:
        return
    ops = t.ops
    ranges = {part: ops[ops["name"] == rng][["ts", "end"]].to_numpy() for rng, part in PART_RANGES.items()}
    by_ts: dict[float, str] = {}
    if ctx is not None and not any(len(r) for r in ranges.values()):
        sdpa = (ops["name"] == SDPA_OP).to_numpy() & (ctx["phase"] == "forward").to_numpy()
        by_ts = dict(zip(ops["ts"].to_numpy()[sdpa], ctx["part"].to_numpy()[sdpa]))
    per_part: dict[str, dict[str, Any]] = {}
    for ts, name, dims in t.shapes:
        if name != SDPA_OP or len(dims) < 2 or len(dims[0]) != 4 or len(dims[1]) != 4:
            continue
        part = next((p for p, r in ranges.items() if len(r) and ((r[:, 0] <= ts) & (r[:, 1] >= ts)).any()), None)
        if part is None and by_ts.get(ts) in ("vision", "projector", "llm"):
            part = by_ts[ts]
        if part is None:  # checkpoint recompute (or code outside the model's ranges): not a part's own forward
            continue
        (b, h, lq, d), lk = dims[0], dims[1][2]
        causal = 0.5 if part == "llm" else 1.0  # decoder attention is causal, the tower's is not
        entry = per_part.setdefault(part, {"head_dims": set(), "flop": 0.0, "calls": 0, "masked": 0})
        entry["head_dims"].add(int(d))
        entry["flop"] += 4.0 * b * h * lq * lk * d * causal
        entry["calls"] += 1
        entry["masked"] += len(dims) > 3 and len(dims[3]) >= 2  # a dense attn_mask tensor, not is_causal
    for part, e in per_part.items():
        # SDPA with a dense mask cannot take the flash path and computes every masked-out block
        facts[f"attention.{part}.dense_mask_share"] = e["masked"] / e["calls"]
        dims = sorted(e["head_dims"])
        facts[f"attention.{part}.head_dims"] = dims
        facts[f"attention.{part}.head_dim_pow2"] = all(x & (x - 1) == 0 for x in dims)
        facts[f"attention.{part}.fwd_tflop_per_step"] = e["flop"] / 1e12 / n
        fwd_ms = facts.get(f"attention.{part}.forward_ms")
        if fwd_ms:
            facts[f"attention.{part}.fwd_tflops"] = e["flop"] / n / (fwd_ms / 1e3) / 1e12


def _idle_by_innermost(t: Tables, idle: Intervals) -> np.ndarray:
    """Idle time under each name: between consecutive boundaries the innermost op of a thread is fixed."""
    cats = t.ops["name"].cat.categories
    out = np.zeros(len(cats))
    if len(idle[0]) == 0:
        return out
    items = pd.concat([t.ops[["name", "tid", "ts", "end"]], t.runtime[["name", "tid", "ts", "end"]]], ignore_index=True)
    code = items["name"].cat.codes.to_numpy()
    tid_all = items["tid"].to_numpy()
    for tid in np.unique(tid_all):
        sel = np.flatnonzero(tid_all == tid)
        order = sel[np.lexsort((-items["end"].to_numpy()[sel], items["ts"].to_numpy()[sel]))]
        ts, end = items["ts"].to_numpy()[order], items["end"].to_numpy()[order]
        _, par = nesting(ts, end)
        bounds = np.unique(np.concatenate([ts, end]))
        if len(bounds) < 2:
            continue
        owner = innermost(ts, end, par, bounds[:-1])
        idle_len = _measure(idle, bounds[1:]) - _measure(idle, bounds[:-1])
        ok = (owner >= 0) & (idle_len > 0)
        out += np.bincount(code[order[owner[ok]]], weights=idle_len[ok], minlength=len(cats))
    return out


def token_batches(t: Tables) -> list[tuple[int, ...]]:
    """Token-id batch shapes, one per LLM embedding call: aten::embedding(weight, indices) on the largest table."""
    emb = [(d[0][0], tuple(d[1])) for _, name, d in t.shapes if name in SHAPE_OPS and len(d) > 1 and d[0] and d[1]]
    vocab = max((v for v, _ in emb), default=None)
    return [idx for v, idx in emb if v == vocab]


def _host_facts(t: Tables, facts: dict[str, Any], n: int) -> None:
    ops = t.ops
    counts = ops["name"].value_counts()
    counts = counts[counts > 0]
    ran = {backend: float(counts[op]) / n for op, backend in SDPA_BACKENDS.items() if op in counts.index}
    for backend, calls in ran.items():
        facts[f"attention.backend.{backend}.calls"] = calls
    if facts.get("kernels.attention_flex.count"):  # compiled FlexAttention: Triton kernels, no SDPA op
        ran["flex"] = facts["kernels.attention_flex.count"]
    facts["attention.backends"] = sorted(ran)
    facts["ops.fused_linear_cross_entropy"] = bool(ops["name"].str.contains("FusedLinearCrossEntropy").any())
    facts["ops.checkpoint_reentrant"] = bool(ops["name"].str.contains("CheckpointFunction").any())
    syncs = t.runtime["name"].str.match(SYNC_CALLS)
    facts["host.sync_calls"] = float(syncs.sum()) / n
    if syncs.any():
        facts["host.sync_ops"] = _sync_ops(t, syncs.to_numpy(), n)
    facts["attention.eager_softmax_calls"] = float(ops["name"].isin(EAGER_SOFTMAX).sum()) / n
    facts["attention.sdpa_calls"] = float((ops["name"] == SDPA_OP).sum()) / n
    token_shapes = token_batches(t)
    if token_shapes:
        facts["shapes.micro_batches_per_step"] = len(token_shapes) / n  # one LLM embedding call per micro-batch
        facts["shapes.distinct_token_batches"] = len(set(token_shapes))
        facts["shapes.token_batches"] = sorted({"x".join(map(str, s)) for s in set(token_shapes)})
        rows = [s[0] for s in token_shapes if len(s) == 2]
        if rows:  # rows per LLM batch; with packing, fewer than the samples of a micro-batch
            facts["shapes.rows_per_micro_batch"] = float(np.mean(rows))
    logits = [(name, d[0]) for _, name, d in t.shapes if name in LOGITS_OPS and d and d[0]]
    if logits:
        name, dims = max(logits, key=lambda x: int(np.prod(x[1])))
        tp = (t.types.get(name) or ["float"])[0]
        facts["loss.logits_elements"] = int(np.prod(dims))
        facts["loss.logits_gb"] = int(np.prod(dims)) * DTYPE_BYTES.get(tp, 4) / 2**30
        facts["loss.logits_dtype"] = tp
        ce = [d[0] for _, name, d in t.shapes if name == "aten::cross_entropy_loss" and d and len(d[0]) == 2]
        tokens = sum(int(np.prod(b)) for b in token_shapes) if token_shapes else 0
        if ce and tokens:  # rows the LM head and loss ran on, against the positions of the token batches
            facts["loss.head_rows_per_step"] = sum(d[0] for d in ce) / n
            facts["loss.head_rows_frac"] = sum(d[0] for d in ce) / tokens


def analyze(path: str | Path, stage: int | None = None, model: str | None = None) -> dict[str, Any]:
    """Facts of every trace file a path names (one per rank in a folder), and the ranks joined.

    A trace with collectives gets `comm.*` facts (trace/comms.py); a folder of two or more rank
    traces gets a `cross_rank` section (trace/ranks.py).
    """
    from vlmdoctor.trace.comms import rank_comms

    files = trace_files(path)
    results, per = [], []
    for f in files:
        t = load_tables(f)
        if t.ops.empty and t.gpu.empty:
            raise TraceError(
                f"{f}: the trace holds no CPU ops and no GPU events (did the profiled code run inside the "
                "profiler's active steps?); nothing to analyze"
            )
        facts = compute_facts(t, stage, model)
        rc = rank_comms(t)
        facts.update(rc.facts)
        entry = {
            "file": str(f),
            "facts": facts,
            "meta": {k: t.meta[k] for k in ("vlmdoctor", "deviceProperties", "distributedInfo") if k in t.meta},
        }
        if rc.rank is not None and (len(files) > 1 or rc.facts):
            entry["rank"] = rc.rank
        results.append(entry)
        rc.work = rc.work.copy()
        per.append(rc)
        del t
    out = {"path": str(path), "files": results}
    if len(files) > 1:
        out["cross_rank"] = _cross_rank(path, files, per, results)
    return out


def _cross_rank(path: str | Path, files: list[Path], per: list[Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks joined, or why a folder of several traces cannot be read as one job's ranks."""
    from vlmdoctor.trace.ranks import cross_rank, hta_overlap

    missing = [f.name for f, rc in zip(files, per) if rc.rank is None]
    if missing:
        return {
            "skipped": f"{missing[0]}: no rank in its distributedInfo.rank or its file name (trace_rank<R>.json.gz); "
            "cross-rank facts need one trace per rank"
        }
    seen: dict[int, str] = {}
    for f, rc in zip(files, per):
        if rc.rank in seen:
            return {
                "skipped": f"{seen[rc.rank]} and {f.name} are both rank {rc.rank}: cross-rank facts need one trace "
                "per rank of one job"
            }
        seen[rc.rank] = f.name
    doc = cross_rank(per, [r["facts"] for r in results])
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    if any(rc.backend == "nccl" for rc in per) and size_mb > HTA_MAX_MB:
        doc["hta"] = {
            "skipped": f"the traces hold {size_mb:,.0f} MB; traceinsight loads them whole (about 10x "
            f"vlmdoctor's memory), so it is run on folders under {HTA_MAX_MB} MB only"
        }
    elif any(rc.backend == "nccl" for rc in per):
        doc["hta"] = hta_overlap(path)
        ours = {r["rank"]: (r["hidden_ms"] / r["comm_ms"] * 100 if r.get("comm_ms") else None) for r in doc["ranks"]}
        doc["hta"]["ours_overlap_pct"] = ours
    else:
        doc["hta"] = {
            "skipped": "traceinsight reads GPU NCCL kernels only; these traces ran their collectives on the CPU"
        }
    return doc


def merge_measured(facts: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Facts a trace cannot hold, from a profile report's measurements (padding, measured memory, exact MFU)."""
    m = report.get("metrics") or {}
    out = dict(facts)
    for key, metric in (
        ("data.pad_fraction", "pad_fraction"),
        ("data.real_tokens_per_s", "real_tokens_per_s"),
        ("memory.peak_allocated_gb", "peak_mem_gb"),
        ("memory.peak_reserved_gb", "peak_mem_reserved_gb"),
        ("memory.device_total_gb", "device_mem_total_gb"),
        ("mfu", "mfu"),
    ):
        if m.get(metric) is not None:
            out[key] = m[metric]
    if m.get("loss_tokens_per_s") and m.get("real_tokens_per_s") and m.get("pad_fraction") is not None:
        # labeled positions as a share of all positions the batches held (padding included)
        out["data.loss_token_frac"] = m["loss_tokens_per_s"] * (1 - m["pad_fraction"]) / m["real_tokens_per_s"]
    if out.get("gpu.busy_ms") and m.get("step_ms") and "gpu.busy_frac" in out:
        # the profiler's host overhead lengthens the traced step but not the kernels: on the H100 a compiled
        # 0.5b step took 151 ms traced and 95 ms untraced (busy 37% vs 59%), which sized the batch too small.
        # The GPU's busy time per traced step over the untraced median step is the share the run really had.
        out["gpu.busy_frac_traced"] = out["gpu.busy_frac"]
        out["gpu.busy_frac"] = min(1.0, out["gpu.busy_ms"] / m["step_ms"])
    _memory_fractions(out)
    if "device.compute_capability" not in out and "gpu.busy_ms" in out:
        cc = _env_capability(report)  # a GPU trace without deviceProperties: the run's own record of the GPU
        if cc is not None:
            out["device.compute_capability"] = cc
    return out
