"""`vlmdoctor.DoctorCallback`: one line to doctor a `transformers.Trainer` (or TRL `SFTTrainer`) run.

    Trainer(..., callbacks=[DoctorCallback(out="doctor-out")])

A step is one optimizer step (`on_step_begin` .. `on_step_end`, gradient accumulation included).
Tokens come from a forward pre-hook on the model (the inputs the Trainer passes); the run's
TrainingArguments go into the report's config, under vlmdoctor's knob names where one applies,
so the rules see what is already set and the advice names the TrainingArguments fields.

The measured numbers go into the Trainer's own logs (`vlmdoctor/real_tokens_per_s`, `vlmdoctor/mfu`,
`vlmdoctor/step_ms`, ...), so `log_history` and every `report_to` integration (TensorBoard, wandb)
see them: through `Trainer.log` of the Trainer that calls this callback, once the report is written.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from vlmdoctor.invisible import kept
from vlmdoctor.own.api import Doctor
from vlmdoctor.report import progress
from vlmdoctor.run.trainer_args import sample_lengths, training_args_config
from vlmdoctor.window import OUT, STEPS, TRACE_STEPS, WARMUP

__all__ = ["DoctorCallback", "trainer_metrics", "training_args_config"]

PREFIX = "vlmdoctor/"


def trainer_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's headline as Trainer log entries: numbers only (what TensorBoard and wandb accept)."""
    m = report.get("metrics") or {}
    findings = report.get("findings")
    values = {
        "real_tokens_per_s": m.get("real_tokens_per_s"),
        "loss_tokens_per_s": m.get("loss_tokens_per_s"),
        "mfu": m.get("mfu"),
        "model_tflops_per_s": m.get("model_tflops_per_s"),
        "step_ms": m.get("step_ms"),
        "step_ms_p10": m.get("step_ms_p10"),
        "step_ms_p90": m.get("step_ms_p90"),
        "pad_fraction": m.get("pad_fraction"),
        "peak_mem_gb": m.get("peak_mem_gb"),
        "findings": len(findings) if isinstance(findings, list) else None,
    }
    return {PREFIX + k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def calling_trainer() -> Any:
    """The Trainer whose callback handler is calling us, read off the call stack (callbacks are not given it)."""
    try:
        from transformers import Trainer  # deferred: the Trainer module is heavy, and only asked for here
    except ImportError:
        return None
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return None
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    return None


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callback method whose own errors never reach the Trainer: said once, measurement switched off."""

    @functools.wraps(method)
    def call(self: DoctorCallback, *args: Any, **kwargs: Any) -> Any:
        with kept():  # the user's random streams as they were, whatever vlmdoctor and its libraries did
            return _call(self, *args, **kwargs)

    def _call(self: DoctorCallback, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # never the user's training
            doc, self.doc = self.doc, None
            if doc is not None:
                doc.rec.fail(e)
                if self.report is None:  # what was measured before the error is still written
                    self.report = doc.finish()
            elif not self.failed:
                progress.say(f"internal error, measurement switched off, training goes on: {type(e).__name__}: {e}")
            self.failed = True
            return None

    return call


class DoctorCallback(TrainerCallback):
    """Measure warm-up, a timed window and a traced window of a Trainer run, then write the report."""

    def __init__(
        self,
        out: str | Path = OUT,
        warmup: int = WARMUP,
        steps: int = STEPS,
        trace_steps: int = TRACE_STEPS,
        stage: int | None = None,
        stop_after_window: bool = False,
        quiet: bool = False,
        rules_dirs: Sequence[str] = (),
        force: bool = False,
        verbose: bool = False,
    ) -> None:
        self.kw = dict(
            out=out,
            warmup=warmup,
            steps=steps,
            trace_steps=trace_steps,
            stage=stage,
            quiet=quiet,
            rules_dirs=rules_dirs,
            force=force,
            verbose=verbose,
        )
        self.stop_after_window = stop_after_window
        self.doc: Doctor | None = None
        self.report: dict[str, Any] | None = None
        self.failed = False
        self.trainer: Any = None
        self.pending: dict[str, float] | None = None  # metrics not yet in the Trainer's logs

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.trainer = calling_trainer()
        cfg = training_args_config(args)
        cfg["trainer"] = type(self.trainer).__name__ if self.trainer is not None else "Trainer"
        if self.trainer is not None:
            cfg["sample_lengths"] = sample_lengths(self.trainer)  # what the group_by_length advice needs
        if int(getattr(args, "world_size", 1) or 1) > 1:
            cfg["parallel"] = "fsdp" if getattr(args, "fsdp", None) else "ddp"
        offset = int(getattr(state, "global_step", 0) or 0)
        self.doc = Doctor(model, audience="trainer", config=cfg, source="trainer", step_offset=offset, **self.kw)
        self.doc.__enter__()

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doc is not None and self.doc.rec.n == 0:
            self.doc.rec.begin()

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.doc is None:
            return None
        was = self.doc.reported
        self.doc.step()  # writes the report once the traced window is over
        if self.doc.reported and not was:
            self.report = self.doc.report
            should_log = control.should_log
            self._to_logs()
            control.should_log = should_log  # Trainer.log cleared it: the Trainer's own log of this step still comes
            if self.stop_after_window:
                control.should_training_stop = True
        return control

    def _to_logs(self) -> None:
        """The metrics into the Trainer's logs, on rank 0 (its integrations log on the main process only)."""
        if self.doc is None or self.doc.report is None or not self.doc.lead:
            return
        metrics = trainer_metrics(self.doc.report)
        if not metrics:
            return
        if self.trainer is not None:
            try:
                self.trainer.log(dict(metrics))
                return
            except Exception as e:
                progress.say(f"could not log the metrics through the Trainer, they go with its next log: {e}")
        self.pending = metrics

    @_guarded
    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An evaluation ran after the last step (the model in eval mode: its forwards count no tokens): its
        time is not the training's."""
        if self.doc is not None and not self.doc.refused:
            self.doc.rec.exclude_since_last_step("evaluation")

    @_guarded
    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doc is not None and not self.doc.refused:
            self.doc.rec.exclude_since_last_step("prediction")

    @_guarded
    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Without the Trainer at hand: into the next log entry (log_history, and the callbacks after this one)."""
        if not self.pending or logs is None or any(k.startswith(PREFIX) for k in logs):
            return
        logs.update(self.pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self.pending)
        self.pending = None

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doc is not None:
            if not self.doc.reported:  # a run shorter than its windows: the report of the steps it had
                self.report = self.doc.write_report()
                self._to_logs()
            self.report = self.doc.finish()  # the summary
