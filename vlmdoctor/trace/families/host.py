"""Host ops: which attention backends ran, fused loss and checkpoint ops, and the calls that made the host wait."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import ALLOCATOR, SYNC_CALLS, Reading
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
    facts["attention.eager_softmax_calls"] = float(ops["name"].isin(EAGER_SOFTMAX).sum()) / n
    facts["attention.sdpa_calls"] = float((ops["name"] == SDPA_OP).sum()) / n


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
