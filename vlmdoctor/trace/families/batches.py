"""Micro-batches and token batches: their shapes where record_shapes measured them, else an estimate."""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import BACKWARD_NODE, LOSS_OPS, Reading, token_batches

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """The token batches of the LLM's embedding calls (one per micro-batch), else the micro-batch estimate."""
    n = r.n
    token_shapes = token_batches(r.t)
    if token_shapes:
        facts["shapes.micro_batches_per_step"] = len(token_shapes) / n  # one LLM embedding call per micro-batch
        facts["shapes.distinct_token_batches"] = len(set(token_shapes))
        facts["shapes.token_batches"] = sorted({"x".join(map(str, s)) for s in set(token_shapes)})
        rows = [s[0] for s in token_shapes if len(s) == 2]
        if rows:  # rows per LLM batch; with packing, fewer than the samples of a micro-batch
            facts["shapes.rows_per_micro_batch"] = float(np.mean(rows))
        facts["shapes.micro_batches_per_step.source"] = (
            "measured: one LLM embedding call per micro-batch (record_shapes)"
        )
        return
    _estimate(r, facts)


def _estimate(r: Reading, facts: dict[str, Any]) -> None:
    """Micro-batches per step without token-batch shapes: forward->backward transitions, or loss calls."""
    t, ctx, windows = r.t, r.ctx, r.windows
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
            facts["shapes.micro_batches_per_step"] = count / len(windows)
            facts["shapes.micro_batches_per_step.source"] = (
                "estimated from forward/backward boundaries; record_shapes=True measures it"
            )
            return
    loss = names.str.contains(LOSS_OPS).to_numpy() & ~ctx["in_bwd"].to_numpy()
    if loss.any():
        order = np.argsort(ts[loss])
        l_ts, l_end = ts[loss][order], ops["end"].to_numpy()[loss][order]
        outer = np.ones(len(l_ts), dtype=bool)
        outer[1:] = l_ts[1:] >= np.maximum.accumulate(l_end)[:-1]  # not nested in the previous loss op
        count = int((outer & in_windows(l_ts)).sum())
        if count:
            facts["shapes.micro_batches_per_step"] = count / len(windows)
            facts["shapes.micro_batches_per_step.source"] = (
                "estimated from loss computations; record_shapes=True measures it"
            )
