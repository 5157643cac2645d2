"""The `vlmdoctor` command line: the one typer app with its commands (vlmdoctor/commands/, one module each, thin
over the Python API), and `main`, the console entry point (pyproject's `vlmdoctor`, `python -m vlmdoctor`): every
error one line and its exit code (errors.py), usage errors included."""

from __future__ import annotations

import sys

from vlmdoctor.commands import analyze, compare, export, facts, gate, models, profile, rules, run, sweep, treat
from vlmdoctor.commands.app import ABORTS, EXITS, app, click_errors, describe_error, err, one_line, out
from vlmdoctor.errors import EXIT_USAGE
from vlmdoctor.files import reader_gone
from vlmdoctor.supervise import (
    Terminated,
    describe_interruption,
    handle_termination,
    interrupted_exit_code,
    terminated_by,
)

__all__ = ["app", "describe_error", "err", "main", "out"]

#: the commands, in the order `--help` lists them
COMMANDS = (profile, analyze, facts, run, models, treat, sweep, gate, compare, export, rules)
for _command in COMMANDS:
    _command.register(app)


def main() -> None:
    """The console entry point: click's usage errors become one line too, not a panel."""
    handle_termination()  # SIGTERM / SIGHUP unwind like Ctrl-C: children stopped, temp folders removed
    try:
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as e:  # help was asked for by giving nothing
        out.print(e.ctx.get_help() if getattr(e, "ctx", None) else e.format_message(), markup=False, highlight=False)
        sys.exit(EXIT_USAGE)
    except BrokenPipeError:  # a print outside the console: the reader went away (`| head`), quietly
        reader_gone(sys.stdout)
        sys.exit(0)
    except EXITS as e:
        code = getattr(e, "exit_code", getattr(e, "code", 0))
        sys.exit(code if isinstance(code, int) else 0)
    except click_errors.ClickException as e:  # a usage error: bad flag, value that does not parse
        where = f" (see: {e.ctx.command_path} --help)" if getattr(e, "ctx", None) else ""
        err.print(f"error: {one_line(e.format_message())}{where}", highlight=False, markup=False)
        sys.exit(e.exit_code)
    except ABORTS as e:
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
