"""Runs real training steps of the VLM described by a run config and measures them.

One configuration per process: Liger patches transformers classes globally and cannot be
undone, so a second configuration in the same process would measure a mix. `run_isolated`
starts a fresh interpreter for each configuration.

Every timed step is a full optimizer step: data fetch, host-to-device copy, forward, backward
and a real AdamW update (the seed's benchmark left the optimizer out), followed by a device
synchronize so that wall time is what the GPU really took.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from vlmdoctor import SCHEMA_VERSION, __version__, supervise
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_NAN, EXIT_OK, EXIT_OOM, UsageError, first_line, is_out_of_memory
from vlmdoctor.run import arms, distributed, envinfo, flops, metrics, modes, native, switch, throughput
from vlmdoctor.run.capture import TraceOptions, capture, lost_note, measured_metadata, trace_path
from vlmdoctor.run.checks import check
from vlmdoctor.run.compile import compiled, graphs_compiled, mark_lengths_dynamic
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.flopcount import device_name
from vlmdoctor.run.model import param_counts
from vlmdoctor.run.patient import (
    Patient,
    Progress,
    attention_context,
    autocast,
    build_patient,
    input_dtype,
    quiet,
    release,
    sync,
    to_device,
)
from vlmdoctor.supervise import scratch_dir


def train_step(p: Patient) -> tuple[torch.Tensor, dict[str, Any]]:
    """One optimizer step over grad_accum micro-batches; returns the (device) loss and host counts."""
    cfg = p.cfg
    dtype = input_dtype(p)
    total = {
        "real_tokens": 0,
        "loss_tokens": 0,
        "padded_tokens": 0,
        "samples": 0,
        "lengths": [],
        "host_losses": [],
    }
    loss_sum = None
    for micro in range(cfg.grad_accum):
        batch = next(p.batches)
        counts = batch.pop("counts")
        index = batch.pop("pair_index", None)
        for k in ("real_tokens", "loss_tokens", "padded_tokens", "samples"):
            total[k] += counts[k]
        total["lengths"] += counts["lengths"]
        batch = to_device(batch, p.device, dtype)
        if cfg.compile != "off":
            mark_lengths_dynamic(batch)  # one graph for every length, no recompile per new length
        sync = (
            distributed.micro_batch(p.model, p.vlm, cfg, micro == cfg.grad_accum - 1)
            if p.dist
            else contextlib.nullcontext()
        )
        with attention_context(cfg.attention), sync:
            with autocast(cfg, p.device):
                loss = (
                    _dpo_loss(p, batch, index) if p.reference is not None else p.model(**batch).loss
                ) / cfg.grad_accum
            loss.backward()
        if cfg.sync_loss:  # what a logging loop does: the host waits for the device every micro-batch
            total["host_losses"].append(loss.item())
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    p.optimizer.step()
    p.optimizer.zero_grad(set_to_none=True)
    return loss_sum, total


def _dpo_loss(p: Patient, batch: dict[str, Any], index: list[int]) -> torch.Tensor:
    """The policy on all 2B rows, the reference on the same rows (or its precomputed log-probs), the DPO loss."""
    labels = batch.pop("labels")
    n = len(index)
    policy = modes.sequence_logps(p.model(**batch, labels=None).logits, labels)
    ref = p.reference
    if p.cfg.dpo_precompute_reference:
        pairs = [ref.cache[i] for i in index]
        ref_logps = torch.tensor([c for c, _ in pairs] + [r for _, r in pairs], device=policy.device)
    else:
        ref_logps = ref.logps(batch, labels)
    loss, _ = modes.dpo_loss(policy[:n], policy[n:], ref_logps[:n], ref_logps[n:], p.cfg.dpo_beta)
    return loss


# ------------------------------------------------------------------------------------------------
def _window(p: Patient, steps: int, peak: float | None, progress: Progress, label: str) -> dict[str, Any]:
    """Timed steps; every step ends with a device synchronize."""
    retries = 0
    if p.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(p.device)
        retries = torch.cuda.memory_stats(p.device).get("num_alloc_retries", 0)
    step_s, step_tokens, step_loss, step_padded, step_flops, losses = [], [], [], [], [], []
    step_cpu: list[float] = []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, c = train_step(p)
        sync(p.device)
        step_s.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        losses.append(loss)
        step_tokens.append(c["real_tokens"])  # every micro-batch of the optimizer step
        step_loss.append(c["loss_tokens"])
        step_padded.append(c["padded_tokens"])
        step_flops.append(p.step_flops(c))
        progress(label, i + 1, steps)
    wall = sum(step_s)
    loss_values = torch.stack(losses).float().cpu().tolist()
    step_ms = [s * 1e3 for s in step_s]
    w = {
        "steps": steps,
        "wall_s": wall,
        **metrics.window_numbers(step_ms, step_tokens, step_loss, step_padded, step_flops, peak),
        "step_ms": step_ms,
        "step_real_tokens": step_tokens,  # with step_ms: a throughput sample per step (the estimator, the gate)
        "step_loss_tokens": step_loss,
        "step_flops": step_flops,
        # CPU time of the process per step: on a shared CPU host the work of a single-threaded step,
        # which a neighbour's load does not stretch the way it stretches the wall time (the CPU gate)
        "step_cpu_ms": [s * 1e3 for s in step_cpu],
        "losses": loss_values,
    }
    if p.device.type == "cuda":
        w["peak_mem_gb"] = torch.cuda.max_memory_allocated(p.device) / 2**30
        w["peak_mem_reserved_gb"] = torch.cuda.max_memory_reserved(p.device) / 2**30
        w["alloc_retries"] = torch.cuda.memory_stats(p.device).get("num_alloc_retries", 0) - retries
    return w


def summarize(
    windows: list[dict[str, Any]],
    device_total_gb: float | None,
    peak: float | None = None,
    warmup: dict[str, Any] | None = None,
    mfu_reason: str | None = None,
) -> metrics.Blocks:
    """The timed windows -> the report's metrics, stats and throughput, by the one writer (run/metrics.py): the
    estimator over every step of the `repeats` windows, each window's numbers spread over the windows."""
    return metrics.write(
        windows,
        peak=peak,
        device_total_gb=device_total_gb,
        spread_of=metrics.SPREAD_OWN,
        warmup=warmup,
        mfu_reason=mfu_reason,
    )


