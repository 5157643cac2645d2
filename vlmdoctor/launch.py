"""`vlmdoctor run -- python train.py ARGS`: doctor a training script without changing a line of it.

The script runs in a child Python process whose bootstrap registers a global optimizer step
hook (`torch.optim.optimizer.register_optimizer_step_post_hook`). The first optimizer step shows
which optimizer trains and so which model it trains (the module holding its parameters); from
then on each step of that optimizer is one training step for vlmdoctor's Recorder (the same as
`vlmdoctor.Doctor`): warm-up, a timed window, a traced window with the model's parts marked.
The child writes the measured report; this (parent) process passes the script's output through
to the terminal and into DIR/script.log, then analyzes the trace, diagnoses and prints.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_OK, UsageError

ENV_KEY = "VLMDOCTOR_RUN"
BOOTSTRAP = "from vlmdoctor.launch import child_main; child_main()"
#: interpreter options that take no value and can be dropped (the child is a fresh interpreter)
PY_FLAGS = {"-u", "-O", "-OO", "-B", "-s", "-E", "-I", "-q", "-b", "-bb"}
PY_FLAGS_WITH_VALUE = {"-W", "-X"}
MULTI_PROCESS_LAUNCHERS = {"torchrun", "accelerate", "deepspeed", "mpirun", "srun"}


def parse_command(command: Sequence[str], cwd: str | None = None) -> list[str]:
    """`python [opts] train.py ARGS`, `train.py ARGS` or `python -m pkg.mod ARGS` -> what follows the interpreter.

    `cwd`: the folder the command runs in (the gate runs a recorded command in a baseline checkout)."""
    cmd = list(command)
    if not cmd:
        raise UsageError("give the training command after --, e.g.: vlmdoctor run -- python train.py --epochs 1")
    if Path(cmd[0]).name in MULTI_PROCESS_LAUNCHERS:  # vlmdoctor run follows torchrun and accelerate (launchers.py)
        raise UsageError(
            f"{Path(cmd[0]).name} starts several processes, which this command does not follow; "
            "give one process: python train.py ARGS"
        )
    if Path(cmd[0]).name.startswith("python") and not cmd[0].endswith(".py"):
        cmd = cmd[1:]
        while cmd and cmd[0].startswith("-") and cmd[0] != "-m":
            flag = cmd.pop(0)
            if flag == "-c":
                raise UsageError("python -c is not supported; put the code in a script file")
            if flag in PY_FLAGS_WITH_VALUE and cmd:
                cmd.pop(0)
            elif flag not in PY_FLAGS and flag[:2] not in PY_FLAGS_WITH_VALUE:
                raise UsageError(f"interpreter option {flag} is not supported by vlmdoctor run")
    if not cmd:
        raise UsageError("no script given after the interpreter; e.g.: vlmdoctor run -- python train.py")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise UsageError("python -m needs a module name")
        return cmd
    if not (Path(cwd or ".") / cmd[0]).is_file():
        raise UsageError(f"{cmd[0]}: no such script file" + (f" in {cwd}" if cwd else ""))
    return cmd


# --- the child -----------------------------------------------------------------------------------


class _StopAfterWindow(BaseException):
    """Raised out of the optimizer step once the windows are measured (--stop-after-window)."""


def find_model(optimizer: Any) -> Any:
    """The module whose parameters the optimizer holds: the root module covering most of them."""
    from torch import nn

    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes (torch.distributed)
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    children = {id(c) for m in modules for c in m.children()}
    best, best_key = None, (0, 0)
    for m in modules:
        if id(m) in children:
            continue
        ids = [id(p) for p in m.parameters()]
        key = (sum(i in wanted for i in ids), len(ids))
        if key[0] and key > best_key:
            best, best_key = m, key
    return best  # DDP / FSDP / torch.compile wrappers included: the Recorder unwraps them (api.unwrap)


def _trainer() -> Any:
    """The transformers Trainer the script built, if any."""
    mod = sys.modules.get("transformers.trainer")
    cls = getattr(mod, "Trainer", None) if mod else None
    if cls is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, cls):
                return o
    return None


class _Child:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.s = settings
        self.optimizer: Any = None
        self.rec: Any = None
        self.report: dict[str, Any] | None = None  # set once written (at the window's end)
        self.handed_over = False
        self.steps_of_others = 0

    def on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if self.optimizer is None:
            self._start(optimizer)
            return
        if optimizer is not self.optimizer or self.rec is None:
            self.steps_of_others += 1
            return
        self.rec.step()
        if self.rec.window_done and self.report is None:
            self._report_now()
            if self.s.get("stop_after_window"):
                raise _StopAfterWindow()

    def _report_now(self) -> None:
        """Diagnose and print as soon as the windows are measured, while the script trains on unmeasured.

        Under a launcher every rank gets here at the same step: rank 0 joins the others' numbers."""
        from vlmdoctor.api import _log, complete, show

        try:
            report = self.rec.finish()
            report["audience"] = self.rec.audience
            report["script"] = {"argv": self.s["argv"], "exit_code": None, "error": None}
            from vlmdoctor.doctor.select import Selection

            selection = Selection.from_json(self.s.get("selection"))
            report["diagnosed_while_running"] = True
            rules = self.s.get("rules_dirs") or []
            diagnose, html = self.s.get("diagnose", True), self.s.get("html", True)
            done = complete(report, self.rec, rules, selection, diagnose=diagnose, html=html)
            self.handed_over = done is None  # a rank other than 0: its numbers went to rank 0
            self.report = done or {}
            if done is not None and self.rec.say is not None:
                show(done, sys.stdout)
                goes_on = "" if self.s.get("stop_after_window") else "; the script goes on, unmeasured"
                self.rec.say(f"report written to {Path(self.s['out']) / 'report.json'}{goes_on}")
        except Exception as e:  # the analysis must not end the user's training
            self.report = {}
            _log(f"could not write the report now, training goes on: {type(e).__name__}: {e}")

    def _start(self, optimizer: Any) -> None:
        from vlmdoctor.api import Recorder, _log

        self.optimizer = optimizer
        try:
            model = find_model(optimizer)
            config: dict[str, Any] = {"script": self.s["argv"]}
            trainer = _trainer()
            audience = "loop"
            if getattr(trainer, "args", None) is not None:
                from vlmdoctor.run.trainer_args import sample_lengths, training_args_config

                config.update(training_args_config(trainer.args))
                config["sample_lengths"] = sample_lengths(trainer)
                audience = "trainer"
            config["optimizer"] = type(optimizer).__name__
            defaults = getattr(optimizer, "defaults", {}) or {}
            if "fused" in defaults:
                config["fused_optimizer"] = bool(defaults.get("fused"))
            self.rec = Recorder(
                model,
                self.s["out"],
                self.s["warmup"],
                self.s["steps"],
                self.s["trace_steps"],
                self.s.get("stage"),
                "script",
                config,
                audience,
                step_offset=1,  # the first optimizer step only finds the model
            )
            if not self.s.get("quiet") and self.rec.rank == 0:
                from vlmdoctor.report.progress import say

                self.rec.say = say
            self.rec.attach()
            self.rec.begin()  # steps count from the first optimizer step on: its inputs came before the hooks
        except Exception as e:
            self.rec = None
            _log(f"could not start measuring, the script goes on: {type(e).__name__}: {e}")

    def finish(self, exit_code: int | None, error: str | None) -> None:
        from vlmdoctor.api import complete, write_outputs
        from vlmdoctor.rank_join import rank_and_world

        out = Path(self.s["out"])
        if self.handed_over:
            return  # a rank other than 0: rank 0 holds its numbers
        if self.report:  # written at the window's end: add how the script ended
            self.report["script"] |= {
                "exit_code": exit_code,
                "error": error,
                "steps_of_other_optimizers": self.steps_of_others,
            }
            write_outputs(self.report, out, html=self.s.get("html", True))
            return
        if self.rec is None:
            report: dict[str, Any] = {
                "status": "error",
                "error": {
                    "type": "NoSteps" if self.optimizer is None else "NotStarted",
                    "message": "the script never called an optimizer step"
                    if self.optimizer is None
                    else "vlmdoctor could not start measuring (see the log)",
                },
            }
        else:
            report = self.rec.finish()
            report["audience"] = self.rec.audience
            if (report.get("error") or {}).get("type") == "NoSteps":
                report["error"]["message"] = (
                    "the script called the optimizer step only once; a step is timed "
                    "from one optimizer step to the next, so at least 2 are needed"
                )
        report["script"] = {
            "argv": self.s["argv"],
            "exit_code": exit_code,
            "error": error,
            "steps_of_other_optimizers": self.steps_of_others,
        }
        if self.rec is not None:  # the steps that ran: rank 0 joins the ranks, the parent diagnoses
            complete(report, self.rec, diagnose=False, html=False)
        elif rank_and_world()[0] == 0:
            write_outputs(report, out, html=False)


