"""One traced step split into vision / projector / LLM / loss / optimizer and the rest, shares summing to one.

Every row comes from the same window, the traced one, and is a share of that window's wall step.
On a GPU trace the parts are their GPU kernel time, and the rest is said as what it is: kernels of
no part, the communication no compute hid, and the GPU's idle time (the step's accounts,
trace/accounts.py, say why it idled). On a CPU trace the parts are their CPU op time and `other`
is the rest of the step. The traced step is longer than the timed median (the profiler's overhead),
so its milliseconds are never set beside the timed median without saying so; its shares are what
carries over.
"""

from __future__ import annotations

from typing import Any

ROWS = ("vision", "projector", "llm", "loss", "optimizer")
#: what a GPU split splits: said with its numbers
GPU_BASIS = "wall time: parts' GPU kernel time, exposed communication, GPU idle"


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
    if basis == "GPU kernel time" and isinstance(facts.get("gpu.idle_ms"), (int, float)):
        return _gpu_split(facts, times, float(step))
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


def _gpu_split(facts: dict[str, Any], times: dict[str, float], step: float) -> dict[str, Any]:
    """Parts' kernel time, then kernels of no part, exposed communication and GPU idle: the wall step whole."""
    busy = float(facts.get("gpu.busy_ms") or 0.0)
    comm = float(facts.get("busy.communication.ms") or 0.0)
    idle = float(facts["gpu.idle_ms"])
    used = sum(times.values())
    rest = busy - comm - used  # busy time no part's kernels cover (their own kernel time overlapping aside)
    parts = list(times.items()) + [("other kernels", max(rest, 0.0)), ("communication", comm), ("GPU idle", idle)]
    total = max(step, sum(ms for _, ms in parts))
    note = None
    if rest < -0.01 * step:
        note = (
            f"the parts' kernels ran {-rest:,.1f} ms side by side on several streams: their kernel time adds up "
            "to more than the GPU's busy time, and the shares are of the sum"
        )
    return {
        "window": "traced",
        "basis": GPU_BASIS,
        "step_ms": step,
        "steps": facts.get("trace.steps"),
        "rows": [{"part": p, "ms": ms, "share": ms / total} for p, ms in parts],
        "note": note,
    }


def split_text(split: dict[str, Any]) -> str:
    """'traced step 1,250.0 ms (CPU op time): vision 9%, ...' on one line."""
    rows = ", ".join(f"{r['part']} {r['share'] * 100:.0f}%" for r in split["rows"])
    return f"traced step {split['step_ms']:,.1f} ms ({split['basis']}): {rows}"
