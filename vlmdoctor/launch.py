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

import contextlib
import gc
import json
import os
import runpy
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmdoctor import supervise
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_OK, EXIT_OOM, UsageError, is_out_of_memory
from vlmdoctor.invisible import kept

ENV_KEY = "VLMDOCTOR_RUN"
#: this vlmdoctor's folder: the bootstrap finds it there even under `python -I` or `-E` (PYTHONPATH ignored)
PKG_ROOT = str(Path(__file__).resolve().parent.parent)
#: what the child's interpreter runs before the script: vlmdoctor's hooks, or, where vlmdoctor cannot be
#: imported by the user's interpreter, the script alone, as `python SCRIPT` would run it
BOOTSTRAP = f"""import sys
sys.path.append({PKG_ROOT!r})
try:
    from vlmdoctor.launch import child_main
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


# --- the child -----------------------------------------------------------------------------------


class _StopAfterWindow(BaseException):
    """Raised out of the optimizer step once the windows are measured (--stop-after-window). A BaseException:
    `except Exception` lets it through; a bare `except:` that swallows it is seen at the next step."""


STOP_SAID = "vlmdoctor: stopped the script after the measured window (--stop-after-window)"


def _exit_now(code: int) -> None:
    """End the process from inside a hook, without raising into the script: its exit work (atexit) first, as
    a normal exit runs it. Only for a stop the script has already swallowed once."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _is_instance(o: Any, cls: type) -> bool:
    """isinstance over the process's objects: a weak proxy whose object is gone (torch.compile keeps them)
    raises ReferenceError when asked its class."""
    try:
        return isinstance(o, cls)
    except ReferenceError:
        return False


def find_model(optimizer: Any) -> Any:
    """The module whose parameters the optimizer holds: the root module covering most of them."""
    from torch import nn

    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes (torch.distributed)
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if _is_instance(o, nn.Module)]
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


def _evaluation_excluder(rec: Any) -> Any:
    """A Trainer callback that leaves the Trainer's evaluations out of the step times (as DoctorCallback does)."""
    from transformers import TrainerCallback

    class LeaveOut(TrainerCallback):
        def on_evaluate(self, *args: Any, **kwargs: Any) -> None:
            with contextlib.suppress(Exception), kept():
                rec.exclude_since_last_step("evaluation")

        def on_predict(self, *args: Any, **kwargs: Any) -> None:
            with contextlib.suppress(Exception), kept():
                rec.exclude_since_last_step("prediction")

    return LeaveOut()


def _trainer() -> Any:
    """The transformers Trainer the script built, if any."""
    mod = sys.modules.get("transformers.trainer")
    cls = getattr(mod, "Trainer", None) if mod else None
    if cls is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if _is_instance(o, cls):
                return o
    return None


