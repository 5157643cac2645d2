"""`vlmdoctor profile`: run real training steps of a VLM from its run config, measure them, trace a short window
and prescribe. The run is run/job.py's (one process, or torchrun ranks with the one-GPU reference), the diagnosis
doctor/diagnosis.py's; here: the options, the checks before any measurement, the files and the console."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import describe_error, err, out, user_errors
from vlmdoctor.commands.knobs import knob_options, run_command
from vlmdoctor.commands.options import (
    HtmlOut,
    Ignore,
    MasterAddr,
    MasterPort,
    MeasureOneGpu,
    Nnodes,
    NodeRank,
    OneGpuReport,
    RdzvBackend,
    RdzvEndpoint,
    RdzvId,
    RulesDirs,
    Select,
    Verbose,
    hush_profiler,
    rule_choice,
)
from vlmdoctor.errors import EXIT_FAILED_RUN
from vlmdoctor.files import (
    check_distinct,
    check_inputs_kept,
    check_output_dir,
    check_writable,
    json_text,
    rescue,
    save,
    save_json,
    write_text,
)
from vlmdoctor.inputs import check_number, check_rules_dirs
from vlmdoctor.report.console import esc, render_profile
from vlmdoctor.run.config import NNODES, RunConfig, panel
from vlmdoctor.supervise import check_room, describe_interruption, interrupted_exit_code
from vlmdoctor.window import MAX_TRACE_STEPS, TRACE_STEPS

# Deferred on purpose, inside the functions that run them, so that `--help` loads none of them: the runner, capture,
# distributed and job modules (torch); the diagnosis (pandas, through trace/tables.py); the HTML page; rich's
# progress bar.

Liger = Annotated[
    bool | None,
    typer.Option(
        "--liger",
        help="shorthand: Liger rope + rms_norm + swiglu (FusedCE stays as set)",
        rich_help_panel=panel("liger_rope"),
        show_default=False,
    ),
]
Diagnose = Annotated[
    bool,
    typer.Option(
        "--diagnose/--no-diagnose",
        help="trace a short window and prescribe "
        "fixes (the trace goes to a temporary folder unless --trace-dir is given)",
    ),
]
TraceDir = Annotated[
    str | None,
    typer.Option(
        "--trace-dir",
        help="after the timed steps, trace a separate window with torch.profiler and write gzipped Chrome JSON here",
        rich_help_panel="trace",
    ),
]
TraceSteps = options.trace_steps("active steps in the traced window", panel="trace")
TraceShapes = Annotated[
    bool,
    typer.Option(
        "--trace-shapes/--no-trace-shapes",
        help="record input shapes (shape churn, logits size)",
        rich_help_panel="trace",
    ),
]
TraceStack = Annotated[
    bool, typer.Option("--trace-stack", help="record Python stacks (much bigger)", rich_help_panel="trace")
]
TraceMemory = Annotated[
    bool | None,
    typer.Option(
        "--trace-memory/--no-trace-memory",
        help="record allocations (default: on a GPU, where the memory wall's facts need them)",
        rich_help_panel="trace",
        show_default=False,
    ),
]
Config = Annotated[
    str | None, typer.Option("--config", help="run config YAML/JSON (or a report JSON); flags override it")
]
SaveConfig = Annotated[str | None, typer.Option("--save-config", help="write the resolved run config (YAML/JSON)")]
JsonOut = options.json_out("report")
Force = options.force("overwrite existing output files")
Quiet = options.quiet("no progress and no table")


@knob_options()
def profile(
    liger: Liger = None,
    nnodes: Nnodes = NNODES,
    node_rank: NodeRank = None,
    rdzv_backend: RdzvBackend = None,
    rdzv_endpoint: RdzvEndpoint = None,
    rdzv_id: RdzvId = None,
    master_addr: MasterAddr = None,
    master_port: MasterPort = None,
    one_gpu_report: OneGpuReport = None,
    measure_one_gpu: MeasureOneGpu = False,
    diagnose_run: Diagnose = True,
    rules_dirs: RulesDirs = None,
    select: Select = None,
    ignore: Ignore = None,
    trace_dir: TraceDir = None,
    trace_steps: TraceSteps = TRACE_STEPS,
    trace_shapes: TraceShapes = True,
    trace_stack: TraceStack = False,
    trace_memory: TraceMemory = None,
    config: Config = None,
    json_path: JsonOut = None,
    html_path: HtmlOut = None,
    save_config: SaveConfig = None,
    force: Force = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
    **knobs: Any,
) -> None:
    """Run real training steps of a VLM and measure them.

    Runs on the GPU when there is one; `--model tiny --device cpu` runs anywhere. Prints one screen: the numbers,
    where the step went and the prescriptions with their fix; --verbose prints every table.
    """
    from vlmdoctor.run.capture import TraceOptions  # deferred: torch

    trace = TraceOptions(trace_dir, trace_steps, trace_shapes, trace_stack, trace_memory) if trace_dir else None
    if trace is None and diagnose_run:  # a short traced window into a temporary folder, removed after analysis
        trace = TraceOptions("", trace_steps, trace_shapes, trace_stack, trace_memory, keep=False)
    overrides = {k: v for k, v in knobs.items() if v is not None}
    if liger is not None:
        for k in ("liger_rope", "liger_rms_norm", "liger_swiglu"):
            overrides.setdefault(k, liger)
    with user_errors():
        check_number("--trace-steps", trace_steps, minimum=1, maximum=MAX_TRACE_STEPS, integer=True)
        from vlmdoctor.run.distributed import Rendezvous  # deferred: torch
        from vlmdoctor.run.job import Launch  # deferred: torch

        rdzv = Rendezvous(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id, master_addr, master_port)
        launch = Launch(rdzv, one_gpu_report, measure_one_gpu)
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
        if quiet:
            hush_profiler()
        _profile(
            overrides,
            config,
            json_path,
            save_config,
            force,
            quiet,
            trace,
            rules_dirs,
            html_path,
            launch,
            selection=selection,
            verbose=verbose,
        )


def _run_config(config: str | None, overrides: dict[str, Any]) -> RunConfig:
    """The command line's knobs over a config file's; what a file's knob only qualified, now off, is said once."""
    if not config:
        return RunConfig().replace(source="command line", **overrides)
    notes: list[str] = []
    cfg = RunConfig.load(config, overrides, notes)
    for note in notes:
        err.print(f"note: {esc(note)}", highlight=False)
    return cfg


