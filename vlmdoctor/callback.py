"""`vlmdoctor.DoctorCallback`: one line to doctor a `transformers.Trainer` (or TRL `SFTTrainer`) run.

    Trainer(..., callbacks=[DoctorCallback(out="doctor-out")])

A step is one optimizer step (`on_step_begin` .. `on_step_end`, gradient accumulation included).
Tokens come from a forward pre-hook on the model (the inputs the Trainer passes); the run's
TrainingArguments go into the report's config, under vlmdoctor's knob names where one applies,
so the rules see what is already set and the advice names the TrainingArguments fields.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from vlmdoctor.api import Doctor, _log
from vlmdoctor.run.trainer_args import training_args_config

__all__ = ["DoctorCallback", "training_args_config"]


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """A callback method whose own errors never reach the Trainer: said once, measurement switched off."""

    @functools.wraps(method)
    def call(self: DoctorCallback, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as e:  # never the user's training
            doc, self.doc = self.doc, None
            if doc is not None:
                doc.rec.fail(e)
                if self.report is None:  # what was measured before the error is still written
                    self.report = doc.finish()
            elif not self.failed:
                _log(f"internal error, measurement switched off, training goes on: {type(e).__name__}: {e}")
            self.failed = True
            return None

    return call


class DoctorCallback(TrainerCallback):
    """Measure warm-up, a timed window and a traced window of a Trainer run, then write the report."""

    def __init__(
        self,
        out: str | Path = "doctor-out",
        warmup: int = 5,
        steps: int = 20,
        trace_steps: int = 2,
        stage: int | None = None,
        stop_after_window: bool = False,
        quiet: bool = False,
        rules_dirs: Sequence[str] = (),
    ) -> None:
        self.kw = dict(
            out=out,
            warmup=warmup,
            steps=steps,
            trace_steps=trace_steps,
            stage=stage,
            quiet=quiet,
            rules_dirs=rules_dirs,
        )
        self.stop_after_window = stop_after_window
        self.doc: Doctor | None = None
        self.report: dict[str, Any] | None = None
        self.failed = False

    @_guarded
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        cfg = training_args_config(args)
        trainer_cls = type(kwargs.get("trainer")).__name__ if kwargs.get("trainer") is not None else "Trainer"
        cfg["trainer"] = trainer_cls
        self.doc = Doctor(model, audience="trainer", config=cfg, source="trainer", **self.kw)
        self.doc.__enter__()

    @_guarded
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doc is not None and self.doc.rec.n == 0:
            self.doc.rec.begin()

    @_guarded
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.doc is None:
            return None
        self.doc.step()  # writes the report once the traced window is over
        if self.doc.window_done and self.report is None:
            self.report = self.doc.finish()
            if self.stop_after_window:
                control.should_training_stop = True
        return control

    @_guarded
    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.doc is not None and self.report is None:
            self.report = self.doc.finish()