class _Child:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.s = settings
        self.optimizer: Any = None
        self.rec: Any = None
        self.report: dict[str, Any] | None = None  # set once written (at the window's end); {}: that failed
        self.steps_of_others = 0
        self.off = False  # vlmdoctor's own error switched measuring off
        self.out_of_memory = False  # the script died out of memory (GPU or host): exit 3, as a profile run
        self.said: set[str] = set()
        self.rescued: Path | None = None  # where the report went when OUT/ could not take it
        self.handed_over = False  # a rank other than 0 whose numbers went to rank 0: it writes nothing
        self.claimed = False  # OUT's report and page claimed: a file the script puts there is never replaced
        self.stop_raised = False  # --stop-after-window raised its stop into the script

    def say(self, what: str, e: BaseException) -> None:
        """One line per distinct error of vlmdoctor's own, however often it comes back."""
        from vlmdoctor.api import _log

        key = f"{type(e).__name__}: {e}"
        if self.rec is not None:
            self.said |= self.rec.said
        if key not in self.said:
            self.said.add(key)
            _log(f"{what}: {key}")
        if self.rec is not None:
            self.rec.said |= self.said

    def on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """The optimizer step hook: nothing of vlmdoctor's own raises out of it into the script (but the stop
        that --stop-after-window asks for)."""
        if self.stop_raised:  # the script caught the stop (a bare `except:`) and stepped on: stop it another way
            self._stop_swallowed()
        try:
            with kept():
                self._on_step(optimizer)
        except _StopAfterWindow:
            self.stop_raised = True
            raise
        except Exception as e:  # said once; the script trains on, unmeasured (what was measured is reported)
            self.off = True
            if self.rec is not None:
                self.rec.fail(e)
            else:
                self.say("internal error, measurement switched off, training goes on", e)

    def _stop_swallowed(self) -> None:
        """The stop came back: the script's own `except:` caught it. The process ends here, its exit work run."""
        from vlmdoctor.api import _log

        if self.rec is None or self.rec.rank == 0:
            _log(
                "the script caught the stop of --stop-after-window (a bare `except:`) and trained on; "
                "stopping it at its next optimizer step, its atexit work run"
            )
        finish_child(self, 0, None)
        _exit_now(0)

    def _on_step(self, optimizer: Any) -> None:
        if self.off:
            return
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
        from vlmdoctor.api import diagnose_report, gather_ranks, show

        self.report = {}  # tried once, whatever happens below
        try:
            report = self.rec.finish()
            report["audience"] = self.rec.audience
            report["script"] = {"argv": self.s["argv"], "exit_code": None, "error": None}
        except Exception as e:  # the analysis must not end the user's training
            self.say("could not build the report now, training goes on", e)
            return
        if not self._gathered(report, gather_ranks):
            return
        if self.s.get("diagnose", True):
            try:
                from vlmdoctor.doctor.select import Selection

                selection = Selection.from_json(self.s.get("selection"))
                diagnose_report(report, self.rec.audience, self.s.get("rules_dirs") or [], selection)
            except Exception as e:  # the measurement stands without its diagnosis
                report["diagnosis_error"] = f"{type(e).__name__}: {e}"
                self.say("the diagnosis failed, the measurement is kept", e)
        report["diagnosed_while_running"] = True
        self.report = report
        if not self._write(report) or self.s.get("quiet"):
            return
        if self.rec.tell is None:  # quiet, or a rank other than 0
            return
        try:
            show(report, sys.stdout)
            goes_on = "" if self.s.get("stop_after_window") else "; the script goes on, unmeasured"
            self.rec.tell(f"report written to {Path(self.s['out']) / 'report.json'}{goes_on}")
        except Exception as e:
            self.say("could not print the report (it is written)", e)

    def _gathered(self, report: dict[str, Any], gather: Any) -> bool:
        """Several ranks: False on a rank other than 0, which handed its numbers to rank 0 (and is done)."""
        self.handed_over = gather(report, self.rec) is None
        return not self.handed_over

    def _write(self, report: dict[str, Any]) -> bool:
        """OUT/report.json; when that fails, the report is rescued to a file the line names (never lost)."""
        from vlmdoctor.api import HTML, REPORT, write_outputs
        from vlmdoctor.files import claim

        out = Path(self.s["out"])
        if not self.claimed:
            claim(out / REPORT, out / HTML)
            self.claimed = True
        try:
            if self.s.get("handoff"):  # the parent's copy first: it reads the report from there, not from OUT/
                write_outputs(report, Path(self.s["handoff"]), html=self.s.get("html", True))
            write_outputs(report, out, html=self.s.get("html", True))
            return True
        except Exception as e:
            from vlmdoctor.files import json_text, rescue, save

            data = json_text(report)
            try:  # the same rescue file each time: the last write (with how the script ended) is the one kept
                if self.rescued is None:
                    self.rescued = rescue("report.json", data.encode())
                    kept = f"it was saved to {self.rescued}"
                else:
                    kept = save(self.rescued, data, "report") or f"it was saved to {self.rescued}"
            except Exception as e2:
                kept = f"it could not be saved elsewhere either ({type(e2).__name__}: {e2})"
            self.say(f"could not write the report ({kept})", e)
            return False

    def _start(self, optimizer: Any) -> None:
        from vlmdoctor.api import Recorder

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

                self.rec.tell = say
            self.rec.attach()
            self.rec.begin()  # steps count from the first optimizer step on: its inputs came before the hooks
            if audience == "trainer":
                trainer.add_callback(_evaluation_excluder(self.rec))
        except Exception as e:
            rec, self.rec = self.rec, None
            if rec is not None:  # its hooks and profiler go; what it said is not said again
                rec.fail(e)
                self.said |= rec.said
            self.say("could not start measuring, the script goes on", e)

    def finish(self, exit_code: int | None, error: str | None) -> None:
        """The report, with how the script ended: the window's (written when it ended), else what was measured.
        Under a launcher, rank 0 writes the job's (the other ranks hand theirs to it)."""
        from vlmdoctor.api import gather_ranks
        from vlmdoctor.rank_join import rank_and_world

        if self.handed_over:
            return
        script = {
            "argv": self.s["argv"],
            "exit_code": exit_code,
            "error": error,
            "out_of_memory": self.out_of_memory,
            "steps_of_other_optimizers": self.steps_of_others,
        }
        if self.report:  # written at the window's end: add how the script ended
            self.report["script"] |= script
            self._write(self.report)
            return
        report = None
        if self.rec is not None:
            try:
                report = self.rec.finish()
            except Exception as e:
                self.say("could not build the report", e)
        if report is None:
            report = {
                "status": "error",
                "error": {
                    "type": "NoSteps" if self.optimizer is None else "NotStarted",
                    "message": "the script never called an optimizer step"
                    if self.optimizer is None
                    else "vlmdoctor could not measure (see the log)",
                },
            }
            if rank_and_world()[0] != 0:
                return  # rank 0 says it for the job
        else:
            report["audience"] = self.rec.audience
            if (report.get("error") or {}).get("type") == "NoSteps":
                report["error"]["message"] = (
                    "the script called the optimizer step only once; a step is timed "
                    "from one optimizer step to the next, so at least 2 are needed"
                )
            report["script"] = script
            if not self._gathered(report, gather_ranks):
                return
        report["script"] = script
        self._write(report)


