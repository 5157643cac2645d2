"""Facts a trace cannot hold, from the untraced run's report: padding, real tokens/s, MFU, and the run's own
measurements of what the trace also shows (`measured.*`: GPU busy share, memory), under names of their own."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.families.device import env_capability

PRODUCES = by_producer(__name__)


def merge_measured(facts: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """The trace's facts plus the profile report's measurements; no trace fact is overwritten."""
    m = report.get("metrics") or {}
    out = dict(facts)
    for key, metric in (
        ("data.pad_fraction", "pad_fraction"),
        ("data.real_tokens_per_s", "real_tokens_per_s"),
        ("measured.memory.peak_allocated_gb", "peak_mem_gb"),
        ("measured.memory.peak_reserved_gb", "peak_mem_reserved_gb"),
        ("measured.memory.device_total_gb", "device_mem_total_gb"),
        ("mfu", "mfu"),
    ):
        if m.get(metric) is not None:
            out[key] = m[metric]
    if m.get("loss_tokens_per_s") and m.get("real_tokens_per_s") and m.get("pad_fraction") is not None:
        # labeled positions as a share of all positions the batches held (padding included)
        out["data.loss_token_frac"] = m["loss_tokens_per_s"] * (1 - m["pad_fraction"]) / m["real_tokens_per_s"]
    if out.get("gpu.busy_ms") and m.get("step_ms") and "gpu.busy_frac" in out:
        # the profiler's host overhead lengthens the traced step but not the kernels: on the H100 a compiled
        # 0.5b step took 151 ms traced and 95 ms untraced (busy 37% vs 59%), which sized the batch too small.
        # The GPU's busy time per traced step over the untraced median step is the share the run really had.
        out["measured.gpu.busy_frac"] = min(1.0, out["gpu.busy_ms"] / m["step_ms"])
    card = out.get("measured.memory.device_total_gb") or out.get("memory.device_total_gb")
    if out.get("measured.memory.peak_allocated_gb") and card:
        out["measured.memory.peak_allocated_frac"] = out["measured.memory.peak_allocated_gb"] / card
    if out.get("measured.memory.peak_reserved_gb") and card:
        out["measured.memory.peak_reserved_frac"] = out["measured.memory.peak_reserved_gb"] / card
    if "device.compute_capability" not in out and "gpu.busy_ms" in out:
        cc = env_capability(report)  # a GPU trace without deviceProperties: the run's own record of the GPU
        if cc is not None:
            out["measured.device.compute_capability"] = cc
    return out
