"""`vlmdoctor gate`: fail CI when training got slower than the baseline, beyond the noise. Its three modes are
ci/gate_modes.py's, the verdict and its statistics ci/gate.py's; here: the options (the thresholds' defaults are
doctor/settings.py's), the checks of the files, the verdict's table."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from vlmdoctor import supervise
from vlmdoctor.commands import options
from vlmdoctor.commands.app import err, exit_if_failed, out, user_errors
from vlmdoctor.commands.options import Ignore, Select, Timeout, rule_choice
from vlmdoctor.doctor.decide import MIN_PAIRS
from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.doctor.settings import ALPHA, CPU_THREADS, FAIL_ON, MAX_MEMORY_GROWTH, MAX_PAIRS, MAX_REGRESSION
from vlmdoctor.files import check_distinct, check_inputs_kept, check_writable
from vlmdoctor.report.console import esc
from vlmdoctor.supervise import RUN_TIMEOUT_S

Baseline = Annotated[str, typer.Option("--baseline", help="the baseline report JSON (kept in the repository)")]
Current = Annotated[
    str | None,
    typer.Option(
        "--current",
        help="the report to judge; without it, the baseline's config is profiled now, in a fresh process",
    ),
]
MaxRegression = Annotated[
    float | None,
    typer.Option(
        "--max-regression",
        help=f"fail on a real tokens/s drop larger than this ({MAX_REGRESSION} = {MAX_REGRESSION:.0%}) that is also "
        f"significant [default: [tool.vlmdoctor] max-regression, else {MAX_REGRESSION}]",
        show_default=False,
    ),
]
Alpha = Annotated[
    float, typer.Option("--alpha", help="significance level of the Mann-Whitney U test on per-step throughput")
]
MaxMemoryGrowth = Annotated[
    float | None,
    typer.Option(
        "--max-memory-growth",
        help="fail when peak memory grew more "
        f"[default: [tool.vlmdoctor] max-memory-growth, else {MAX_MEMORY_GROWTH:.2f}]",
        show_default=False,
    ),
]
FailOn = Annotated[
    str | None,
    typer.Option(
        "--fail-on",
        help=f"fail on a new finding of this severity or above ({', '.join(SEVERITIES)}); muted findings never fail "
        f"[default: [tool.vlmdoctor] fail-on, else {FAIL_ON}]",
        show_default=False,
    ),
]
AllowEnvChange = Annotated[
    bool,
    typer.Option(
        "--allow-env-change",
        help="compare across GPU models too (torch, "
        "transformers, liger-kernel and driver changes are always compared, "
        "and named)",
    ),
]
RemeasureBaseline = Annotated[
    bool,
    typer.Option(
        "--remeasure-baseline",
        help="measure the baseline's config again "
        "in this job, alternating with the current run in fresh processes, and "
        "judge on the paired ratios instead of the stored numbers",
    ),
]
BaselinePython = Annotated[
    str | None,
    typer.Option(
        "--baseline-python",
        help="with --remeasure-baseline: the Python interpreter of the baseline's install (another code version)",
    ),
]
BaselineEnv = Annotated[
    list[str] | None,
    typer.Option(
        "--baseline-env",
        help="with --remeasure-baseline: KEY=VALUE for the baseline's runs, e.g. PYTHONPATH=old/checkout (repeatable)",
    ),
]
BaselineCwd = Annotated[
    str | None,
    typer.Option(
        "--baseline-cwd",
        help="with --remeasure-baseline of a `vlmdoctor run` baseline: the checkout of the baseline's code, "
        "where its recorded command runs",
    ),
]
CurrentCommand = Annotated[
    str | None,
    typer.Option(
        "--current-command",
        help="with --remeasure-baseline of a `vlmdoctor run` baseline: the current side's command, quoted, "
        "when it is not the recorded one (e.g. 'python train.py --new-flag')",
    ),
]
MaxPairs = Annotated[
    int,
    typer.Option(
        "--max-pairs",
        help=f"with --remeasure-baseline: paired runs at most ({MIN_PAIRS} at least; more only while undecided)",
    ),
]
ExtendPairs = Annotated[
    int | None,
    typer.Option(
        "--extend-pairs",
        help="with --remeasure-baseline: paired "
        "runs at most when, at --max-pairs, the ratio is below "
        "1 - --max-regression but not yet beyond the noise (default: "
        "2 x --max-pairs; --max-pairs or less: stop there)",
    ),
]
CpuThreads = Annotated[
    int,
    typer.Option(
        "--cpu-threads",
        help="with --remeasure-baseline on a CPU baseline: intra-op "
        "threads a side (0: torch's default); one keeps a shared host's load from "
        "stalling a side's parallel regions",
    ),
]
UpdateBaseline = Annotated[
    bool,
    typer.Option("--update-baseline", help="write the current report over the baseline, on purpose, and pass"),
]
Junit = Annotated[str | None, typer.Option("--junit", help="write JUnit XML here")]
JsonOut = options.json_out("verdict")
Force = options.force(
    "overwrite existing --junit/--json files; with --update-baseline, replace a baseline of another model or stage"
)


def gate(
    baseline: Baseline,
    current: Current = None,
    max_regression: MaxRegression = None,
    alpha: Alpha = ALPHA,
    max_memory_growth: MaxMemoryGrowth = None,
    fail_on: FailOn = None,
    select: Select = None,
    ignore: Ignore = None,
    allow_env_change: AllowEnvChange = False,
    remeasure_baseline: RemeasureBaseline = False,
    baseline_python: BaselinePython = None,
    baseline_env: BaselineEnv = None,
    baseline_cwd: BaselineCwd = None,
    current_command: CurrentCommand = None,
    max_pairs: MaxPairs = MAX_PAIRS,
    extend_pairs: ExtendPairs = None,
    cpu_threads: CpuThreads = CPU_THREADS,
    timeout: Timeout = RUN_TIMEOUT_S,
    update_baseline: UpdateBaseline = False,
    junit: Junit = None,
    json_path: JsonOut = None,
    force: Force = False,
) -> None:
    """Fail (exit 1) when training got slower than the baseline, beyond the noise; exit 2 on unusable input."""
    # deferred: the gate's own modules (its reader of reports, its statistics); keeps --help fast
    from vlmdoctor.ci import gate_modes as modes
    from vlmdoctor.ci.gate import load_report

    with user_errors():
        selection, _, settings = rule_choice(select, ignore, None)
        limits = modes.Limits.resolve(settings, max_regression, alpha, max_memory_growth, fail_on)
        inputs = {"the --baseline": baseline, "the --current": current}
        _check_files(inputs, junit, json_path, force, update_baseline, runs=remeasure_baseline or not current)
        summary = modes.step_summary(inputs, _warn)
        base = load_report(baseline)
        if remeasure_baseline:
            paired = modes.Paired.from_flags(
                current,
                update_baseline,
                baseline_env,
                current_command,
                baseline_python=baseline_python,
                baseline_cwd=baseline_cwd,
                max_pairs=max_pairs,
                extend_pairs=extend_pairs,
                cpu_threads=cpu_threads,
                timeout=timeout,
            )
            import vlmdoctor.own.launch as launcher  # deferred: only a `vlmdoctor run` baseline needs it

            with err.status("paired runs: baseline and current, alternating") as status:
                result = modes.remeasured(
                    base, paired, limits, allow_env_change, selection, launcher, lambda m: status.update(esc(m))
                )
        else:
            cur = _current(base, current, timeout)
            if update_baseline:
                exit_if_failed([modes.replace_baseline(base, cur, baseline, force)])
                (err if json_path == "-" else out).print(
                    f"baseline updated: {esc(baseline)} ({cur['metrics']['real_tokens_per_s']:,.0f} real tokens/s)",
                    highlight=False,
                )
                return
            result = modes.judged(base, cur, limits, allow_env_change, selection)
        failures = modes.write_outputs(result, junit, json_path, summary, _warn)  # the files first: what the
        _show(result, json_path)  # console shows can never cost the verdict's files
        exit_if_failed(failures)
        raise typer.Exit(0 if result["passed"] else 1)


def _warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {esc(message)}", highlight=False)


def _check_files(
    inputs: dict[str, str | None],
    junit: str | None,
    json_path: str | None,
    force: bool,
    update_baseline: bool,
    runs: bool,
) -> None:
    """The gate's files, before anything is read or run: no output replaces an input or another output; the
    baseline is written to only with --update-baseline; room in the temp folder when runs start."""
    baseline = inputs["the --baseline"] if update_baseline else None
    check_distinct(junit=junit, json=json_path, baseline=baseline)
    check_writable(junit, force, "--junit")
    check_writable(json_path, force, "--json")
    if baseline:
        check_writable(baseline, True, "--baseline")
    check_inputs_kept(inputs, {"--junit": junit, "--json": json_path})
    supervise.check_file_folders(junit=junit, json=json_path, baseline=baseline)
    if runs:  # runs start: their reports go to the temp folder first
        supervise.check_temp()


def _current(base: dict[str, Any], current: str | None, timeout: float) -> dict[str, Any]:
    """The report to judge: --current, else the baseline's config profiled now in a fresh process."""
    from vlmdoctor.ci.gate import load_report, run_current  # deferred: as in gate()

    if current:
        return load_report(current)
    with err.status("profiling the baseline's config"):
        return run_current(base, timeout=timeout)


def _show(result: dict[str, Any], json_path: str | None) -> None:
    """The verdict's table and notes on the console (stdout is the JSON's under --json -)."""
    if json_path == "-":
        return
    t = Table(title=f"vlmdoctor gate: {esc(result['summary'])}", header_style="bold")
    for col in ("check", "verdict", "detail"):
        t.add_column(col)
    for c in result["checks"]:
        t.add_row(esc(c["name"]), esc(c["verdict"]), esc(c["detail"]))
    out.print(t)
    for n in result.get("notes") or []:
        out.print(f"note: {esc(n)}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(gate)