def _traced_window(
    step: Callable[[], None],
    trace: TraceOptions,
    cfg: RunConfig,
    dist: Any,
    device: torch.device,
    meta: dict[str, Any],
    progress: Progress,
) -> dict[str, Any]:
    """The traced window, into --trace-dir or a temporary folder. A trace that cannot be written (a full or
    read-only folder, no temp folder) is reported as lost and never costs the measurement."""

    try:
        where = (
            trace
            if trace.keep
            else replace(trace, trace_dir=str(supervise.temp_folder("vlmdoctor-trace-", dir=scratch_dir())))
        )
    except OSError as e:
        info = {"path": None, "lost": f"no temporary folder for it: {e.strerror or e}", "traced_step_ms": []}
    else:
        path = (
            trace_path(where, cfg.model, cfg.stage)
            if dist is None  # ranks: one folder, rank in the name
            else Path(where.trace_dir) / f"vlmdoctor_{cfg.model}_s{cfg.stage}_rank{dist.rank}.pt.trace.json.gz"
        )
        try:
            info = capture(step, where, device, path, meta, progress)
        except BaseException:  # a temporary trace folder never outlives a failed or interrupted capture
            if not trace.keep:
                shutil.rmtree(where.trace_dir, ignore_errors=True)
            raise
        if info.get("lost") and not trace.keep:
            shutil.rmtree(where.trace_dir, ignore_errors=True)
    info["kept"] = trace.keep
    return info


