"""The ranks of the user's own job (torchrun, accelerate launch): each rank measures, rank 0 writes one report.

Every rank runs the same Recorder over its own steps and traces them into one folder of rank traces
(the layout `vlmdoctor analyze` and Holistic Trace Analysis read). A rank other than 0 writes what
it measured to OUT/ranks/<job>/rank<R>.json and says nothing; rank 0 waits (bounded) for those files and
joins them into the job's report: per step the slowest rank's time and all ranks' tokens and FLOPs,
so the headline is the one estimator over the job's steps (as `vlmdoctor profile --nproc-per-node`
reports it, docs/distributed.md), each rank's own numbers under `distributed.ranks`, and the rank
folder under `trace.dir` for the cross-rank facts (trace/ranks.py, trace/comms.py).

No collective is used: a rank whose measuring broke must never leave the others waiting inside a
collective the training did not ask for. The ranks agree on the windows because they step together
and the warm-up is not extended when there are several ranks.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from vlmdoctor.files import write_json
from vlmdoctor.run import metrics

#: a rank's file is waited for this long at least, plus twice the timed window's wall time
WAIT_S = 30.0
WAIT_MAX_S = 600.0


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the job's size, from what the launcher set (RANK / WORLD_SIZE), else the
    process group if the script made one; (0, 1) for a plain process."""
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        try:
            return int(env_rank), max(1, int(env_world))
        except ValueError:
            pass
    try:
        import torch.distributed as dist  # deferred: torch

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


def job_name() -> str:
    """One name for the job that every rank computes alike: the folder of its rank traces."""
    given = os.environ.get("VLMDOCTOR_JOB")  # set by `vlmdoctor run` for every rank it starts
    if given:
        return given
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # torchrun's rendezvous id (a uuid with --standalone)
    if run_id and run_id != "none":
        return run_id[:40]
    return f"{time.strftime('%Y%m%d')}-launcher{os.getppid()}"  # the launcher every local rank shares


def backend() -> str | None:
    try:
        import torch.distributed as dist  # deferred: torch

        return str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else None
    except Exception:
        return None


def part_path(out: Path, rank: int) -> Path:
    """Where a rank hands its numbers to rank 0: under the job's name, so an earlier job's file is never read."""
    return Path(out) / "ranks" / job_name() / f"rank{rank}.json"


