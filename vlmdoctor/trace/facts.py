"""Trace -> tables -> facts: the driver that reads each trace once and runs every fact family over it.

One streaming pass turns the trace into compact tables (trace/tables.py); trace/context.py gives every host
op and kernel launch its model part and phase; one module per family of facts (trace/families/, and
trace/cpu_facts.py, trace/modes.py, trace/comms.py) computes its facts from them, and trace/ranks.py joins a
folder of rank traces. Facts are one flat dict of named numbers; trace/catalog.py declares each one (its
unit, meaning, what records it, and its producer), and `vlmdoctor facts NAME` prints it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from vlmdoctor.trace import causes, cudnn_plan, modes
from vlmdoctor.trace import cpu_facts as cpu_family
from vlmdoctor.trace.accounts import step_accounts
from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.comms import rank_comms
from vlmdoctor.trace.context import (  # noqa: F401  (re-exported: read through this module too)
    BACKWARD_NODE,
    LOSS_OPS,
    PART_RANGES,
    Reading,
    innermost,
    launch_context,
    nesting,
    op_context,
    part_source,
    token_batches,
)
from vlmdoctor.trace.effects import effects
from vlmdoctor.trace.families import (
    attention,
    batches,
    busy,
    device,
    flops,
    host,
    identity,
    idle,
    kernels,
    launch,
    loss,
    memcpy,
    memory,
    memory_live,
    moe,
    parts,
    side_work,
)
from vlmdoctor.trace.families.identity import estimate_stage  # noqa: F401  (re-exported)
from vlmdoctor.trace.intervals import (  # noqa: F401  (re-exported)
    Intervals,
    _measure,
    intersect,
    subtract,
    total,
    union,
)
from vlmdoctor.trace.measured import merge_measured  # noqa: F401  (re-exported)
from vlmdoctor.trace.ranks import cross_rank, hta_overlap, one_job
from vlmdoctor.trace.read import TraceError, json_size, trace_files
from vlmdoctor.trace.tables import (  # noqa: F401  (re-exported: the tables are read through this module too)
    COMM_KERNELS,
    COMM_OPS,
    LOGITS_OPS,
    MODULE_PREFIX,
    OPERAND_OPS,
    PARALLEL_MIN_BYTES,
    SDPA_OP,
    SHAPE_OPS,
    Tables,
    _Column,
    load_tables,
)
from vlmdoctor.trace.worker import cpus, run_pool

PRODUCES = by_producer(__name__)
HTA_MAX_MB = 200  # the traceinsight cross-check runs on rank folders up to this size on disk (docs/analysis.md)
RECORDED = {"shapes": "trace.recorded.shapes", "memory": "trace.recorded.memory", "stack": "trace.recorded.stack"}

#: the fact families the driver runs (the catalogue test checks each against its PRODUCES)
FAMILIES = (
    attention,
    batches,
    busy,
    device,
    flops,
    host,
    identity,
    idle,
    kernels,
    launch,
    loss,
    memcpy,
    memory,
    parts,
    memory_live,
    side_work,
    moe,
)


def compute_facts(t: Tables, stage: int | None = None, model: str | None = None) -> dict[str, Any]:
    """One flat dict of named facts (times in ms per step unless the name says otherwise)."""
    facts: dict[str, Any] = {}
    warnings: list[str] = []
    facts["trace.invalid_events"] = sum(n for whys in t.invalid.values() for n in whys.values())
    if t.invalid_warning():  # said first: every number below is without these events
        warnings.append(t.invalid_warning())
    vmeta = t.meta.get("vlmdoctor") or {}
    cfg = vmeta.get("config") or {}
    if not isinstance(cfg, dict):
        cfg = {}
    for knob, value in cfg.items():  # what the run asked for: rules read it for exceptions, never as the trigger
        facts[f"config.{knob}"] = value
    facts["trace.written_by_vlmdoctor"] = bool(vmeta)
    for what, seen in t.recorded.items():  # which profiler options left their marks
        facts[RECORDED.get(what, f"trace.recorded.{what}")] = seen
    facts["part.source"] = part_source(t)

    steps = t.steps
    facts["trace.windows_from"] = "ProfilerStep" if len(steps) else "whole trace"
    if len(steps):
        windows = list(zip(steps["ts"], steps["end"]))
    else:
        lo = min(x for x in (t.ops["ts"].min(), t.gpu["ts"].min()) if pd.notna(x))
        hi = max(x for x in (t.ops["end"].max(), t.gpu["end"].max()) if pd.notna(x))
        windows = [(lo, hi)]
        warnings.append(
            "no ProfilerStep markers: the whole trace is analyzed as one step (per-step numbers are "
            "per trace); record with a torch.profiler schedule and prof.step() for per-step facts"
        )
    r = Reading(t, windows, stage, model)
    facts["trace.steps"] = r.n
    step_ms = [(e - s) / 1e3 for s, e in windows]
    facts["step.ms"] = float(np.mean(step_ms))
    facts["step.ms_list"] = [round(x, 3) for x in step_ms]
    identity.produce(r, facts, warnings)

    if t.gpu.empty:
        warnings.append("no GPU kernels in the trace (a CPU-only run?): GPU, kernel and launch facts are left out")
        facts["trace.gpu_kernels"] = False
        facts["trace.partial"] = True
        facts["trace.warnings"] = warnings
        host.produce(r, facts)
        batches.produce(r, facts)
        loss.produce(r, facts)
        attention.produce(r, facts)  # head dims come from the host's shapes: no GPU needed
        side_work.produce(r, facts)  # host ops only: its GPU times are left out
        moe.produce(r, facts)
        facts.update(cpu_family.cpu_facts(t, windows, facts))
        facts.update(modes.mode_facts(t, windows, facts))
        facts.update(causes.cause_facts(t, r.ctx, facts, r.n))  # written-out attention, by kind
        return facts
    facts["trace.gpu_kernels"] = True
    facts["trace.partial"] = bool(warnings)
    busy.produce(r, facts)
    idle.produce(r, facts)
    facts.update(cudnn_plan.cudnn_plan_facts(t.ops, t.runtime, r.idle, r.n, facts["step.ms"]))
    for family in (
        kernels,
        launch,
        parts,
        memcpy,
        host,
        batches,
        loss,
        attention,
        memory,
        memory_live,
        device,
        flops,
        side_work,
        moe,
    ):
        family.produce(r, facts)
    facts.update(modes.mode_facts(t, windows, facts))
    facts.update(causes.cause_facts(t, r.ctx, facts, r.n))  # casts and written-out attention, by kind
    facts["trace.warnings"] = warnings
    return facts


def analyze(
    path: str | Path, stage: int | None = None, model: str | None = None, workers: int | None = None
) -> dict[str, Any]:
    """Facts of every trace file a path names (one per rank in a folder), and the ranks joined.

    A trace with collectives gets `comm.*` facts (trace/comms.py); a folder of two or more rank
    traces gets a `cross_rank` section (trace/ranks.py). Up to `workers` processes (default: one
    per core) read a rank folder, one file each (the next starts as one ends), or one large file, a
    part each. Sizes count JSON text: a .gz rank file inflates to about 15 times its size on disk.
    """
    files = trace_files(path)
    workers = min(cpus(), workers or cpus())
    if len(files) > 1 and workers > 1 and sum(map(json_size, files)) >= PARALLEL_MIN_BYTES:
        calls = [(_analyze_file, (f, stage, model, len(files), 1)) for f in files]
        done = run_pool(calls, workers)
    else:
        done = [_analyze_file(f, stage, model, len(files), workers) for f in files]
    results, per = [entry for entry, _ in done], [rc for _, rc in done]
    out = {"path": str(path), "files": results}
    if len(files) > 1:
        out["cross_rank"] = _cross_rank(path, files, per, results)
    return out


def _analyze_file(f: Path, stage: int | None, model: str | None, n_files: int, workers: int) -> tuple[dict, Any]:
    """One file's report entry and its collectives (for the cross-rank join)."""
    t = load_tables(f, workers)
    if t.ops.empty and t.gpu.empty:
        raise TraceError(
            f"{f}: the trace holds no CPU ops and no GPU events (did the profiled code run inside the "
            "profiler's active steps?); nothing to analyze"
        )
    facts = compute_facts(t, stage, model)
    rc = rank_comms(t)
    facts.update(rc.facts)
    entry = {
        "file": str(f),
        "facts": facts,
        "accounts": step_accounts(facts),
        "effects": msgspec.to_builtins(effects(facts)),  # which optimizations took effect (trace/effects.py)
        "meta": {k: t.meta[k] for k in ("vlmdoctor", "deviceProperties", "distributedInfo") if k in t.meta},
    }
    if rc.rank is not None and (n_files > 1 or rc.facts):
        entry["rank"] = rc.rank
    rc.work = rc.work.copy()
    return entry, rc


