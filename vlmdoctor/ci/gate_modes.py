"""The three modes of `vlmdoctor gate`, and its verdict's files.

- judge a report against the baseline (`judged`): a stored `--current`, or the baseline's config profiled now
  (ci/gate.py `run_current`);
- judge paired runs of both sides, measured now and alternating (`--remeasure-baseline`: `Paired`, `remeasured`);
- replace the baseline on purpose (`--update-baseline`: `replace_baseline`).

The thresholds (`Limits`) are the command line's, else the project's [tool.vlmdoctor] table's, else
doctor/settings.py's. The verdict itself and its statistics are ci/gate.py's, called through the module (so that
`gate.remeasure` is looked up when it runs).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vlmdoctor.ci import gate
from vlmdoctor.doctor.decide import MIN_PAIRS
from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.doctor.settings import ALPHA, FAIL_ON, MAX_MEMORY_GROWTH, MAX_REGRESSION
from vlmdoctor.errors import UsageError, VlmdoctorError
from vlmdoctor.files import append_text, check_inputs_kept, check_writable, json_text, save, save_json
from vlmdoctor.inputs import check_number
from vlmdoctor.report.compare import model_differences

#: a line for the user (a warning: the step summary skipped)
Say = Callable[[str], None]


@dataclass
class Limits:
    """What fails the gate: a real tokens/s drop (also significant at `alpha`), peak memory growth, a new finding
    of this severity or above."""

    max_regression: float = MAX_REGRESSION
    alpha: float = ALPHA
    max_memory_growth: float = MAX_MEMORY_GROWTH
    fail_on: str = FAIL_ON

    @classmethod
    def resolve(
        cls,
        settings: dict[str, Any],
        max_regression: float | None,
        alpha: float,
        max_memory_growth: float | None,
        fail_on: str | None,
    ) -> Limits:
        """Each threshold from the command line (None: not given), else the [tool.vlmdoctor] table, else the
        default; each checked."""
        limits = cls(
            settings.get("max-regression", MAX_REGRESSION) if max_regression is None else max_regression,
            alpha,
            settings.get("max-memory-growth", MAX_MEMORY_GROWTH) if max_memory_growth is None else max_memory_growth,
            fail_on or settings.get("fail-on", FAIL_ON),
        )
        check_number("--max-regression", limits.max_regression, minimum=0, below=1)
        check_number("--alpha", limits.alpha, above=0, below=1)
        check_number("--max-memory-growth", limits.max_memory_growth, minimum=0, maximum=100)
        if limits.fail_on not in SEVERITIES:
            raise UsageError(f"--fail-on {limits.fail_on!r} is not valid; choose one of: {', '.join(SEVERITIES)}")
        return limits


def step_summary(inputs: dict[str, Any], warn: Say) -> str | None:
    """$GITHUB_STEP_SUMMARY, where the verdict is appended as Markdown; None (said once) when it is unset, an input,
    or not a regular file to append to: a step summary never costs the verdict."""
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary:
        try:
            check_inputs_kept(inputs, {"GITHUB_STEP_SUMMARY": summary})
            check_writable(summary, True, "GITHUB_STEP_SUMMARY")
        except VlmdoctorError as e:
            warn(f"{e.message}; the step summary is skipped")
            return None
    return summary


@dataclass
class Paired:
    """`--remeasure-baseline`: how the paired runs of both sides are made (the defaults are the command line's)."""

    baseline_python: str | None
    baseline_cwd: str | None
    max_pairs: int
    extend_pairs: int | None
    cpu_threads: int
    timeout: float | None
    baseline_env: dict[str, str] = field(default_factory=dict)
    current_command: list[str] | None = None

    @classmethod
    def from_flags(
        cls,
        current: str | None,
        update_baseline: bool,
        baseline_env: list[str] | None,
        current_command: str | None,
        **given: Any,
    ) -> Paired:
        """The command line's options of the paired runs, checked (`given`: the fields taken as they are)."""
        if current or update_baseline:
            raise UsageError("--remeasure-baseline measures both sides now; it takes no --current or --update-baseline")
        paired = cls(**given)
        if paired.max_pairs < MIN_PAIRS:
            raise UsageError(f"--max-pairs must be at least {MIN_PAIRS}")
        if paired.extend_pairs is not None:
            check_number("--extend-pairs", paired.extend_pairs, minimum=0, maximum=1000, integer=True)
        check_number("--cpu-threads", paired.cpu_threads, minimum=0, maximum=4096)
        for item in baseline_env or []:
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise UsageError(f"--baseline-env {item!r}: expected KEY=VALUE")
            paired.baseline_env[key] = value
        if current_command is not None:
            try:
                paired.current_command = shlex.split(current_command)
            except ValueError as e:
                raise UsageError(f"--current-command {current_command!r}: {e}") from None
            if not paired.current_command:
                raise UsageError("--current-command is empty")
        return paired


def remeasured(
    base: dict[str, Any],
    paired: Paired,
    limits: Limits,
    allow_env_change: bool,
    selection: Any,
    launcher: Any,
    notify: Say,
) -> dict[str, Any]:
    """The verdict on paired runs of the baseline's config (or recorded command) and the current side.

    `launcher` is `vlmdoctor.own.launch`, for a baseline recorded by `vlmdoctor run` (a way in: the command passes it,
    since the gate sits upstream of the ways in)."""
    result = gate.remeasure(
        base,
        paired.baseline_python,
        paired.baseline_env or None,
        paired.timeout,
        cpu_threads=paired.cpu_threads,
        baseline_cwd=paired.baseline_cwd,
        current_command=paired.current_command,
        launcher=launcher,
        max_regression=limits.max_regression,
        max_pairs=paired.max_pairs,
        extend_pairs=paired.extend_pairs,
        max_memory_growth=limits.max_memory_growth,
        fail_on=limits.fail_on,
        allow_env_change=allow_env_change,
        notify=notify,
        selection=selection,
    )
    result.pop("reports", None)
    return result


def judged(
    base: dict[str, Any], cur: dict[str, Any], limits: Limits, allow_env_change: bool, selection: Any
) -> dict[str, Any]:
    """The verdict on a current report: refused when it measures something else, else every check."""
    notes = gate.check_comparable(base, cur, allow_env_change)
    return gate.gate(
        base, cur, limits.max_regression, limits.alpha, limits.max_memory_growth, limits.fail_on, notes, selection
    )


def replace_baseline(base: dict[str, Any], cur: dict[str, Any], baseline: str, force: bool) -> str | None:
    """--update-baseline: the current report written over the baseline file; refused when it measures another model
    or stage, unless forced. Returns what failed to write (None: written)."""
    diffs = model_differences(base, cur)
    if diffs and not force:
        raise UsageError(
            f"the current report measures something else than the baseline ({'; '.join(diffs)}); "
            "pass --force to replace the baseline anyway"
        )
    return save(baseline, json_text(cur), "new baseline")


def write_outputs(
    result: dict[str, Any], junit: str | None, json_path: str | None, summary: str | None, warn: Say
) -> list[str | None]:
    """The verdict's files, before anything is printed (what the console shows can never cost them): the step
    summary (its failure only said), JUnit XML, JSON. Returns what failed to write."""
    failures = []
    if summary:
        try:
            append_text(summary, gate.markdown(result) + "\n")
        except VlmdoctorError as e:
            warn(f"{e.message}; the step summary is skipped")
    if junit:
        failures.append(save(junit, gate.junit_xml(result), "JUnit XML"))
    failures.append(save_json(result, json_path, "verdict JSON"))
    return failures
