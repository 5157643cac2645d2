"""Attention shapes: head dims, forward FLOPs and dense masks per model part, from the recorded SDPA inputs."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import PART_RANGES, Reading
from vlmdoctor.trace.tables import SDPA_OP

PRODUCES = by_producer(__name__)
#: each part's facts, spelled out so that a search for a fact finds where it is computed:
#: (dense-mask share, head dims, all powers of two, forward TFLOP a step, forward TFLOP/s)
PART_FACTS = {
    "vision": (
        "attention.vision.dense_mask_share",
        "attention.vision.head_dims",
        "attention.vision.head_dim_pow2",
        "attention.vision.fwd_tflop_per_step",
        "attention.vision.fwd_tflops",
    ),
    "projector": (
        "attention.projector.dense_mask_share",
        "attention.projector.head_dims",
        "attention.projector.head_dim_pow2",
        "attention.projector.fwd_tflop_per_step",
        "attention.projector.fwd_tflops",
    ),
    "llm": (
        "attention.llm.dense_mask_share",
        "attention.llm.head_dims",
        "attention.llm.head_dim_pow2",
        "attention.llm.fwd_tflop_per_step",
        "attention.llm.fwd_tflops",
    ),
}
FORWARD_MS = {
    "vision": "attention.vision.forward_ms",
    "projector": "attention.projector.forward_ms",
    "llm": "attention.llm.forward_ms",
}  # trace/families/parts.py


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """Head dims and forward attention FLOPs per model part, from the recorded SDPA input shapes.

    The part is the vlmdoctor range around the call or, in a user's trace with the module
    hierarchy, the part op_context gave the SDPA op (its forward calls only).
    """
    t, n = r.t, r.n
    if not t.shapes:
        return
    ctx = r.ctx
    ops = t.ops
    ranges = {part: ops[ops["name"] == rng][["ts", "end"]].to_numpy() for rng, part in PART_RANGES.items()}
    by_ts: dict[float, str] = {}
    if not any(len(x) for x in ranges.values()):
        sdpa = (ops["name"] == SDPA_OP).to_numpy() & (ctx["phase"] == "forward").to_numpy()
        by_ts = dict(zip(ops["ts"].to_numpy()[sdpa], ctx["part"].to_numpy()[sdpa]))
    per_part: dict[str, dict[str, Any]] = {}
    for ts, name, dims in t.shapes:
        if name != SDPA_OP or len(dims) < 2 or len(dims[0]) != 4 or len(dims[1]) != 4:
            continue
        part = next((p for p, x in ranges.items() if len(x) and ((x[:, 0] <= ts) & (x[:, 1] >= ts)).any()), None)
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
        mask_share, head_dims, pow2, tflop, tflops = PART_FACTS[part]
        # SDPA with a dense mask cannot take the flash path and computes every masked-out block
        facts[mask_share] = e["masked"] / e["calls"]
        dims = sorted(e["head_dims"])
        facts[head_dims] = dims
        facts[pow2] = all(x & (x - 1) == 0 for x in dims)
        facts[tflop] = e["flop"] / 1e12 / n
        fwd_ms = facts.get(FORWARD_MS[part])
        if fwd_ms:
            facts[tflops] = e["flop"] / n / (fwd_ms / 1e3) / 1e12
