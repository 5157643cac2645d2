"""Attention written out as matmul + softmax: which kind, where it sits, and the time it takes per step.

A softmax is attention when batched matmuls sit on both sides of it (scores = Q K^T, out = P V);
a softmax elsewhere (a router, a loss) is not counted. Each such block is one of:
  - `eager`: the model's own attention code (transformers' eager path: torch.matmul + softmax),
    what `attn_implementation="sdpa"` replaces with a fused kernel;
  - `math`: inside SDPA's math backend (SDPA is already asked for; a fused kernel refused the inputs);
  - `mha`: torch.nn.MultiheadAttention returning its attention weights (bare bmm + softmax), e.g.
    SigLIP's pooling head (`vision_use_head=True`); `attn_implementation` does not change it. A block
    whose query length is 1 (recorded shapes) is a pooling head whatever code wrote it.
The time of a block is its forward (first matmul to last), the backward nodes of the ops inside it,
and any checkpoint recompute of it: GPU kernel time on a GPU trace, host time on a CPU one.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.optime import OpTree, backward_nodes
from vlmdoctor.trace.tables import MODULE_PREFIX, Tables

PRODUCES = by_producer(__name__)

SOFTMAX = "aten::_softmax"
SOFTMAX_WRAPPERS = ("aten::softmax", "aten::_safe_softmax", "aten::_softmax")
MATH_SDPA = "aten::_scaled_dot_product_attention_math"
SDPA = "aten::scaled_dot_product_attention"
MATMULS = ("aten::matmul", "aten::bmm", "aten::baddbmm", "aten::einsum")
BARE = ("aten::bmm", "aten::baddbmm")  # torch.nn.functional.multi_head_attention_forward's own calls
#: ops that may sit between a matmul and the softmax of one attention (scale, mask, dropout, casts, views)
BETWEEN = re.compile(
    r"^aten::(mul|div|add|add_|sub|masked_fill|masked_fill_|where|dropout|native_dropout|to|_to_copy|view|reshape|"
    r"_unsafe_view|transpose|contiguous|clone|expand|scalar_tensor|isneginf|all|fill_|empty|mean|type_as|"
    r"_reshape_alias|as_strided|copy_|squeeze|unsqueeze|tanh)$"
)
HEAD_MODULES = re.compile(r"PoolingHead|MultiheadAttention|AttentionPool", re.IGNORECASE)
KINDS = ("eager", "math", "mha")
#: each kind's facts, spelled out so that a search for a fact finds where it is computed:
#: (blocks, ms, parts, head blocks, head ms)
KIND_FACTS = {
    "eager": (
        "attention.eager.blocks",
        "attention.eager.ms",
        "attention.eager.parts",
        "attention.eager.head_blocks",
        "attention.eager.head_ms",
    ),
    "math": (
        "attention.math.blocks",
        "attention.math.ms",
        "attention.math.parts",
        "attention.math.head_blocks",
        "attention.math.head_ms",
    ),
    "mha": (
        "attention.mha.blocks",
        "attention.mha.ms",
        "attention.mha.parts",
        "attention.mha.head_blocks",
        "attention.mha.head_ms",
    ),
}


def attention_cause_facts(t: Tables, ctx: pd.DataFrame, tree: OpTree, n: int) -> dict[str, Any]:
    """Per kind: blocks per step, their time per step (ms), the model parts; pooling heads among them."""
    source = "GPU kernels" if tree.gpu else "host ops (CPU trace)"
    soft = np.flatnonzero(tree.names == SOFTMAX)
    if not len(soft):  # measured: no softmax, so nothing written out
        none = {name: 0.0 for k in KINDS for name in KIND_FACTS[k][:2]}
        return _with_math_fp32(t, n, {**none, "attention.eager.model_ms": 0.0, "attention.written_out.source": source})
    qlen = _query_lengths(t)
    children = _children(tree)
    bwd = backward_nodes(tree, ctx["in_bwd"].to_numpy())
    part = ctx["part"].to_numpy()
    acc = {k: {"blocks": 0, "us": 0.0, "parts": set(), "heads": 0, "head_us": 0.0} for k in KINDS}
    seen: set[tuple[int, int]] = set()
    for row in soft:
        found = _block(tree, children, int(row))
        if found is None:
            continue
        kind, lo, hi = found
        if (lo, hi) in seen:
            continue
        seen.add((lo, hi))
        us = _block_time(tree, lo, hi, bwd)
        head = _query_length(qlen, tree, lo) == 1 or _in_head_module(tree, int(row))
        a = acc[kind]
        a["blocks"] += 1
        a["us"] += us
        a["parts"].add(str(part[row]))
        if head:
            a["heads"] += 1
            a["head_us"] += us
    facts: dict[str, Any] = {}
    for kind, a in acc.items():
        blocks, ms, parts, head_blocks, head_ms = KIND_FACTS[kind]
        facts[blocks] = a["blocks"] / n
        facts[ms] = a["us"] / 1e3 / n
        if a["blocks"]:
            facts[parts] = sorted(a["parts"])
            facts[head_blocks] = a["heads"] / n
            facts[head_ms] = a["head_us"] / 1e3 / n
    # what attn_implementation="sdpa" would fuse: the model's eager attention, pooling heads left out
    facts["attention.eager.model_ms"] = facts["attention.eager.ms"] - facts.get("attention.eager.head_ms", 0.0)
    facts["attention.written_out.source"] = source
    return _with_math_fp32(t, n, facts) if tree.gpu else facts


def _with_math_fp32(t: Tables, n: int, facts: dict[str, Any]) -> dict[str, Any]:
    """Whether the step's FP32 GEMMs are SDPA's math path's (a GPU trace): it computes attention in FP32 for bf16
    inputs, so FP32 GEMM time that fits inside the math attention's time, beside bf16 GEMMs of the rest of the
    model, says nothing of the weights' dtype."""
    if t.gpu.empty:
        return facts
    g = t.gpu
    fp32 = float(g.loc[g["cls"] == "gemm_fp32_simt", "dur"].sum()) / 1e3 / n
    bf16 = float(g.loc[g["cls"] == "gemm_tensor_core", "dur"].sum()) / 1e3 / n
    facts["gemm.fp32_from_math_attention"] = bool(
        facts["attention.math.blocks"] > 0 and fp32 <= facts["attention.math.ms"] and bf16 > fp32
    )
    return facts


