"""Model parts and phases: GPU time by the part and phase of the op that launched each kernel, and recompute."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.kernels import ATTENTION_CLASSES

PRODUCES = by_producer(__name__)
#: each part's facts, spelled out so that a search for a fact finds where it is computed: (ms, share)
PART_FACTS = {
    "vision": ("part.vision.ms", "part.vision.share"),
    "projector": ("part.projector.ms", "part.projector.share"),
    "llm": ("part.llm.ms", "part.llm.share"),
    "loss": ("part.loss.ms", "part.loss.share"),
    "optimizer": ("part.optimizer.ms", "part.optimizer.share"),
    "other": ("part.other.ms", "part.other.share"),
    "unattributed": ("part.unattributed.ms", "part.unattributed.share"),
}
#: (part, phase) -> (its GPU time, its attention time)
PART_PHASE_FACTS = {
    ("vision", "forward"): ("part.vision.forward_ms", "attention.vision.forward_ms"),
    ("vision", "backward"): ("part.vision.backward_ms", "attention.vision.backward_ms"),
    ("vision", "recompute"): ("part.vision.recompute_ms", "attention.vision.recompute_ms"),
    ("vision", "optimizer"): ("part.vision.optimizer_ms", "attention.vision.optimizer_ms"),
    ("vision", "unattributed"): ("part.vision.unattributed_ms", "attention.vision.unattributed_ms"),
    ("projector", "forward"): ("part.projector.forward_ms", "attention.projector.forward_ms"),
    ("projector", "backward"): ("part.projector.backward_ms", "attention.projector.backward_ms"),
    ("projector", "recompute"): ("part.projector.recompute_ms", "attention.projector.recompute_ms"),
    ("projector", "optimizer"): ("part.projector.optimizer_ms", "attention.projector.optimizer_ms"),
    ("projector", "unattributed"): ("part.projector.unattributed_ms", "attention.projector.unattributed_ms"),
    ("llm", "forward"): ("part.llm.forward_ms", "attention.llm.forward_ms"),
    ("llm", "backward"): ("part.llm.backward_ms", "attention.llm.backward_ms"),
    ("llm", "recompute"): ("part.llm.recompute_ms", "attention.llm.recompute_ms"),
    ("llm", "optimizer"): ("part.llm.optimizer_ms", "attention.llm.optimizer_ms"),
    ("llm", "unattributed"): ("part.llm.unattributed_ms", "attention.llm.unattributed_ms"),
    ("loss", "forward"): ("part.loss.forward_ms", "attention.loss.forward_ms"),
    ("loss", "backward"): ("part.loss.backward_ms", "attention.loss.backward_ms"),
    ("loss", "recompute"): ("part.loss.recompute_ms", "attention.loss.recompute_ms"),
    ("loss", "optimizer"): ("part.loss.optimizer_ms", "attention.loss.optimizer_ms"),
    ("loss", "unattributed"): ("part.loss.unattributed_ms", "attention.loss.unattributed_ms"),
    ("optimizer", "forward"): ("part.optimizer.forward_ms", "attention.optimizer.forward_ms"),
    ("optimizer", "backward"): ("part.optimizer.backward_ms", "attention.optimizer.backward_ms"),
    ("optimizer", "recompute"): ("part.optimizer.recompute_ms", "attention.optimizer.recompute_ms"),
    ("optimizer", "optimizer"): ("part.optimizer.optimizer_ms", "attention.optimizer.optimizer_ms"),
    ("optimizer", "unattributed"): ("part.optimizer.unattributed_ms", "attention.optimizer.unattributed_ms"),
    ("other", "forward"): ("part.other.forward_ms", "attention.other.forward_ms"),
    ("other", "backward"): ("part.other.backward_ms", "attention.other.backward_ms"),
    ("other", "recompute"): ("part.other.recompute_ms", "attention.other.recompute_ms"),
    ("other", "optimizer"): ("part.other.optimizer_ms", "attention.other.optimizer_ms"),
    ("other", "unattributed"): ("part.other.unattributed_ms", "attention.other.unattributed_ms"),
    ("unattributed", "forward"): ("part.unattributed.forward_ms", "attention.unattributed.forward_ms"),
    ("unattributed", "backward"): ("part.unattributed.backward_ms", "attention.unattributed.backward_ms"),
    ("unattributed", "recompute"): ("part.unattributed.recompute_ms", "attention.unattributed.recompute_ms"),
    ("unattributed", "optimizer"): ("part.unattributed.optimizer_ms", "attention.unattributed.optimizer_ms"),
    ("unattributed", "unattributed"): ("part.unattributed.unattributed_ms", "attention.unattributed.unattributed_ms"),
}
PHASE_FACTS = {
    "forward": "phase.forward.ms",
    "backward": "phase.backward.ms",
    "recompute": "phase.recompute.ms",
    "optimizer": "phase.optimizer.ms",
    "unattributed": "phase.unattributed.ms",
}


def _part_phase(part: str, phase: str) -> tuple[str, str]:
    """A part's time and attention time in a phase (a part or phase the tables lack: tests/test_catalog.py)."""
    return PART_PHASE_FACTS.get((part, phase)) or (f"part.{part}.{phase}_ms", f"attention.{part}.{phase}_ms")


