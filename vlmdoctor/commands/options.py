"""The options several commands share, declared once in their groups: each a typer `Annotated` alias holding its
flag, help and metavar, which a command takes as `json_path: JsonOut = None`. Where the help names the command's own
document, a small function makes the alias (`json_out("report")`), so the flag and its words stay here.

A default that is not "not given" (None, off) is the project's own constant, named at the use, never a number typed
again: window.py (the measured window), supervise.py (a run's time limit), doctor/settings.py (the gate).

Groups: outputs (--json, --html, --force, --quiet, --verbose); rule choice (--rules, --select, --ignore, and
`rule_choice`, which reads them over the project's [tool.vlmdoctor] table); the measured window (--warmup, --steps,
--trace-steps); several GPUs (torchrun's launch options; --nproc-per-node and --parallel are run-config knobs,
made by commands/knobs.py); runs (--timeout). An option only one command has is declared in that command's module.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

import typer

from vlmdoctor.doctor.select import build_selection, split_tokens
from vlmdoctor.doctor.settings import project_settings
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import check_rules_dirs

# --- outputs ----------------------------------------------------------------------------------------------------


def json_out(what: str) -> Any:
    """--json PATH|-: the command's document (`what`, as its help names it) as JSON, to a file or to stdout."""
    return Annotated[
        str | None,
        typer.Option(
            "--json", metavar="PATH|-", help=f"write the {what} as JSON to PATH ('-': standard output, and no table)"
        ),
    ]


def json_also(words: str) -> Any:
    """--json of a command whose results are files of their own (`run`, `treat`): the document written here too."""
    return Annotated[str | None, typer.Option("--json", help=words)]


def html_out(words: str = "write a self-contained HTML report here") -> Any:
    """--html PATH: the command's HTML page."""
    return Annotated[str | None, typer.Option("--html", help=words)]


def force(words: str) -> Any:
    """--force: overwrite what the command writes (`words` says which files)."""
    return Annotated[bool, typer.Option("--force", help=words)]


def quiet(words: str, short: bool = False) -> Any:
    """--quiet (and -q where `short`): print less (`words` says what is left)."""
    return Annotated[bool, typer.Option(*(("--quiet", "-q") if short else ("--quiet",)), help=words)]


HtmlOut = html_out()
ForceJson = force("overwrite an existing --json file")
#: --verbose / -v on the commands that diagnose (`analyze`, `profile`, `run`): one screen by default, this for more
Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="every table, and each prescription's evidence")]


def hush_profiler() -> None:
    """Under --quiet: torch's profiler (kineto) prints `USDT: ... profiler_start` lines on stderr at its default
    log level; kineto's level 6 is above them. Only kineto's own log is affected (the variable reaches the runs'
    child processes too): Python errors, tracebacks and the training's own output print as always. A level the
    user set is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


# --- rule choice ------------------------------------------------------------------------------------------------

RULES_WORDS = "extra folder of rule files"
#: --rules on the commands that diagnose
RulesDirs = Annotated[list[str] | None, typer.Option("--rules", help=f"{RULES_WORDS} (repeatable)")]
#: --rules on `rules list` and `rules show` (the same option; their help never said it repeats)
RuleFolders = Annotated[list[str] | None, typer.Option("--rules", help=RULES_WORDS)]
Select = Annotated[
    list[str] | None,
    typer.Option(
        "--select",
        metavar="RULES",
        help="only these rules: ids (or globs: fusion-*), layers (1-5, precision ...) or severities (high, "
        "medium, low); comma-separated, repeatable; the others' findings are listed as muted",
    ),
]
Ignore = Annotated[
    list[str] | None,
    typer.Option(
        "--ignore",
        metavar="RULES",
        help="mute these rules (ids, globs, layers or severities; comma-separated, repeatable): "
        "their findings are listed as muted, never fail the gate",
    ),
]


def rule_choice(
    select: list[str] | None, ignore: list[str] | None, rules_dirs: list[str] | None
) -> tuple[Any, list[str], dict[str, Any]]:
    """(selection, rule folders, project settings): --select/--ignore/--rules over the nearest
    pyproject.toml's [tool.vlmdoctor] table, every token checked against the rules' ids (exit 2 with
    "did you mean" on a typo)."""
    settings = project_settings()
    check_rules_dirs(list(rules_dirs or []))
    for d in settings.get("rules", []):
        if not Path(d).is_dir():
            raise UsageError(f"{settings['_where']}: [tool.vlmdoctor] rules: {d} is not a folder")
    dirs = [*(rules_dirs or []), *settings.get("rules", [])]
    tokens = split_tokens(select) + split_tokens(ignore) + split_tokens(settings.get("select"))
    tokens += split_tokens(settings.get("ignore"))
    ids: list[str] = []
    if tokens:
        from vlmdoctor.doctor.rules import load_rules  # deferred: pandas

        ids = [r.id for r in load_rules(*dirs)[0]]
    return build_selection(select, ignore, ids, settings), dirs, settings


# --- the measured window (defaults: window.py) ------------------------------------------------------------------

Warmup = Annotated[int, typer.Option("--warmup", help="optimizer steps before the timed window")]
Steps = Annotated[int, typer.Option("--steps", help="timed optimizer steps")]


def trace_steps(words: str, panel: str | None = None) -> Any:
    """--trace-steps: the traced window's steps (`profile` says it in its trace panel, `run` after the timed ones)."""
    return Annotated[int, typer.Option("--trace-steps", help=words, rich_help_panel=panel)]


# --- several GPUs: how torchrun starts the ranks (run/distributed.py's Rendezvous) and the scaling's reference ----

#: the help panel of torchrun's options
LAUNCH = "torchrun launch"
Nnodes = Annotated[str, typer.Option("--nnodes", help="torchrun: nodes (N or MIN:MAX)", rich_help_panel=LAUNCH)]
NodeRank = Annotated[int | None, typer.Option("--node-rank", help="torchrun: this node's rank", rich_help_panel=LAUNCH)]
RdzvBackend = Annotated[
    str | None, typer.Option("--rdzv-backend", help="torchrun: rendezvous backend (c10d)", rich_help_panel=LAUNCH)
]
RdzvEndpoint = Annotated[
    str | None, typer.Option("--rdzv-endpoint", help="torchrun: rendezvous HOST:PORT", rich_help_panel=LAUNCH)
]
RdzvId = Annotated[
    str | None, typer.Option("--rdzv-id", help="torchrun: job id shared by all nodes", rich_help_panel=LAUNCH)
]
MasterAddr = Annotated[
    str | None,
    typer.Option("--master-addr", help="torchrun: rank 0's host (static rendezvous)", rich_help_panel=LAUNCH),
]
MasterPort = Annotated[
    int | None, typer.Option("--master-port", help="torchrun: rank 0's port", rich_help_panel=LAUNCH)
]
OneGpuReport = Annotated[
    str | None,
    typer.Option(
        "--one-gpu-report",
        help="a report of the same config on one GPU: the reference of the scaling efficiency",
        rich_help_panel=LAUNCH,
    ),
]
MeasureOneGpu = Annotated[
    bool,
    typer.Option(
        "--measure-one-gpu",
        help="first run the same config on one GPU in this command, for the scaling efficiency",
        rich_help_panel=LAUNCH,
    ),
]

# --- runs (default: supervise.RUN_TIMEOUT_S) --------------------------------------------------------------------


def timeout(flag: str = "--timeout") -> Any:
    """A run's time limit in seconds (`treat` calls it --trial-timeout)."""
    return Annotated[float, typer.Option(flag, help="seconds one run may take")]


Timeout = timeout()