def _check_profile_outputs(
    cfg: RunConfig,
    config: str | None,
    json_path: str | None,
    save_config: str | None,
    html_path: str | None,
    force: bool,
    trace: Any,
    rules_dirs: list[str] | None,
    launch: Any,
) -> None:
    """Every output of `profile`, checked before any measurement: a bad path must not cost the run, and no
    output may replace a file the run reads."""
    check_distinct(json=json_path, save_config=save_config, html=html_path)
    check_writable(json_path, force, "--json")
    check_writable(save_config, force, "--save-config")
    check_writable(html_path, force, "--html")
    if trace is not None and trace.keep:
        check_output_dir(trace.trace_dir, "--trace-dir")
        check_room(trace.trace_dir, "--trace-dir")  # a full disk found now, not after the measurement
    check_inputs_kept(
        {
            "the --config": config,
            "the --data file": None if cfg.data == "synthetic" else cfg.data,
            "the --tokenizer folder": cfg.tokenizer,
            "the --one-gpu-report": launch.one_gpu_report if launch is not None else None,
            "a --rules folder": rules_dirs,
        },
        {"--json": json_path, "--html": html_path, "--save-config": save_config},
    )


def _kept_elsewhere(report: dict[str, Any], json_path: str | None) -> str:
    """Where the report is when the HTML page failed: the --json file, else a rescue file (cwd, then temp)."""
    if json_path and json_path != "-":
        return f"the report is in {json_path}"
    try:
        return f"the report was saved to {rescue('report.json', json_text(report).encode())}"
    except OSError:
        return "the report could not be saved anywhere"