def run_profile(cfg: RunConfig, progress: Progress = quiet, trace: TraceOptions | None = None) -> dict[str, Any]:
    """Build, warm up, time, then (if asked) trace a separate window.

    Returns the report, also on OOM, NaN loss or a crash in a step.
    """
    spec, device = check(cfg)
    dist = None
    if distributed.is_distributed(cfg):  # one rank of a torchrun job: join the group, take this rank's GPU
        dist, device = distributed.setup(cfg, device)
        if not dist.is_main:
            progress = quiet
    env = envinfo.collect(device)
    peak, peak_source = flops.peak_flops(env.get("gpu"))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vlmdoctor", "version": __version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "ok",
        "config": cfg.to_dict(),
        "model": spec.describe(),
        "env": env,
        "flops": {"formula": flops.describe(), "peak_flops": peak, "peak_source": peak_source},
    }
    interrupted: KeyboardInterrupt | None = None
    try:
        patient = build_patient(cfg, device, progress, dist)
        report["model"]["params"] = (
            native.native_param_counts(patient.vlm)
            if isinstance(patient.vlm, native.NativeVLM)
            else param_counts(patient.vlm)
        )
        report["data"] = patient.data_info
        report["mode"] = patient.mode_info
        windows = _measure(patient, report, peak, progress)
        if trace is not None:
            interrupted = _trace(patient, report, trace, windows, env, peak, dist, progress)
        if interrupted is None and dist is None:
            interrupted = _in_process_arms(patient, report, progress)
    except UsageError:
        raise
    except Exception as e:  # a crash inside a step (illegal memory access, no SDPA kernel, compile failure)
        return _crashed(report, e, device)
    _summarize_report(report, patient, windows, env, peak, dist)
    if interrupted is not None:  # the caller keeps the measured report and ends as interrupted
        report["interrupted"] = supervise.describe_interruption(interrupted) + " in the traced window: not traced"
        interrupted.report = report  # type: ignore[attr-defined]
        raise interrupted
    return report


def _warm_up(p: Patient, progress: Progress) -> tuple[list[float], list[float]]:
    """The warm-up steps: as many as asked, then more while the last ones disagree (`settle_budget`); each step's
    wall seconds and its seconds per token."""
    cfg = p.cfg
    warm_s: list[float] = []
    per_token: list[float] = []
    settle = settle_budget(cfg)
    while len(warm_s) < cfg.warmup or (settle and _unsettled(per_token)):
        if len(warm_s) >= cfg.warmup:
            settle -= 1
        t0 = time.perf_counter()
        _, counts = train_step(p)
        sync(p.device)
        warm_s.append(time.perf_counter() - t0)
        per_token.append(warm_s[-1] / max(1, counts["padded_tokens"] or counts["real_tokens"]))
        progress("warm-up", len(warm_s), max(cfg.warmup, len(warm_s)))
    return warm_s, per_token


def _measure(p: Patient, report: dict[str, Any], peak: float | None, progress: Progress) -> list[dict[str, Any]]:
    """Warm-up, then the `repeats` timed windows; the warm-up (and what compiled when) into the report."""
    cfg = p.cfg
    warm_s, per_token = _warm_up(p, progress)
    graphs = graphs_compiled() if compiled(cfg) else 0
    windows = [_window(p, cfg.steps, peak, progress, f"timed {r + 1}/{cfg.repeats}") for r in range(cfg.repeats)]
    report["warmup"] = _warmup_times(warm_s)
    report["warmup"]["settle_steps"] = len(warm_s) - cfg.warmup
    report["warmup"]["settled"] = None if not settle_budget(cfg) else not _unsettled(per_token)
    if compiled(cfg):
        report["warmup"]["graphs_compiled"] = graphs
        new = graphs_compiled() - graphs
        report["warmup"]["graphs_compiled_in_timed_windows"] = new
        if new:
            report.setdefault("warnings", []).append(
                f"torch.compile compiled {new} new graph(s) during the timed windows: their compile time counts "
                f"as step time; raise --warmup or pad to fewer lengths (pad_to_multiple_of)"
            )
    return windows