def write_part(report: dict[str, Any], out: Path, rank: int) -> Path:
    """What a rank other than 0 measured, for rank 0 to join."""

    path = part_path(out, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(report | {"rank": rank, "host": platform.node()}, str(path))
    return path


def _wait_for(paths: list[Path], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.2)


def _row(rank: int, report: dict[str, Any]) -> dict[str, Any]:
    m = report.get("metrics") or {}
    rep = (report.get("repeats") or [{}])[0]
    return {
        "rank": rank,
        "host": report.get("host") or platform.node(),
        "status": report.get("status"),
        "steps": len(rep.get("step_ms") or []),
        "step_ms": m.get("step_ms"),
        "real_tokens_per_s": m.get("real_tokens_per_s"),
        "real_tokens": sum(rep.get("step_real_tokens") or []),
        "pad_fraction": m.get("pad_fraction"),
        "peak_mem_gb": m.get("peak_mem_gb"),
        "final_loss": m.get("final_loss"),
        "loss_finite": m.get("loss_finite"),
        "trace": (report.get("trace") or {}).get("path"),
    }


def join(report: dict[str, Any], out: Path, world: int, wait_s: float | None = None) -> dict[str, Any]:
    """Rank 0's report becomes the job's, in place, from the ranks' files (those that came in time)."""
    others = [part_path(out, r) for r in range(1, world)]
    wall = ((report.get("repeats") or [{}])[0]).get("wall_s") or 0.0
    _wait_for(others, min(WAIT_MAX_S, wait_s if wait_s is not None else WAIT_S + 2 * wall))
    parts: list[tuple[int, dict[str, Any]]] = [(0, report)]
    missing = []
    for r, p in enumerate(others, 1):
        try:
            parts.append((r, json.loads(p.read_text())))
            p.unlink()
        except (OSError, ValueError):
            missing.append(r)
    for folder in (part_path(out, 0).parent, part_path(out, 0).parent.parent):  # vlmdoctor's own, once empty
        try:
            folder.rmdir()
        except OSError:
            pass
    rows = [_row(r, rep) for r, rep in parts]
    measured = [(r, rep) for r, rep in parts if rep.get("status") in ("ok", "nan_loss") and rep.get("repeats")]
    joined = {r for r, _ in measured}
    d: dict[str, Any] = {
        "world_size": world,
        "ranks_joined": len(measured),
        "missing_ranks": missing + [r for r, _ in parts if r not in joined and r not in missing],
        "backend": backend(),
        "parallel": (report.get("config") or {}).get("parallel"),
        "ranks": rows,
    }
    report["distributed"] = d
    if missing:
        report.setdefault("notes", []).append(
            f"rank(s) {', '.join(map(str, missing))} sent no measurement in time: the job's numbers are of "
            f"{len(measured)} of {world} ranks"
        )
    if len(measured) < 2 or report.get("status") not in ("ok", "nan_loss"):
        return report
    _job_numbers(report, [rep for _, rep in measured], rows, world)
    traces = [row["trace"] for row in rows if row["trace"]]
    if report.get("trace") and len(traces) > 1:
        report["trace"]["rank_paths"] = traces
        report["trace"]["dir"] = str(Path(traces[0]).parent)
    return report


#: the job's own numbers, by the one writer over the job's steps; the others of `metrics` stay rank 0's (its own
#: process: its device and host memory, its loss, its FLOPs per step, why it has no MFU)
JOB_METRICS = (*metrics.RATES, "step_ms", "step_ms_p10", "step_ms_p90")
#: the job's steps, in place of rank 0's in its `repeats` entry
JOB_STEPS = ("steps", "step_ms", "step_real_tokens", "step_loss_tokens", "step_padded_tokens", "step_flops")


def _job_numbers(report: dict[str, Any], reps: list[dict[str, Any]], rows: list[dict[str, Any]], world: int) -> None:
    """The job's metrics over its steps: per step the slowest rank's time, all ranks' tokens and FLOPs
    (run/metrics.py: `joined`, then the one writer over that window)."""
    peak = (report.get("flops") or {}).get("peak_flops")
    job = metrics.joined([r["repeats"][0] for r in reps], peak * world if peak else None)
    m = report["metrics"]
    blocks = metrics.write(
        [job],
        peak=peak * world if peak else None,
        device_total_gb=m.get("device_mem_total_gb"),
        spread_of=metrics.SPREAD_JOB,
    )
    m.update({k: blocks.metrics[k] for k in JOB_METRICS})
    m.update(
        pad_fraction=job["pad_fraction"] if job["pad_fraction"] is not None else m.get("pad_fraction"),
        peak_mem_gb=max((r["peak_mem_gb"] for r in rows if r["peak_mem_gb"] is not None), default=None),
        loss_finite=all(r["loss_finite"] is not False for r in rows),
        steps_per_repeat=job["steps"],
    )
    if m.get("mfu") is None and m.get("mfu_reason") is None:
        m["mfu_reason"] = "not every rank counted its FLOPs"
    report["repeats"][0] |= {k: job[k] for k in JOB_STEPS} | {k: m[k] for k in metrics.RATES[:2]}
    report["throughput"] = blocks.throughput
    report["stats"] = blocks.stats
    timed = [r for r in rows if r["step_ms"] is not None]
    slowest = max(timed, key=lambda r: (r["step_ms"], -r["rank"]))
    fastest = min(timed, key=lambda r: (r["step_ms"], r["rank"]))
    report["distributed"]["global"] = {
        "real_tokens_per_s": m["real_tokens_per_s"],
        "real_tokens": sum(r["real_tokens"] for r in rows),
        "slowest_rank": slowest["rank"],
        "slowest_step_ms": slowest["step_ms"],
        "fastest_step_ms": fastest["step_ms"],
        "step_imbalance": slowest["step_ms"] / fastest["step_ms"] - 1.0 if fastest["step_ms"] else None,
        "peak_mem_gb": m["peak_mem_gb"],
        "median_rank_step_ms": statistics.median(r["step_ms"] for r in timed),
    }