def produce(r: Reading, facts: dict[str, Any]) -> None:
    n, gpu_time = r.n, r.gpu_time
    g2 = r.attributed
    for part, v in g2.groupby("part")["dur"].sum().items():
        ms, share = PART_FACTS.get(part) or (f"part.{part}.ms", f"part.{part}.share")
        facts[ms] = v / 1e3 / n
        facts[share] = v / gpu_time
    for phase, v in g2.groupby("phase")["dur"].sum().items():
        facts[PHASE_FACTS.get(phase) or f"phase.{phase}.ms"] = v / 1e3 / n
    for part in g2["part"].unique():  # every phase of a part that ran, zero where it launched nothing
        for phase in ("forward", "backward", "recompute"):
            facts[_part_phase(part, phase)[0]] = 0.0
    for (part, phase), v in g2.groupby(["part", "phase"])["dur"].sum().items():
        facts[_part_phase(part, phase)[0]] = v / 1e3 / n
    att_k = g2[g2["cls"].isin(ATTENTION_CLASSES) | ((g2["cls"] == "softmax") & (g2["part"] != "loss"))]
    for (part, phase), v in att_k.groupby(["part", "phase"])["dur"].sum().items():
        facts[_part_phase(part, phase)[1]] = v / 1e3 / n
    rec = float(g2.loc[g2["phase"] == "recompute", "dur"].sum())
    facts["recompute.ms"] = rec / 1e3 / n
    facts["recompute.share"] = rec / gpu_time
    names = set(r.t.ops["name"].astype(str).unique())
    if rec > 0:
        facts["recompute.kind"] = "reentrant" if any("CheckpointFunction" in x for x in names) else "non_reentrant"
    else:
        facts["recompute.kind"] = "none"
    # kernels launched under Optimizer.step: a fused AdamW launches a few, foreach AdamW a few hundred multi-tensor
    # kernels, a for-loop AdamW (foreach=False) several plain elementwise kernels per parameter
    opt = g2["part"] == "optimizer"
    facts["optimizer.kernels"] = float(opt.sum()) / n
    facts["optimizer.multi_tensor_kernels"] = float((opt & (g2["cls"] == "optimizer")).sum()) / n
    facts["part.fp32_gemm_parts"] = sorted(set(g2.loc[g2["cls"] == "gemm_fp32_simt", "part"]))
    if facts["part.source"] != "none":  # the LLM's bf16 GEMMs: what the fp8 knob converts (and its LM head, not)
        facts["gemm.bf16_llm_ms"] = (
            float(g2.loc[(g2["cls"] == "gemm_tensor_core") & (g2["part"] == "llm"), "dur"].sum()) / 1e3 / n
        )
