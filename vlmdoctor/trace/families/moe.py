"""Mixture-of-experts layers: the experts' grouped GEMMs, and how many routed tokens each expert gets.

An MoE layer routes each token to its top-k experts and runs every expert's GEMM on the tokens it got
(`torch._grouped_mm`, one call for all experts: transformers' `grouped_mm` experts implementation). The
forward call's inputs are (routed rows, hidden) and (experts, hidden, out); rows / experts is the tokens an
expert's GEMM sees. A few tens of rows leave each expert's GEMM a sliver of a tensor core's tile while the
step still pays the router's host work and the update of every expert's weights.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.intervals import _member
from vlmdoctor.trace.tables import MOE_OPS

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    t, n = r.t, r.n
    ops = t.ops
    grouped = ops["name"].isin(MOE_OPS).to_numpy() & _member(r.span, ops["ts"].to_numpy())
    facts["moe.grouped_mm_calls"] = float(grouped.sum()) / n
    if not grouped.any():
        return
    rows, experts = [], []
    for ts, name, dims in t.shapes:
        if name not in MOE_OPS or not _member(r.span, np.array([ts]))[0] or len(dims) < 2:
            continue
        a, w = dims[0], dims[1]
        if len(a) == 2 and len(w) == 3 and w[0] and a[1] == w[1]:  # forward: (rows, k) x (experts, k, n)
            rows.append(a[0])
            experts.append(w[0])
    if rows:
        facts["moe.experts"] = int(max(experts))
        facts["moe.tokens_per_expert"] = float(np.mean(np.array(rows) / np.array(experts)))
