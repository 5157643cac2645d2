"""Model FLOPs of the token batches the trace saw (run/flops.py's formula), and the MFU they bound."""

from __future__ import annotations

from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.run.flops import Mode, flop_model, peak_flops  # the zoo's specs: loaded when a model is known
from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading, token_batches

PRODUCES = by_producer(__name__)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    """Model FLOPs from the token batches the trace saw, counted as if no token were padding: an upper bound."""

    t, cfg = r.t, r.cfg
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
