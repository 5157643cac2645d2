"""What vlmdoctor says while the user's training runs: one line at each window boundary, tqdm-safe.

A Trainer (or the user's own loop) often has a tqdm bar live on the terminal; text printed past it
lands in the middle of the bar. While a bar is live, vlmdoctor's text goes through `tqdm.write`,
which clears the bars, prints and draws them again (the Trainer's own log lines go the same way);
with no bar live it is printed as it is. Lines go to stderr, beside the bars; the report and the
summary to stdout.
"""

from __future__ import annotations

import io
import re
import sys
import textwrap
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console

from vlmdoctor.report.text import SafeConsole, esc, plain

WIDTH = 80


def live_bars() -> bool:
    """Is a tqdm bar drawn on the terminal now? (disabled bars leave tqdm's set of instances)"""
    std = sys.modules.get("tqdm.std")
    bars = getattr(getattr(std, "tqdm", None), "_instances", None)
    return bool(bars) and any(not getattr(b, "disable", False) for b in list(bars))


def emit(render: Callable[[Console], None], file: TextIO | None = None) -> None:
    """A block of rich text (a line, the report, the summary), 80 columns, around any live tqdm bar."""
    stream = file or sys.stdout
    if not live_bars():
        render(SafeConsole(file=stream, width=WIDTH, highlight=False))  # text from the run is shown as text
        return
    from tqdm import tqdm

    buf = io.StringIO()
    isatty = getattr(stream, "isatty", None)
    render(SafeConsole(file=buf, width=WIDTH, highlight=False, force_terminal=bool(isatty and isatty())))
    tqdm.write(buf.getvalue().rstrip("\n"), file=stream)


def say(line: str, file: TextIO | None = None) -> None:
    """One `vlmdoctor: ...` line on stderr (text from the run is printed as text, never as markup).

    Wrapped at spaces to 80 columns; a path longer than a line is left whole, for copy and paste."""
    text = wrap(f"vlmdoctor: {line}")
    emit(lambda c: c.print(esc(text).replace("vlmdoctor:", "[bold]vlmdoctor:[/bold]", 1), **WHOLE), file or sys.stderr)


#: print as wrapped by `wrap`: rich neither folds nor crops what is longer than the width
WHOLE: dict[str, Any] = {"overflow": "ignore", "crop": False}