def _trace(
    p: Patient,
    report: dict[str, Any],
    trace: TraceOptions,
    windows: list[dict[str, Any]],
    env: dict[str, Any],
    peak: float | None,
    dist: Any,
    progress: Progress,
) -> KeyboardInterrupt | None:
    """The traced window after the timed ones, into the report's `trace`. A Ctrl-C / SIGTERM in it comes back (what
    the timed windows measured is kept), but on a rank of a torchrun job."""
    cfg, device = p.cfg, p.device

    def step() -> None:
        train_step(p)
        sync(device)

    meta = {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "config": cfg.to_dict(),
        "model": report["model"],
        "env": {
            k: env[k]
            for k in ("device_type", "cpu_count", "cpu_capability", "cpu_matmul_gflops", "compute_capability")
            if k in env
        },
        # the timed windows' measurements: `analyze` of this trace merges them as profile does
        "metrics": measured_metadata(summarize(windows, metrics.device_total_gb(device), peak).metrics),
    }
    try:
        report["trace"] = _traced_window(step, trace, cfg, dist, device, meta, progress)
    except KeyboardInterrupt as e:
        if dist is not None:
            raise
        return e  # Ctrl-C / SIGTERM after the timed windows: what they measured is kept
    if report["trace"].get("lost"):  # a trace that could not be written never costs the measurement
        report.setdefault("warnings", []).append(lost_note(report["trace"]["lost"]))
    return None


def _in_process_arms(p: Patient, report: dict[str, Any], progress: Progress) -> KeyboardInterrupt | None:
    """The leave-one-out arms a treatment asked this run for (run/arms.py), measured in this process after the
    timed and traced windows, into the report's `in_process`; a Ctrl-C / SIGTERM in them comes back (what the timed
    windows measured is kept). A crash in them is said in the report, not raised: the run's numbers stand."""
    asked = arms.read_request()
    if asked is None:
        return None
    wanted, seconds = asked
    progress("in-process arms", 0, 1)
    try:
        report["in_process"] = switch.measure(p, wanted, seconds, train_step)
    except KeyboardInterrupt as e:
        return e
    except Exception as e:  # the arms are extra: their failure costs the run nothing
        report["in_process"] = {"error": f"{type(e).__name__}: {first_line(e)}", "arms": {}}
        release(p.device)
    progress("in-process arms", 1, 1)
    return None


def _crashed(report: dict[str, Any], e: Exception, device: torch.device) -> dict[str, Any]:
    """The report of a run that crashed in a step (called while handling `e`): out of memory, or the error."""
    release(device)
    if is_out_of_memory(e):  # the GPU's or the host's (MemoryError, torch's CPU allocator): exit 3 either way
        report.update(status="oom", error=_oom_details(e, device))
        return report
    report.update(
        status="error",
        error={
            "type": type(e).__name__,
            "message": first_line(e),
            "traceback": traceback.format_exc(limit=8)[-4000:],
        },
    )
    return report


def _summarize_report(
    report: dict[str, Any],
    p: Patient,
    windows: list[dict[str, Any]],
    env: dict[str, Any],
    peak: float | None,
    dist: Any,
) -> None:
    """The timed windows' numbers into the report (a job's, under torchrun), with what makes them doubtful."""
    cfg, device = p.cfg, p.device
    warm = report.get("warmup", {})
    blocks = summarize(
        windows,
        metrics.device_total_gb(device),
        peak,
        warmup={"warmup_s": warm.get("warmup_s"), "compile_s": warm.get("compile_s") if compiled(cfg) else None},
        mfu_reason=f"no peak known for {device_name(env)}",
    )
    report["metrics"], report["stats"], report["throughput"] = blocks
    if "trace" in report:  # profiler overhead, visible next to the untraced numbers it stayed out of
        report["trace"]["untraced_step_ms_median"] = blocks.metrics["step_ms"]
    report["repeats"] = [
        {k: v for k, v in w.items() if k != "losses"} | {"final_loss": w["losses"][-1]} for w in windows
    ]
    warning = recompile_warning(cfg, windows)
    if warning and not (report.get("warmup") or {}).get("graphs_compiled_in_timed_windows"):
        # step times show compilation in the window that dynamo's graph count did not already report
        report.setdefault("warnings", []).append(warning)
    if dist is not None:
        distributed.merge_ranks(report, dist, p, windows, peak)
    if not report["metrics"]["loss_finite"]:
        report["status"] = "nan_loss"
        report["error"] = {"type": "NonFiniteLoss", "message": "the loss was NaN or inf in a timed step"}


