"""The step clock of a loop vlmdoctor does not own: each step's end time and CPU time with its tokens and loss,
the warm-up (grown until its last steps agree), and the timed window's numbers.

Steps are the intervals between the ends of two steps. The device is synchronized at the timed window's two
ends only, so the loop runs as it always does; a step's tokens are read (`.item()`) once, when the window is
summarized.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from vlmdoctor.own.tokens import guess_sampler
from vlmdoctor.run import metrics, throughput


def next_from(record: dict[str, Any], clock: str = "t") -> float:
    """Where the step after this record starts: its end, or later when work that is not training came between."""
    return record.get("next_from" if clock == "t" else "cpu_next_from", record[clock])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Times the steps: warm-up, then a timed window of `steps` steps, summarized once it ends."""

    def __init__(self, warmup: int, steps: int, device: torch.device, may_settle: bool) -> None:
        self.warmup, self.steps = warmup, steps
        self.warmup_asked = warmup
        self.device = device
        self.n = 0  # steps completed
        self.records: list[dict[str, Any]] = []  # per step: t (its end), cpu, counts, losses, nograd
        self.t_start: float | None = None
        self.c_start: float | None = None  # the process's CPU time where the first step starts
        self.window: dict[str, Any] | None = None  # the timed window's numbers, once it ended
        # the warm-up may grow until its last steps agree (throughput.unsettled), by as many steps as were asked;
        # not with several ranks, which must open their windows at the same step without talking to each other
        grows = may_settle and self.warmup >= throughput.SETTLE_STEPS
        self.settle_left = min(20, self.warmup) if grows else 0
        self.settled: bool | None = None
        self.excluded_ms: dict[str, float] = {}  # work between steps that is not training, left out of the times

    @property
    def timed_end(self) -> int:
        """The step that ends the timed window."""
        return self.warmup + self.steps

    def begin(self, now: float | None = None) -> bool:
        """Where the first step starts (the first interval is measured from here); True when that is now."""
        if self.t_start is not None:
            return False
        self.t_start = time.perf_counter() if now is None else now
        self.c_start = time.process_time()
        return True

    def now(self) -> float:
        return time.perf_counter()

    def tick(self, now: float, counts: list[dict[str, Any]], losses: list[Any], nograd: int) -> tuple[int, float]:
        """A step ended at `now`: recorded with its tokens (the device synchronized first where the timed window
        opens or closes). Returns the step's number (1-based) and its end time."""
        self.n += 1
        i = self.n
        if i == self.warmup or i == self.timed_end:
            sync(self.device)
            now = time.perf_counter()
        self.records.append(
            {"t": now, "cpu": time.process_time(), "counts": counts, "losses": losses[-1:], "nograd": nograd}
        )
        return i, now

    def still_warming(self) -> bool:
        """The warm-up's last steps do not agree yet (time per real token): warm up one more step, while allowed."""
        if self.warmup < throughput.SETTLE_STEPS or not self.warmup_asked:
            return False
        per_token = []
        for k in range(max(0, self.warmup - throughput.SETTLE_STEPS), self.warmup):
            prev = self.records[k - 1]["t"] if k >= 1 else self.t_start
            tokens = sum(int(c["real"]) for c in self.records[k]["counts"]) or 1
            per_token.append((self.records[k]["t"] - prev) / tokens)
        self.settled = not throughput.unsettled(per_token)
        if self.settled or self.settle_left <= 0:
            return False
        self.settle_left -= 1
        return True

    def open_window(self) -> None:
        """The timed window starts after this step: the device's memory peak from here on."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def exclude_since_last_step(self, what: str) -> None:
        """Work that is not training ran since the last step ended (the Trainer's evaluation): the next step is
        timed from now, and the time left out is counted when inside the windows."""
        now = time.perf_counter()
        if not self.records:
            if self.t_start is not None:
                self.t_start, self.c_start = now, time.process_time()
            return
        last = self.records[-1]
        left_out = now - next_from(last)
        last["next_from"], last["cpu_next_from"] = now, time.process_time()
        if self.n >= self.warmup:  # inside the timed or traced window
            self.excluded_ms[what] = self.excluded_ms.get(what, 0.0) + left_out * 1e3

    def last_step_s(self) -> float:
        """The step that just ended, in seconds (from where it started)."""
        return self.records[-1]["t"] - next_from(self.records[-2])

    def summarize(self, first: int, last: int) -> dict[str, Any]:
        """Steps first+1..last (1-based): their end times minus the previous step's end."""
        recs = self.records[first:last]
        step_s, step_cpu = self._intervals(first, last)
        toks = [_tokens(r["counts"]) for r in recs]
        lengths = [[int(x) for x in c["lengths"].tolist()] for r in recs for c in r["counts"]]
        step_ms = [s * 1e3 for s in step_s]
        real_steps = [t[0] for t in toks]
        loss_steps = [t[1] for t in toks] if toks and all(t[4] for t in toks) else None
        padded_steps = [t[2] for t in toks]
        w: dict[str, Any] = {
            "steps": last - first,
            "wall_s": sum(step_s),
            # the FLOPs come later, counted on the traced steps (the report asks again with them)
            **metrics.window_numbers(step_ms, real_steps, loss_steps, padded_steps, None, None),
            "step_ms": step_ms,
            # the process's CPU time per step: a one-thread CPU run's work, which a neighbour's load does not stretch
            "step_cpu_ms": [c * 1e3 for c in step_cpu] if None not in step_cpu else None,
            "step_real_tokens": real_steps,
            "step_loss_tokens": loss_steps,
            "step_padded_tokens": padded_steps,
            "losses": [float(x) for r in recs for x in r["losses"]],
            "rows_per_step": statistics.median([t[3] for t in toks]) if toks else None,
            "forwards_per_step": statistics.median([t[5] for t in toks]) if toks else None,
            # forwards under no_grad inside a step (a stray evaluation): not training, their tokens not counted
            "nograd_forwards_per_step": statistics.median([r.get("nograd", 0) for r in recs]) if last > first else None,
            "sampler_guess": guess_sampler(lengths),
        }
        if self.device.type == "cuda":
            w["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            w["peak_mem_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return w

    def _intervals(self, first: int, last: int) -> tuple[list[float], list[float | None]]:
        """The wall and CPU seconds of steps first+1..last, each from where the one before it left off."""
        recs = self.records
        prev = next_from(recs[first - 1]) if first >= 1 else self.t_start
        cpu = next_from(recs[first - 1], "cpu") if first >= 1 else self.c_start
        step_s, step_cpu = [], []
        for r in recs[first:last]:
            step_s.append(r["t"] - prev)
            prev = next_from(r)
            step_cpu.append(r["cpu"] - cpu if cpu is not None else None)
            cpu = next_from(r, "cpu")
        return step_s, step_cpu


def _tokens(cs: list[dict[str, Any]]) -> tuple[int, int, int, int, bool, int]:
    """One step's micro-batches: real, loss, padded tokens, rows, whether every one counted its loss tokens, and
    how many there were."""
    return (
        sum(int(c["real"]) for c in cs),
        sum(int(c["loss"]) for c in cs if c["loss"] is not None),
        sum(int(c["padded"]) for c in cs),
        sum(int(c["rows"]) for c in cs),
        all(c["loss"] is not None for c in cs) and bool(cs),
        len(cs),
    )