def finish_child(child: _Child, code: int | None, error: str | None) -> None:
    """The child's last words: its report. An error here is said, never raised (the script's exit code stands)."""
    try:
        with kept():
            child.finish(code, error)
    except Exception as e:
        child.say("could not write the report", e)


def _script_frames(tb: Any) -> Any:
    """The traceback from the script's first frame on: what `python SCRIPT` would have shown (no runpy, no
    bootstrap frames)."""
    first = tb
    while tb is not None:
        if "runpy" not in tb.tb_frame.f_code.co_filename and tb.tb_frame.f_code.co_name != "child_main":
            return tb
        tb = tb.tb_next
    return first


def child_main() -> None:
    """The child's bootstrap: hooks in, then the user's script as __main__ (run unmeasured when the hooks
    cannot go in). The process then ends as `python SCRIPT` would: its exit code, its atexit work, its
    non-daemon threads waited for, its `sys.excepthook` called on an error."""
    settings = json.loads(os.environ.pop(ENV_KEY))
    settings["out"] = os.path.abspath(settings["out"])  # the script may change its folder before the first step
    argv = sys.argv[1:]
    settings["argv"] = argv
    child = _Child(settings)
    handle: Any = None
    try:
        with kept():
            from torch.optim.optimizer import register_optimizer_step_post_hook

            from vlmdoctor.run import one_profiler

            one_profiler.install()  # a Doctor or torch.profiler in the script and this run: one profiler at a time
            handle = register_optimizer_step_post_hook(child.on_step)
    except Exception as e:
        from vlmdoctor.report.console import plain

        print(
            plain(f"vlmdoctor: could not hook in, the script runs unmeasured: {type(e).__name__}: {e}"), file=sys.stderr
        )
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            target = Path(argv[0]).resolve()
            sys.path[0] = str(target if target.is_dir() else target.parent)
            runpy.run_path(argv[0], run_name="__main__")
    except _StopAfterWindow:
        if child.rec is None or child.rec.rank == 0:
            print(STOP_SAID, file=sys.stderr)
        _ended(child, handle, 0, None)
        return
    except SystemExit as e:  # the script's own exit: its code, as python gives it
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        _ended(child, handle, code, None)
        raise
    except KeyboardInterrupt:  # python's own ending of an interrupt (exit by SIGINT) follows
        _ended(child, handle, 130, "KeyboardInterrupt")
        raise
    except BaseException as e:  # the script's own error: its excepthook, then exit code 1, as python does
        child.out_of_memory = is_out_of_memory(e)
        _ended(child, handle, 1, f"{type(e).__name__}: {e}"[:500])
        sys.excepthook(type(e), e, _script_frames(e.__traceback__))
        raise SystemExit(1) from None
    if child.stop_raised and (child.rec is None or child.rec.rank == 0):
        from vlmdoctor.api import _log

        _log("the script caught the stop of --stop-after-window and ran on to its end")
    _ended(child, handle, 0, None)


def _ended(child: _Child, handle: Any, code: int, error: str | None) -> None:
    """The script is done: the hook goes, the report is written with how it ended."""
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.remove()
    finish_child(child, code, error)
    sys.stdout.flush()
    sys.stderr.flush()


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


