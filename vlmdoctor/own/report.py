"""The report of what a Recorder measured (its analysis comes after, outputs.py): the model, the environment, the
timed window's numbers by the one writer (run/metrics.py, the same names and meanings as vlmdoctor's own runs),
the FLOPs counted on the traced steps, the trace, and notes that say plainly what the numbers do not cover. Also
what is known of the run under run-config knob names (`rule_config`): the rules read it, in the report and in
the trace's metadata."""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from vlmdoctor import SCHEMA_VERSION, __version__
from vlmdoctor.own.model import estimate_stage, weight_dtype
from vlmdoctor.report import progress
from vlmdoctor.run import envinfo, metrics
from vlmdoctor.run.capture import lost_note, measured_metadata
from vlmdoctor.run.flopcount import describe_counted, peak_of, per_step
from vlmdoctor.run.metrics import Blocks
from vlmdoctor.window import TRACE_LEAD


def rule_config(rec: Any) -> dict[str, Any]:
    """What is known of the run, under run-config knob names where one applies (rules read them)."""
    desc, window = rec.desc, rec.clock.window
    cfg: dict[str, Any] = {
        "source": rec.source,
        "model": desc.get("class"),
        "vision": desc.get("vision"),
        "llm": desc.get("llm"),
        "projector": desc.get("projector"),
    }
    stage = rec.stage_given if rec.stage_given is not None else estimate_stage(desc)
    cfg["stage"] = stage
    cfg["stage_source"] = "given" if rec.stage_given is not None else ("estimated" if stage else "unknown")
    wd = weight_dtype(desc)
    if wd:
        cfg["weight_dtype"] = wd
    with warnings.catch_warnings():  # transformers 5 renamed it; read whichever there is, quietly
        warnings.simplefilter("ignore")
        gc = getattr(rec.model, "is_activation_checkpointing", getattr(rec.model, "is_gradient_checkpointing", None))
    if isinstance(gc, bool):
        cfg["gradient_checkpointing"] = gc
    impl = getattr(getattr(rec.model, "config", None), "_attn_implementation", None)
    if impl in ("sdpa", "eager", "flash_attention_2"):
        cfg["attention"] = {"flash_attention_2": "flash"}.get(impl, impl)
    cfg["device"] = rec.device.type
    if rec.parallel != "none":
        cfg["parallel"] = rec.parallel
    if rec.world > 1:
        cfg["world_size"] = rec.world
    cfg["warmup"], cfg["steps"], cfg["trace_steps"] = rec.clock.warmup, rec.clock.steps, rec.traced.steps
    cfg.update(rec.extra_config)
    if window and window.get("rows_per_step") and "batch_size" not in cfg:
        fw = window.get("forwards_per_step") or 1
        cfg["batch_size"] = int(window["rows_per_step"] / max(fw, 1))
    if window and window.get("sampler_guess") and "sampler" not in cfg:
        cfg["sampler"] = window["sampler_guess"]
        cfg["sampler_source"] = "measured: spread of the real lengths inside batches"
    return cfg


def trace_metadata(rec: Any) -> dict[str, Any]:
    """What the trace carries of the run (as vlmdoctor's own runs' traces do), so that `analyze` of it sees it too."""
    meta = {
        "schema_version": SCHEMA_VERSION,
        "tool_version": __version__,
        "config": rule_config(rec),
        "model": rec.desc,
        "source": rec.source,
    }
    if rec.clock.window is not None:  # the timed window's measurements
        meta["metrics"] = measured_metadata(blocks(rec.clock.window, rec.device, None).metrics)
    return meta


def blocks(w: dict[str, Any], device: torch.device, peak: float | None, mfu_reason: str | None = None) -> Blocks:
    """The report's metrics, stats and throughput of the one timed window, by the one writer (run/metrics.py):
    the same names and meanings as vlmdoctor's own runs, so gate, compare and HTML read both."""
    return metrics.write(
        [w],
        peak=peak,
        device_total_gb=metrics.device_total_gb(device),
        spread_of=metrics.SPREAD_USER,
        mfu_reason=mfu_reason,
    )


def build_report(rec: Any) -> dict[str, Any]:
    """The report of what was measured; status error (NoSteps) when no step was seen."""
    env = envinfo.collect(rec.device)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vlmdoctor", "version": __version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "ok",
        "kind": "profile",
        "model": rec.desc,
        "env": env,
    }
    peak, peak_source, no_peak = peak_of(env)
    report["flops"] = _flops_block(rec) | {"peak_flops": peak, "peak_source": peak_source}
    notes = list(rec.notes)
    window = _window_or_what_ran(rec, notes)
    notes += _window_notes(rec, window)
    report["config"] = rule_config(rec)
    if window is None:
        report["status"] = "error"
        report["error"] = {
            "type": "NoSteps",
            "message": "no training step was seen: call doc.step() once per "
            "optimizer step (or check that the optimizer steps)",
        }
        report["notes"] = notes
        return report
    _add_flops(rec, window, peak)
    if window["real_tokens_per_s"] is None:
        notes.append(
            "no tokens seen: the model was not called with input_ids / attention_mask keyword "
            "arguments (with vlmdoctor.Doctor, pass the batch: doc.step(batch))"
        )
    mfu_reason = no_peak or f"FLOPs {report['flops']['formula']}"
    report["metrics"], report["stats"], report["throughput"] = blocks(window, rec.device, peak, mfu_reason)
    clock = rec.clock
    report["warmup"] = {
        "asked": clock.warmup_asked,
        "steps": clock.warmup,
        "settle_steps": clock.warmup - clock.warmup_asked,
        "settled": clock.settled,
    }
    report["repeats"] = [
        {k: v for k, v in window.items() if k != "losses"}
        | {"final_loss": window["losses"][-1] if window["losses"] else None}
    ]
    report["data"] = {
        "source": rec.source,
        "tokens_from": "batch" if rec.tokens.batch_seen else "forward hook",
        "steps_seen": clock.n,
    }
    if rec.traced.info is not None:
        report["trace"] = dict(rec.traced.info) | {"untraced_step_ms_median": report["metrics"]["step_ms"]}
    report["notes"] = notes
    if report["metrics"]["loss_finite"] is False:
        report["status"] = "nan_loss"
        report["error"] = {"type": "NonFiniteLoss", "message": "the loss was NaN or inf in a timed step"}
    return report