def _children(tree: OpTree) -> dict[int, np.ndarray]:
    """Parent row -> its child rows in start order (top-level ops under -1, per thread by tid offset)."""
    key = np.where(tree.parent >= 0, tree.parent, -1 - tree.tid)
    order = np.lexsort((tree.ts, key))
    ks = key[order]
    cuts = np.flatnonzero(np.diff(ks)) + 1
    starts = np.concatenate([[0], cuts])
    return {int(ks[a]): g for a, g in zip(starts, np.split(order, cuts)) if len(g)}


def _block(tree: OpTree, children: dict[int, np.ndarray], row: int) -> tuple[str, int, int] | None:
    """(kind, first row, last row) of the attention around one softmax, or None when it is no attention."""
    anc = tree.ancestors(row)
    names = tree.names
    sdpa = [a for a in anc if names[a] == MATH_SDPA]
    if sdpa:
        outer = next((a for a in anc if names[a] == SDPA), sdpa[0])
        return "math", outer, outer
    top = row
    for a in anc:  # the outermost softmax wrapper the model called
        if names[a] in SOFTMAX_WRAPPERS:
            top = a
        else:
            break
    p = int(tree.parent[top])
    sibs = children.get(p if p >= 0 else -1 - int(tree.tid[top]))
    if sibs is None:
        return None
    k = int(np.flatnonzero(sibs == top)[0])
    before = _neighbour(names, sibs, k, -1)
    after = _neighbour(names, sibs, k, +1)
    if before is None or after is None:
        return None
    kind = "mha" if names[before] in BARE else "eager"
    return kind, before, after


def _neighbour(names: np.ndarray, sibs: np.ndarray, k: int, step: int) -> int | None:
    """The nearest matmul sibling on one side of the softmax, past scale/mask/dropout ops only."""
    j = k + step
    for _ in range(12):
        if j < 0 or j >= len(sibs):
            return None
        name = names[sibs[j]]
        if name in MATMULS:
            return int(sibs[j])
        if not BETWEEN.match(name):
            return None
        j += step
    return None


def _block_time(tree: OpTree, lo: int, hi: int, bwd: dict[int, list[int]]) -> float:
    """Forward time from the first matmul's start to the last's end, plus the backward of the ops inside."""
    tid, start, stop = int(tree.tid[lo]), float(tree.ts[lo]), float(tree.end[hi])
    us = tree.time_us(tid, start, stop)
    inside = np.flatnonzero((tree.tid == tid) & (tree.ts >= start) & (tree.end <= stop) & (tree.seq >= 0))
    for s in set(tree.seq[inside].tolist()):
        for r in bwd.get(int(s), ()):
            us += tree.time_us(int(tree.tid[r]), float(tree.ts[r]), float(tree.end[r]))
    return us


def _in_head_module(tree: OpTree, row: int) -> bool:
    """The module hierarchy (with_stack / with_modules) names a pooling head or an nn.MultiheadAttention."""
    return any(
        tree.names[a].startswith(MODULE_PREFIX) and HEAD_MODULES.search(tree.names[a]) for a in tree.ancestors(row)
    )


def _query_lengths(t: Tables) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per thread: start times of the recorded bmm/baddbmm calls and their query lengths (record_shapes)."""
    rows: dict[int, list[tuple[float, int]]] = {}
    for name, ts, _dur, tid, dims, _types in t.operands:
        q = dims[1] if name == "aten::baddbmm" and dims and len(dims) > 1 else (dims[0] if dims else None)
        if name in BARE and q and len(q) == 3:
            rows.setdefault(int(tid), []).append((float(ts), int(q[1])))
    return {k: (np.array([a for a, _ in sorted(v)]), np.array([b for _, b in sorted(v)])) for k, v in rows.items()}


def _query_length(qlen: dict[int, tuple[np.ndarray, np.ndarray]], tree: OpTree, lo: int) -> int | None:
    """The query length of the first batched matmul inside the block's first op, where shapes were recorded."""
    found = qlen.get(int(tree.tid[lo]))
    if found is None:
        return None
    ts, q = found
    k = int(np.searchsorted(ts, tree.ts[lo], side="left"))
    return int(q[k]) if k < len(ts) and ts[k] <= tree.end[lo] else None
