"""What every command shares: the one typer app, its two consoles, the words `--help` uses for a value, and the
error handling that turns any failure into one line on stderr and its exit code, never a traceback.

The commands register on `app` (vlmdoctor/commands/*.py, in the order vlmdoctor/cli.py lists them); `main`, in
cli.py, is the console entry point around it.
"""

from __future__ import annotations

import errno
import json
import tempfile
import time
import traceback
from typing import Any

import typer
import yaml

try:  # typer >= 0.20 carries its own copy of click; its exceptions are those, not click's
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import exceptions as click_errors

from vlmdoctor import __version__
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_OOM, EXIT_USAGE, VlmdoctorError
from vlmdoctor.report.text import SafeConsole, esc
from vlmdoctor.supervise import describe_interruption, interrupted_exit_code

#: exceptions that end a command on purpose, with their own exit code
EXITS = tuple({typer.Exit, SystemExit, *(getattr(m, "Exit", SystemExit) for m in (click_errors, typer))})
ABORTS = tuple({getattr(m, "Abort", KeyboardInterrupt) for m in (click_errors, typer)})

app = typer.Typer(
    no_args_is_help=True,
    help="Profiler-driven diagnosis of vision-language-model training.",
)

#: how --help names a value's type, in place of typer's Python names (<str>, <int>)
_TYPE_WORDS = {"str": "TEXT", "int": "INTEGER", "float": "NUMBER", "Path": "PATH", "list[str]": "TEXT"}
#: the hook through which typer 0.2x prints <str>/<bool>; a typer without it keeps its own words
_typer_type = getattr(typer.core.TyperOption, "display_type_rich", None)


def _value_word(param: Any, ctx: Any) -> str | None:
    """--help's value column: nothing for an on/off flag (typer prints <bool>), TEXT, INTEGER, NUMBER or the
    choices for a value."""
    if param.metavar is not None:
        return param.metavar
    if getattr(param, "is_flag", False) or getattr(param, "is_bool_flag", False):
        return None
    word = (_typer_type(param, ctx) or "").removeprefix("<").removesuffix(">")
    return _TYPE_WORDS.get(word, word.upper() if word.isidentifier() else word) or None


if _typer_type is not None:
    typer.core.TyperOption.display_type_rich = _value_word
    typer.core.TyperArgument.display_type_rich = _value_word
err = SafeConsole(stderr=True, soft_wrap=True)  # soft wrap: an error stays one line
out = SafeConsole()  # text from inputs is shown as text (report/console.py)


def _version(value: bool) -> None:
    if value:
        out.print(f"vlmdoctor {__version__}", markup=False, highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """Profiler-driven diagnosis of vision-language-model training."""


def exit_if_failed(failures: list[str | None]) -> None:
    """Writes that failed after the work: one line each (naming where the content was kept), exit 1."""
    failures = [f for f in failures if f]
    for f in failures:
        err.print(f"[bold red]error:[/bold red] {esc(f)}", highlight=False)
    if failures:
        raise typer.Exit(EXIT_FAILED_RUN)


class user_errors:
    """Turns every error into one line on stderr and its exit code, never a traceback.

    Errors the user can cause (bad input files, paths, numbers) exit 2; a failed run or a write
    that failed after the work exits 1; running out of host memory exits 3; Ctrl-C exits 130.
    Anything else is a bug: one line, and the full traceback goes to a file the line names.
    """

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None or isinstance(exc, EXITS):
            return False
        if isinstance(exc, click_errors.ClickException):
            return False  # click's own usage errors print themselves and exit 2
        message, code = describe_error(exc)
        interrupted = isinstance(exc, KeyboardInterrupt)
        message = message if interrupted else one_line(message)
        err.print(message if interrupted else f"[bold red]error:[/bold red] {esc(message)}", highlight=False)
        raise typer.Exit(code)


#: errno values of an OSError the user caused (a path that is missing, refused, a folder, too long ...): exit 2
USER_ERRNOS = (
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


def describe_error(exc: BaseException) -> tuple[str, int]:
    """(one line, exit code) for any exception that reaches the top of a command."""
    if isinstance(exc, VlmdoctorError):
        return one_line(exc.message), exc.exit_code
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C 130; SIGTERM (supervise.Terminated) 143
        return describe_interruption(exc), interrupted_exit_code(exc)
    if isinstance(exc, MemoryError):
        return "out of host memory (MemoryError); use fewer samples or smaller inputs", EXIT_OOM
    if isinstance(exc, RecursionError):
        return "an input is nested too deeply to read (RecursionError)", EXIT_USAGE
    if isinstance(exc, UnicodeDecodeError):
        return f"an input file is not UTF-8 text ({exc.reason} at byte {exc.start})", EXIT_USAGE
    if isinstance(exc, (yaml.YAMLError, json.JSONDecodeError)):
        return f"an input file does not parse: {one_line(str(exc))}", EXIT_USAGE
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}", EXIT_USAGE if exc.errno in USER_ERRNOS else EXIT_FAILED_RUN
    return _internal_error(exc), EXIT_FAILED_RUN


#: an error line is read by a person: past this many characters its middle is left out, and says so
ERROR_LINE_MAX = 600


def one_line(text: str) -> str:
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
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        fd, path = tempfile.mkstemp(prefix=f"vlmdoctor-crash-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".txt")
        with open(fd, "w") as f:
            f.write(text)
        where = f"full traceback: {path}"
    except OSError:
        where = "the traceback could not be saved"
    return f"internal error: {type(exc).__name__}: {one_line(str(exc)) if str(exc) else ''} ({where}; please report it)"