#: a compiled run warms up past --warmup, by at most this many steps, until its steps settle
SETTLE_MAX_STEPS = 20
SETTLE_RATIO = throughput.SETTLE_RATIO
_unsettled = throughput.unsettled


def settle_budget(cfg: RunConfig) -> int:
    """How many steps the warm-up may grow by until its last steps agree (throughput.unsettled).

    Compiled runs: up to SETTLE_MAX_STEPS (compilation and autotuning take a while to settle); others, with
    a warm-up of at least throughput.SETTLE_STEPS steps asked for, up to as many again as were asked
    (allocator growth, cuDNN/cuBLAS autotuning, a first-epoch cache); none when the warm-up asked is shorter.
    """
    if cfg.warmup <= 0:
        return 0
    if compiled(cfg):
        return SETTLE_MAX_STEPS
    return min(SETTLE_MAX_STEPS, cfg.warmup) if cfg.warmup >= throughput.SETTLE_STEPS else 0


def _warmup_times(warm_s: list[float]) -> dict[str, Any]:
    """Warm-up wall time, and the part of it beyond steady steps: compilation, autotuning, first-call setup.

    A steady step is the last warm-up step; what the earlier steps took beyond it is `compile_s`.
    """
    if not warm_s:
        return {"warmup_s": 0.0, "compile_s": 0.0, "steps": 0}
    steady = warm_s[-1]
    return {
        "warmup_s": sum(warm_s),
        "compile_s": sum(max(0.0, s - steady) for s in warm_s[:-1]),
        "steps": len(warm_s),
        "step_s": warm_s,
    }


#: a first timed step this many times the median of the others means compilation ran inside the timed window
RECOMPILE_RATIO = 5.0


def recompile_warning(cfg: RunConfig, windows: list[dict[str, Any]]) -> str | None:
    """torch.compile that (re)compiles inside a timed window makes its throughput meaningless; say so."""
    if not compiled(cfg):
        return None
    for r, w in enumerate(windows):
        steps = w["step_ms"]
        if len(steps) < 2:
            continue
        worst = max(range(len(steps)), key=steps.__getitem__)
        rest = statistics.median(steps[:worst] + steps[worst + 1 :])
        if rest > 0 and steps[worst] > RECOMPILE_RATIO * rest:
            what = (
                f"--compile {cfg.compile}"
                if cfg.compile != "off"
                else f"--compile-vision {cfg.compile_vision}"
                if cfg.compile_vision != "model"
                else "--attention flex"
            )
            return (
                f"{what}: timed step {worst + 1} of window {r + 1} took {steps[worst]:.0f} ms, "
                f"{steps[worst] / rest:.0f}x the median of {rest:.0f} ms: compilation ran inside the timed "
                "window, so tokens/s is too low; use more --warmup steps"
            )
    return None


