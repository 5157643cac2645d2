"""Dtype casts by kind: fp32 weights re-cast by autocast, activations into fp32 islands, inputs of ops.

Each `aten::_to_copy` is sorted by the op around it:
  - `weight`: under a GEMM op (linear, matmul, addmm, conv, ...): autocast casting an operand to
    bf16, which in a model stored in bf16 does not happen. With record_shapes, only the operand
    that is the op's parameter counts (its shape is the GEMM's weight operand transposed, a 1-D bias,
    a 4-D conv kernel); the others are `input`. Without shapes every cast under a GEMM op counts
    (`casts.classified_by` says which). The backward of a weight cast (the bf16 gradient cast back to
    the fp32 parameter, ToCopyBackward0) counts with it. Fix: store the weights in bf16.
  - `input`: an activation cast by autocast into a lower-precision op (SDPA, or a GEMM's
    activation operand where shapes tell them apart).
  - `island`: every other cast: the model's own fp32 islands (norms, softmax, rotary tables, loss
    upcasts computed in float32 by the model's code) and their backward. A bf16 model has them by
    design; storing weights in bf16 does not remove them.
Time is the GPU time of the cast kernels each cast launched (a CPU trace: the host op's own time).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.optime import OpTree
from vlmdoctor.trace.tables import Tables

PRODUCES = by_producer(__name__)

CAST = "aten::_to_copy"
WRAPPERS = ("aten::to", "aten::_to_copy", "aten::type_as", "aten::float", "aten::bfloat16", "aten::half")
GEMM_OPS = (
    "aten::linear",
    "aten::matmul",
    "aten::addmm",
    "aten::mm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::einsum",
    "aten::conv1d",
    "aten::conv2d",
    "aten::conv3d",
    "aten::convolution",
    "aten::_convolution",
)
LOW_PRECISION_OPS = ("aten::scaled_dot_product_attention", "aten::addbmm", "aten::prelu")
KINDS = ("weight", "input", "island")
#: (count, ms, share) of each kind, spelled out so that a search for a fact finds where it is computed
KIND_FACTS = {
    "weight": ("casts.weight.count", "casts.weight.ms", "casts.weight.share"),
    "input": ("casts.input.count", "casts.input.ms", "casts.input.share"),
    "island": ("casts.island.count", "casts.island.ms", "casts.island.share"),
}


def cast_facts(t: Tables, ctx: pd.DataFrame, tree: OpTree, n: int) -> dict[str, Any]:
    """Cast ops and their time per step, by kind; nothing when the trace holds no cast op."""
    rows = np.flatnonzero(tree.names == CAST)
    if not len(rows):
        return {}
    shapes = _cast_shapes(t)
    operands = _operand_index(t)
    in_bwd = ctx["in_bwd"].to_numpy()
    by_seq: dict[int, str] = {}
    kind_of = np.empty(len(rows), dtype=object)
    fwd_first = np.argsort(in_bwd[rows], kind="mergesort")  # forward casts first: backward ones look them up
    for i in fwd_first:
        r = int(rows[i])
        kind_of[i] = _kind(tree, r, shapes, operands, by_seq)
    us = np.array([tree.time_us(int(tree.tid[r]), float(tree.ts[r]), float(tree.end[r])) for r in rows])
    launched = us > 0 if tree.gpu else np.ones(len(rows), dtype=bool)
    total_us = float(t.gpu["dur"].sum()) if tree.gpu else 0.0
    step_us = float((t.steps["end"] - t.steps["ts"]).sum()) if len(t.steps) else 0.0
    facts: dict[str, Any] = {}
    for kind in KINDS:
        count, ms, share = KIND_FACTS[kind]
        sel = (kind_of == kind) & launched
        facts[count] = float(sel.sum()) / n
        facts[ms] = float(us[sel].sum()) / 1e3 / n
        denom = total_us if tree.gpu else step_us
        if denom:
            facts[share] = float(us[sel].sum()) / denom
    facts["casts.classified_by"] = "shapes" if shapes else "parent op"
    return facts


def _kind(
    tree: OpTree,
    row: int,
    shapes: dict[tuple[int, float], list],
    operands: dict[int, tuple[np.ndarray, list]],
    by_seq: dict[int, str],
) -> str:
    """The kind of one cast, from the first op around it that is not itself a cast wrapper."""
    anc = tree.ancestors(row)
    wrapper = row
    for a in anc:
        if tree.names[a] in WRAPPERS:
            wrapper = a
        else:
            break
    outer = [a for a in anc if tree.names[a] not in WRAPPERS]
    parent = outer[0] if outer else -1
    name = tree.names[parent] if parent >= 0 else ""
    seq = int(tree.seq[wrapper])
    if name.startswith("ToCopyBackward"):  # the backward of a forward cast: the gradient cast back to its dtype
        return by_seq.get(int(tree.seq[parent]), "island")
    if name in GEMM_OPS:
        kind = _gemm_operand_kind(tree, row, parent, shapes, operands)
    elif name in LOW_PRECISION_OPS:
        kind = "input"
    else:
        kind = "island"
    if seq >= 0:
        by_seq[seq] = kind
    return kind


def _gemm_operand_kind(
    tree: OpTree,
    row: int,
    gemm: int,
    shapes: dict[tuple[int, float], list],
    operands: dict[int, tuple[np.ndarray, list]],
) -> str:
    """A parameter operand (weight) or an activation operand (input) of the GEMM op around a cast."""
    dims = shapes.get((int(tree.tid[row]), float(tree.ts[row])))
    if not shapes or dims is None:
        return "weight"  # no shapes: autocast casting a GEMM operand, weights in a model stored in fp32
    dims = list(dims)
    if len(dims) == 1 or (len(dims) == 4 and "conv" in tree.names[gemm]):
        return "weight"  # a bias, or a conv kernel
    if len(dims) != 2:
        return "input"
    found = operands.get(int(tree.tid[row]))
    if found is None:
        return "input"
    ts, entries = found
    lo = np.searchsorted(ts, tree.ts[gemm], side="left")
    hi = np.searchsorted(ts, tree.end[gemm], side="right")
    for name, d in entries[lo:hi]:
        mat2 = d[2] if name == "aten::addmm" and len(d) > 2 else (d[1] if len(d) > 1 else None)
        if mat2 is not None and len(mat2) == 2 and list(reversed(mat2)) == dims:
            return "weight"
    return "input"


def _cast_shapes(t: Tables) -> dict[tuple[int, float], list]:
    """(thread, start) of each recorded cast -> the dims of the tensor it cast (record_shapes)."""
    return {
        (int(tid), float(ts)): dims[0]
        for name, ts, _dur, tid, dims, _types in t.operands
        if name == CAST and dims and isinstance(dims[0], list)
    }


def _operand_index(t: Tables) -> dict[int, tuple[np.ndarray, list]]:
    """Per thread, the recorded mm/addmm calls in start order: (name, input dims)."""
    rows: dict[int, list[tuple[float, str, Any]]] = {}
    for name, ts, _dur, tid, dims, _types in t.operands:
        if name in ("aten::mm", "aten::addmm") and dims:
            rows.setdefault(int(tid), []).append((float(ts), name, dims))
    out = {}
    for tid, v in rows.items():
        v.sort(key=lambda x: x[0])
        out[tid] = (np.array([x[0] for x in v]), [(x[1], x[2]) for x in v])
    return out