def child_main() -> None:
    """The child's bootstrap: hooks in, then the user's script as __main__."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    settings = json.loads(os.environ.pop(ENV_KEY))
    argv = sys.argv[1:]
    settings["argv"] = argv
    child = _Child(settings)
    handle = register_optimizer_step_post_hook(child.on_step)
    code: int | None = 0
    error = None
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = str(Path(argv[0]).resolve().parent)
            runpy.run_path(argv[0], run_name="__main__")
    except _StopAfterWindow:
        if child.rec is None or child.rec.rank == 0:
            print("vlmdoctor: stopped the script after the measured window (--stop-after-window)", file=sys.stderr)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException as e:  # the script's own error: its traceback, as python would print it
        traceback.print_exc()
        code = 1
        error = f"{type(e).__name__}: {e}"[:500]
    finally:
        handle.remove()
    try:
        child.finish(code, error)
    except Exception as e:
        print(f"vlmdoctor: could not write the report: {type(e).__name__}: {e}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)  # the script's exit code; skip atexit work of a script that already finished


# --- the parent ----------------------------------------------------------------------------------


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


def recorded_command(command: Sequence[str], warmup: int, steps: int) -> dict[str, Any]:
    """What `vlmdoctor gate --remeasure-baseline` needs to run the training again: the command as given, the
    folder it ran in, the interpreter, the variables that matter, and the measured window."""
    return {
        "command": list(command),
        "cwd": os.getcwd(),
        "python": sys.executable,
        "env": recorded_env(),
        "warmup": warmup,
        "steps": steps,
    }


def child_env(settings: dict[str, Any], extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the child: the settings for its bootstrap, and this vlmdoctor importable first."""
    env = {**os.environ, **(extra or {})}
    env[ENV_KEY] = json.dumps(settings)
    pkg_root = str(Path(__file__).resolve().parent.parent)  # this vlmdoctor, importable in the child
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
    from vlmdoctor import SCHEMA_VERSION

    argv = parse_command(command, cwd)
    with tempfile.TemporaryDirectory(prefix="vlmdoctor-gate-") as tmp:
        settings = {
            "out": tmp,
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
        log = Path(tmp) / "script.log"

        def failed(status: str, message: str) -> dict[str, Any]:
            tail = log.read_text(errors="replace")[-400:] if log.exists() else ""
            return {
                "schema_version": SCHEMA_VERSION,
                "status": status,
                "error": {"type": "ScriptFailed", "message": message + (f"; its output ended: {tail}" if tail else "")},
            }

        try:
            with log.open("wb") as f:
                rc = subprocess.run(
                    [python or sys.executable, "-c", BOOTSTRAP, *argv],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    env=child_env(settings, env),
                    cwd=cwd,
                    timeout=timeout,
                ).returncode
        except subprocess.TimeoutExpired:
            return failed("timeout", f"the script took longer than {timeout:.0f} s")
        path = Path(tmp) / "report.json"
        if not path.exists():
            return failed("error", f"the script exited with code {rc} and left no report")
        report = json.loads(path.read_text())
        code = (report.get("script") or {}).get("exit_code")
        if rc != 0 or code:
            return failed("error", f"the script exited with code {code if code is not None else rc}")
        if report.get("status") == "ok":
            report.setdefault("script", {}).update(recorded_command(command, warmup, steps) | {"cwd": cwd})
        return report


def _tee(proc: subprocess.Popen, log: Path, to_stderr: bool) -> None:
    """The script's output, as it comes, to the terminal (stderr when stdout carries the JSON) and the log."""
    sink = sys.stderr if to_stderr else sys.stdout
    with log.open("wb") as f:
        assert proc.stdout is not None
        while True:
            chunk = proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096)
            if not chunk:
                break
            f.write(chunk)
            f.flush()
            sink.buffer.write(chunk)
            sink.buffer.flush()


