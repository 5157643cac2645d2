"""`vlmdoctor run -- python train.py ARGS`: doctor the user's own training script, unchanged. The script is started,
watched and measured by launch.py; here: the options (the measured window's defaults are window.py's)."""

from __future__ import annotations

from typing import Annotated

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import user_errors
from vlmdoctor.commands.options import HtmlOut, Ignore, RulesDirs, Select, Steps, Verbose, Warmup, rule_choice
from vlmdoctor.files import write_json
from vlmdoctor.window import OUT, STEPS, TRACE_STEPS, WARMUP

Command = Annotated[list[str], typer.Argument(help="the training command, after --: python train.py ARGS")]
OutDir = Annotated[str, typer.Option("--out", help="folder for report.json, trace/ and script.log")]
TraceSteps = options.trace_steps("steps traced with torch.profiler after the timed ones")
StopAfterWindow = Annotated[
    bool,
    typer.Option(
        "--stop-after-window",
        help="stop the script once the windows are measured, instead of letting it train on",
    ),
]
Stage = Annotated[int | None, typer.Option("--stage", help="1 or 2, when the estimate from the frozen parts is wrong")]
JsonAlso = options.json_also("also write the report JSON here ('-' for stdout)")
Force = options.force("overwrite a report already in --out, --json or --html")
Quiet = options.quiet("no metrics and prescriptions on the console")


def run(
    command: Command,
    out_dir: OutDir = OUT,
    warmup: Warmup = WARMUP,
    steps: Steps = STEPS,
    trace_steps: TraceSteps = TRACE_STEPS,
    stop_after_window: StopAfterWindow = False,
    stage: Stage = None,
    json_path: JsonAlso = None,
    html_path: HtmlOut = None,
    rules_dirs: RulesDirs = None,
    select: Select = None,
    ignore: Ignore = None,
    force: Force = False,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Doctor your own training script, unchanged: vlmdoctor run -- python train.py ARGS.

    Each optimizer step is a training step. The script's output goes to the terminal and to
    OUT/script.log; the report to OUT/report.json. A failing script's own exit code is passed on (3 when it ran out of
    memory); exit 1 when it never steps. The report prints one screen (the numbers, where the step went, the
    prescriptions with the lines to change); --verbose prints every table.
    """
    from vlmdoctor.own.launch import run_script  # deferred: the command's own module

    with user_errors():
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
        code, report = run_script(
            command,
            out_dir,
            warmup,
            steps,
            trace_steps,
            stop_after_window,
            stage,
            json_path,
            rules_dirs,
            force,
            quiet,
            html_path,
            selection=selection,
            verbose=verbose,
        )
        if json_path == "-" and report is not None:
            write_json(report, "-")
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command(context_settings={"allow_interspersed_args": False})(run)
