"""`vlmdoctor.Doctor`: measure and diagnose the user's own training loop from inside it.

    with vlmdoctor.Doctor(model, out="doctor-out") as doc:
        for batch in loader:
            ...; opt.step(); opt.zero_grad()
            doc.step(batch)

Steps are the intervals between `doc.step()` calls. After `warmup` steps comes a timed window of
`steps` steps (the device is synchronized at its two ends only, so the loop runs as it always
does), then a traced window (torch.profiler: 1 wait, 1 warm-up, `trace_steps` active steps) with
the model's parts marked. Tokens come from the batch passed to `step()`, or, when none is passed,
from a forward pre-hook that reads the model's `input_ids` / `attention_mask` / `labels`.

The user's training comes first: an error in vlmdoctor's own bookkeeping is logged once and
switches vlmdoctor off; errors from the user's code pass through unchanged. The callback
(callback.py) and `vlmdoctor run` (child.py) measure through the same `Recorder` (recorder.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from vlmdoctor.files import json_text, rescue
from vlmdoctor.invisible import kept
from vlmdoctor.own import outputs
from vlmdoctor.own.recorder import Recorder
from vlmdoctor.report import progress
from vlmdoctor.window import HTML, OUT, STEPS, TRACE_STEPS, WARMUP, WINDOW_LIMITS


def argument_problem(out: Any, warmup: Any, steps: Any, trace_steps: Any, stage: Any, model: Any = None) -> str | None:
    """What is wrong with the arguments of `Doctor` (and `DoctorCallback`), in words; None: nothing. Said, and the
    training left unmeasured: a wrong argument never raises into the training, and an out= that is a link or a
    file is never written through (as `vlmdoctor run --out`)."""
    if model is not None and not isinstance(model, nn.Module):
        return f"model= must be a torch.nn.Module (or None), got {type(model).__name__}"

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(out, (str, os.PathLike)) or not str(out):
        return f"out= must be a folder path, got {out!r}"[:200]
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        return f"out={str(out)!r} exists and is not a folder (a link or a file): vlmdoctor writes only into a folder"
    for name, value in (("warmup", warmup), ("steps", steps), ("trace_steps", trace_steps)):
        low, high = WINDOW_LIMITS[name]
        if not whole(value) or not low <= value <= high:
            return f"{name} must be a whole number from {low} to {high:,}, got {value!r}"[:200]
    if isinstance(stage, bool) or (stage is not None and stage not in (1, 2)):
        return f"stage must be 1, 2 or None, got {stage!r}"[:200]
    return None


class Doctor:
    """Measure and diagnose a training loop from inside it; see the module docstring.

    Under a launcher (torchrun, accelerate launch) every rank measures its own steps and rank 0
    alone prints and writes the job's report (rank_join.py).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        out: str | Path = OUT,
        warmup: int = WARMUP,
        steps: int = STEPS,
        trace_steps: int = TRACE_STEPS,
        stage: int | None = None,
        config: dict[str, Any] | None = None,
        audience: str = "loop",
        quiet: bool = False,
        rules_dirs: Sequence[str] = (),
        source: str = "api",
        force: bool = False,
        step_offset: int = 0,
        verbose: bool = False,
    ) -> None:
        self.verbose = verbose  # the report prints every table, not one screen
        args = (model, out, warmup, steps, trace_steps, stage, config, audience, quiet, rules_dirs, source, force)
        with kept():
            try:
                self._setup(*args, step_offset)
            except Exception as e:  # whatever the arguments, the constructor never raises into the training
                self._refuse(
                    f"vlmdoctor.Doctor: {type(e).__name__}: {e}"[:300] + ": this run is not measured; training goes on"
                )

    def _refuse(self, why: str) -> None:
        """This run is not measured, said once (rank 0): the loop runs as it would without vlmdoctor, and nothing
        is written."""
        if getattr(self, "rec", None) is None:
            self.rec = Recorder(None, OUT, 0, 1, 0)
        self.rec.done = self.rec.broken = True
        self.lead = self.rec.rank == 0
        self.quiet, self.rules_dirs = True, []
        self.report, self.reported, self.summarized, self.refused = None, False, False, True
        if self.lead:
            progress.say(why)

    def _setup(
        self,
        model: nn.Module | None,
        out: str | Path,
        warmup: int,
        steps: int,
        trace_steps: int,
        stage: int | None,
        config: dict[str, Any] | None,
        audience: str,
        quiet: bool,
        rules_dirs: Sequence[str],
        source: str,
        force: bool,
        step_offset: int,
    ) -> None:
        bad = argument_problem(out, warmup, steps, trace_steps, stage, model)
        if bad:  # a wrong argument is said, never raised into the training: the loop runs, unmeasured
            model, out, warmup, steps, trace_steps, stage = None, OUT, 0, 1, 0, None
        window = (warmup, steps, trace_steps, stage, source, config, audience, step_offset)
        try:
            self.rec = Recorder(model, out, *window)
        except Exception as e:  # a model vlmdoctor cannot read: the loop runs, unmeasured
            self.rec = Recorder(None, out, *window)
            self.rec.fail(e)
        self.lead = self.rec.rank == 0
        self.quiet = quiet or not self.lead
        if not self.quiet:
            self.rec.tell = progress.say
        self.rules_dirs = list(rules_dirs)
        self.report: dict[str, Any] | None = None
        self.reported = False
        self.summarized = False
        existing = [] if force or bad else outputs.existing_outputs(out)
        if bad:
            why = f"vlmdoctor.Doctor: {bad}: this run is not measured; training goes on"
        elif existing:  # the rule of `vlmdoctor run`: an earlier report stays, unless force=True
            why = (
                f"{existing[0]} exists: this run is not measured (force=True replaces it, "
                "or out= another folder); training goes on"
            )
        else:
            why = None
        self.refused = False
        if why is not None:
            self._refuse(why)

    def __enter__(self) -> Doctor:
        if not self.refused:
            with kept():
                self.rec._safe(self.rec.attach)
                self.rec._safe(self.rec.begin)
        return self

    def step(self, batch: Any = None, *, loss: Any = None, **inputs: Any) -> None:
        """Call once per optimizer step, after it; the batch (or its tensors as keywords) is optional.

        Once the traced window is over, the report is written and printed at once (the loop
        goes on, unmeasured), so a long training does not hold it back until its end.
        """
        with kept():
            try:
                self.rec.step(batch, loss, **inputs)
                if not self.reported and not self.refused and self.rec.window_done:
                    self.write_report()
            except Exception as e:  # vlmdoctor's own error: said once, the loop goes on
                self.rec.fail(e)

    @property
    def window_done(self) -> bool:
        try:
            return self.rec.window_done
        except Exception as e:
            self.rec.fail(e)
            return True

    def write_report(self) -> dict[str, Any] | None:
        """Stop; analyze, write out/report.json and its page, and print the prescriptions (rank 0), or hand
        the numbers to rank 0 (the other ranks). Runs once. Whatever fails in here is said in one line and the
        loop goes on; a report that was measured is kept (in `self.report`, and in a rescue file when out/
        cannot be written)."""
        if self.reported or self.refused:
            return self.report
        with kept():
            return self._write_report()

    def _write_report(self) -> dict[str, Any] | None:
        self.reported = True
        try:
            report = self.rec.finish()
        except Exception as e:
            self.rec.fail(e)
            return None
        if report is None:
            return None
        if self.rec.broken:
            report.setdefault("notes", []).append(
                "vlmdoctor hit an internal error during the run and stopped measuring; the numbers may be partial"
            )
        if outputs.gather_ranks(report, self.rec) is None:
            return None  # a rank other than 0: rank 0 holds its numbers
        self.report = report
        try:
            outputs.diagnose_report(report, self.rec.audience, self.rules_dirs)
        except Exception as e:  # the measurement stands without its diagnosis
            report["diagnosis_error"] = f"{type(e).__name__}: {e}"
            self.rec.say("the diagnosis failed, the measurement is kept", e)
        try:
            path = outputs.write_outputs(report, self.rec.out)
        except Exception as e:  # through the one writer; what it could not write is kept in a rescue file
            try:
                kept = f"it was saved to {rescue('report.json', json_text(report).encode())}"
            except Exception as e2:
                kept = f"it could not be saved elsewhere either ({type(e2).__name__}: {e2})"
            self.rec.say(f"could not write {self.rec.out / 'report.json'} ({kept})", e)
            return report
        try:
            if not self.quiet:
                outputs.show(report, verbose=self.verbose)
                page = self.rec.out / HTML
                written = f"{path}, {page}" if page.exists() else str(path)
                self.rec._tell(f"report written: {written}; training goes on, unmeasured")
        except Exception as e:
            self.rec.say(f"could not print the report (it is in {path})", e)
        return report

    def finish(self) -> dict[str, Any] | None:
        """The end of training: the report of what was measured (if not written yet), then the summary;
        returns the report."""
        if self.refused:
            return None
        self.write_report()
        with kept():
            self._summarize_once()
        return self.report

    def _summarize_once(self) -> None:
        if self.report is not None and not self.quiet and not self.summarized:
            self.summarized = True
            try:
                outputs.show_summary(self.report, outputs.output_paths(self.report, self.rec.out))
            except Exception as e:
                self.rec.say("could not print the summary", e)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.finish()
        return False  # the user's exception, if any, goes on unchanged