def _oom_details(e: BaseException, device: torch.device) -> dict[str, Any]:
    msg = str(e)
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)", msg)
    requested = None
    if m:
        requested = float(m.group(1)) * {"GiB": 1, "MiB": 1 / 1024, "KiB": 1 / 2**20}[m.group(2)]
    m = re.search(r"tried to allocate (\d+) bytes", msg)  # torch's CPU allocator
    if m:
        requested = int(m.group(1)) / 2**30
    info = {
        "type": "OutOfMemoryError",
        "message": first_line(e),
        "requested_gb": requested,
        "where": "gpu" if isinstance(e, torch.OutOfMemoryError) else "host",
    }
    if device.type == "cuda":
        info["peak_mem_gb_before_failure"] = torch.cuda.max_memory_allocated(device) / 2**30
        info["device_mem_total_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def exit_code(report: dict[str, Any]) -> int:
    return {"ok": EXIT_OK, "oom": EXIT_OOM, "nan_loss": EXIT_NAN}.get(report["status"], EXIT_FAILED_RUN)


def run_isolated(
    cfg: RunConfig,
    timeout: float | None = None,
    diagnose: bool = True,
    rules_dirs: list[str] | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    own_cwd: bool = False,
    in_process: dict[str, dict[str, Any]] | None = None,
    in_process_s: float = 0.0,
) -> dict[str, Any]:
    """Run one configuration in a fresh Python process and return its report (diagnosed unless asked not to).

    `env` adds to the child's environment (compile cache folders shared by a treatment's trials);
    `python` is another interpreter (the gate's baseline: another vlmdoctor or torch install).
    `own_cwd` starts the child in its own empty folder: `python -m` imports from the working
    folder first, so in a checkout the child would run that checkout's vlmdoctor whatever
    `env`'s PYTHONPATH or `python` say (the gate's baseline side needs its own code).
    `in_process`: leave-one-out arms (name: knobs) the child measures in its own process after its
    windows, in at most `in_process_s` seconds (run/arms.py; its report's `in_process`).
    """
    with supervise.scratch("vlmdoctor-") as folder:
        tmp = str(folder)
        cfg_path, out_path = folder / "config.json", folder / "report.json"
        cfg.dump(cfg_path)
        cmd = [
            python or sys.executable,
            "-m",
            "vlmdoctor",
            "profile",
            "--config",
            str(cfg_path),
            "--json",
            str(out_path),
            "--quiet",
        ]
        cmd += [] if diagnose else ["--no-diagnose"]
        for d in rules_dirs or []:
            cmd += ["--rules", str(d)]
        (folder / "scratch").mkdir()
        # the child's own temporary folders (a trace, torchrun's rank folder) go inside this one: removed with it
        child_env = {**os.environ, **(env or {}), supervise.SCRATCH_ENV: str(folder / "scratch")}
        child_env.pop(arms.ARMS_ENV, None)  # only this call's own request reaches the child
        if in_process:
            child_env[arms.ARMS_ENV] = str(arms.write_request(folder, in_process, in_process_s))
        log = folder / "child.log"
        with open(log, "wb") as f:
            # its own process group: a timeout, Ctrl-C or SIGTERM stops it and all it started (torchrun, its ranks)
            outcome = supervise.run(cmd, env=child_env, cwd=tmp if own_cwd else None, timeout=timeout, log=f)
        return _isolated_report(cfg, outcome, out_path, log, timeout)


def _isolated_report(
    cfg: RunConfig, outcome: supervise.Outcome, out_path: Path, log: Path, timeout: float | None
) -> dict[str, Any]:
    """The report the isolated run left, or one that says why there is none (timeout, a crash, an unreadable
    report); an interrupted child is an interruption here too."""
    if outcome.returncode in (130, 143, -2, -15) and not outcome.timed_out:  # the child was interrupted
        raise KeyboardInterrupt
    if outcome.timed_out:
        kept = _read_json(out_path)
        if kept and kept.get("metrics"):  # stopped in its traced window: the timed numbers are kept
            kept.setdefault("warnings", []).append(
                f"the run hit its time limit ({timeout:.0f} s) in the traced window: timed numbers only"
            )
            return kept
        return {
            "schema_version": SCHEMA_VERSION,
            "status": "timeout",
            "config": cfg.to_dict(),
            "error": {"type": "Timeout", "message": f"the run took longer than {timeout:.0f} s"},
        }
    if out_path.exists():
        try:
            return json.loads(out_path.read_text())
        except (OSError, ValueError) as e:
            return {
                "schema_version": SCHEMA_VERSION,
                "status": "error",
                "config": cfg.to_dict(),
                "error": {
                    "type": "ProcessFailed",
                    "message": f"the run's report is unreadable ({e})",
                    "exit_code": outcome.returncode,
                },
            }
    tail = log.read_bytes()[-8000:].decode("utf-8", errors="replace")
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "error",
        "config": cfg.to_dict(),
        "error": {
            "type": "ProcessFailed",
            "message": tail.strip()[-2000:] or f"the run exited with code {outcome.returncode} and said nothing",
            "exit_code": outcome.returncode,
        },
    }


