"""GPU memory: the card's size and the peaks of the profiler's [memory] events (profile_memory=True)."""

from __future__ import annotations

from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading

PRODUCES = by_producer(__name__)
CUDA_DEVICE_TYPE = 1  # the profiler's [memory] events: 0 CPU, 1 CUDA


def produce(r: Reading, facts: dict[str, Any]) -> None:
    t = r.t
    props = t.meta.get("deviceProperties") or []
    if props and props[0].get("totalGlobalMem"):
        facts["memory.device_total_gb"] = props[0]["totalGlobalMem"] / 2**30
    if CUDA_DEVICE_TYPE in t.memory:
        alloc, reserved = t.memory[CUDA_DEVICE_TYPE]
        facts["memory.peak_allocated_gb"] = alloc / 2**30
        facts["memory.peak_reserved_gb"] = reserved / 2**30
        total = facts.get("memory.device_total_gb")
        if facts["memory.peak_allocated_gb"] and total:
            facts["memory.peak_allocated_frac"] = facts["memory.peak_allocated_gb"] / total
        if facts["memory.peak_reserved_gb"] and total:
            facts["memory.peak_reserved_frac"] = facts["memory.peak_reserved_gb"] / total
