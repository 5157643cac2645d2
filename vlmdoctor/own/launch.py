"""`vlmdoctor run -- python train.py ARGS`: doctor a training script without changing a line of it.

The script runs in a child Python process started with vlmdoctor's bootstrap in front of it (child.py: an
optimizer step hook, then the script as `__main__`); under torchrun or accelerate launch every rank starts in it
(launchers.py). The child measures and writes the report; this (parent) process passes the script's output
through to the terminal and into DIR/script.log, then reads the child's copy of the report, diagnoses what the
child did not, writes it and prints. `measure_script` is one timed run of a script, for the gate.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlmdoctor import SCHEMA_VERSION, supervise
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_OK, EXIT_OOM, UsageError, VlmdoctorError
from vlmdoctor.files import (
    adopt,
    check_distinct,
    check_inputs_kept,
    check_output_dir,
    check_writable,
    claim,
    json_text,
    open_log,
    rescue,
    write_json,
)
from vlmdoctor.inputs import check_number
from vlmdoctor.own.child import ENV_KEY
from vlmdoctor.own.launchers import rank_command
from vlmdoctor.own.outputs import diagnose_report, output_paths, show, show_summary, write_outputs
from vlmdoctor.report.html import profile_html, write_html
from vlmdoctor.report.progress import say
from vlmdoctor.report.text import plain
from vlmdoctor.window import HTML, OUT, REPORT, STEPS, TRACE_STEPS, WARMUP, WINDOW_LIMITS

#: this vlmdoctor's folder: the bootstrap finds it there even under `python -I` or `-E` (PYTHONPATH ignored)
PKG_ROOT = str(Path(__file__).resolve().parents[2])
#: what the child's interpreter runs before the script: vlmdoctor's hooks, or, where vlmdoctor cannot be
#: imported by the user's interpreter, the script alone, as `python SCRIPT` would run it
BOOTSTRAP = f"""import sys
sys.path.append({PKG_ROOT!r})
try:
    from vlmdoctor.own.child import child_main