# ------------------------------------------------------------------------------------------------
def run_distributed(
    cfg: RunConfig,
    trace: TraceOptions | None = None,
    rdzv: distributed.Rendezvous | None = None,
    progress: Progress = quiet,
    python: str | None = None,
) -> dict[str, Any]:
    """Launch the config through torchrun, one process per GPU, and return rank 0's report of the job.

    Every rank writes its own trace into one folder (the layout Holistic Trace Analysis reads):
    under --trace-dir a new folder per run, else a temporary one the caller removes. On a GPU the
    ranks get NVLink multicast switched off (distributed.NVLINK_MULTICAST_OFF) unless already set.
    """

    _, device = check(cfg)
    rdzv = rdzv or distributed.Rendezvous()
    rdzv.check()
    temp_trace: Path | None = None
    with supervise.scratch("vlmdoctor-ranks-", dir=scratch_dir()) as tmp:
        cfg.dump(tmp / "config.json")
        args = ["--config", str(tmp / "config.json"), "--out", str(tmp)]
        if trace is not None:
            if trace.keep:
                stem = f"vlmdoctor_{cfg.model}_s{cfg.stage}_{time.strftime('%Y%m%d-%H%M%S')}_{cfg.parallel}"
                folder = Path(trace.trace_dir) / stem
                n = 1
                while folder.exists():
                    n += 1
                    folder = Path(trace.trace_dir) / f"{stem}-{n}"
                folder.mkdir(parents=True)
            else:
                folder = temp_trace = supervise.temp_folder("vlmdoctor-trace-", dir=scratch_dir())
            args += ["--trace", json.dumps({**asdict(trace), "trace_dir": str(folder), "keep": True})]
        cmd = distributed.torchrun_command(cfg, args, rdzv, python, log_dir=str(tmp / "torchrun-logs"))
        env = distributed.child_env(device.type == "cuda")
        progress(f"{cfg.nproc_per_node} ranks through torchrun", 0, 1)
        try:
            with open(tmp / "torchrun.log", "wb") as log:  # torchrun and its ranks: one owned group
                proc = supervise.run(cmd, env=env, log=log)
        except BaseException:
            if temp_trace is not None:
                shutil.rmtree(temp_trace, ignore_errors=True)
            raise
        progress(f"{cfg.nproc_per_node} ranks through torchrun", 1, 1)
        try:
            report = _rank_report(tmp, cfg, proc.returncode)
        except BaseException:  # a usage error found on a rank: no temporary trace outlives it
            if temp_trace is not None:
                shutil.rmtree(temp_trace, ignore_errors=True)
            raise
    if temp_trace is not None:
        if report.get("trace"):
            report["trace"]["kept"] = False  # remove_temporary_trace removes the folder after the diagnosis
        else:
            shutil.rmtree(temp_trace, ignore_errors=True)
    report["launch"] = {
        "launcher": "torch.distributed.run",
        "command": shlex.join(cmd),
        "env": {k: env[k] for k in distributed.NVLINK_MULTICAST_OFF if k in env},
    }
    return report


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rank_report(folder: Path, cfg: RunConfig, returncode: int) -> dict[str, Any]:
    """Rank 0's report of the job; else the first failed rank's; else why torchrun failed."""
    path = folder / "report.json"
    if path.exists():
        return json.loads(path.read_text())
    failed = sorted(folder.glob("report_rank*.json"), key=lambda p: int(p.stem.removeprefix("report_rank")))
    if failed:
        report = json.loads(failed[0].read_text())
        if report.get("status") == "usage_error":
            raise UsageError(f"rank {report['rank']}: {report['error']['message']}")
        return report
    log = (folder / "torchrun.log").read_text(errors="replace") if (folder / "torchrun.log").exists() else ""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if "Error" in ln and not ln.lstrip().startswith("File")), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "error",
        "config": cfg.to_dict(),
        "error": {
            "type": "ProcessFailed",
            "exit_code": returncode,
            "message": (why or f"torchrun exited with code {returncode}").strip()[:500],
            "log_tail": "\n".join(lines[-40:])[-4000:],
        },
    }
