"""Trace capture: a separate, profiled window after the timed ones.

Throughput comes from untraced windows, so profiler overhead stays out of the numbers. The traced
window uses a torch.profiler schedule (wait 1, warm-up 1, active N steps), so the trace holds
`ProfilerStep#N` markers. It is written as gzipped Chrome JSON, which Perfetto and Holistic Trace
Analysis read. The run config travels inside the trace as metadata (`vlmdoctor`), so later
analysis knows the stage and model without guessing, and so do the timed windows' measurements
(`metrics`: padding, tokens/s, measured memory, MFU), so `vlmdoctor analyze` of the trace alone
diagnoses what `profile` diagnosed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule


@dataclass
class TraceOptions:
    """What the traced window records. Shapes, stacks and memory cost much and are off by default."""

    trace_dir: str  # "" with keep=False: a temporary folder, removed once the facts are read
    steps: int = 2
    shapes: bool = True
    stack: bool = False
    memory: bool | None = None  # None: on a GPU (the memory wall's facts need the allocations), off on a CPU
    keep: bool = True


def measured_metadata(metrics: dict[str, Any]) -> dict[str, Any]:
    """The timed window's metrics that travel in the trace: finite numbers only (the trace stays valid JSON)."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and (isinstance(v, bool) or math.isfinite(v))
    }


def trace_path(opts: TraceOptions, model: str, stage: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(opts.trace_dir) / f"vlmdoctor_{model}_s{stage}_{stamp}.pt.trace.json.gz"


def capture(
    step: Callable[[], None],
    opts: TraceOptions,
    device: torch.device,
    path: Path,
    metadata: dict[str, Any],
    progress: Callable[[str, int, int], None],
) -> dict[str, Any]:
    """Run wait + warm-up + active steps under the profiler; returns where the trace went and its step times."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    memory = opts.memory if opts.memory is not None else device.type == "cuda"
    wait, warmup = 1, 1
    total = wait + warmup + opts.steps
    path.parent.mkdir(parents=True, exist_ok=True)
    active_ms: list[float] = []
    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=opts.steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
        record_shapes=opts.shapes,
        with_stack=opts.stack,
        profile_memory=memory,
    ) as prof:
        for i in range(total):
            if i == wait + warmup:  # the first recorded step: metadata lands in this trace
                prof.add_metadata_json("vlmdoctor", json.dumps(metadata))
            t0 = time.perf_counter()
            step()
            if i >= wait + warmup:
                active_ms.append((time.perf_counter() - t0) * 1e3)
            prof.step()
            progress("traced steps", i + 1, total)
    return {
        "path": str(path),
        "bytes": path.stat().st_size if path.exists() else None,
        "steps": opts.steps,
        "schedule": {"wait": wait, "warmup": warmup, "active": opts.steps},
        "record_shapes": opts.shapes,
        "with_stack": opts.stack,
        "profile_memory": memory,
        "traced_step_ms": active_ms,
    }