def _with_progress(measure: Any, quiet: bool) -> dict[str, Any]:
    """`measure()`, with a progress bar on stderr unless quiet."""
    if quiet:
        return measure()
    # deferred: only a run that measures draws a bar; keeps --help fast
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        tasks: dict[str, Any] = {}

        def progress(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
            bar.update(tasks[phase], completed=done)

        return measure(progress)


def _diagnose_kept(report: dict[str, Any], rules_dirs: list[str] | None, selection: Any) -> KeyboardInterrupt | None:
    """Diagnose a measured report in place; the measurement is kept whatever the diagnosis does (an
    interruption is returned, for the caller to end with once the report is written)."""
    from vlmdoctor.doctor.diagnosis import examine  # deferred: pandas

    try:
        examine(report, rules_dirs or [], selection=selection)
    except KeyboardInterrupt as e:
        report["diagnosis_error"] = "interrupted before the diagnosis finished"
        return e
    except Exception as e:
        message, _ = describe_error(e)
        report["diagnosis_error"] = message
        err.print(
            f"[yellow]warning:[/yellow] the diagnosis failed, the measurement is kept: {esc(message)}",
            highlight=False,
        )
    return None


def _profile(
    overrides: dict[str, Any],
    config: str | None,
    json_path: str | None,
    save_config: str | None,
    force: bool,
    quiet: bool,
    trace: Any = None,
    rules_dirs: list[str] | None = None,
    html_path: str | None = None,
    launch: Any = None,
    selection: Any = None,
    verbose: bool = False,
) -> None:
    """Check everything, measure, diagnose, write and show; exit with the run's code."""
    from vlmdoctor.doctor.diagnosis import remove_temporary_trace  # deferred: pandas
    from vlmdoctor.run import job  # deferred: torch
    from vlmdoctor.run.runner import check  # deferred: torch

    cfg = _run_config(config, overrides)
    _check_profile_outputs(cfg, config, json_path, save_config, html_path, force, trace, rules_dirs, launch)
    check_rules_dirs(rules_dirs or [])
    check(cfg)  # refuse before any progress display opens
    launch = launch or job.Launch()
    job.check(cfg, launch)
    if launch.one_gpu_report:
        from vlmdoctor.ci.gate import load_report  # deferred: the gate's reader of reports; keeps --help fast

        job.take_reference(cfg, launch, load_report(launch.one_gpu_report))
    if save_config:
        write_text(save_config, cfg.dump_text(save_config))
    report: dict[str, Any] = {}
    interrupted: KeyboardInterrupt | None = None
    try:
        try:
            report = _with_progress(lambda progress=None: job.measure(cfg, trace, launch, progress), quiet)
        except KeyboardInterrupt as e:  # after the timed windows the runner hands back what they measured
            if getattr(e, "report", None) is None:
                raise
            interrupted, report = e, e.report  # type: ignore[attr-defined]
        if interrupted is None:
            interrupted = _diagnose_kept(report, rules_dirs, selection)
    finally:
        remove_temporary_trace(report)
    failures, written = _write(report, json_path, html_path, trace)
    _finish(report, failures, interrupted, quiet, json_path, verbose, written)


def _write(
    report: dict[str, Any], json_path: str | None, html_path: str | None, trace: Any
) -> tuple[list[str], list[str]]:
    """The report's files (--json, --html), each failure kept as a line; a --trace-dir trace that was lost, said.
    Returns (the failures, the files written)."""
    failures = [save_json(report, json_path, "report")]
    written = [json_path] if json_path and json_path != "-" and not failures[0] else []
    if html_path:
        from vlmdoctor.report.html import profile_html  # deferred: the HTML builder; keeps --help fast

        try:
            page = profile_html(report)
        except Exception as e:  # a page that cannot be drawn must not cost the measurement
            failures.append(
                f"cannot draw the HTML report ({describe_error(e)[0]}); {_kept_elsewhere(report, json_path)}"
            )
        else:
            failures.append(save(html_path, page, "HTML report"))
            written += [] if failures[-1] else [html_path]
    lost = (report.get("trace") or {}).get("lost")
    if lost and trace is not None and trace.keep:  # the --trace-dir asked for is not there; the measurement is
        from vlmdoctor.run.capture import lost_note  # deferred: torch

        failures.append(lost_note(lost))
    return [f for f in failures if f], written


def _finish(
    report: dict[str, Any],
    failures: list[str],
    interrupted: KeyboardInterrupt | None,
    quiet: bool,
    json_path: str | None,
    verbose: bool = False,
    written: list[str] | None = None,
) -> None:
    """The console's report (one screen, or every table when verbose), the errors, and the exit code: the run's,
    else 1 for a lost file."""
    from vlmdoctor.run.runner import exit_code  # deferred: torch

    if not quiet and json_path != "-":
        render_profile(report, out, verbose, lambda patch: run_command(report["config"], patch), written)
    code = exit_code(report)
    if code and (quiet or json_path == "-"):  # a failed run always says so, even when nothing else is printed
        why = (report.get("error") or {}).get("message") or report.get("status")
        err.print(
            f"[bold red]error:[/bold red] the run ended with status {esc(report.get('status'))}: {esc(why)}",
            highlight=False,
        )
    for f in failures:
        err.print(f"[bold red]error:[/bold red] {esc(f)}", highlight=False)
    if interrupted is not None:  # what the timed windows measured was written above
        err.print(f"{describe_interruption(interrupted)}; the measured numbers are kept", highlight=False, markup=False)
        raise typer.Exit(interrupted_exit_code(interrupted))
    raise typer.Exit(code or (EXIT_FAILED_RUN if failures else 0))


def register(app: typer.Typer) -> None:
    app.command()(profile)
