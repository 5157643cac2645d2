"""Host ops: which attention backends ran, fused loss and checkpoint ops, the calls that made the host wait, and
torch.compile: its regions, the model's GPU time its graphs launched, graph breaks and compilations in the window."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import ALLOCATOR, SYNC_CALLS, Reading
from vlmdoctor.trace.intervals import union
from vlmdoctor.trace.tables import SDPA_OP, Tables

PRODUCES = by_producer(__name__)
SDPA_BACKENDS = {
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash_cpu",
}
#: each backend's calls fact, spelled out so that a search for a fact finds where it is computed
BACKEND_FACTS = {
    "cudnn": "attention.backend.cudnn.calls",
    "flash": "attention.backend.flash.calls",
    "efficient": "attention.backend.efficient.calls",
    "math": "attention.backend.math.calls",
    "flash_cpu": "attention.backend.flash_cpu.calls",
}
EAGER_SOFTMAX = ("aten::_softmax",)
#: torch.compile's host range around each call of a compiled frame: `Torch-Compiled Region: 0/1` names the frame
#: (0) and its compiled version (1): a new version is a recompile
COMPILE_REGION = "Torch-Compiled Region"  # attention written out as matmul + softmax (eager / math paths)
#: host ranges around a compiled graph's run, forward and backward: Inductor's `## Call CompiledFxGraph <hash> ##`,
#: AOTAutograd's `CompiledFunction` and the `CompiledFunctionBackward` node; kernels launched inside one ran compiled
COMPILED_GRAPH = ("## Call CompiledFxGraph", "CompiledFunction")
#: dynamo compiling a frame inside the traced steps (a first compile or a recompile): torch 2.11 records each under
#: two of these names (the span and its phase), so the largest count is taken
DYNAMO_COMPILE = ("_compile.compile_inner (dynamo_timed)", "_compile.compile_inner", "entire_frame_compile")
#: kernel classes no compiler takes: copies, memsets, collectives (left out of the compiled share either way)
NOT_COMPILABLE = ("memcpy", "memset", "nccl")


def produce(r: Reading, facts: dict[str, Any]) -> None:
    t, n = r.t, r.n
    ops = t.ops
    counts = ops["name"].value_counts()
    counts = counts[counts > 0]
    ran = {backend: float(counts[op]) / n for op, backend in SDPA_BACKENDS.items() if op in counts.index}
    facts[BACKEND_FACTS["math"]] = ran.get("math", 0.0)  # measured either way: a rule reads its absence too
    for backend, calls in ran.items():
        facts[BACKEND_FACTS.get(backend) or f"attention.backend.{backend}.calls"] = calls
    if facts.get("kernels.attention_flex.count"):  # compiled FlexAttention: Triton kernels, no SDPA op
        ran["flex"] = facts["kernels.attention_flex.count"]
    facts["attention.backends"] = sorted(ran)
    facts["ops.fused_linear_cross_entropy"] = bool(ops["name"].str.contains("FusedLinearCrossEntropy").any())
    facts["ops.checkpoint_reentrant"] = bool(ops["name"].str.contains("CheckpointFunction").any())
    syncs = t.runtime["name"].str.match(SYNC_CALLS)
    facts["host.sync_calls"] = float(syncs.sum()) / n
    if syncs.any():
        facts["host.sync_ops"] = _sync_ops(t, syncs.to_numpy(), n)
    facts["host.allocator_calls"] = float(t.runtime["name"].str.match(ALLOCATOR).sum()) / n
    compiled = ops["name"].str.startswith(COMPILE_REGION)
    facts["compile.regions"] = float(compiled.sum()) / n
    facts["compile.frames"] = sorted(
        {str(x).split(": ", 1)[1] for x in ops.loc[compiled, "name"].unique() if ": " in str(x)}
    )
    facts["compile.compiles"] = max(float(counts.get(x, 0)) for x in DYNAMO_COMPILE) / n
    if not t.gpu.empty:
        _compiled_gpu(r, facts)
    facts["attention.eager_softmax_calls"] = float(ops["name"].isin(EAGER_SOFTMAX).sum()) / n
    facts["attention.sdpa_calls"] = float((ops["name"] == SDPA_OP).sum()) / n


def _compiled_gpu(r: Reading, facts: dict[str, Any]) -> None:
    """The model's GPU time that compiled graphs launched (Optimizer.step, copies and collectives left out), its
    share, and the GPU time launched inside compiled regions but outside their graphs: what graph breaks ran eager."""
    t, n = r.t, r.n
    ops, rt = t.ops, t.runtime
    cats = [str(c) for c in ops["name"].cat.categories]
    codes = ops["name"].cat.codes.to_numpy()
    graph = np.isin(codes, [k for k, c in enumerate(cats) if c.startswith(COMPILED_GRAPH)])
    region = np.isin(codes, [k for k, c in enumerate(cats) if c.startswith(COMPILE_REGION)])
    in_graph = np.zeros(len(rt), dtype=bool)
    in_region = np.zeros(len(rt), dtype=bool)
    op_tid, rt_tid, rt_ts = ops["tid"].to_numpy(), rt["tid"].to_numpy(), rt["ts"].to_numpy()
    ts, end = ops["ts"].to_numpy(), ops["end"].to_numpy()
    for tid in np.unique(op_tid[graph | region]):
        on = rt_tid == tid
        for mask, out in ((graph, in_graph), (region, in_region)):
            s, e = union(ts[mask & (op_tid == tid)], end[mask & (op_tid == tid)])
            k = np.searchsorted(s, rt_ts[on], side="right") - 1
            out[on] = (k >= 0) & (rt_ts[on] < e[np.maximum(k, 0)]) if len(s) else False
    corr = rt["corr"].to_numpy()
    g = r.attributed
    model = (g["part"] != "optimizer").to_numpy() & ~g["cls"].isin(NOT_COMPILABLE).to_numpy()
    launch = corr >= 0
    ran_compiled = g["corr"].isin(corr[in_graph & launch]).to_numpy()
    ran_broken = g["corr"].isin(corr[in_region & ~in_graph & launch]).to_numpy()
    dur = g["dur"].to_numpy()
    model_us = float(dur[model].sum())
    facts["compile.gpu_ms"] = float(dur[model & ran_compiled].sum()) / 1e3 / n
    facts["compile.gpu_share"] = float(dur[model & ran_compiled].sum()) / model_us if model_us else 0.0
    facts["compile.eager_ms"] = float(dur[model & ran_broken & ~ran_compiled].sum()) / 1e3 / n


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
