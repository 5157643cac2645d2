"""Trace capture: a separate, profiled window after the timed ones.

Throughput comes from untraced windows, so profiler overhead stays out of the numbers. The traced
window uses a torch.profiler schedule (wait 1, warm-up 1, active N steps), so the trace holds
`ProfilerStep#N` markers. It is written as gzipped Chrome JSON, which Perfetto and Holistic Trace
Analysis read. The run config travels inside the trace as metadata (`vlmdoctor`), so later
analysis knows the stage and model without guessing, and so do the timed windows' measurements
(`metrics`: padding, tokens/s, measured memory, MFU), so `vlmdoctor analyze` of the trace alone
diagnoses what `profile` diagnosed.

The trace goes through the one writer (`files.export_via`): torch writes a temp name beside it, which is
gzipped into place once complete, so an interrupted export never leaves a truncated trace under its final
name. A trace that cannot be written (a full or read-only folder) is lost, never the measurement: the
capture says why in `lost` and the run goes on to its report.
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

from vlmdoctor.errors import VlmdoctorError
from vlmdoctor.files import export_via
from vlmdoctor.window import TRACE_STEPS


@dataclass
class TraceOptions:
    """What the traced window records. Shapes, stacks and memory cost much and are off by default."""

    trace_dir: str  # "" with keep=False: a temporary folder, removed once the facts are read
    steps: int = TRACE_STEPS
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


def trace_writer(path: Path, info: dict[str, Any]) -> Callable[[Any], None]:
    """torch.profiler's `on_trace_ready`: the trace to `path` through the one writer; a write that fails is
    recorded in `info["lost"]` instead of raised, so the profiler stops cleanly and the measurement is kept."""

    def ready(prof: Any) -> None:
        try:
            export_via(path, prof.export_chrome_trace)
        except VlmdoctorError as e:
            info["lost"] = e.message

    return ready


def lost_note(reason: str) -> str:
    """One line for a report whose trace could not be written."""
    return (
        f"the trace could not be written ({reason}): it is lost, so there are no facts and no diagnosis; "
        "the measurement is kept"
    )


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
    info: dict[str, Any] = {}
    described = {
        "steps": opts.steps,
        "schedule": {"wait": wait, "warmup": warmup, "active": opts.steps},
        "record_shapes": opts.shapes,
        "with_stack": opts.stack,
        "profile_memory": memory,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # no folder for the trace: no traced steps, the measurement stands
        return (
            {"path": None, "bytes": None, "lost": f"cannot create {path.parent}: {e.strerror or e}"}
            | described
            | {"traced_step_ms": []}
        )
    active_ms: list[float] = []
    with profile(
        activities=activities,
        schedule=schedule(wait=wait, warmup=warmup, active=opts.steps, repeat=1),
        on_trace_ready=trace_writer(path, info),
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
    written = "lost" not in info and path.is_file()
    return (
        {"path": str(path) if written else None, "bytes": path.stat().st_size if written else None}
        | ({"lost": info["lost"]} if "lost" in info else {})
        | described
        | {"traced_step_ms": active_ms}
    )