def _interpreter_path(command: Sequence[str]) -> str:
    """The interpreter the command runs: the user's (a venv's, a conda shim's) found on PATH, else this one."""
    import shutil

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

        from vlmdoctor.files import open_log

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
    from vlmdoctor.api import REPORT, write_outputs
    from vlmdoctor.errors import VlmdoctorError
    from vlmdoctor.files import json_text, rescue

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
        from vlmdoctor.report.console import plain

        print(plain(f"vlmdoctor: {folder / REPORT}: {why}; {kept}"), file=sys.stderr, flush=True)
        if copy:
            from vlmdoctor.files import write_json

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
    from vlmdoctor.api import HTML, REPORT
    from vlmdoctor.files import adopt

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
    from vlmdoctor.api import write_outputs

    report = _read_report(handed)
    if report is None:
        raise exc
    report.setdefault("script", {}).update(recorded_command(command, warmup, steps))
    report["interrupted"] = supervise.describe_interruption(exc)
    report_path = write_outputs(report, folder, json_path if json_path != "-" else None)
    from vlmdoctor.report.console import plain

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
    from vlmdoctor.api import HTML, REPORT
    from vlmdoctor.files import check_writable
    from vlmdoctor.launchers import rank_command

    cmd = rank_command(command)
    if cmd is None:
        cmd = child_command(command)
    if stage is not None and stage not in (1, 2):
        raise UsageError("--stage must be 1 or 2")
    from vlmdoctor.api import WINDOW_LIMITS
    from vlmdoctor.inputs import check_number

    for name, v in (("warmup", warmup), ("steps", steps), ("trace_steps", trace_steps)):
        low, high = WINDOW_LIMITS[name]
        low = max(low, 1) if name == "trace_steps" else low  # run always traces: its diagnosis needs a window
        check_number("--" + name.replace("_", "-"), v, minimum=low, maximum=high, integer=True)
    folder = Path(out)
    report_path, page_path = folder / REPORT, folder / HTML
    log = folder / "script.log"
    from vlmdoctor.files import check_distinct, check_inputs_kept, check_output_dir

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
    from vlmdoctor.files import claim

    claim(report_path, page_path)  # from now on a file there is the script's own unless it is the child's copy
    import shutil
    import tempfile

    handoff = Path(tempfile.mkdtemp(prefix="vlmdoctor-run-"))  # the child's copy of the report, for this process
    try:
        return _run_and_finish(
            cmd, command, folder, handoff, warmup, steps, trace_steps, stop_after_window, stage,
            json_path, rules_dirs, quiet, html_path, selection,
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
) -> tuple[int, dict[str, Any] | None]:
    """The script under the bootstrap, then its report: read from the child's private copy (`handoff`), never from
    OUT/, where the script may write a report.json of its own; OUT's files are this command's only where they are
    the child's copy byte for byte."""
    import time

    from vlmdoctor.api import REPORT, diagnose_report, output_paths, show, show_summary

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
            "handoff": str(handoff),
        },
        {"VLMDOCTOR_JOB": time.strftime("%Y%m%d-%H%M%S")},  # the ranks' one name for their trace folder
    )
    log = folder / "script.log"
    sink = sys.stderr if json_path == "-" else sys.stdout  # stdout carries the JSON: the script's output to stderr
    from vlmdoctor.files import open_log

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
    rc = outcome.returncode
    if outcome.left_running:
        print(
            f"vlmdoctor: the script left {outcome.left_running} process(es) running when it exited; stopped them",
            file=sys.stderr,
            flush=True,
        )
    copy = json_path if json_path != "-" else None  # '-': the caller prints the report, once

    def say(m: str) -> None:
        from vlmdoctor.report.progress import say as line

        line(m)

    rescued: Path | None = None  # where the report went when OUT/ would not take it

    def summary() -> None:
        if not quiet:
            moved = {"report": str(rescued)} if rescued else {}
            show_summary(report, output_paths(report, folder) | {"log": str(log)} | moved, sink)

    report = _read_report(handoff / REPORT)
    if report is None:
        say(f"the script exited with code {rc} and left no report; its output is in {log}")
        return EXIT_FAILED_RUN, None
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
        oom = bool(script.get("out_of_memory"))
        report["error"] = {
            "type": "OutOfMemoryError" if oom else "ScriptFailed",
            "message": f"the script exited with code {code}" + (f" ({script['error']})" if script.get("error") else ""),
            "exit_code": code,
        }
        if oom:
            report["status"] = "oom"
        rescued = _write_kept(report, folder, copy)
        summary()
        say(f"the script {'ran out of memory' if oom else 'failed'} (exit code {code}); its output is in {log}")
        return (EXIT_OOM if oom else _exit_code_of(code)), report
    if err.get("type") in ("NoSteps", "NotStarted"):
        say(f"{err['message']}: nothing to measure (its output: {log})")
        return EXIT_FAILED_RUN, report
    shown = bool(report.get("diagnosed_while_running"))  # the child printed it when the window ended
    if not shown:
        diagnose_report(report, report.get("audience") or "loop", rules_dirs, selection)
    rescued = _write_kept(report, folder, copy)
    if html_path:
        from vlmdoctor.report.html import profile_html, write_html

        write_html(profile_html(report), Path(html_path), force=True)  # refused up front unless --force
    if not quiet and json_path != "-" and not shown:
        show(report)
    summary()
    return (EXIT_FAILED_RUN if rescued else EXIT_OK), report
