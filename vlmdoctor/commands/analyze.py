"""`vlmdoctor analyze`: read anyone's torch.profiler trace, print what the GPU did, why it waited, and what to
change. The facts are trace/facts.py's, the diagnosis doctor/analysis.py's; here: the options, checks and outputs."""

from __future__ import annotations

from typing import Annotated

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import err, exit_if_failed, out, user_errors
from vlmdoctor.commands.knobs import run_command
from vlmdoctor.commands.options import HtmlOut, Ignore, RulesDirs, Select, Verbose, rule_choice
from vlmdoctor.errors import UsageError
from vlmdoctor.files import check_distinct, check_inputs_kept, check_writable, save, save_json
from vlmdoctor.inputs import check_rules_dirs
from vlmdoctor.report.console import render_analysis
from vlmdoctor.run.zoo import presets

Trace = Annotated[str, typer.Argument(help="a torch.profiler trace (.json, .json.gz) or a folder of per-rank traces")]
Stage = Annotated[int | None, typer.Option("--stage", help="training stage, when the trace does not say (1 or 2)")]
Model = Annotated[str | None, typer.Option("--model", help="model preset, when the trace does not say")]
JsonOut = options.json_out("facts and prescriptions")
Force = options.force("overwrite an existing --json or --html file")
Quiet = options.quiet("print nothing but errors (with --json or --html)", short=True)


def analyze(
    path: Trace,
    stage: Stage = None,
    model: Model = None,
    json_path: JsonOut = None,
    html_path: HtmlOut = None,
    force: Force = False,
    rules_dirs: RulesDirs = None,
    select: Select = None,
    ignore: Ignore = None,
    verbose: Verbose = False,
    quiet: Quiet = False,
) -> None:
    """Read a torch.profiler trace (anyone's), print what the GPU did, why it waited, and what to change."""
    from vlmdoctor.doctor.analysis import diagnosed  # deferred: pandas
    from vlmdoctor.trace.facts import analyze as run_analysis  # deferred: pandas

    with user_errors():
        if stage is not None and stage not in (1, 2):
            raise UsageError("--stage must be 1 or 2")
        if model is not None and model not in presets():
            raise UsageError(f"unknown model preset {model!r}; valid presets: {', '.join(presets())}")
        check_distinct(json=json_path, html=html_path)
        check_writable(json_path, force, "--json")
        check_writable(html_path, force, "--html")
        check_rules_dirs(rules_dirs or [])
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
        check_inputs_kept(
            {"the trace": path, "a --rules folder": rules_dirs}, {"--json": json_path, "--html": html_path}
        )
        with err.status("reading the trace"):
            result = run_analysis(path, stage, model)
        doc = diagnosed(result, rules_dirs, selection)
        failures = []
        failures.append(save_json(doc, json_path, "analysis JSON"))
        if html_path:
            from vlmdoctor.report.html import analyze_html  # deferred: the HTML builder; keeps --help fast

            failures.append(save(html_path, analyze_html(doc), "HTML report"))
        if json_path != "-" and not quiet:
            written = [p for p, failed in ((json_path, failures[0]), (html_path, failures[-1])) if p and not failed]
            render_analysis(doc, out, verbose, run_command, written)
        exit_if_failed(failures)


def register(app: typer.Typer) -> None:
    app.command()(analyze)
