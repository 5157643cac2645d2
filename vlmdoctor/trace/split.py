"""One traced step split into vision / projector / LLM / loss / optimizer / other, shares summing to one.

Every row comes from the same window, the traced one, and is a share of that window's step: the
parts' times (GPU kernel time on a GPU trace, CPU op time on a CPU trace) and `other`, the rest of
the step (an idle GPU, host work, unattributed kernels or ops). The traced step is longer than the
timed median (the profiler's overhead), so its milliseconds are never set beside the timed median
without saying so; its shares are what carries over.
"""

from __future__ import annotations

from typing import Any

ROWS = ("vision", "projector", "llm", "loss", "optimizer")


def _times(facts: dict[str, Any]) -> tuple[dict[str, float], str]:
    if facts.get("trace.gpu_kernels"):
        return (
            {p: float(facts[f"part.{p}.ms"]) for p in ROWS if facts.get(f"part.{p}.ms") is not None},
            "GPU kernel time",
        )
    keys = {p: f"cpu.part.{p}.ms" for p in ("vision", "projector", "llm")} | {
        "loss": "cpu.loss.ms",
        "optimizer": "cpu.optimizer.ms",
    }
    return {p: float(facts[k]) for p, k in keys.items() if facts.get(k) is not None}, "CPU op time"


def step_split(facts: dict[str, Any]) -> dict[str, Any] | None:
    """The split of the traced step; None when the trace names no part (no ranges, no module hierarchy)."""
    step = facts.get("step.ms")
    times, basis = _times(facts)
    if not step or not any(v > 0 for k, v in times.items() if k in ("vision", "projector", "llm")):
        return None
    used = sum(times.values())
    total = max(float(step), used)
    rows = [{"part": p, "ms": ms, "share": ms / total} for p, ms in times.items()]
    rows.append({"part": "other", "ms": total - used, "share": (total - used) / total})
    out: dict[str, Any] = {
        "window": "traced",
        "basis": basis,
        "step_ms": float(step),
        "steps": facts.get("trace.steps"),
        "rows": rows,
        "note": None,
    }
    if used > step:
        out["note"] = (
            f"the parts' {basis} adds up to {used:,.1f} ms, more than the {step:,.1f} ms traced step (streams or "
            "threads overlap): the shares are of their sum"
        )
    return out


def split_text(split: dict[str, Any]) -> str:
    """'traced step 1,250.0 ms (CPU op time): vision 9%, ...' on one line."""
    rows = ", ".join(f"{r['part']} {r['share'] * 100:.0f}%" for r in split["rows"])
    return f"traced step {split['step_ms']:,.1f} ms ({split['basis']}): {rows}"