def _flops_block(rec: Any) -> dict[str, Any]:
    """The FLOPs counted on the traced steps, or why none were."""
    traced = rec.traced
    out = describe_counted(traced.flops, traced.flops_padded)
    if traced.flops.total is None and traced.flops.reason is None:
        out["formula"] = (
            "not counted: no traced window (another profiler ran), whose recorded steps are the ones counted"
            if traced.skipped is not None
            else "not counted: the loop ended before the traced window recorded a step"
            if traced.steps
            else "not counted: no traced window (trace_steps=0), whose recorded steps are the ones counted"
        )
    return out


def _window_or_what_ran(rec: Any, notes: list[str]) -> dict[str, Any] | None:
    """The timed window; when the loop ended before it, the steps that ran (said in a note); None: no step."""
    clock = rec.clock
    n = clock.n
    if clock.window is None and n >= 1:  # the loop ended before the window: measure what ran
        # inside the warm-up: every step but the first (one-time costs), when there is another
        first = clock.warmup if n > clock.warmup else (1 if n > 1 else 0)
        clock.window = clock.summarize(first, n)
        notes.append(
            f"the loop ran {n} step(s), fewer than the {clock.warmup} warm-up + {clock.steps} timed "
            f"asked for: the numbers are over steps {first + 1}..{n}"
            + (" (warm-up steps included)" if first < clock.warmup else "")
        )
    return clock.window


def _window_notes(rec: Any, window: dict[str, Any] | None) -> list[str]:
    """What the numbers do not cover: a loop shorter than asked, forwards under no_grad, work left out of the step
    times, another profiler's overhead, and why there is no trace (or fewer traced steps than asked)."""
    clock, traced = rec.clock, rec.traced
    n, notes = clock.n, []
    if n < clock.timed_end + (TRACE_LEAD + traced.steps if traced.steps else 0):
        script = rec.source == "script"  # `vlmdoctor run`: flags, and the first optimizer step is not counted
        notes.append(progress.fit_hint(n, clock.warmup_asked, clock.steps, traced.steps, script, int(script)))
    if window is not None and (window.get("nograd_forwards_per_step") or 0) > 0:
        notes.append(
            f"{window['nograd_forwards_per_step']:g} forward(s) per step ran under no_grad (an evaluation inside "
            "the step?): not training, so their tokens are not counted; their time is in the step"
        )
    for what, ms in clock.excluded_ms.items():
        notes.append(
            f"{what} ran between steps of the measured windows ({ms:,.0f} ms): left out of the step times"
            + ("; the trace holds it" if traced.info is not None else "")
        )
    if traced.profiled_timed_steps:
        notes.append(
            f"{traced.profiled_by} ran during {traced.profiled_timed_steps} of the timed steps: their times "
            "include its overhead"
        )
    if window is not None and traced.skipped is not None:
        notes.append(f"not traced: {traced.skipped} (one profiler at a time); timed only, no diagnosis")
    elif window is not None and traced.info is None and not traced.steps:
        notes.append("not traced (trace steps 0): timed only, no facts and no diagnosis")
    elif window is not None and traced.info is None:
        notes.append("no traced window: the loop ended first, so there are no facts and no diagnosis")
    elif traced.info is not None and traced.info.get("lost"):
        notes.append(lost_note(traced.info["lost"]))
    elif traced.info is not None and n < clock.timed_end + TRACE_LEAD + traced.steps:
        notes.append("the loop ended inside the traced window: the trace holds fewer steps than asked")
    return notes


def _add_flops(rec: Any, window: dict[str, Any], peak: float | None) -> None:
    """The window's numbers again, now with the FLOPs per step counted on the traced steps."""
    traced = rec.traced
    step_flops = per_step(traced.flops.total, traced.flops_padded, window.get("step_padded_tokens") or [])
    if step_flops is not None:
        window["step_flops"] = step_flops if isinstance(step_flops, list) else [step_flops] * window["steps"]
    window |= metrics.window_numbers(
        window["step_ms"],
        window["step_real_tokens"],
        window.get("step_loss_tokens"),
        window.get("step_padded_tokens"),
        window.get("step_flops"),
        peak,
    )