def _cross_rank(path: str | Path, files: list[Path], per: list[Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks joined, or why a folder of several traces cannot be read as one job's ranks."""
    missing = [f.name for f, rc in zip(files, per) if rc.rank is None]
    if missing:
        return {
            "skipped": f"{missing[0]}: no rank in its distributedInfo.rank or its file name (trace_rank<R>.json.gz); "
            "cross-rank facts need one trace per rank"
        }
    seen: dict[int, str] = {}
    for f, rc in zip(files, per):
        if rc.rank in seen:
            return {
                "skipped": f"{seen[rc.rank]} and {f.name} are both rank {rc.rank}: cross-rank facts need one trace "
                "per rank of one job"
            }
        seen[rc.rank] = f.name
    configs = [((r.get("meta") or {}).get("vlmdoctor") or {}).get("config") for r in results]
    why = one_job([f.name for f in files], per, configs)
    if why:
        return {"skipped": f"{why}: not one job's ranks; each file's facts are given, the ranks are not joined"}
    doc = cross_rank(per, [r["facts"] for r in results])
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    if any(rc.backend == "nccl" for rc in per) and size_mb > HTA_MAX_MB:
        doc["hta"] = {
            "skipped": f"the traces hold {size_mb:,.0f} MB; traceinsight loads them whole (about 10x "
            f"vlmdoctor's memory), so it is run on folders under {HTA_MAX_MB} MB only"
        }
    elif any(rc.backend == "nccl" for rc in per):
        doc["hta"] = hta_overlap(path)
        ours = {r["rank"]: (r["hidden_ms"] / r["comm_ms"] * 100 if r.get("comm_ms") else None) for r in doc["ranks"]}
        doc["hta"]["ours_overlap_pct"] = ours
    else:
        doc["hta"] = {
            "skipped": "traceinsight reads GPU NCCL kernels only; these traces ran their collectives on the CPU"
        }
    return doc
