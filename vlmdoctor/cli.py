"""The `vlmdoctor` command line: thin over the Python API (config, runner, report)."""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

try:  # typer >= 0.20 carries its own copy of click; its exceptions are those, not click's
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_USAGE, VlmdoctorError
from vlmdoctor.report.console import SafeConsole, esc
from vlmdoctor.run.config import RunConfig, _base_type, fields_by_name, flag, override, panel

#: exceptions that end a command on purpose, with their own exit code
_EXITS = tuple({typer.Exit, SystemExit, *(getattr(m, "Exit", SystemExit) for m in (click_errors, typer))})
_ABORTS = tuple({getattr(m, "Abort", KeyboardInterrupt) for m in (click_errors, typer)})

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Profiler-driven diagnosis of vision-language-model training.",
)
err = SafeConsole(stderr=True, soft_wrap=True)  # soft wrap: an error stays one line
out = SafeConsole()  # text from inputs is shown as text (report/console.py)


def _version(value: bool) -> None:
    if value:
        from vlmdoctor import __version__

        out.print(f"vlmdoctor {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """Profiler-driven diagnosis of vision-language-model training."""


def _json_opt(what: str):
    return typer.Option(
        None,
        "--json",
        metavar="PATH|-",
        help=f"write the {what} as JSON to PATH ('-': standard output, and no table)",
    )


#: --select / --ignore, the same on every command that diagnoses (typer only reads these, so commands share them)
_SELECT = typer.Option(
    None,
    "--select",
    metavar="RULES",
    help="only these rules: ids (or globs: fusion-*), layers (1-5, precision ...) or severities (high, "
    "medium, low); comma-separated, repeatable; the others' findings are listed as muted",
)
_IGNORE = typer.Option(
    None,
    "--ignore",
    metavar="RULES",
    help="mute these rules (ids, globs, layers or severities; comma-separated, repeatable): "
    "their findings are listed as muted, never fail the gate",
)


def rule_choice(
    select: list[str] | None, ignore: list[str] | None, rules_dirs: list[str] | None
) -> tuple[Any, list[str], dict[str, Any]]:
    """(selection, rule folders, project settings): --select/--ignore/--rules over the nearest
    pyproject.toml's [tool.vlmdoctor] table, every token checked against the rules' ids (exit 2 with
    "did you mean" on a typo)."""
    from pathlib import Path

    from vlmdoctor.doctor.select import build_selection, split_tokens
    from vlmdoctor.doctor.settings import project_settings
    from vlmdoctor.inputs import check_rules_dirs

    settings = project_settings()
    check_rules_dirs(list(rules_dirs or []))
    for d in settings.get("rules", []):
        if not Path(d).is_dir():
            raise VlmdoctorError(f"{settings['_where']}: [tool.vlmdoctor] rules: {d} is not a folder")
    dirs = [*(rules_dirs or []), *settings.get("rules", [])]
    tokens = split_tokens(select) + split_tokens(ignore) + split_tokens(settings.get("select"))
    tokens += split_tokens(settings.get("ignore"))
    ids: list[str] = []
    if tokens:
        from vlmdoctor.doctor.rules import load_rules

        ids = [r.id for r in load_rules(*dirs)[0]]
    return build_selection(select, ignore, ids, settings), dirs, settings


def knob_flags() -> dict[str, tuple[str, str | None]]:
    """Each run-config knob's flag on `profile`, read from the typer app: (flag, its --no- form or None)."""
    import typer.main

    command = typer.main.get_command(app).commands["profile"]
    return {
        p.name: (p.opts[0], p.secondary_opts[0] if p.secondary_opts else None)
        for p in command.params
        if p.name in RunConfig.__dataclass_fields__ and p.opts
    }


def run_command(config: dict[str, Any], patch: dict[str, Any]) -> str:
    """The `vlmdoctor profile` command that runs `config` with `patch` applied, to paste into a shell.

    Model, stage and device always; other knobs only where they differ from the default; the
    patch's flags last, so the change stands at the end of the line.
    """
    import shlex

    flags = knob_flags()
    defaults = RunConfig().to_dict()
    parts = ["vlmdoctor", "profile"]
    patch = {k: v for k, v in patch.items() if config.get(k, defaults.get(k)) != v}  # a no-op knob needs no flag

    def add(knob: str, value: Any) -> None:
        if knob not in flags or value is None:
            return
        on, off = flags[knob]
        if isinstance(value, bool):
            if value or off:
                parts.append(on if value else off)
        else:
            parts.extend([on, shlex.quote(str(value))])

    for knob in ("model", "stage", "device"):
        if knob not in patch:
            add(knob, config.get(knob, defaults.get(knob)))
    for knob, value in config.items():
        if knob not in ("model", "stage", "device") and knob not in patch and value != defaults.get(knob):
            add(knob, value)
    for knob, value in patch.items():
        add(knob, value)
    return " ".join(parts)


PL = "torchrun launch"


def _knob_param(name: str, default: Any, panels: bool, note: str) -> inspect.Parameter:
    """A run-config knob as a typer option, all from its declaration: flag, help, panel, choices.

    The option's own default is None, so the command sees which knobs the command line set;
    `default` is what the help says the knob is when it is not given."""
    meta = fields_by_name()[name].metadata
    kind = _base_type(fields_by_name()[name].type)
    spelled = flag(name)
    decls = f"{spelled}/--no-{spelled[2:]}" if kind is bool else spelled
    words = [meta["help"] + (f" {note}" if note else "")]
    if meta["choices"] and kind is not bool:
        words.append("[" + ", ".join(str(c) for c in meta["choices"]) + "]")
    if default is not None and default is not False:  # a switch not given is off: no need to say it
        words.append(f"[default: {'on' if default is True else default}]")
    option = typer.Option(
        None,
        decls,
        help=escape(" ".join(words)),  # rich markup would eat "[default: ...]"
        rich_help_panel=panel(name) if panels else None,
        show_default=False,
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None)


def knob_options(
    names: tuple[str, ...] | None = None, defaults: dict[str, Any] | None = None, panels: bool = True, note: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command an option for each run-config knob (all, or `names`), generated from the config.

    The command takes them as `**knobs` (None where not given); `defaults`: what the command uses
    where it does not use the config's own default (treat's shorter window), said in the help."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func)
        made = [
            _knob_param(n, (defaults or {}).get(n, f.default), panels, note)
            for n, f in RunConfig.__dataclass_fields__.items()
            if names is None or n in names
        ]
        kept = [p.replace(kind=p.KEYWORD_ONLY) for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        func.__signature__ = own.replace(parameters=made + kept)
        func.__annotations__ = {**func.__annotations__, **{p.name: p.annotation for p in made}}
        return func

    return wrap


@app.command()
@knob_options()
def profile(
    liger: bool | None = typer.Option(
        None,
        "--liger",
        help="shorthand: Liger rope + rms_norm + swiglu (FusedCE stays as set)",
        rich_help_panel=panel("liger_rope"),
        show_default=False,
    ),
    nnodes: str = typer.Option("1", "--nnodes", help="torchrun: nodes (N or MIN:MAX)", rich_help_panel=PL),
    node_rank: int | None = typer.Option(None, "--node-rank", help="torchrun: this node's rank", rich_help_panel=PL),
    rdzv_backend: str | None = typer.Option(
        None, "--rdzv-backend", help="torchrun: rendezvous backend (c10d)", rich_help_panel=PL
    ),
    rdzv_endpoint: str | None = typer.Option(
        None, "--rdzv-endpoint", help="torchrun: rendezvous HOST:PORT", rich_help_panel=PL
    ),
    rdzv_id: str | None = typer.Option(
        None, "--rdzv-id", help="torchrun: job id shared by all nodes", rich_help_panel=PL
    ),
    master_addr: str | None = typer.Option(
        None, "--master-addr", help="torchrun: rank 0's host (static rendezvous)", rich_help_panel=PL
    ),
    master_port: int | None = typer.Option(None, "--master-port", help="torchrun: rank 0's port", rich_help_panel=PL),
    one_gpu_report: str | None = typer.Option(
        None,
        "--one-gpu-report",
        help="a report of the same config on one GPU: the reference of the scaling efficiency",
        rich_help_panel=PL,
    ),
    measure_one_gpu: bool = typer.Option(
        False,
        "--measure-one-gpu",
        help="first run the same config on one GPU in this command, for the scaling efficiency",
        rich_help_panel=PL,
    ),
    diagnose_run: bool = typer.Option(
        True,
        "--diagnose/--no-diagnose",
        help="trace a short window and prescribe "
        "fixes (the trace goes to a temporary folder unless --trace-dir is given)",
    ),
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files (repeatable)"),
    select: list[str] | None = _SELECT,
    ignore: list[str] | None = _IGNORE,
    trace_dir: str | None = typer.Option(
        None,
        "--trace-dir",
        help="after the timed steps, trace a separate window with torch.profiler and write gzipped Chrome JSON here",
        rich_help_panel="trace",
    ),
    trace_steps: int = typer.Option(
        2, "--trace-steps", help="active steps in the traced window", rich_help_panel="trace"
    ),
    trace_shapes: bool = typer.Option(
        True,
        "--trace-shapes/--no-trace-shapes",
        help="record input shapes (shape churn, logits size)",
        rich_help_panel="trace",
    ),
    trace_stack: bool = typer.Option(
        False, "--trace-stack", help="record Python stacks (much bigger)", rich_help_panel="trace"
    ),
    trace_memory: bool | None = typer.Option(
        None,
        "--trace-memory/--no-trace-memory",
        help="record allocations (default: on a GPU, where the memory wall's facts need them)",
        rich_help_panel="trace",
        show_default=False,
    ),
    config: str | None = typer.Option(
        None, "--config", help="run config YAML/JSON (or a report JSON); flags override it"
    ),
    json_path: str | None = _json_opt("report"),
    html_path: str | None = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    save_config: str | None = typer.Option(None, "--save-config", help="write the resolved run config (YAML/JSON)"),
    force: bool = typer.Option(False, "--force", help="overwrite existing output files"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress and no table"),
    **knobs: Any,
) -> None:
    """Run real training steps of a VLM and measure them.

    Runs on the GPU when there is one; `--model tiny --device cpu` runs anywhere.
    """
    from vlmdoctor.run.capture import TraceOptions

    trace = TraceOptions(trace_dir, trace_steps, trace_shapes, trace_stack, trace_memory) if trace_dir else None
    if trace is None and diagnose_run:  # a short traced window into a temporary folder, removed after analysis
        trace = TraceOptions("", trace_steps, trace_shapes, trace_stack, trace_memory, keep=False)
    overrides = {k: v for k, v in knobs.items() if v is not None}
    if liger is not None:
        for k in ("liger_rope", "liger_rms_norm", "liger_swiglu"):
            overrides.setdefault(k, liger)
    with _user_errors():
        from vlmdoctor.inputs import check_number

        check_number("--trace-steps", trace_steps, minimum=1, maximum=1000, integer=True)
        from vlmdoctor.run.distributed import Rendezvous

        launch = {
            "rdzv": Rendezvous(nnodes, node_rank, rdzv_backend, rdzv_endpoint, rdzv_id, master_addr, master_port),
            "one_gpu_report": one_gpu_report,
            "measure_one_gpu": measure_one_gpu,
        }
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
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
    launch: dict[str, Any] | None,
) -> None:
    """Every output of `profile`, checked before any measurement: a bad path must not cost the run, and no
    output may replace a file the run reads."""
    from vlmdoctor.files import check_distinct, check_inputs_kept, check_output_dir, check_writable

    check_distinct(json=json_path, save_config=save_config, html=html_path)
    check_writable(json_path, force, "--json")
    check_writable(save_config, force, "--save-config")
    check_writable(html_path, force, "--html")
    if trace is not None and trace.keep:
        from vlmdoctor.supervise import check_room

        check_output_dir(trace.trace_dir, "--trace-dir")
        check_room(trace.trace_dir, "--trace-dir")  # a full disk found now, not after the measurement
    check_inputs_kept(
        {
            "the --config": config,
            "the --data file": None if cfg.data == "synthetic" else cfg.data,
            "the --tokenizer folder": cfg.tokenizer,
            "the --one-gpu-report": (launch or {}).get("one_gpu_report"),
            "a --rules folder": rules_dirs,
        },
        {"--json": json_path, "--html": html_path, "--save-config": save_config},
    )


def compare_labels(a: str, b: str) -> tuple[str, str]:
    """Column heads for two reports: their file names, or, where those are the same (two runs' report.json),
    the shortest trailing paths that tell them apart."""
    pa, pb = Path(a), Path(b)
    for depth in range(1, max(len(pa.parts), len(pb.parts)) + 1):
        la, lb = str(Path(*pa.parts[-depth:])), str(Path(*pb.parts[-depth:]))
        if la != lb:
            return la, lb
    return a, b


def _kept_elsewhere(report: dict[str, Any], json_path: str | None) -> str:
    """Where the report is when the HTML page failed: the --json file, else a rescue file (cwd, then temp)."""
    from vlmdoctor.files import json_text, rescue

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
    from vlmdoctor.doctor.diagnosis import examine

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
    launch: dict[str, Any] | None = None,
    selection: Any = None,
) -> None:
    from vlmdoctor.doctor.diagnosis import remove_temporary_trace
    from vlmdoctor.files import save, save_json
    from vlmdoctor.inputs import check_rules_dirs
    from vlmdoctor.report.console import render
    from vlmdoctor.run.runner import check, exit_code, run_distributed, run_profile

    cfg = _run_config(config, overrides)
    _check_profile_outputs(cfg, config, json_path, save_config, html_path, force, trace, rules_dirs, launch)
    check_rules_dirs(rules_dirs or [])
    check(cfg)  # refuse before any progress display opens
    from vlmdoctor.run import distributed, throughput

    launch = launch or {}
    dist_run = distributed.is_distributed(cfg)
    reference = None
    if not dist_run and (
        launch.get("one_gpu_report")
        or launch.get("measure_one_gpu")
        or launch.get("rdzv", distributed.Rendezvous()).args() != ["--standalone"]
    ):
        raise VlmdoctorError(
            "--one-gpu-report, --measure-one-gpu and the torchrun options (--nnodes, --rdzv-*, "
            "--master-*) belong to a run with --parallel ddp or fsdp2"
        )
    if dist_run:
        launch.get("rdzv", distributed.Rendezvous()).check()
        if launch.get("one_gpu_report") and launch.get("measure_one_gpu"):
            raise VlmdoctorError("give --one-gpu-report or --measure-one-gpu, not both")
        if launch.get("one_gpu_report"):
            from vlmdoctor.ci.gate import load_report

            reference = load_report(launch["one_gpu_report"])
            distributed.check_reference(cfg.to_dict(), reference, launch["one_gpu_report"])
    if save_config:
        from vlmdoctor.files import write_text

        write_text(save_config, cfg.dump_text(save_config))
    report: dict[str, Any] = {}

    def measure(progress: Any = None) -> dict[str, Any]:
        if not dist_run:
            return run_profile(cfg, progress, trace) if progress else run_profile(cfg, trace=trace)
        nonlocal reference
        ref_source = launch.get("one_gpu_report")
        if launch.get("measure_one_gpu"):
            from vlmdoctor.run.runner import run_isolated

            if progress:
                progress("one-GPU reference run", 0, 1)
            reference = run_isolated(distributed.one_gpu_config(cfg), diagnose=False)
            ref_source = "measured first in this command (--measure-one-gpu)"
            if progress:
                progress("one-GPU reference run", 1, 1)
        result = run_distributed(cfg, trace, launch.get("rdzv"), progress or (lambda *_: None))
        if "distributed" in result and reference is not None:
            ref_tps = (reference.get("metrics") or {}).get("real_tokens_per_s")
            if reference.get("status") == "ok" and ref_tps:
                result["distributed"]["scaling"] = throughput.scaling(
                    result["metrics"]["real_tokens_per_s"],
                    result["distributed"]["world_size"],
                    ref_tps,
                    ref_source,
                    {
                        "job's": (result.get("throughput") or {}).get("unstable_reason"),
                        "one-GPU reference's": (reference.get("throughput") or {}).get("unstable_reason"),
                    },
                )
            else:
                result.setdefault("warnings", []).append(
                    f"the one-GPU reference run ended with status {reference.get('status')}: no scaling efficiency"
                )
        return result

    interrupted: KeyboardInterrupt | None = None
    try:
        try:
            report = _with_progress(measure, quiet)
        except KeyboardInterrupt as e:  # after the timed windows the runner hands back what they measured
            if getattr(e, "report", None) is None:
                raise
            interrupted, report = e, e.report  # type: ignore[attr-defined]
        if interrupted is None:
            interrupted = _diagnose_kept(report, rules_dirs, selection)
    finally:
        remove_temporary_trace(report)
    failures = []
    failures.append(save_json(report, json_path, "report"))
    if html_path:
        from vlmdoctor.report.html import profile_html

        try:
            page = profile_html(report)
        except Exception as e:  # a page that cannot be drawn must not cost the measurement
            failures.append(
                f"cannot draw the HTML report ({describe_error(e)[0]}); {_kept_elsewhere(report, json_path)}"
            )
        else:
            failures.append(save(html_path, page, "HTML report"))
    lost = (report.get("trace") or {}).get("lost")
    if lost and trace is not None and trace.keep:  # the --trace-dir asked for is not there; the measurement is
        from vlmdoctor.run.capture import lost_note

        failures.append(lost_note(lost))
    failures = [f for f in failures if f]
    if not quiet and json_path != "-":
        render(report, out)
        if "diagnosis" in report:
            from vlmdoctor.report.console import render_findings

            render_findings(report["diagnosis"], out, lambda patch: run_command(report["config"], patch))
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
        from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

        err.print(f"{describe_interruption(interrupted)}; the measured numbers are kept", highlight=False, markup=False)
        raise typer.Exit(interrupted_exit_code(interrupted))
    raise typer.Exit(code or (EXIT_FAILED_RUN if failures else 0))


@app.command()
def analyze(
    path: str = typer.Argument(..., help="a torch.profiler trace (.json, .json.gz) or a folder of per-rank traces"),
    stage: int | None = typer.Option(None, "--stage", help="training stage, when the trace does not say (1 or 2)"),
    model: str | None = typer.Option(None, "--model", help="model preset, when the trace does not say"),
    json_path: str | None = _json_opt("facts and prescriptions"),
    html_path: str | None = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json or --html file"),
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files (repeatable)"),
    select: list[str] | None = _SELECT,
    ignore: list[str] | None = _IGNORE,
) -> None:
    """Read a torch.profiler trace (anyone's), print what the GPU did, why it waited, and what to change."""
    from vlmdoctor import SCHEMA_VERSION
    from vlmdoctor.doctor.rules import diagnose, load_rules
    from vlmdoctor.files import check_inputs_kept, check_writable, save, save_json
    from vlmdoctor.inputs import check_rules_dirs
    from vlmdoctor.report.console import render_facts, render_findings
    from vlmdoctor.trace.facts import analyze as run_analysis

    with _user_errors():
        if stage is not None and stage not in (1, 2):
            raise VlmdoctorError("--stage must be 1 or 2")
        if model is not None:
            from vlmdoctor.run.zoo import presets

            if model not in presets():
                raise VlmdoctorError(f"unknown model preset {model!r}; valid presets: {', '.join(presets())}")
        from vlmdoctor.files import check_distinct

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
        rules, problems = load_rules(*(rules_dirs or []))
        from vlmdoctor.doctor.advice import add_advice
        from vlmdoctor.doctor.diagnosis import measured_from_trace

        for entry in result["files"]:
            measured_from_trace(entry)  # a vlmdoctor trace carries its run's measurements: as profile diagnosed
            entry["diagnosis"] = diagnose(entry["facts"], rules, problems, selection)
            entry["findings"] = entry["diagnosis"]["findings"]
            entry["muted"] = entry["diagnosis"]["muted"]
            if not entry["facts"].get("trace.written_by_vlmdoctor"):
                # a user's own training: the fix as the lines of their loop, not a vlmdoctor command
                add_advice({"config": {}, "diagnosis": entry["diagnosis"]}, "loop")
        cross = result.get("cross_rank")
        if cross and "facts" in cross:  # the job as a whole: rules over the joined ranks' facts
            cross["diagnosis"] = diagnose(cross["facts"], [r for r in rules if r.uses_dist], problems, selection)
            cross["findings"] = cross["diagnosis"]["findings"]
            cross["muted"] = cross["diagnosis"]["muted"]
            if not any(e["facts"].get("trace.written_by_vlmdoctor") for e in result["files"]):
                add_advice({"config": {}, "diagnosis": cross["diagnosis"]}, "loop")
        doc = {"schema_version": SCHEMA_VERSION, "kind": "analysis", **result}
        failures = []
        failures.append(save_json(doc, json_path, "analysis JSON"))
        if html_path:
            from vlmdoctor.report.html import analyze_html

            failures.append(save(html_path, analyze_html(doc), "HTML report"))
        if json_path != "-":
            render_facts(result, out)
            said: dict[str, str] = {}  # a diagnosis already printed -> the file it was printed for
            for entry in result["files"]:
                name = Path(entry["file"]).name
                if len(result["files"]) > 1:  # several ranks: one diagnosis each, an identical one said once
                    key = json.dumps(entry["diagnosis"], sort_keys=True, default=str)
                    if key in said:
                        out.print(f"{esc(name)}: the same diagnosis as {esc(said[key])}", highlight=False)
                        continue
                    said[key] = name
                    out.print(f"[bold]{esc(name)}[/bold]:", highlight=False)
                cfg = {k.removeprefix("config."): v for k, v in entry["facts"].items() if k.startswith("config.")}
                for k in ("stage", "model"):
                    if f"run.{k}" in entry["facts"]:
                        cfg[k] = entry["facts"][f"run.{k}"]
                render_findings(entry["diagnosis"], out, lambda patch, cfg=cfg: run_command(cfg, patch))
            if cross:
                from vlmdoctor.report.console import render_cross_rank

                render_cross_rank(cross, out)
                if "diagnosis" in cross:
                    render_findings(cross["diagnosis"], out, None)
        _fail_on(failures)


rules_app = typer.Typer(help="The prescription rules (rules/*.yaml).", no_args_is_help=True)
app.add_typer(rules_app, name="rules")


@rules_app.command("list")
def rules_list(
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files"),
    json_path: str | None = _json_opt("rule list"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json file"),
) -> None:
    """Every rule, in layer order, with what it detects."""
    from rich.table import Table

    from vlmdoctor.doctor.rules import load_rules
    from vlmdoctor.files import check_inputs_kept, check_writable, save_json
    from vlmdoctor.inputs import check_rules_dirs

    with _user_errors():
        check_writable(json_path, force, "--json")
        check_rules_dirs(rules_dirs or [])
        check_inputs_kept({"a --rules folder": rules_dirs}, {"--json": json_path})
        rules, problems = load_rules(*(rules_dirs or []))
        rules = sorted(rules, key=lambda r: (r.layer, r.id))
        if json_path:
            kept = save_json(
                {
                    "rules": [
                        {
                            "id": r.id,
                            "layer": r.layer,
                            "severity": r.severity,
                            "title": r.title,
                            "file": str(r.path),
                        }
                        for r in rules
                    ],
                    "problems": problems,
                },
                json_path,
                "rule list",
            )
            _fail_on([kept])
    if json_path != "-":
        # an id is never cut (it is what --ignore and rules show take): the title wraps instead
        t = Table(show_header=True, header_style="bold")
        t.add_column("layer", no_wrap=True)
        t.add_column("id", no_wrap=True, min_width=max((len(r.id) for r in rules), default=2))
        t.add_column("max", no_wrap=True)
        t.add_column("title", overflow="fold")
        for r in rules:
            t.add_row(esc(r.layer), esc(r.id), esc(r.severity), esc(r.title))
        out.print(t)
        out.print("[dim]max: the highest severity a finding can have; its expected gain sets it[/dim]")
        out.print("[dim]vlmdoctor rules show ID: what a rule detects, its evidence, fix and thresholds[/dim]")
    for p in problems:
        err.print(f"[yellow]rule problem:[/yellow] {esc(p)}", highlight=False)
    if problems:
        raise typer.Exit(EXIT_USAGE)


@rules_app.command("show")
def rules_show(
    rule_id: str = typer.Argument(..., help="rule id (vlmdoctor rules list)"),
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files"),
    json_path: str | None = _json_opt("rule page"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json file"),
) -> None:
    """One rule's page: what it detects, why it matters, its evidence, the fix, where its thresholds come from."""
    from vlmdoctor.doctor.rules import load_rules, rule_page
    from vlmdoctor.files import check_inputs_kept, check_writable, save_json
    from vlmdoctor.inputs import check_rules_dirs
    from vlmdoctor.report.console import render_rule_page

    with _user_errors():
        check_writable(json_path, force, "--json")
        check_rules_dirs(rules_dirs or [])
        check_inputs_kept({"a --rules folder": rules_dirs}, {"--json": json_path})
        rules, _ = load_rules(*(rules_dirs or []))
        match = [r for r in rules if r.id == rule_id]
        if not match:
            from vlmdoctor.doctor.select import suggest

            close = suggest(rule_id, sorted(r.id for r in rules))
            raise VlmdoctorError(
                f"no rule {rule_id!r}"
                + (f"; did you mean {', '.join(close)}?" if close else "; vlmdoctor rules list shows every id")
            )
        page = rule_page(match[0])
        if json_path:
            _fail_on([save_json(page, json_path, "rule page")])
        if json_path != "-":
            render_rule_page(page, out)


@app.command()
def facts(
    name: str | None = typer.Argument(None, help="a fact (gpu.busy_frac, kernels.cast.ms); none: every fact"),
    markdown: bool = typer.Option(False, "--markdown", help="print the table of docs/analysis.md instead"),
    json_path: str | None = _json_opt("fact catalogue"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json file"),
) -> None:
    """What a fact is, where it is computed and what records it (the catalogue: trace/catalog.py)."""
    from vlmdoctor.doctor.rules import load_rules
    from vlmdoctor.errors import UsageError
    from vlmdoctor.files import check_writable, save_json
    from vlmdoctor.trace import catalog

    with _user_errors():
        check_writable(json_path, force)
        found = [catalog.lookup(name)] if name else catalog.FACTS
        if found == [None]:
            near = catalog.suggest(name)
            raise UsageError(f"no fact {name!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
        rules, _ = load_rules()
        docs = [
            {
                **catalog.describe(f),
                "read_by": sorted(r.id for r in rules if any(map(f.pattern.fullmatch, r.facts_used()))),
            }
            for f in found
        ]
        if json_path:
            _fail_on([save_json(docs[0] if name else docs, json_path, "fact catalogue")])
    if markdown and json_path != "-":
        out.print(catalog.markdown_facts(), end="", markup=False, highlight=False, soft_wrap=True)
    elif json_path != "-":
        for d in docs:
            out.print(
                f"[bold]{escape(d['name'])}[/bold] ({escape(d['unit'])}): {escape(d['meaning'])}", highlight=False
            )
            if name:
                out.print(f"  computed in {d['computed_in']}", highlight=False)
                out.print(f"  recorded by {escape('; '.join(d['recorded_by']))}", highlight=False)
                for k, v in {**d.get("values", {}), "ranks": d.get("ranks"), "rules": ", ".join(d["read_by"])}.items():
                    if v:
                        out.print(f"  {k}: {escape(v)}", highlight=False)


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    command: list[str] = typer.Argument(..., help="the training command, after --: python train.py ARGS"),
    out_dir: str = typer.Option("doctor-out", "--out", help="folder for report.json, trace/ and script.log"),
    warmup: int = typer.Option(5, "--warmup", help="optimizer steps before the timed window"),
    steps: int = typer.Option(20, "--steps", help="timed optimizer steps"),
    trace_steps: int = typer.Option(2, "--trace-steps", help="steps traced with torch.profiler after the timed ones"),
    stop_after_window: bool = typer.Option(
        False,
        "--stop-after-window",
        help="stop the script once the windows are measured, instead of letting it train on",
    ),
    stage: int | None = typer.Option(None, "--stage", help="1 or 2, when the estimate from the frozen parts is wrong"),
    json_path: str | None = typer.Option(None, "--json", help="also write the report JSON here ('-' for stdout)"),
    html_path: str | None = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files (repeatable)"),
    select: list[str] | None = _SELECT,
    ignore: list[str] | None = _IGNORE,
    force: bool = typer.Option(False, "--force", help="overwrite a report already in --out, --json or --html"),
    quiet: bool = typer.Option(False, "--quiet", help="no metrics and prescriptions on the console"),
) -> None:
    """Doctor your own training script, unchanged: vlmdoctor run -- python train.py ARGS.

    Each optimizer step is a training step. The script's output goes to the terminal and to
    OUT/script.log; the report to OUT/report.json. A failing script's own exit code is passed on (3 when it ran out of
    memory); exit 1 when it never steps.
    """
    from vlmdoctor.launch import run_script

    with _user_errors():
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
        )
        if json_path == "-" and report is not None:
            from vlmdoctor.files import write_json

            write_json(report, "-")
        raise typer.Exit(code)


@app.command()
def models(
    json_path: str | None = _json_opt("catalogue"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json file"),
) -> None:
    """List presets, vision towers and LLMs with parameter counts and head dims."""
    from vlmdoctor.files import check_writable, save_json
    from vlmdoctor.report.console import render_models
    from vlmdoctor.run.model import catalogue

    with _user_errors():
        check_writable(json_path, force)
        rows = catalogue()
        if json_path:
            _fail_on([save_json(rows, json_path, "model catalogue")])  # a list of rows, as before
    if json_path != "-":
        render_models(rows, out)


def _parse_sets(sets: list[str], many: bool = False) -> dict[str, Any]:
    """`knob=value` pairs (YAML values; with many, comma-separated lists) into a dict."""
    from vlmdoctor.inputs import parse_yaml

    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            raise VlmdoctorError(f"--set {item!r}: expected knob=value")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in RunConfig.__dataclass_fields__:
            raise VlmdoctorError(
                f"--set {k}: unknown knob; valid knobs: {', '.join(sorted(RunConfig.__dataclass_fields__))}"
            )
        kind = _base_type(RunConfig.__dataclass_fields__[k].type)
        # "off" is a string here, not YAML's False
        parse = (lambda x, _: x.strip()) if kind is str else parse_yaml
        out[k] = [parse(x, f"--set {item}") for x in v.split(",")] if many else parse(v, f"--set {item}")
    return out


#: the knobs `treat` takes as flags (others: --set), and its shorter window without --config
TREAT_KNOBS = ("model", "stage", "device", "steps", "warmup", "repeats", "nproc_per_node", "parallel")
TREAT_DEFAULTS = {"steps": 10, "repeats": 3}


@app.command()
@knob_options(TREAT_KNOBS, TREAT_DEFAULTS, panels=False)
def treat(
    config: str | None = typer.Option(None, "--config", help="start from this run config (YAML/JSON or a report)"),
    sets: list[str] | None = typer.Option(None, "--set", help="knob=value on top of the start config (repeatable)"),
    max_trials: int = typer.Option(
        24,
        "--max-trials",
        help="trials at most (a trial: one composition or one ablation, measured in several paired runs)",
    ),
    time_budget: float | None = typer.Option(
        540,
        "--time-budget",
        help="seconds; no run starts after this and a run's limit is cut to what is left",
    ),
    min_gain: float = typer.Option(
        0.02,
        "--min-gain",
        help="smallest throughput gain worth keeping (0.02 = 2%): "
        "kept when the paired interval's lower bound is above it",
    ),
    trial_timeout: float = typer.Option(900, "--trial-timeout", help="seconds one run may take"),
    max_pairs: int = typer.Option(6, "--max-pairs", help="paired runs per comparison at most (3 at least)"),
    rules_dirs: list[str] | None = typer.Option(None, "--rules", help="extra folder of rule files (repeatable)"),
    select: list[str] | None = _SELECT,
    ignore: list[str] | None = _IGNORE,
    out_dir: str | None = typer.Option(
        None,
        "--out",
        help="folder for treat.json, final_config.yaml, ladder.png [default: treat-MODEL-stageN]",
    ),
    html_path: str | None = typer.Option(
        None, "--html", help="also write the HTML report here (it is always written as treat.html in --out)"
    ),
    force: bool = typer.Option(False, "--force", help="write into an --out folder that already holds results"),
    json_path: str | None = typer.Option(None, "--json", help="also write the result JSON here ('-' = stdout)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress and no tables"),
    **knobs: Any,
) -> None:
    """Apply the prescriptions together, verify on paired runs, confirm each change by ablation.

    Prints the ladder: each adopted round with its paired speedup, each change with its measured contribution.

    Then the trials not kept; writes the final run config, which `vlmdoctor profile --config` runs again.
    """
    from pathlib import Path

    from vlmdoctor.doctor.treat import TreatOptions
    from vlmdoctor.doctor.treat import treat as run_treat
    from vlmdoctor.files import check_output_dir, save, save_json
    from vlmdoctor.inputs import check_number, check_rules_dirs
    from vlmdoctor.report.console import render_ladder
    from vlmdoctor.report.treat_outputs import write_outputs
    from vlmdoctor.run.runner import check, run_isolated

    with _user_errors():
        check_number("--max-trials", max_trials, minimum=0, maximum=1000, integer=True)
        check_number("--time-budget", time_budget, above=0)
        check_number("--min-gain", min_gain, minimum=0, maximum=10)
        check_number("--trial-timeout", trial_timeout, above=0)
        cfg = RunConfig.load(config) if config else RunConfig(**TREAT_DEFAULTS)
        flags = {k: v for k, v in knobs.items() if v is not None}
        for source, changes in (("--set", _parse_sets(sets or [])), ("command line", flags)):
            merged, dropped = override(cfg.to_dict(), changes, config or "the start config")  # the later one wins
            if dropped:
                err.print(f"note: {esc(dropped)}", highlight=False)
            cfg = RunConfig.from_dict(merged, source=source)
        check(cfg)
        from vlmdoctor.files import check_distinct, check_inputs_kept, check_writable

        check_distinct(json=json_path, html=html_path)
        check_writable(html_path, force, "--html")
        folder = Path(out_dir or f"treat-{cfg.model}-stage{cfg.stage}")
        from vlmdoctor import supervise

        check_output_dir(folder, "--out")
        supervise.check_room(folder, "--out")  # compile caches and results: found full now, not after the trials
        supervise.check_file_folders(json=json_path, html=html_path)
        supervise.check_temp()
        check_rules_dirs(rules_dirs or [])
        selection, rules_dirs, _ = rule_choice(select, ignore, rules_dirs)
        if folder.is_dir() and any(folder.iterdir()) and not force:
            raise VlmdoctorError(
                f"{folder} already holds files; pass --force to write into it, or --out another folder"
            )
        if folder.is_dir():  # the files treat will write there: never a link, fifo or folder
            for name in ("treat.json", "final_config.yaml", "ladder.png", "treat.html"):
                check_writable(folder / name, True, "--out")
        from vlmdoctor.doctor.rules import load_rules

        _, problems = load_rules(*(rules_dirs or []))
        for p in problems:
            err.print(f"rule problem: {esc(p)}", highlight=False)
        check_number("--max-pairs", max_pairs, minimum=3, maximum=1000, integer=True)
        check_writable(json_path if json_path != "-" else None, force, "--json")
        check_inputs_kept(
            {"the --config": config, "a --rules folder": rules_dirs},
            {
                "--out": [folder / n for n in ("treat.json", "final_config.yaml", "ladder.png", "treat.html")],
                "--html": html_path,
                "--json": json_path,
            },
        )
        opts = TreatOptions(
            max_trials=max_trials,
            time_budget_s=time_budget or None,
            min_gain=min_gain,
            trial_timeout_s=trial_timeout,
            rules_dirs=list(rules_dirs or []),
            max_pairs=max_pairs,
        )
        from vlmdoctor.run.compile import cache_env

        compile_env = cache_env(folder / "compile-cache")  # trials of one treatment reuse each other's compiled kernels

        def run_one(c: RunConfig, diagnose: bool, timeout: float | None) -> dict[str, Any]:
            from vlmdoctor.doctor.select import mute_report

            report = run_isolated(c, timeout=timeout, diagnose=diagnose, rules_dirs=opts.rules_dirs, env=compile_env)
            return mute_report(report, selection)  # a muted rule's fix is not tried

        if quiet or json_path == "-":
            result = run_treat(cfg, run_one, opts)
        else:
            import time

            with err.status("treat") as status:
                t0 = time.time()

                def notify(msg: str) -> None:
                    status.update(f"{esc(msg)}  [dim]({time.time() - t0:.0f} s so far)[/dim]")
                    err.print(f"[dim]{esc(msg)}[/dim]", highlight=False)

                result = run_treat(cfg, run_one, opts, notify)
        paths, failures = write_outputs(result, folder)
        if html_path:
            from vlmdoctor.report.html import treat_html

            failures.append(save(html_path, treat_html(result), "HTML report"))
        failures.append(save_json(result, json_path, "result JSON"))
        failures = [f for f in failures if f]
        if not quiet and json_path != "-":
            render_ladder(result, out)
            out.print(f"written: {esc(', '.join(str(p) for p in paths.values()))}", highlight=False)
            out.print(f"run the final config again: vlmdoctor profile --config {esc(paths['config'])}", highlight=False)
        _fail_on(failures)
        if result["interrupted"]:
            raise typer.Exit(result.get("exit_code") or 130)
        if not result["ladder"]:
            raise typer.Exit(1)


@app.command()
@knob_options(("nproc_per_node", "parallel"), panels=False, note="(every run; a --set value wins)")
def sweep(
    grid: str | None = typer.Argument(None, help="a grid YAML: defaults, runs (name, set, optional stages), stages"),
    sets: list[str] | None = typer.Option(
        None,
        "--set",
        help="knob=v1,v2,... : every combination is run "
        "(repeatable); with a grid file, knob=value applies to every row",
    ),
    stages: list[int] | None = typer.Option(None, "--stage", help="only these stages (repeatable)"),
    csv_path: str | None = typer.Option(None, "--csv", help="write the results table as CSV"),
    jsonl_path: str | None = typer.Option(None, "--jsonl", help="append each run's full report as a JSON line"),
    diagnose_runs: bool = typer.Option(False, "--diagnose/--no-diagnose", help="trace and diagnose each run"),
    timeout: float = typer.Option(900, "--timeout", help="seconds one run may take"),
    json_path: str | None = _json_opt("results table"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --csv or --json file"),
    **knobs: Any,
) -> None:
    """Run a list of configurations, one fresh process each, and tabulate them (the seed's 48-run table style)."""
    from vlmdoctor.ci.sweep import load_grid, product_grid, run_sweep
    from vlmdoctor.files import check_writable, save, save_json
    from vlmdoctor.inputs import check_number
    from vlmdoctor.report.console import render_sweep

    with _user_errors():
        check_number("--timeout", timeout, above=0)
        from vlmdoctor.files import check_distinct, check_inputs_kept

        check_distinct(csv=csv_path, json=json_path, jsonl=jsonl_path)
        check_writable(csv_path, force, "--csv")
        check_writable(json_path, force, "--json")
        check_writable(jsonl_path, True, "--jsonl")  # appended to: an existing regular file is fine
        check_inputs_kept({"the grid": grid}, {"--csv": csv_path, "--json": json_path, "--jsonl": jsonl_path})
        from vlmdoctor import supervise

        supervise.check_file_folders(csv=csv_path, json=json_path, jsonl=jsonl_path)
        supervise.check_temp()  # each run's report goes there first
        launch = {k: v for k, v in knobs.items() if v is not None}
        if grid:  # every run launched the same way (--set knob=value wins)
            plan = load_grid(grid, {**launch, **_parse_sets(sets or [])}, stages)
        elif sets:
            values = _parse_sets(sets, many=True)
            for k, v in launch.items():
                values.setdefault(k, [v])
            plan = product_grid(values, stages)
        else:
            raise VlmdoctorError("give a grid YAML file or at least one --set knob=v1,v2")
        from vlmdoctor.run.runner import check

        for (
            name,
            c,
        ) in plan:  # a run this machine refuses (a GPU preset without a GPU, say) is refused up front
            try:
                check(c)
            except VlmdoctorError as e:
                raise VlmdoctorError(f"{name}: {e.message}") from None
        with err.status("sweep") as status:

            def notify(i: int, n: int, name: str) -> None:
                status.update(f"run {i}/{n}: {esc(name)}")

            problems: list[str] = []
            rows: list[dict[str, Any]] = []
            interrupted: KeyboardInterrupt | None = None
            try:
                run_sweep(plan, timeout, diagnose_runs, jsonl_path, notify, problems, rows)
            except KeyboardInterrupt as e:  # the run in flight was stopped; the finished rows are kept below
                interrupted = e
        failures = []
        failures.append(save_json({"runs": rows}, json_path, "sweep JSON"))
        if json_path != "-":
            render_sweep(rows, out)
        if csv_path:
            from vlmdoctor.ci.sweep import csv_text

            failures.append(save(csv_path, csv_text(rows), "results table"))
            if json_path != "-" and not failures[-1]:
                out.print(f"written: {esc(csv_path)}", highlight=False)
        if interrupted is not None:
            from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

            err.print(
                f"{describe_interruption(interrupted)}: {len(rows)} of {len(plan)} run(s) finished, kept above",
                highlight=False,
                markup=False,
            )
        _fail_on([*failures, *problems])
        if interrupted is not None:
            raise typer.Exit(interrupted_exit_code(interrupted))


@app.command()
def gate(
    baseline: str = typer.Option(..., "--baseline", help="the baseline report JSON (kept in the repository)"),
    current: str | None = typer.Option(
        None,
        "--current",
        help="the report to judge; without it, the baseline's config is profiled now, in a fresh process",
    ),
    max_regression: float | None = typer.Option(
        None,
        "--max-regression",
        help="fail on a real tokens/s drop larger than this (0.05 = 5%) that is also significant "
        "[default: [tool.vlmdoctor] max-regression, else 0.05]",
        show_default=False,
    ),
    alpha: float = typer.Option(
        0.01, "--alpha", help="significance level of the Mann-Whitney U test on per-step throughput"
    ),
    max_memory_growth: float | None = typer.Option(
        None,
        "--max-memory-growth",
        help="fail when peak memory grew more [default: [tool.vlmdoctor] max-memory-growth, else 0.10]",
        show_default=False,
    ),
    fail_on: str | None = typer.Option(
        None,
        "--fail-on",
        help="fail on a new finding of this severity or above (high, medium, low); muted findings never fail "
        "[default: [tool.vlmdoctor] fail-on, else high]",
        show_default=False,
    ),
    select: list[str] | None = _SELECT,
    ignore: list[str] | None = _IGNORE,
    allow_env_change: bool = typer.Option(
        False,
        "--allow-env-change",
        help="compare across GPU models too (torch, "
        "transformers, liger-kernel and driver changes are always compared, "
        "and named)",
    ),
    remeasure_baseline: bool = typer.Option(
        False,
        "--remeasure-baseline",
        help="measure the baseline's config again "
        "in this job, alternating with the current run in fresh processes, and "
        "judge on the paired ratios instead of the stored numbers",
    ),
    baseline_python: str | None = typer.Option(
        None,
        "--baseline-python",
        help="with --remeasure-baseline: the Python interpreter of the baseline's install (another code version)",
    ),
    baseline_env: list[str] | None = typer.Option(
        None,
        "--baseline-env",
        help="with --remeasure-baseline: KEY=VALUE for the baseline's runs, e.g. PYTHONPATH=old/checkout (repeatable)",
    ),
    baseline_cwd: str | None = typer.Option(
        None,
        "--baseline-cwd",
        help="with --remeasure-baseline of a `vlmdoctor run` baseline: the checkout of the baseline's code, "
        "where its recorded command runs",
    ),
    current_command: str | None = typer.Option(
        None,
        "--current-command",
        help="with --remeasure-baseline of a `vlmdoctor run` baseline: the current side's command, quoted, "
        "when it is not the recorded one (e.g. 'python train.py --new-flag')",
    ),
    max_pairs: int = typer.Option(
        16,
        "--max-pairs",
        help="with --remeasure-baseline: paired runs at most (3 at least; more only while undecided)",
    ),
    extend_pairs: int | None = typer.Option(
        None,
        "--extend-pairs",
        help="with --remeasure-baseline: paired "
        "runs at most when, at --max-pairs, the ratio is below "
        "1 - --max-regression but not yet beyond the noise (default: "
        "2 x --max-pairs; --max-pairs or less: stop there)",
    ),
    cpu_threads: int = typer.Option(
        1,
        "--cpu-threads",
        help="with --remeasure-baseline on a CPU baseline: intra-op "
        "threads a side (0: torch's default); one keeps a shared host's load from "
        "stalling a side's parallel regions",
    ),
    timeout: float = typer.Option(900, "--timeout", help="seconds one run may take"),
    update_baseline: bool = typer.Option(
        False, "--update-baseline", help="write the current report over the baseline, on purpose, and pass"
    ),
    junit: str | None = typer.Option(None, "--junit", help="write JUnit XML here"),
    json_path: str | None = _json_opt("verdict"),
    force: bool = typer.Option(
        False,
        "--force",
        help="overwrite existing --junit/--json files; with "
        "--update-baseline, replace a baseline of another model or stage",
    ),
) -> None:
    """Fail (exit 1) when training got slower than the baseline, beyond the noise; exit 2 on unusable input."""
    import os

    from vlmdoctor.ci.gate import check_comparable, load_report, run_current
    from vlmdoctor.ci.gate import gate as judge
    from vlmdoctor.files import check_inputs_kept, check_writable, json_text, save
    from vlmdoctor.inputs import check_number

    with _user_errors():
        selection, _, settings = rule_choice(select, ignore, None)
        max_regression = settings.get("max-regression", 0.05) if max_regression is None else max_regression
        max_memory_growth = settings.get("max-memory-growth", 0.10) if max_memory_growth is None else max_memory_growth
        fail_on = fail_on or settings.get("fail-on", "high")
        check_number("--max-regression", max_regression, minimum=0, below=1)
        check_number("--alpha", alpha, above=0, below=1)
        check_number("--max-memory-growth", max_memory_growth, minimum=0, maximum=100)
        if fail_on not in ("high", "medium", "low"):
            raise VlmdoctorError(f"--fail-on {fail_on!r} is not valid; choose one of: high, medium, low")
        from vlmdoctor.files import check_distinct

        check_distinct(junit=junit, json=json_path, baseline=baseline if update_baseline else None)
        check_writable(junit, force, "--junit")
        check_writable(json_path, force, "--json")
        if update_baseline:
            check_writable(baseline, True, "--baseline")
        inputs = {"the --baseline": baseline, "the --current": current}
        check_inputs_kept(inputs, {"--junit": junit, "--json": json_path})
        from vlmdoctor import supervise

        supervise.check_file_folders(junit=junit, json=json_path, baseline=baseline if update_baseline else None)
        if remeasure_baseline or not current:  # runs start: their reports go to the temp folder first
            supervise.check_temp()
        summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if summary:
            try:
                check_inputs_kept(inputs, {"GITHUB_STEP_SUMMARY": summary})
                check_writable(summary, True, "GITHUB_STEP_SUMMARY")
            except VlmdoctorError as e:
                err.print(
                    f"[yellow]warning:[/yellow] {esc(e.message)}; the step summary is skipped",
                    highlight=False,
                )
                summary = None
        base = load_report(baseline)
        if remeasure_baseline:
            if current or update_baseline:
                raise VlmdoctorError(
                    "--remeasure-baseline measures both sides now; it takes no --current or --update-baseline"
                )
            if max_pairs < 3:
                raise VlmdoctorError("--max-pairs must be at least 3")
            if extend_pairs is not None:
                check_number("--extend-pairs", extend_pairs, minimum=0, maximum=1000, integer=True)
            check_number("--cpu-threads", cpu_threads, minimum=0, maximum=4096)
            env = {}
            for item in baseline_env or []:
                key, eq, value = item.partition("=")
                if not eq or not key:
                    raise VlmdoctorError(f"--baseline-env {item!r}: expected KEY=VALUE")
                env[key] = value
            import vlmdoctor.launch as launcher
            from vlmdoctor.ci.gate import remeasure

            command = None
            if current_command is not None:
                import shlex

                try:
                    command = shlex.split(current_command)
                except ValueError as e:
                    raise VlmdoctorError(f"--current-command {current_command!r}: {e}") from None
                if not command:
                    raise VlmdoctorError("--current-command is empty")
            with err.status("paired runs: baseline and current, alternating") as status:
                result = remeasure(
                    base,
                    baseline_python,
                    env or None,
                    timeout,
                    cpu_threads=cpu_threads,
                    baseline_cwd=baseline_cwd,
                    current_command=command,
                    launcher=launcher,
                    max_regression=max_regression,
                    max_pairs=max_pairs,
                    extend_pairs=extend_pairs,
                    max_memory_growth=max_memory_growth,
                    fail_on=fail_on,
                    allow_env_change=allow_env_change,
                    notify=lambda m: status.update(esc(m)),
                    selection=selection,
                )
            result.pop("reports", None)
            _gate_outputs(result, junit, json_path, summary)
            raise typer.Exit(0 if result["passed"] else 1)
        if current:
            cur = load_report(current)
        else:
            with err.status("profiling the baseline's config"):
                cur = run_current(base, timeout=timeout)
        if update_baseline:
            from vlmdoctor.report.compare import model_differences

            diffs = model_differences(base, cur)
            if diffs and not force:
                raise VlmdoctorError(
                    f"the current report measures something else than the baseline ({'; '.join(diffs)}); "
                    "pass --force to replace the baseline anyway"
                )
            _fail_on([save(baseline, json_text(cur), "new baseline")])
            (err if json_path == "-" else out).print(
                f"baseline updated: {esc(baseline)} ({cur['metrics']['real_tokens_per_s']:,.0f} real tokens/s)",
                highlight=False,
            )
            return
        notes = check_comparable(base, cur, allow_env_change)
        result = judge(base, cur, max_regression, alpha, max_memory_growth, fail_on, notes, selection)
        _gate_outputs(result, junit, json_path, summary)
        raise typer.Exit(0 if result["passed"] else 1)


def _gate_outputs(result: dict[str, Any], junit: str | None, json_path: str | None, summary: str | None) -> None:
    """The verdict table, notes, step summary, JUnit and JSON of a gate result."""
    from rich.table import Table

    from vlmdoctor.ci.gate import junit_xml, markdown
    from vlmdoctor.files import append_text, save, save_json

    failures = []  # the files first: what the console shows can never cost the verdict's files
    if summary:
        try:
            append_text(summary, markdown(result) + "\n")
        except VlmdoctorError as e:
            err.print(f"[yellow]warning:[/yellow] {esc(e.message)}; the step summary is skipped", highlight=False)
    if junit:
        failures.append(save(junit, junit_xml(result), "JUnit XML"))
    failures.append(save_json(result, json_path, "verdict JSON"))
    if json_path != "-":  # stdout is the JSON's
        t = Table(title=f"vlmdoctor gate: {esc(result['summary'])}", header_style="bold")
        for col in ("check", "verdict", "detail"):
            t.add_column(col)
        for c in result["checks"]:
            t.add_row(esc(c["name"]), esc(c["verdict"]), esc(c["detail"]))
        out.print(t)
        for n in result.get("notes") or []:
            out.print(f"note: {esc(n)}", highlight=False)
    _fail_on(failures)


@app.command()
def compare(
    a: str = typer.Argument(..., help="report JSON (before)"),
    b: str = typer.Argument(..., help="report JSON (after)"),
    allow_different: bool = typer.Option(False, "--allow-different", help="compare different models or stages"),
    json_path: str | None = _json_opt("comparison"),
    force: bool = typer.Option(False, "--force", help="overwrite an existing --json file"),
) -> None:
    """Side by side: metrics, GPU time by kernel class, idle causes, findings added or gone, knobs changed."""

    from vlmdoctor.ci.gate import load_report
    from vlmdoctor.files import check_inputs_kept, check_writable, json_text, save, write_json
    from vlmdoctor.report.compare import compare as diff
    from vlmdoctor.report.compare import render_compare

    with _user_errors():
        check_writable(json_path, force, "--json")
        check_inputs_kept({"report A": a, "report B": b}, {"--json": json_path})
        result = diff(load_report(a), load_report(b), allow_different, labels=compare_labels(a, b))
        if json_path == "-":
            write_json(result, "-")
            return
        render_compare(result, out)
        if json_path:
            _fail_on([save(json_path, json_text(result), "comparison JSON")])


@app.command()
def export(
    source: str = typer.Argument(
        ..., help="a profile report JSON (its kept trace) or a trace file / folder of rank traces"
    ),
    chrome: str | None = typer.Option(
        None, "--chrome", help="write gzipped Chrome JSON (opens in Perfetto) here, *.json.gz"
    ),
    hta_dir: str | None = typer.Option(
        None,
        "--hta-dir",
        help="write a folder of per-rank traces as Holistic Trace Analysis (traceinsight) reads them",
    ),
    json_path: str | None = _json_opt("list of files written"),
    force: bool = typer.Option(False, "--force", help="overwrite existing output"),
) -> None:
    """Export a trace for Perfetto (ui.perfetto.dev) or for Holistic Trace Analysis."""
    from pathlib import Path

    from vlmdoctor.files import check_output_dir, check_writable
    from vlmdoctor.trace.export import export_chrome, export_hta_folder
    from vlmdoctor.trace.read import trace_files

    with _user_errors():
        check_writable(chrome, force, "--chrome")  # an empty path or a folder's name: refused before anything
        if not chrome and not hta_dir:
            raise VlmdoctorError("say where: --chrome OUT.json.gz and/or --hta-dir DIR")
        check_output_dir(hta_dir, "--hta-dir")
        from vlmdoctor.trace.export import trace_of_report

        src = trace_of_report(Path(source))
        from vlmdoctor.files import check_inputs_kept, check_writable, save_json

        check_writable(json_path, force)
        check_inputs_kept(
            {"the source": source, "its trace": src}, {"--chrome": chrome, "--hta-dir": hta_dir, "--json": json_path}
        )
        files = trace_files(src)
        written: dict[str, str] = {}
        if chrome:
            if len(files) != 1:
                raise VlmdoctorError(f"{src} holds {len(files)} traces; --chrome exports one (use --hta-dir for ranks)")
            written["chrome"] = str(export_chrome(files[0], Path(chrome), force))
        if hta_dir:
            written["hta_dir"] = str(export_hta_folder(files, Path(hta_dir), force))
        if json_path:
            listing = {"source": str(src), "traces": [str(f) for f in files], "written": written}
            _fail_on([save_json(listing, json_path, "list of files written")])
        if json_path != "-":
            for path in written.values():
                out.print(f"written: {esc(path)}", highlight=False)


def _fail_on(failures: list[str | None]) -> None:
    """Writes that failed after the work: one line each (naming where the content was kept), exit 1."""
    failures = [f for f in failures if f]
    for f in failures:
        err.print(f"[bold red]error:[/bold red] {esc(f)}", highlight=False)
    if failures:
        raise typer.Exit(EXIT_FAILED_RUN)


class _user_errors:
    """Turns every error into one line on stderr and its exit code, never a traceback.

    Errors the user can cause (bad input files, paths, numbers) exit 2; a failed run or a write
    that failed after the work exits 1; running out of host memory exits 3; Ctrl-C exits 130.
    Anything else is a bug: one line, and the full traceback goes to a file the line names.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, _EXITS):
            return False
        if isinstance(exc, click_errors.ClickException):
            return False  # click's own usage errors print themselves and exit 2
        message, code = describe_error(exc)
        interrupted = isinstance(exc, KeyboardInterrupt)
        message = message if interrupted else _one_line(message)
        err.print(message if interrupted else f"[bold red]error:[/bold red] {esc(message)}", highlight=False)
        raise typer.Exit(code)


def describe_error(exc: BaseException) -> tuple[str, int]:
    """(one line, exit code) for any exception that reaches the top of a command."""
    import errno

    import yaml

    from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_OOM

    if isinstance(exc, VlmdoctorError):
        return _one_line(exc.message), exc.exit_code
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C 130; SIGTERM (supervise.Terminated) 143
        from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

        return describe_interruption(exc), interrupted_exit_code(exc)
    if isinstance(exc, MemoryError):
        return "out of host memory (MemoryError); use fewer samples or smaller inputs", EXIT_OOM
    if isinstance(exc, RecursionError):
        return "an input is nested too deeply to read (RecursionError)", EXIT_USAGE
    if isinstance(exc, UnicodeDecodeError):
        return f"an input file is not UTF-8 text ({exc.reason} at byte {exc.start})", EXIT_USAGE
    if isinstance(exc, (yaml.YAMLError, json.JSONDecodeError)):
        return f"an input file does not parse: {_one_line(str(exc))}", EXIT_USAGE
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        user = exc.errno in (
            errno.ENOENT,
            errno.EACCES,
            errno.EPERM,
            errno.EISDIR,
            errno.ENOTDIR,
            errno.ENAMETOOLONG,
            errno.ELOOP,
            errno.EROFS,
            errno.EEXIST,
            errno.ENXIO,
        )
        return f"{where}{exc.strerror or exc}", EXIT_USAGE if user else EXIT_FAILED_RUN
    return _internal_error(exc), EXIT_FAILED_RUN


#: an error line is read by a person: past this many characters its middle is left out, and says so
ERROR_LINE_MAX = 600


def _one_line(text: str) -> str:
    """The first line of a message, at most ERROR_LINE_MAX characters (a path or a value from an input can be
    a megabyte long)."""
    lines = [x for x in str(text).strip().splitlines() if x.strip()]
    line = lines[0] if lines else "(no message)"
    if len(line) <= ERROR_LINE_MAX:
        return line
    head, tail = line[: ERROR_LINE_MAX * 2 // 3], line[-(ERROR_LINE_MAX // 4) :]
    return f"{head} ... ({len(line) - len(head) - len(tail):,} characters left out) ... {tail}"


def _internal_error(exc: BaseException) -> str:
    """A bug, not the user's doing: the traceback goes to a file, the console gets one line naming it."""
    import tempfile
    import time
    import traceback

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        fd, path = tempfile.mkstemp(prefix=f"vlmdoctor-crash-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with open(fd, "w") as f:
            f.write(text)
        where = f"full traceback: {path}"
    except OSError:
        where = "the traceback could not be saved"
    return (
        f"internal error: {type(exc).__name__}: {_one_line(str(exc)) if str(exc) else ''} ({where}; please report it)"
    )


def main() -> None:
    """The console entry point: click's usage errors become one line too, not a panel."""
    from vlmdoctor.supervise import (
        Terminated,
        describe_interruption,
        handle_termination,
        interrupted_exit_code,
        terminated_by,
    )

    handle_termination()  # SIGTERM / SIGHUP unwind like Ctrl-C: children stopped, temp folders removed
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:  # help was asked for by giving nothing
        out.print(e.ctx.get_help() if getattr(e, "ctx", None) else e.format_message(), markup=False, highlight=False)
        sys.exit(EXIT_USAGE)
    except BrokenPipeError:  # a print outside the console: the reader went away (`| head`), quietly
        from vlmdoctor.files import reader_gone

        reader_gone(sys.stdout)
        sys.exit(0)
    except _EXITS as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code if isinstance(code, int) else 0)
    except click_errors.ClickException as e:  # a usage error: bad flag, value that does not parse
        where = f" (see: {e.ctx.command_path} --help)" if getattr(e, "ctx", None) else ""
        err.print(f"error: {_one_line(e.format_message())}{where}", highlight=False, markup=False)
        sys.exit(e.exit_code)
    except _ABORTS as e:
        why = e if isinstance(e, KeyboardInterrupt) else e.__cause__ or e.__context__  # click wraps Ctrl-C in Abort
        if not isinstance(why, KeyboardInterrupt):
            why = KeyboardInterrupt()
        err.print(describe_interruption(why), highlight=False, markup=False)
        sys.exit(interrupted_exit_code(why))
    except SystemExit:
        raise
    except BaseException as e:  # raised outside a command body
        message, exit_code = describe_error(e)
        err.print(message if isinstance(e, KeyboardInterrupt) else f"error: {message}", highlight=False, markup=False)
        sys.exit(exit_code)
    if code == 130 and terminated_by() is not None:  # typer turns an interruption while it parses into 130,
        why = Terminated(terminated_by())  # a SIGTERM too: said, and 143 for it
        err.print(describe_interruption(why), highlight=False, markup=False)
        sys.exit(interrupted_exit_code(why))
    sys.exit(code if isinstance(code, int) else 0)