def wrap(text: str, indent: str = "") -> str:
    """80 columns, broken at spaces only: a long path or word stays whole on its own line. Control characters
    are made visible first (console.plain), so that a tab or a form feed in a path is neither a break nor
    turned into a space."""
    return textwrap.fill(plain(text), WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


# --- the lines -------------------------------------------------------------------------------------


def _steps(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def plan_line(what: str, warmup: int, steps: int, trace_steps: int, offset: int, out: str) -> str:
    """Where each window falls, said once as measuring starts (steps as the user counts them)."""
    w, s = offset + warmup, offset + warmup + steps
    parts = [f"warm-up {_steps(offset + 1, w)}" if warmup else "no warm-up", f"timed {_steps(w + 1, s)}"]
    if trace_steps:
        parts.append(f"traced {_steps(s + 1, s + 2 + trace_steps)}")
    return f"measuring {what}: " + ", ".join(parts) + f"; report to {out}"


def timed_start_line(last_warmup: int, asked: int, offset: int, steps: int) -> str:
    extended = last_warmup - asked
    head = (
        f"warm-up done at step {offset + last_warmup}"
        + (f" (extended by {extended} step(s) until its last steps agreed)" if extended else "")
        if last_warmup
        else "no warm-up"
    )
    first = offset + last_warmup + 1
    return f"{head}; timed window: {_steps(first, first + steps - 1)}"


def timed_done_line(window: dict[str, Any], last: int, offset: int, trace_steps: int, rank: int | None = None) -> str:
    """The timed window's headline with its spread (the one estimator), and where the traced window falls.
    `rank`: one rank of several, whose own numbers these are (the report's headline is the job's)."""
    from vlmdoctor.run import throughput

    first = offset + last - window["steps"] + 1
    tps = window.get("real_tokens_per_s")
    est = throughput.window_stats(window["step_ms"], window.get("step_real_tokens") if tps else None)
    spread = throughput.spread_text(est)
    numbers = (
        (f"{tps:,.0f} real tokens/s" + (f" ({spread})" if spread else "") + ", ") if tps is not None else ""
    ) + f"{est['step_ms']:,.1f} ms/step"
    if rank is not None:
        numbers = f"rank {rank} alone {numbers} (the job's numbers come with the report)"
    line = f"timed window done ({_steps(first, offset + last)}): {numbers}"
    if trace_steps:
        s = offset + last
        line += f"; traced window: {_steps(s + 1, s + 2 + trace_steps)} (torch.profiler, slower)"
    return line


def traced_done_line(last: int, offset: int, trace_path: str | None) -> str:
    where = f": {trace_path}" if trace_path else " (no trace file was written)"
    return f"traced window done at step {offset + last}{where}; analyzing"


def fit_hint(ran: int, warmup: int, steps: int, trace_steps: int, flags: bool, offset: int = 0) -> str:
    """A run shorter than its windows: which warm-up and timed steps would fit the steps it had.

    `ran` counts the steps vlmdoctor saw (with `vlmdoctor run` the first optimizer step is not one:
    `offset` 1). The warm-up may grow while its last steps disagree (by up to its own length, from 3
    steps on), so the hint keeps room for that or proposes a warm-up of 2, which does not grow.
    """
    from vlmdoctor.run.throughput import MIN_STEPS, SETTLE_STEPS

    def name(k: str) -> str:
        return f"--{k.replace('_', '-')} " if flags else f"{k}="

    def grow(w: int) -> int:
        return min(20, w) if w >= SETTLE_STEPS else 0

    t = min(trace_steps, 2)
    budget = ran - (2 + t if t else 0)
    asked = f"{warmup} warm-up + {steps} timed" + (f" + {2 + trace_steps} traced" if trace_steps else "")
    head = f"the run had {ran + offset} step(s), fewer than the windows need ({asked}"
    head += f", and up to {grow(warmup)} more while the warm-up settles)" if grow(warmup) else ")"
    w = warmup if budget - warmup - grow(warmup) >= MIN_STEPS else min(warmup, 2)
    s = min(steps, budget - w - grow(w))
    if s < 2:
        least = 2 + 2 + (2 + t if t else 0) + offset
        return f"{head}: train at least {least} steps, or more, for a diagnosis"
    fits = f"{name('warmup')}{w} {name('steps')}{s}" + (f" {name('trace_steps')}{t}" if trace_steps else "")
    return f"{head}: to fit, use {fits} (or train longer)"


class TreatProgress:
    """`treat`'s progress messages as lines one can follow. Two counters say "round": a treatment's rounds
    (each composes the fixes once) and, inside each, the paired runs that decide it (doctor/decide.py). Here a
    treatment's round keeps its number and each paired run is said as a pair of that round, indented:

        round 1: compile (5 changes)
          round 1, pair 1: current
          round 1, pair 1: compile
    """

    _ROUND = re.compile(r"round (\d+): (.*)", re.S)

    def __init__(self) -> None:
        self.phase = "start"

    def __call__(self, message: str) -> str:
        m = self._ROUND.fullmatch(message)
        if message.startswith("ablation of"):
            self.phase = "ablation"
        elif m and (m.group(2).startswith("sizing ") or re.search(r"\(\d+ changes?\)", m.group(2))):
            self.phase = f"round {m.group(1)}"
        elif m:  # a paired run inside the phase
            return f"  {self.phase}, pair {m.group(1)}: {m.group(2)}"
        return message
