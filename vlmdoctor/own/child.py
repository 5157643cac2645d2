"""The bootstrap of `vlmdoctor run` in the script's own process (and in every rank under a launcher): it hooks in,
then runs the user's script as `__main__`, untouched.

The bootstrap registers a global optimizer step hook (`torch.optim.optimizer.register_optimizer_step_post_hook`).
The first optimizer step shows which optimizer trains and so which model it trains (the module holding its
parameters); from then on each step of that optimizer is one training step for the Recorder (the same as
`vlmdoctor.Doctor`'s): warm-up, a timed window, a traced window with the model's parts marked. When the windows are
measured, the report is diagnosed, written (and a copy handed to the parent, launch.py) and printed while the
script trains on, unmeasured; when the script ends, the report is written again with how it ended.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import runpy
import sys
import warnings
from pathlib import Path
from typing import Any

from vlmdoctor.errors import is_out_of_memory
from vlmdoctor.files import claim, json_text, rescue, save
from vlmdoctor.invisible import kept
from vlmdoctor.own import one_profiler
from vlmdoctor.own.rank_join import rank_and_world
from vlmdoctor.run.trainer_args import sample_lengths, training_args_config
from vlmdoctor.window import HTML, REPORT

# Imports left inside functions: torch, transformers and the Recorder (which imports torch), the report's
# outputs and renderers, and the rule selection: kept out of the user's process (this module is imported before
# the script runs) until a hook needs them.

#: the environment variable that carries the run's settings from the parent (launch.py) to this bootstrap
ENV_KEY = "VLMDOCTOR_RUN"


class _StopAfterWindow(BaseException):
    """Raised out of the optimizer step once the windows are measured (--stop-after-window). A BaseException:
    `except Exception` lets it through; a bare `except:` that swallows it is seen at the next step."""


STOP_SAID = "vlmdoctor: stopped the script after the measured window (--stop-after-window)"


def _exit_now(code: int) -> None:
    """End the process from inside a hook, without raising into the script: its exit work (atexit) first, as
    a normal exit runs it. Only for a stop the script has already swallowed once."""
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
    from torch import nn  # deferred: torch, in the child only

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
    return best  # DDP / FSDP / torch.compile wrappers included: the Recorder unwraps them (model.unwrap)


def _evaluation_excluder(rec: Any) -> Any:
    """A Trainer callback that leaves the Trainer's evaluations out of the step times (as DoctorCallback does)."""
    from transformers import TrainerCallback  # deferred: transformers, in the child only

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
        from vlmdoctor.report.progress import say  # deferred: kept out of the user's process

        key = f"{type(e).__name__}: {e}"
        if self.rec is not None:
            self.said |= self.rec.said
        if key not in self.said:
            self.said.add(key)
            say(f"{what}: {key}")
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
        from vlmdoctor.report.progress import say  # deferred: kept out of the user's process

        if self.rec is None or self.rec.rank == 0:
            say(
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
        from vlmdoctor.own.outputs import diagnose_report, gather_ranks, show  # deferred: the renderers

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
                from vlmdoctor.doctor.select import Selection  # deferred: kept out of the user's process

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
            show(report, sys.stdout, verbose=bool(self.s.get("verbose")))
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
        from vlmdoctor.own.outputs import write_outputs  # deferred: kept out of the user's process

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
        from vlmdoctor.own.recorder import Recorder  # deferred: the recorder imports torch

        self.optimizer = optimizer
        try:
            model = find_model(optimizer)
            config: dict[str, Any] = {"script": self.s["argv"]}
            trainer = _trainer()
            audience = "loop"
            if getattr(trainer, "args", None) is not None:
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
                from vlmdoctor.report.progress import say  # deferred: kept out of the user's process

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
        from vlmdoctor.own.outputs import gather_ranks  # deferred: kept out of the user's process

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
            from torch.optim.optimizer import register_optimizer_step_post_hook  # deferred: torch

            one_profiler.install()  # a Doctor or torch.profiler in the script and this run: one profiler at a time
            handle = register_optimizer_step_post_hook(child.on_step)
    except Exception as e:
        from vlmdoctor.report.text import plain  # deferred: kept out of the user's process

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
        from vlmdoctor.report.progress import say  # deferred: kept out of the user's process

        say("the script caught the stop of --stop-after-window and ran on to its end")
    _ended(child, handle, 0, None)


def _ended(child: _Child, handle: Any, code: int, error: str | None) -> None:
    """The script is done: the hook goes, the report is written with how it ended."""
    if handle is not None:
        with contextlib.suppress(Exception):
            handle.remove()
    finish_child(child, code, error)
    sys.stdout.flush()
    sys.stderr.flush()
