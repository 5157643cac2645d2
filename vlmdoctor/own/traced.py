"""The traced window of a loop vlmdoctor does not own: torch.profiler over the steps after the timed window (1 wait,
1 warm-up, `trace_steps` recorded steps) with the model's parts marked, one profiler session at a time in the
process (one_profiler.py), and the FLOPs of the recorded steps counted from the profiler's record once it stopped.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, schedule

from vlmdoctor.own import one_profiler
from vlmdoctor.own.rank_join import job_name
from vlmdoctor.report import progress
from vlmdoctor.run.capture import trace_writer
from vlmdoctor.run.flopcount import StepFlops
from vlmdoctor.run.parts import mark_parts
from vlmdoctor.window import TRACE_WAIT, TRACE_WARMUP

#: who traces, in the line that says why another recorder did not
WHO = {"api": "vlmdoctor.Doctor", "trainer": "vlmdoctor.DoctorCallback", "script": "vlmdoctor run"}


class TracedWindow:
    """The profiler over the traced steps: started after the timed window, stepped with the loop, stopped (and its
    FLOPs counted) after the recorded steps; or skipped, with why, when another profiler runs in the process."""

    def __init__(
        self,
        model: nn.Module | None,
        device: torch.device,
        out: Path,
        source: str,
        rank: int,
        world: int,
        steps: int,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.model, self.device, self.out, self.source = model, device, out, source
        self.rank, self.world = rank, world
        self.steps = steps  # 0: timed only (the gate's paired runs), no traced window
        self.on_error = on_error  # an error of vlmdoctor's own inside the marks, in the user's forward
        self.prof: Any = None
        self.unmark: Any = None
        self.info: dict[str, Any] | None = None  # the report's `trace` block, once the profiler started
        self.skipped: str | None = None  # why the traced window was not traced (another profiler ran)
        self.flops = StepFlops()  # counted from the traced window's record once it stopped, never on a live step
        self.flops_padded: int | None = None
        self.padded: list[int] = []  # padded tokens of each recorded (active) traced step
        self.profiled_timed_steps = 0  # timed steps during which another profiler ran (their times include it)
        self.profiled_by: str | None = None
        self.busy_at_start: str | None = None  # another profiler ran where the current step started

    @property
    def over(self) -> bool:
        """Nothing more to trace: recorded and stopped, skipped, or not asked for."""
        return self.prof is None and (self.info is not None or not self.steps or self.skipped is not None)

    def watch_timed_step(self, i: int, warmup: int, steps: int) -> None:
        """Another profiler running over a timed step is counted: the step's time includes its overhead."""
        if warmup < i <= warmup + steps and self.busy_at_start:
            self.profiled_timed_steps += 1
            self.profiled_by = self.busy_at_start
        if warmup <= i < warmup + steps:  # where the next timed step starts
            self.busy_at_start = one_profiler.busy(self)

    def start(self) -> None:
        """Trace the next steps, unless another profiler runs in this process: one at a time (two end the
        process), so this one then stays timed only and says why."""
        what = f"{WHO.get(self.source, 'another vlmdoctor recorder')} (writing to {self.out})"
        why = one_profiler.claim(self, what, self._give_way)
        if why is not None:
            self._skip(f"{why} was already profiling this process")
            return
        try:
            self._start_profiler()
        except Exception as e:  # a profiler that did not start is dropped, never stopped (that would end another)
            self.prof = None
            self.info = None
            if self.unmark is not None:
                with contextlib.suppress(Exception):
                    self.unmark()
                self.unmark = None
            one_profiler.release(self)
            self._skip(f"torch.profiler did not start ({type(e).__name__}: {e})")

    def _skip(self, why: str) -> None:
        self.skipped = why
        progress.say(f"not tracing: {why}; one profiler at a time. The timed window stands, the training goes on")

    def _give_way(self, why: str) -> None:
        """The script starts its own profiler while this one holds the session: stop ours first, drop its trace."""
        if self.prof is None:
            one_profiler.release(self)
            return
        self.stop()
        if self.info is not None:
            with contextlib.suppress(OSError):
                Path(self.info["path"]).unlink(missing_ok=True)
        self.info = None
        self._skip(f"{why} during vlmdoctor's traced window, which was stopped for it")

    def _start_profiler(self) -> None:
        if self.world > 1:  # one folder of rank traces per job, named alike by every rank
            folder = self.out / "trace" / f"vlmdoctor_{self.source}_{job_name()}"
            path = folder / f"vlmdoctor_{self.source}_rank{self.rank}.pt.trace.json.gz"
        else:
            folder = self.out / "trace"
            path = folder / f"vlmdoctor_{self.source}_{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json.gz"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        memory = self.device.type == "cuda"  # the live memory at the peak (the memory wall's facts), as `profile` does
        self.info = {
            "path": str(path),
            "steps": self.steps,
            "kept": True,
            "schedule": {"wait": 1, "warmup": 1, "active": self.steps},
            "record_shapes": True,
            "with_stack": False,
            "profile_memory": memory,
            "traced_step_ms": [],
        }
        try:  # a folder for the trace, never through a link: without one the trace is lost, not the measurement
            for f in {self.out / "trace", folder}:
                if f.is_symlink() or (f.exists() and not f.is_dir()):
                    raise OSError(f"{f} exists and is not a folder")
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.info |= {"path": None, "lost": f"cannot create {folder}: {e.strerror or e}"}
            one_profiler.release(self)  # no profiler started: the session is free again
            return
        self.unmark = mark_parts(self.model, on_error=self.on_error) if self.model is not None else None
        plan = schedule(wait=TRACE_WAIT, warmup=TRACE_WARMUP, active=self.steps, repeat=1)
        prof = profile(
            activities=activities,
            schedule=plan,
            on_trace_ready=trace_writer(path, self.info),
            record_shapes=True,
            profile_memory=memory,
        )
        with one_profiler.ours(self):
            prof.__enter__()
        self.prof = prof  # only once it started: a profiler that failed to start is never stopped

    def record(self, step_s: float, counts: list[dict[str, Any]]) -> None:
        """A recorded (active) step: its time and padded tokens, for the report and the FLOPs per step."""
        if self.info is not None:
            self.info["traced_step_ms"].append(step_s * 1e3)
            self.padded.append(sum(int(c["padded"]) for c in counts))

    def step(self) -> None:
        """The profiler's step, as the loop's step ends."""
        with one_profiler.ours(self):
            self.prof.step()

    def add_metadata(self, meta: dict[str, Any]) -> None:
        """What is known of the run travels in the trace (as vlmdoctor's own runs do), so the rules see it."""
        self.prof.add_metadata_json("vlmdoctor", json.dumps(meta, default=str))

    def stop(self) -> None:
        """The profiler stopped (the trace written by it), its FLOPs counted, the marks and the session released."""
        prof, self.prof = self.prof, None
        if prof is not None:
            try:
                with one_profiler.ours(self):
                    prof.__exit__(None, None, None)
            except Exception as e:
                progress.say(f"the profiler did not stop cleanly: {type(e).__name__}: {e}")
            else:
                self._count_flops(prof)
        one_profiler.release(self)
        if self.unmark is not None:
            unmark, self.unmark = self.unmark, None
            unmark()
        if self.info is not None and self.info.get("path"):
            p = Path(self.info["path"])
            written = "lost" not in self.info and p.is_file()
            self.info["bytes"] = p.stat().st_size if written else None
            if not written:
                self.info["path"] = None

    def _count_flops(self, prof: Any) -> None:
        """The traced steps' FLOPs from the profiler's record, after the window: nothing runs on a live step."""
        active = len((self.info or {}).get("traced_step_ms") or [])
        if not active:
            return
        self.flops.count(prof, active)
        padded = self.padded[:active]
        self.flops_padded = round(sum(padded) / len(padded)) if padded and all(padded) else None
