"""Run identity: the training stage and model preset, where each came from, and the stage the trace shows."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import BACKWARD_NODE, Reading
from vlmdoctor.trace.tables import Tables

PRODUCES = by_producer(__name__)
LINEAR_BACKWARD = re.compile(r": (?:Mm|Addmm)Backward0$")  # a linear layer's backward: grad input, + grad weight


def estimate_stage(t: Tables, ctx: pd.DataFrame) -> tuple[int | None, str]:
    """Stage 2 when the LLM's linear layers compute weight gradients in backward, stage 1 when they do not.

    A linear layer's backward node (MmBackward0 / AddmmBackward0) runs one GEMM for the input
    gradient and a second for the weight gradient only when the weight trains. Recompute GEMMs
    (checkpointing) are not counted. Without part attribution every linear layer counts (the LLM's
    are most of them). None when the trace has no backward (inference) or no linear backward.
    """
    if not ctx["in_bwd"].any():
        return None, "no backward pass in the trace (inference only?)"
    names = t.ops["name"].astype(str).to_numpy()
    node = ctx["node"].to_numpy()
    mm = (names == "aten::mm") & ctx["in_bwd"].to_numpy() & ~ctx["recompute"].to_numpy() & (node >= 0)
    per_node = np.bincount(node[mm], minlength=len(names)) if mm.any() else np.zeros(len(names), dtype=np.int64)
    linear = np.flatnonzero(
        pd.Series(names).str.contains(LINEAR_BACKWARD).to_numpy()
        & pd.Series(names).str.startswith(BACKWARD_NODE).to_numpy()
    )
    if not len(linear):
        return None, "no linear-layer backward nodes (MmBackward0 / AddmmBackward0) in the trace"
    in_llm = linear[ctx["part"].to_numpy()[linear] == "llm"]
    use, where = (in_llm, "LLM") if len(in_llm) else (linear, "model (no LLM attribution)")
    trained = float((per_node[use] >= 2).mean())
    stage = 2 if trained >= 0.5 else 1
    return stage, (
        f"estimated: {trained * 100:.0f}% of the {where} linear-layer backward nodes compute a weight "
        f"gradient ({'LLM trains' if stage == 2 else 'LLM frozen'})"
    )


def produce(r: Reading, facts: dict[str, Any], warnings: list[str]) -> None:
    """run.stage / run.model and where each came from; --stage / --model override, and say when they contradict."""
    stage, model, cfg = r.stage, r.model, r.cfg
    notes: list[str] = []
    est, why = estimate_stage(r.t, r.ctx)
    if est is not None:
        facts["run.stage_estimate"] = est
    facts["run.stage_estimate_why"] = why
    recorded_stage = cfg.get("stage")
    if stage is not None:
        facts["run.stage"], facts["run.stage_source"] = int(stage), "--stage"
        if recorded_stage is not None and int(recorded_stage) != int(stage):
            notes.append(f"--stage {stage} overrides stage {recorded_stage} recorded in the trace's run config")
        elif recorded_stage is None and est is not None and est != int(stage):
            notes.append(f"--stage {stage} contradicts the trace: {why}")
    elif recorded_stage is not None:
        facts["run.stage"], facts["run.stage_source"] = int(recorded_stage), "run config in the trace"
    elif est is not None:
        facts["run.stage"], facts["run.stage_source"] = est, why
    recorded_model = cfg.get("model")
    if model is not None:
        facts["run.model"], facts["run.model_source"] = model, "--model"
        if recorded_model is not None and recorded_model != model:
            notes.append(f"--model {model} overrides model {recorded_model} recorded in the trace's run config")
    elif recorded_model is not None:
        facts["run.model"], facts["run.model_source"] = recorded_model, "run config in the trace"
    facts["run.notes"] = notes
    warnings.extend(notes)