except Exception as e:
    print(f"vlmdoctor: could not hook in, the script runs unmeasured: {{type(e).__name__}}: {{e}}", file=sys.stderr)
    import os, runpy
    sys.path.remove({PKG_ROOT!r})
    os.environ.pop({ENV_KEY!r}, None)
    sys.argv = sys.argv[1:]
    if sys.argv[0] == "-m":
        sys.argv = sys.argv[1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")
else:
    child_main()
"""
#: interpreter options that take no value, passed on to the child's interpreter as given
PY_FLAGS = {"-u", "-O", "-OO", "-B", "-s", "-E", "-I", "-P", "-q", "-b", "-bb", "-d", "-v", "-R"}
PY_FLAGS_WITH_VALUE = {"-W", "-X"}
MULTI_PROCESS_LAUNCHERS = {"torchrun", "accelerate", "deepspeed", "mpirun", "srun"}


def split_command(command: Sequence[str], cwd: str | None = None) -> tuple[list[str], list[str]]:
    """`python [opts] train.py ARGS`, `train.py ARGS` or `python -m pkg.mod ARGS` -> (the interpreter with its
    options, exactly as given; what follows them). A command without an interpreter gets this one.

    `cwd`: the folder the command runs in (the gate runs a recorded command in a baseline checkout)."""
    cmd = list(command)
    if not cmd:
        raise UsageError("give the training command after --, e.g.: vlmdoctor run -- python train.py --epochs 1")
    if Path(cmd[0]).name in MULTI_PROCESS_LAUNCHERS:  # vlmdoctor run follows torchrun and accelerate (launchers.py)
        raise UsageError(
            f"{Path(cmd[0]).name} starts several processes, which this command does not follow; "
            "give one process: python train.py ARGS"
        )
    interpreter = [sys.executable]
    if Path(cmd[0]).name.startswith("python") and not cmd[0].endswith(".py"):
        interpreter = [cmd.pop(0)]
        while cmd and cmd[0].startswith("-") and cmd[0] != "-m":
            flag = cmd.pop(0)
            interpreter.append(flag)
            if flag == "-c":
                raise UsageError("python -c is not supported; put the code in a script file")
            if flag in PY_FLAGS_WITH_VALUE and cmd:
                interpreter.append(cmd.pop(0))
            elif flag not in PY_FLAGS and flag[:2] not in PY_FLAGS_WITH_VALUE:
                raise UsageError(f"interpreter option {flag} is not supported by vlmdoctor run")
    if not cmd:
        raise UsageError("no script given after the interpreter; e.g.: vlmdoctor run -- python train.py")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("python -m needs a module name")
        return interpreter, cmd
    target = Path(cwd or ".") / cmd[0]
    if not (target.is_file() or (target / "__main__.py").is_file()):  # a script, or a folder python can run
        raise UsageError(f"{cmd[0]}: no such script file" + (f" in {cwd}" if cwd else ""))
    return interpreter, cmd


def parse_command(command: Sequence[str], cwd: str | None = None) -> list[str]:
    """What follows the interpreter and its options (see `split_command`)."""
    return split_command(command, cwd)[1]


def child_command(command: Sequence[str], cwd: str | None = None) -> list[str]:
    """The user's interpreter, with its options, running the bootstrap in front of the script."""
    interpreter, argv = split_command(command, cwd)
    return [*interpreter, "-c", BOOTSTRAP, *argv]


#: environment variables that change how a training script runs (threads, devices, the allocator, compilers)
RECORDED_ENV_PREFIXES = ("OMP_", "MKL_", "CUDA_", "PYTORCH_", "TORCH", "NCCL_", "CUBLAS_", "CUDNN_", "TRITON_")
#: a variable whose name holds one of these is never recorded: a report is shared, a credential must not be
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def recorded_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables of `environ` that change how training runs, none that could be a credential."""
    environ = dict(os.environ if environ is None else environ)
    return {
        k: v
        for k, v in sorted(environ.items())
        if k.startswith(RECORDED_ENV_PREFIXES) and not any(w in k.upper() for w in SECRET_WORDS)
    }


def _interpreter_path(command: Sequence[str]) -> str:
    """The interpreter the command runs: the user's (a venv's, a conda shim's) found on PATH, else this one."""
    try:
        name = split_command(command)[0][0]
    except UsageError:
        return sys.executable
    return shutil.which(name) or name


def recorded_command(command: Sequence[str], warmup: int, steps: int) -> dict[str, Any]:
    """What `vlmdoctor gate --remeasure-baseline` needs to run the training again: the command as given, the
    folder it ran in, the interpreter, the variables that matter, and the measured window."""
    return {
        "command": list(command),
        "cwd": os.getcwd(),
        "python": _interpreter_path(command),
        "env": recorded_env(),
        "warmup": warmup,
        "steps": steps,
    }


def child_env(settings: dict[str, Any], extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the child: the settings for its bootstrap, and this vlmdoctor importable first."""
    env = {**os.environ, **(extra or {})}
    env[ENV_KEY] = json.dumps(settings)
    pkg_root = PKG_ROOT  # this vlmdoctor, importable in the child
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def measure_script(
    command: Sequence[str],
    cwd: str,
    warmup: int,
    steps: int,
    python: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """One timed run of a training script: a side of the gate's pairs. Untraced and undiagnosed (the pairs
    judge time), stopped after its window (the gate does not wait for the training), output to a log only.
    A run that fails comes back as a report with its status and the end of its output, never an exception."""
    interpreter, argv = split_command(command, cwd)
    if python:  # the interpreter the baseline was recorded with, the command's own options kept
        interpreter = [python, *interpreter[1:]]
    with supervise.scratch("vlmdoctor-gate-") as tmp:
        settings = {
            "out": str(tmp),
            "warmup": warmup,
            "steps": steps,
            "trace_steps": 0,
            "stop_after_window": True,
            "stage": None,
            "rules_dirs": [],
            "quiet": True,
            "diagnose": False,
            "html": False,
        }
        log = tmp / "script.log"

        def failed(status: str, message: str) -> dict[str, Any]:
            tail = log.read_text(errors="replace")[-400:] if log.exists() else ""
            return {
                "schema_version": SCHEMA_VERSION,
                "status": status,
                "error": {"type": "ScriptFailed", "message": message + (f"; its output ended: {tail}" if tail else "")},
            }

        with open_log(log) as f:  # an owned process group: a timeout or Ctrl-C stops all of it
            outcome = supervise.run(
                [*interpreter, "-c", BOOTSTRAP, *argv],
                env=child_env(settings, env),
                cwd=cwd,
                timeout=timeout,
                log=f,
            )
        if outcome.timed_out:
            return failed("timeout", f"the script took longer than {timeout:.0f} s")
        rc = outcome.returncode
        path = tmp / "report.json"
        if not path.exists():
            return failed("error", f"the script exited with code {rc} and left no report")
        report = json.loads(path.read_text())
        code = (report.get("script") or {}).get("exit_code")
        if rc != 0 or code:
            return failed("error", f"the script exited with code {code if code is not None else rc}")
        if report.get("status") == "ok":
            report.setdefault("script", {}).update(recorded_command(command, warmup, steps) | {"cwd": cwd})
        return report


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def _write_kept(report: dict[str, Any], folder: Path, copy: str | None) -> Path | None:
    """OUT/report.json, its page and the --json copy; where OUT/ will not take them (the script wrote a report.json
    of its own there, a full disk), the report goes to a rescue file the line names: never lost, nothing replaced."""
    try:
        write_outputs(report, folder, copy)
        return None
    except (OSError, VlmdoctorError) as e:
        why = e.message if isinstance(e, VlmdoctorError) else f"{type(e).__name__}: {e}"
        spot = None
        try:
            spot = rescue(REPORT, json_text(report).encode())
            kept = f"the report was saved to {spot}"
        except OSError:
            kept = "the report could not be saved anywhere else either"
        print(plain(f"vlmdoctor: {folder / REPORT}: {why}; {kept}"), file=sys.stderr, flush=True)
        if copy:
            with contextlib.suppress(OSError, VlmdoctorError):
                write_json(report, copy)
        return spot or folder / REPORT


def _inside(path: str | None, folder: Path) -> bool:
    """`path` (an output file, '-' or None) is a file directly in `folder`."""
    if not path or path == "-":
        return False
    return Path(path).parent.resolve() == folder.resolve()


def _adopt_identical(folder: Path, handoff: Path) -> None:
    """OUT's report and page become this command's to complete where they are the child's copy byte for byte: a
    file the script wrote there itself is kept (this command's report then goes to a rescue file it names)."""
    for name in (REPORT, HTML):
        with contextlib.suppress(OSError):
            if (folder / name).read_bytes() == (handoff / name).read_bytes():
                adopt(folder / name)


def _interrupted(
    exc: KeyboardInterrupt,
    handed: Path,
    folder: Path,
    log: Path,
    command: Sequence[str],
    warmup: int,
    steps: int,
    json_path: str | None,
) -> int:
    """The run was interrupted and the script stopped: what it measured is kept (the child writes its report
    when the window ends, and again as it stops); nothing measured, the interruption goes on up."""
    report = _read_report(handed)
    if report is None:
        raise exc
    report.setdefault("script", {}).update(recorded_command(command, warmup, steps))
    report["interrupted"] = supervise.describe_interruption(exc)
    report_path = write_outputs(report, folder, json_path if json_path != "-" else None)
    print(
        plain(
            f"vlmdoctor: {report['interrupted']}; the script was stopped. What was measured is kept in "
            f"{report_path} (script output: {log})"
        ),
        file=sys.stderr,
        flush=True,
    )
    return supervise.interrupted_exit_code(exc)


def _exit_code_of(code: Any) -> int:
    """The script's own exit code, as its shell would see it (a signal as 128+N): `vlmdoctor run` passes it on."""
    if not isinstance(code, int) or code == 0:
        return EXIT_FAILED_RUN
    return 128 - code if code < 0 else code & 0xFF or EXIT_FAILED_RUN


def run_script(
    command: Sequence[str],
    out: str = OUT,
    warmup: int = WARMUP,
    steps: int = STEPS,
    trace_steps: int = TRACE_STEPS,
    stop_after_window: bool = False,
    stage: int | None = None,
    json_path: str | None = None,
    rules_dirs: Sequence[str] = (),
    force: bool = False,
    quiet: bool = False,
    html_path: str | None = None,
    selection: Any = None,
    verbose: bool = False,
) -> tuple[int, dict[str, Any] | None]:
    """Run the script under the bootstrap, then diagnose; returns (exit code, report).

    Under torchrun or accelerate launch every rank starts in the bootstrap (launchers.py);
    rank 0 prints and writes the job's report."""
    cmd = rank_command(command)
    if cmd is None:
        cmd = child_command(command)
    if stage is not None and stage not in (1, 2):
        raise UsageError("--stage must be 1 or 2")
    for name, v in (("warmup", warmup), ("steps", steps), ("trace_steps", trace_steps)):
        low, high = WINDOW_LIMITS[name]
        low = max(low, 1) if name == "trace_steps" else low  # run always traces: its diagnosis needs a window
        check_number("--" + name.replace("_", "-"), v, minimum=low, maximum=high, integer=True)
    folder = Path(out)
    report_path, page_path = folder / REPORT, folder / HTML
    log = folder / "script.log"
    check_distinct(json=json_path, html=html_path, out=report_path)
    check_output_dir(folder, "--out")
    check_output_dir(folder / "trace", "--out")  # where the trace goes: a folder, never a link out of --out
    for path in (report_path, page_path, log):  # the rule of every output: a regular file, replaced with --force
        if folder.is_dir():
            check_writable(path, force, "--out")
    if not folder.exists() and any(_inside(p, folder) for p in (json_path, html_path)):
        folder.mkdir(parents=True)  # --out creates its folder: a --json or --html inside it is no missing folder
    check_writable(json_path, force, "--json")
    check_writable(html_path, force, "--html")
    scripts = [a for a in command if str(a).endswith(".py") and Path(a).is_file()]  # under a launcher too
    check_inputs_kept(
        {"the script": scripts, "a --rules folder": list(rules_dirs)},
        {"--out": [report_path, page_path, log], "--json": json_path, "--html": html_path},
    )
    # every folder the run writes in is checked before the script starts: a read-only or full --out is
    # found now, not after the training ran
    supervise.check_folder(folder, "--out")
    supervise.check_file_folders(json=json_path, html=html_path)
    folder.mkdir(parents=True, exist_ok=True)
    for p in (report_path, page_path):
        if p.exists():  # --force: an earlier run's report must not pass for this one's
            p.unlink()
    claim(report_path, page_path)  # from now on a file there is the script's own unless it is the child's copy
    handoff = Path(tempfile.mkdtemp(prefix="vlmdoctor-run-"))  # the child's copy of the report, for this process
    try:
        return _run_and_finish(
            cmd, command, folder, handoff, warmup, steps, trace_steps, stop_after_window, stage,
            json_path, rules_dirs, quiet, html_path, selection, verbose,
        )  # fmt: skip
    finally:
        shutil.rmtree(handoff, ignore_errors=True)


def _run_and_finish(
    cmd: list[str],
    command: Sequence[str],
    folder: Path,
    handoff: Path,
    warmup: int,
    steps: int,
    trace_steps: int,
    stop_after_window: bool,
    stage: int | None,
    json_path: str | None,
    rules_dirs: Sequence[str],
    quiet: bool,
    html_path: str | None,
    selection: Any,
    verbose: bool,
) -> tuple[int, dict[str, Any] | None]:
    """The script under the bootstrap, then its report: read from the child's private copy (`handoff`), never from
    OUT/, where the script may write a report.json of its own; OUT's files are this command's only where they are
    the child's copy byte for byte."""
    env = child_env(
        {
            "out": str(folder),
            "warmup": warmup,
            "steps": steps,
            "trace_steps": trace_steps,
            "stop_after_window": stop_after_window,
            "stage": stage,
            "rules_dirs": [str(Path(d).resolve()) for d in rules_dirs],
            "selection": selection.to_json() if selection else None,
            "quiet": quiet,
            "verbose": verbose,
            "handoff": str(handoff),
        },
        {"VLMDOCTOR_JOB": time.strftime("%Y%m%d-%H%M%S")},  # the ranks' one name for their trace folder
    )
    log = folder / "script.log"
    sink = sys.stderr if json_path == "-" else sys.stdout  # stdout carries the JSON: the script's output to stderr
    log_file = open_log(log)  # through the one writer, before the script starts: a regular file, never a link
    try:
        with log_file as f:  # the script's output, as it comes, to the terminal and the log
            outcome = supervise.run(cmd, env=env, log=f, echo=sink.buffer, stdin=None)
    except KeyboardInterrupt as e:  # Ctrl-C / SIGTERM: passed on to the script's group, which is stopped
        _adopt_identical(folder, handoff)  # the script's bootstrap wrote them: this command completes them
        return _interrupted(e, handoff / REPORT, folder, log, command, warmup, steps, json_path), _read_report(
            handoff / REPORT
        )
    _adopt_identical(folder, handoff)
    if outcome.left_running:
        print(
            f"vlmdoctor: the script left {outcome.left_running} process(es) running when it exited; stopped them",
            file=sys.stderr,
            flush=True,
        )
    ending = _Ending(folder, log, json_path, quiet, sink, rules_dirs, selection, verbose)
    report = _read_report(handoff / REPORT)
    if report is None:
        say(f"the script exited with code {outcome.returncode} and left no report; its output is in {log}")
        return EXIT_FAILED_RUN, None
    report.setdefault("script", {}).update(recorded_command(command, warmup, steps))
    return ending.finish(report, outcome.returncode, html_path)


@dataclass
class _Ending:
    """How a `vlmdoctor run` ends once the script did: its report diagnosed (unless the child did it while the script
    ran), written (OUT/, --json, or a rescue file), printed, and the exit code."""

    folder: Path
    log: Path
    json_path: str | None
    quiet: bool
    sink: Any  # the script's output went there: stderr when stdout carries the JSON
    rules_dirs: Sequence[str]
    selection: Any
    verbose: bool = False  # every table, not one screen

    @property
    def copy(self) -> str | None:
        return self.json_path if self.json_path != "-" else None  # '-': the caller prints the report, once

    @property
    def prints(self) -> bool:
        return not self.quiet and self.json_path != "-"

    def summary(self, report: dict[str, Any], rescued: Path | None) -> None:
        """The summary that ends the output, naming where the report went when OUT/ would not take it."""
        if not self.quiet:
            moved = {"report": str(rescued)} if rescued else {}
            show_summary(report, output_paths(report, self.folder) | {"log": str(self.log)} | moved, self.sink)

    def finish(self, report: dict[str, Any], rc: int, html_path: str | None) -> tuple[int, dict[str, Any] | None]:
        script = report.get("script") or {}
        err = report.get("error") or {}
        if rc != 0 or script.get("exit_code"):
            return self.script_failed(report, rc)
        if err.get("type") in ("NoSteps", "NotStarted"):
            say(f"{err['message']}: nothing to measure (its output: {self.log})")
            return EXIT_FAILED_RUN, report
        shown = bool(report.get("diagnosed_while_running"))  # the child printed it when the window ended
        if not shown:
            diagnose_report(report, report.get("audience") or "loop", self.rules_dirs, self.selection)
        rescued = _write_kept(report, self.folder, self.copy)
        if html_path:
            write_html(profile_html(report), Path(html_path), force=True)  # refused up front unless --force
        if self.prints and not shown:
            show(report, verbose=self.verbose)
        self.summary(report, rescued)
        return (EXIT_FAILED_RUN if rescued else EXIT_OK), report

    def script_failed(self, report: dict[str, Any], rc: int) -> tuple[int, dict[str, Any]]:
        """The script failed (or ran out of memory): what it measured before stands, its exit code is passed on."""
        script = report.get("script") or {}
        code = script.get("exit_code") if script.get("exit_code") is not None else rc
        if report.get("status") == "ok":  # measured before it failed: the diagnosis still stands
            if not report.get("diagnosed_while_running"):
                diagnose_report(report, report.get("audience") or "loop", self.rules_dirs, self.selection)
                if self.prints and "diagnosis" in report:
                    show(report, verbose=self.verbose)
            report["status"] = "error"
        oom = bool(script.get("out_of_memory"))
        report["error"] = {
            "type": "OutOfMemoryError" if oom else "ScriptFailed",
            "message": f"the script exited with code {code}" + (f" ({script['error']})" if script.get("error") else ""),
            "exit_code": code,
        }
        if oom:
            report["status"] = "oom"
        rescued = _write_kept(report, self.folder, self.copy)
        self.summary(report, rescued)
        say(f"the script {'ran out of memory' if oom else 'failed'} (exit code {code}); its output is in {self.log}")
        return (EXIT_OOM if oom else _exit_code_of(code)), report