def run_script(
    command: Sequence[str],
    out: str = "doctor-out",
    warmup: int = 5,
    steps: int = 20,
    trace_steps: int = 2,
    stop_after_window: bool = False,
    stage: int | None = None,
    json_path: str | None = None,
    rules_dirs: Sequence[str] = (),
    force: bool = False,
    quiet: bool = False,
    html_path: str | None = None,
    selection: Any = None,
) -> tuple[int, dict[str, Any] | None]:
    """Run the script under the bootstrap, then diagnose; returns (exit code, report).

    Under torchrun or accelerate launch every rank starts in the bootstrap (vlmdoctor/launchers.py);
    rank 0 prints and writes the job's report."""
    from vlmdoctor.api import HTML, REPORT, diagnose_report, output_paths, show, show_summary, write_outputs
    from vlmdoctor.files import check_writable
    from vlmdoctor.launchers import rank_command

    cmd = rank_command(command)
    if cmd is None:
        cmd = [sys.executable, "-c", BOOTSTRAP, *parse_command(command)]
    if stage is not None and stage not in (1, 2):
        raise UsageError("--stage must be 1 or 2")
    for name, v in (("--warmup", warmup), ("--steps", steps), ("--trace-steps", trace_steps)):
        if v < (0 if name == "--warmup" else 1):
            raise UsageError(f"{name} must be at least {0 if name == '--warmup' else 1}")
    folder = Path(out)
    report_path, page_path = folder / REPORT, folder / HTML
    for p in (report_path, page_path):
        if p.exists() and not force:
            raise UsageError(f"{p} exists; pass --force to overwrite it, or --out another folder")
    from vlmdoctor.files import check_distinct

    check_distinct(json=json_path, html=html_path, out=report_path)
    check_writable(json_path, force, "--json")
    check_writable(html_path, force, "--html")
    folder.mkdir(parents=True, exist_ok=True)
    for p in (report_path, page_path):
        if p.exists():  # --force: an earlier run's report must not pass for this one's
            p.unlink()
    import time

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
        },
        {"VLMDOCTOR_JOB": time.strftime("%Y%m%d-%H%M%S")},  # the ranks' one name for their trace folder
    )
    log = folder / "script.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        _tee(proc, log, to_stderr=json_path == "-")
    except KeyboardInterrupt:
        proc.terminate()
        proc.wait()
        raise
    rc = proc.wait()
    copy = json_path if json_path != "-" else None  # '-': the caller prints the report, once
    console = sys.stderr if json_path == "-" else sys.stdout

    def say(m: str) -> None:
        from vlmdoctor.report.progress import say as line

        line(m)

    def summary() -> None:
        if not quiet:
            show_summary(report, output_paths(report, folder) | {"log": str(log)}, console)

    if not report_path.exists():
        say(f"the script exited with code {rc} and left no report; its output is in {log}")
        return EXIT_FAILED_RUN, None
    report = json.loads(report_path.read_text())
    report.setdefault("script", {}).update(recorded_command(command, warmup, steps))
    script = report.get("script") or {}
    err = report.get("error") or {}
    if rc != 0 or script.get("exit_code"):
        code = script.get("exit_code") if script.get("exit_code") is not None else rc
        if report.get("status") == "ok":  # measured before it failed: the diagnosis still stands
            if not report.get("diagnosed_while_running"):
                diagnose_report(report, report.get("audience") or "loop", rules_dirs, selection)
                if not quiet and json_path != "-" and "diagnosis" in report:
                    show(report)
            report["status"] = "error"
        report["error"] = {
            "type": "ScriptFailed",
            "message": f"the script exited with code {code}" + (f" ({script['error']})" if script.get("error") else ""),
            "exit_code": code,
        }
        write_outputs(report, folder, copy)
        summary()
        say(f"the script failed (exit code {code}); its output is in {log}")
        return EXIT_FAILED_RUN, report
    if err.get("type") in ("NoSteps", "NotStarted"):
        say(f"{err['message']}: nothing to measure (its output: {log})")
        return EXIT_FAILED_RUN, report
    shown = bool(report.get("diagnosed_while_running"))  # the child printed it when the window ended
    if not shown:
        diagnose_report(report, report.get("audience") or "loop", rules_dirs, selection)
    write_outputs(report, folder, copy)
    if html_path:
        from vlmdoctor.report.html import profile_html, write_html

        write_html(profile_html(report), Path(html_path), force=True)  # refused up front unless --force
    if not quiet and json_path != "-" and not shown:
        show(report)
    summary()
    return EXIT_OK, report
