"""What holds the memory at its peak: the live CUDA blocks at the largest allocated total, by what made them.

The profiler's [memory] events (profile_memory=True) carry each block's address and size, and the
running total. Replaying them up to the event with the largest total leaves the blocks alive at the
peak; each was allocated inside some host op, whose model part and phase (trace/context.py) say what
it holds: the vision tower's or the LLM's activations, recompute buffers, backward buffers, the
optimizer's, or the LM head's logits and the loss. What the total holds beyond those blocks was
allocated before the traced window: weights, gradients and optimizer state (`persistent`).

The logits are told by size where the trace recorded shapes (a block of exactly the logits tensor's
elements in bf16 or fp32: its copies and its gradients), else by part: the ops of the loss, and those
outside the model's parts (a native class's LM head runs outside its language model). On the H100
(llava-siglip2-0.5b stage 2, plain cross entropy, batch 40) they held 45 of the 65 GiB peak: the bf16
logits, their fp32 copy, log-softmax's output and the gradients, four tensors of 13 GiB and one of 6.5.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading, innermost

PRODUCES = by_producer(__name__)
#: what each holder's facts are called, spelled out so that a search for a fact finds where it is computed
HOLDER_FACTS = {
    "persistent": "memory.live.persistent_gb",
    "logits": "memory.live.logits_gb",
    "vision": "memory.live.vision_gb",
    "projector": "memory.live.projector_gb",
    "activations": "memory.live.activations_gb",
    "recompute": "memory.live.recompute_gb",
    "backward": "memory.live.backward_gb",
    "optimizer": "memory.live.optimizer_gb",
    "other": "memory.live.other_gb",
}
#: the holders in words, for evidence lines
HOLDER_WORDS = {
    "persistent": "weights, gradients and optimizer state (allocated before the step)",
    "logits": "the LM head's logits and the loss",
    "vision": "the vision tower's activations",
    "projector": "the projector's activations",
    "activations": "the LLM's activations",
    "recompute": "recompute buffers (gradient checkpointing)",
    "backward": "backward buffers",
    "optimizer": "optimizer buffers",
    "other": "other allocations",
}
GIB = 2**30


def live_at_peak(events: list[tuple[float, int, int, float, float]]) -> tuple[float, list[int]]:
    """The largest allocated total and the indices (in `events`) of the blocks alive at it."""
    if not events:
        return 0.0, []
    totals = np.fromiter((e[4] for e in events), dtype=np.float64, count=len(events))
    peak_at = int(np.argmax(totals))
    live: dict[int, int] = {}
    for i in range(peak_at + 1):
        _, _, addr, size, _ = events[i]
        if size > 0:
            live[addr] = i
        elif size < 0:
            live.pop(addr, None)  # a block allocated before the window is not in `live`: nothing to do
    return float(totals[peak_at]), sorted(live.values())


def _holders(r: Reading, events: list[tuple[float, int, int, float, float]], rows: list[int]) -> list[str]:
    """What each live block holds, from the part and phase of the op that allocated it."""
    t, ctx = r.t, r.ctx
    ops = t.ops
    ts_ev = np.array([events[i][0] for i in rows], dtype=np.float64)
    tid_ev = np.array([events[i][1] for i in rows], dtype=np.int64)
    op_row = np.full(len(rows), -1, dtype=np.int64)
    tid_all = ops["tid"].to_numpy()
    for tid in np.unique(tid_ev):
        esel = np.flatnonzero(tid_ev == tid)
        sel = np.flatnonzero(tid_all == tid)
        if not len(sel):
            continue
        order = sel[np.argsort(ctx["order"].to_numpy()[sel])]
        j = innermost(
            ops["ts"].to_numpy()[order], ops["end"].to_numpy()[order], ctx["parent"].to_numpy()[order], ts_ev[esel]
        )
        op_row[esel] = np.where(j >= 0, order[np.maximum(j, 0)], -1)
    part, phase = ctx["part"].to_numpy(), ctx["phase"].to_numpy()
    out = []
    for k in op_row:
        if k < 0:
            out.append("other")
            continue
        p, ph = part[k], phase[k]
        if p in ("loss", "other") and ph in ("forward", "backward"):
            out.append("logits")
        elif p == "llm":
            out.append({"recompute": "recompute", "backward": "backward"}.get(ph, "activations"))
        elif p in ("vision", "projector", "optimizer"):
            out.append(p)
        else:
            out.append("other")
    return out


def produce(r: Reading, facts: dict[str, Any]) -> None:
    events = r.t.cuda_memory
    peak, rows = live_at_peak(events)
    if not peak:
        return
    holders = _holders(r, events, rows)
    elements = facts.get("loss.logits_elements")
    logit_sizes = {float(elements * 2), float(elements * 4)} if elements else set()
    held = dict.fromkeys(HOLDER_FACTS, 0.0)
    for i, who in zip(rows, holders):
        size = events[i][3]
        held["logits" if size in logit_sizes else who] += size
    held["persistent"] = max(0.0, peak - sum(held.values()))
    for who, fact in HOLDER_FACTS.items():
        facts[fact] = held[who] / GIB
    facts["memory.live.peak_gb"] = peak / GIB
    largest = max(held, key=held.__getitem__)
    facts["memory.live.largest"] = HOLDER_WORDS[largest]
    facts["memory.live.largest_gb"] = held[largest] / GIB
    facts["memory.live.logits_frac"] = held["logits"] / peak
    per_step = held["logits"] / GIB
    ranked = sorted(((v, k) for k, v in held.items() if v > 0), reverse=True)[:3]
    facts["memory.live.top"] = ", ".join(f"{HOLDER_WORDS[k]} {v / GIB:.1f} GiB" for v, k in ranked)
    if elements and per_step:
        facts["memory.live.logits_bytes_per_element"] = held["logits"] / elements
