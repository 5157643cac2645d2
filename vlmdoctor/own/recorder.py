"""The Recorder: measures steps of a loop it does not own (the user's), for every way in (`Doctor`,
`DoctorCallback`, `vlmdoctor run`).

It composes parts with one job each: the tokens of the step under way (tokens.py), the step clock and its timed
window (clock.py), the traced window (traced.py) and the report of what was measured (report.py). The Recorder
holds what is known of the run (the model, where it writes, its rank), hooks the model, drives the parts step by
step, and keeps the rule that the user's training comes first: an error in vlmdoctor's own bookkeeping is said
once and switches measuring off; errors from the user's code pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from pathlib import Path
from typing import Any

from torch import nn

from vlmdoctor.own import one_profiler
from vlmdoctor.own.clock import StepClock
from vlmdoctor.own.model import describe_model, device_of, pad_id, unwrap
from vlmdoctor.own.rank_join import rank_and_world
from vlmdoctor.own.report import build_report, trace_metadata
from vlmdoctor.own.tokens import TokenCounter
from vlmdoctor.own.traced import TracedWindow
from vlmdoctor.report import progress
from vlmdoctor.window import OUT, STEPS, TRACE_LEAD, TRACE_STEPS, WARMUP


class Recorder:
    """Counts tokens and times steps of a loop it does not own, then traces a window of it."""

    def __init__(
        self,
        model: nn.Module | None,
        out: str | Path = OUT,
        warmup: int = WARMUP,
        steps: int = STEPS,
        trace_steps: int = TRACE_STEPS,
        stage: int | None = None,
        source: str = "api",
        config: dict[str, Any] | None = None,
        audience: str = "loop",
        step_offset: int = 0,
    ) -> None:
        model, self.parallel = unwrap(model)
        self.model = model
        self.out_given = str(out)
        self.out = Path(os.path.abspath(out))  # where the loop started: a loop that changes its folder writes there
        self.rank, self.world = rank_and_world()
        self.step_offset = step_offset  # the user's number of the step before the first one counted here
        self.tell: Any = None  # the progress lines' printer (Doctor sets it on rank 0 unless quiet)
        self.stage_given = stage
        self.source = source
        self.extra_config = dict(config or {})
        self.audience = audience
        self.device = device_of(model)
        self.broken = False
        self.done = False
        self.hooks: list[Any] = []
        self.notes: list[str] = []
        self.desc = describe_model(model) if model is not None else {"class": None, "parts": {}}
        self.report: dict[str, Any] | None = None  # built once, by finish()
        self.said: set[str] = set()  # errors of vlmdoctor's own already said (each once)
        self.tokens = TokenCounter(pad_id(model))
        self.clock = StepClock(max(0, int(warmup)), max(1, int(steps)), self.device, may_settle=self.world == 1)
        self.traced = TracedWindow(
            model, self.device, self.out, source, self.rank, self.world, max(0, int(trace_steps)), self.fail
        )
        with contextlib.suppress(Exception):
            one_profiler.install()  # sessions the script starts are seen, so that one profiler runs at a time

    @property
    def n(self) -> int:
        """Steps completed."""
        return self.clock.n

    # -- hooks ------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Forward hooks on the model: tokens from its inputs, the loss from its output."""
        if self.model is None:
            return

        def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self._safe(self._on_forward, args, kwargs)

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
            self._safe(self._on_output, output)

        self.hooks.append(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        self.hooks.append(self.model.register_forward_hook(post, with_kwargs=True))

    def _on_forward(self, args: tuple, kwargs: dict) -> None:
        if not self.done and self.model.training:
            self.tokens.on_forward(args, kwargs)

    def _on_output(self, output: Any) -> None:
        if not self.done and self.model.training:
            self.tokens.on_output(output)

    def _detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.tokens.clear()

    # -- the user's training comes first ------------------------------------------------------------
    def _safe(self, fn: Any, *a: Any) -> Any:
        if self.broken:
            return None
        try:
            return fn(*a)
        except Exception as e:  # never the user's training: log once, switch off
            self.fail(e)
            return None

    def fail(self, e: BaseException) -> None:
        """An error of vlmdoctor's own: said once, measurement switched off, hooks and profiler removed; the
        training goes on."""
        if self.broken:
            return
        self.broken = True
        frames = traceback.extract_tb(e.__traceback__)
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        self.say("internal error, measurement switched off, training goes on", e, where)
        with contextlib.suppress(Exception):
            self._detach()
        with contextlib.suppress(Exception):
            self.traced.stop()

    def say(self, what: str, e: BaseException, where: str = "") -> None:
        """One line per distinct error of vlmdoctor's own, however often it comes back."""
        key = f"{type(e).__name__}: {e}"
        if key not in self.said:
            self.said.add(key)
            progress.say(f"{what}: {key}{where}")

    def _tell(self, line: str) -> None:
        """A progress line (report/progress.py), where one is asked for."""
        if self.tell is not None:
            self.tell(line)

    # -- steps ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Where the first step starts (the first interval is measured from here)."""
        if self.clock.begin():
            what = self.desc.get("class") or "your training"
            if self.world > 1:
                what += f" (rank {self.rank} of {self.world}; every rank measures)"
            c = self.clock
            self._tell(progress.plan_line(what, c.warmup, c.steps, self.traced.steps, self.step_offset, self.out_given))

    def step(self, batch: Any = None, loss: Any = None, **inputs: Any) -> None:
        self._safe(self._step, batch, loss, inputs)

    def _step(self, batch: Any, loss: Any, inputs: dict[str, Any]) -> None:
        if self.done or self.window_done:  # measured: the rest of the run costs nothing
            return
        clock, traced = self.clock, self.traced
        now = clock.now()
        clock.begin(now)
        if batch is None and inputs:
            batch = inputs
        i, now = clock.tick(now, *self.tokens.take(batch, loss))
        traced.watch_timed_step(i, clock.warmup, clock.steps)
        if i == clock.warmup and clock.still_warming():
            clock.warmup += 1  # one more warm-up step; the window starts once the steps agree
            return
        if i == clock.warmup:
            self._tell(progress.timed_start_line(clock.warmup, clock.warmup_asked, self.step_offset, clock.steps))
            clock.open_window()
        if i == clock.timed_end:
            clock.window = clock.summarize(clock.warmup, i)
            rank = self.rank if self.world > 1 else None
            self._tell(progress.timed_done_line(clock.window, i, self.step_offset, traced.steps, rank))
            if traced.steps:
                traced.start()
        elif traced.prof is not None:
            self._traced_step(i)

    def _traced_step(self, i: int) -> None:
        """A step of the traced window: recorded once the profiler records, the metadata as it starts to, the
        profiler stopped after the last recorded step."""
        clock, traced = self.clock, self.traced
        lead = clock.timed_end + TRACE_LEAD
        if i > lead:  # an active (recorded) step
            traced.record(clock.last_step_s(), clock.records[-1]["counts"])
        traced.step()
        if i == lead:  # recording starts now; metadata before it is dropped
            traced.add_metadata(trace_metadata(self))
        if i >= lead + traced.steps:
            traced.stop()
            self._detach()
            self._tell(progress.traced_done_line(i, self.step_offset, (traced.info or {}).get("path")))

    def exclude_since_last_step(self, what: str) -> None:
        """Work that is not training ran since the last step ended (the Trainer's evaluation): the next step is
        timed from now, and the time left out is said."""
        if not (self.done or self.window_done):
            self.clock.exclude_since_last_step(what)

    @property
    def window_done(self) -> bool:
        """The timed and traced windows are over: the rest of the run is not measured."""
        return self.clock.window is not None and self.traced.over

    # -- the end ------------------------------------------------------------------------------------
    def finish(self) -> dict[str, Any] | None:
        """Stop measuring and build the report of what was measured (the analysis comes after); once (None
        when building it failed)."""
        if self.done:
            return self.report
        self.done = True
        self._detach()
        self.traced.stop()
        self.report = build_report(self)
        return self.report
