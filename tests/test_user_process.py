"""The user's process is sacred: one profiler at a time, and no error of vlmdoctor's own reaches the loop.

Two classes, each one harness over many inputs:
- profiler conflicts (two Doctors on one loop, the script's own torch.profiler recording, prepared
  before vlmdoctor watched, or started inside vlmdoctor's traced window, a Doctor under `vlmdoctor
  run`): each used to end the process with SIGSEGV, so they run in a child process; the loop must
  finish with the losses it has without vlmdoctor, exactly one profiler must trace, the other
  must say why it did not, and the script's own profiler must write its trace;
- an error injected into every hook of each way in (Doctor, DoctorCallback, `run`'s bootstrap):
  the loop finishes with its own losses and the error is said exactly once.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.modules.module as module_hooks
from _user_loop import loop
from torch.utils import _python_dispatch

ROOT = Path(__file__).resolve().parents[1]
#: the child processes use the same model and loop as the tests here
LOOP_IMPORT = (
    f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom _user_loop import Tiny, batch, loop\n"
)

WINDOW = dict(warmup=1, steps=2, trace_steps=1, quiet=True)  # timed steps 2-3, traced from step 4: done at 6

#: each scenario in order, in one child process (the first needs a process where vlmdoctor never watched yet)
SCENARIOS = (
    LOOP_IMPORT
    + """
import json, os, sys
from torch.profiler import profile, schedule
out = sys.argv[1]
WINDOW = dict(warmup=1, steps=2, trace_steps=1, quiet=True)
N = 12
import vlmdoctor.own.outputs, vlmdoctor.run.envinfo
# the conflict is the subject, not the diagnosis nor the CPU's matmul probe
vlmdoctor.own.outputs.diagnose_report = lambda report, *a, **k: report
vlmdoctor.run.envinfo.collect = lambda device: {"device_type": device.type}

def user_profile(name, **plan):
    path = os.path.join(out, name + ".user.json")
    return profile(schedule=schedule(**plan), on_trace_ready=lambda p: p.export_chrome_trace(path)), path

def result(name, losses, docs, user_trace=None):
    reports = [d.report or {} for d in docs]
    print("RESULT", json.dumps({
        "scenario": name,
        "losses": losses,
        "traced": [bool(r.get("trace")) for r in reports],
        "statuses": [r.get("status") for r in reports],
        "notes": [r.get("notes") or [] for r in reports],
        "user_trace": os.path.exists(user_trace) if user_trace else None,
    }), flush=True)

print("RESULT", json.dumps({"scenario": "reference", "losses": loop(N)}), flush=True)

# prepared before vlmdoctor watched: its warm-up (10 steps) covers the Doctor's traced window
prof, path = user_profile("prepared_before", wait=0, warmup=10, active=1)
prof.__enter__()
doc = vlmdoctor.Doctor(Tiny(), out=os.path.join(out, "prepared_before"), **WINDOW)
doc.__enter__()
losses = loop(N, lambda i, m, b: (doc.step(b), prof.step()))
doc.__exit__(None, None, None)
prof.__exit__(None, None, None)
result("prepared_before", losses, [doc], path)

# two Doctors on one loop
d1 = vlmdoctor.Doctor(None, out=os.path.join(out, "two_1"), **WINDOW).__enter__()
d2 = vlmdoctor.Doctor(None, out=os.path.join(out, "two_2"), **WINDOW).__enter__()
losses = loop(N, lambda i, m, b: (d1.step(b), d2.step(b)))
d1.finish(), d2.finish()
result("two_doctors", losses, [d1, d2])

# the script's profiler records from the first step, over the Doctor's window
prof, path = user_profile("recording", wait=0, warmup=0, active=N)
prof.__enter__()
doc = vlmdoctor.Doctor(None, out=os.path.join(out, "recording"), **WINDOW).__enter__()
losses = loop(N, lambda i, m, b: (doc.step(b), prof.step()))
prof.__exit__(None, None, None)
doc.finish()
result("script_recording", losses, [doc], path)

# the script starts its profiler inside the Doctor's traced window (its warm-up step): the Doctor gives way
prof, path = user_profile("inside", wait=0, warmup=1, active=1)
doc = vlmdoctor.Doctor(None, out=os.path.join(out, "inside"), **WINDOW).__enter__()
started = []
def enter(i):
    if i == 5:
        prof.__enter__()
        started.append(i)
losses = loop(N, lambda i, m, b: (doc.step(b), started and prof.step()), before=enter)
prof.__exit__(None, None, None)
doc.finish()
result("script_starts_inside", losses, [doc], path)
"""
)


@pytest.fixture(scope="module")
def conflicts(tmp_path_factory) -> dict[str, dict]:
    d = tmp_path_factory.mktemp("conflicts")
    (d / "scenarios.py").write_text(SCENARIOS)
    proc = subprocess.run(
        [sys.executable, str(d / "scenarios.py"), str(d)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    found = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT ") :])
            found[r["scenario"]] = r
    found["_proc"] = {
        "returncode": proc.returncode,
        "stderr": proc.stderr[-3000:],
        "not_tracing": proc.stderr.count("not tracing:"),  # on the whole stderr (the tail above may cut one)
    }
    return found


@pytest.mark.parametrize(
    "scenario, traced, user_trace, why",
    [
        ("prepared_before", [False], True, "the script's own torch.profiler"),
        ("two_doctors", [True, False], None, "vlmdoctor.Doctor (writing to"),
        ("script_recording", [False], True, "the script's own torch.profiler"),
        ("script_starts_inside", [False], True, "stopped for it"),
    ],
)
def test_one_profiler_at_a_time_and_the_loop_goes_on(conflicts, scenario, traced, user_trace, why):
    proc = conflicts["_proc"]
    assert scenario in conflicts, f"the process died before '{scenario}' (exit {proc['returncode']}): {proc['stderr']}"
    r = conflicts[scenario]
    assert r["losses"] == conflicts["reference"]["losses"]  # the loop's own results, every step
    assert r["traced"] == traced and set(r["statuses"]) == {"ok"}
    skipped = r["notes"][traced.index(False)]
    assert any(n.startswith("not traced:") and why in n for n in skipped), skipped
    assert r["user_trace"] is user_trace  # the script's own profiler ran as it would without vlmdoctor
    assert proc["returncode"] == 0, proc["stderr"]
    assert proc["not_tracing"] == 4, proc["stderr"]  # one line per refusal, no more


DOCTOR_SCRIPT = (
    LOOP_IMPORT
    + """
import sys, vlmdoctor, vlmdoctor.own.outputs, vlmdoctor.run.envinfo
vlmdoctor.own.outputs.diagnose_report = lambda report, *a, **k: report
vlmdoctor.run.envinfo.collect = lambda device: {"device_type": device.type}
# a shorter window than run's: the Doctor reaches its traced window first, run's recorder is the one refused
with vlmdoctor.Doctor(Tiny(), out=sys.argv[1], warmup=0, steps=2, trace_steps=1, quiet=True) as doc:
    losses = loop(12, lambda i, m, b: doc.step(b))
print("LOSSES", losses, flush=True)
"""
)


@pytest.mark.slow  # two fresh torch processes; two recorders in one process stay in the default run (above)
def test_a_doctor_under_vlmdoctor_run_is_one_profiler(tmp_path):
    """`vlmdoctor run` on a script that uses vlmdoctor.Doctor: the training finishes, one of the two traces."""
    script = tmp_path / "train.py"
    script.write_text(DOCTOR_SCRIPT)
    proc = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", "run", "--out", str(tmp_path / "run"), "--warmup", "1", "--steps", "2"]
        + ["--trace-steps", "1", "--quiet", "--", "python", str(script), str(tmp_path / "doc")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOSSES" in proc.stdout
    reports = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("run", "doc")]
    assert [bool(r.get("trace")) for r in reports] == [False, True]
    assert any("vlmdoctor.Doctor (writing to" in n for n in reports[0]["notes"])
    assert proc.stdout.count("not tracing:") == 1  # (the script's stderr comes through run's stdout)


# --- an error of vlmdoctor's own, in every hook of every way in ----------------------------------

N = 8

#: (what is broken, the ways in that reach it): each raises RuntimeError("injected") when called
TARGETS = {
    "vlmdoctor.own.recorder.describe_model": ("doctor", "callback", "run"),
    "vlmdoctor.own.recorder.Recorder.attach": ("doctor", "callback", "run"),
    "vlmdoctor.own.recorder.Recorder.begin": ("doctor", "callback", "run"),
    "vlmdoctor.own.tokens.TokenCounter.on_forward": ("doctor", "callback", "run"),
    "vlmdoctor.own.tokens.TokenCounter.on_output": ("doctor", "callback", "run"),
    "vlmdoctor.own.tokens.count_tokens": ("doctor", "callback", "run"),
    "vlmdoctor.own.recorder.Recorder._step": ("doctor", "callback", "run"),
    "vlmdoctor.own.clock.StepClock.summarize": ("doctor", "callback", "run"),
    "vlmdoctor.own.recorder.Recorder.window_done": ("doctor", "callback", "run"),  # a property, read after every step
    "vlmdoctor.own.traced.TracedWindow._start_profiler": ("doctor", "callback", "run"),
    "vlmdoctor.own.traced.TracedWindow.add_metadata": ("doctor", "callback", "run"),
    "vlmdoctor.own.recorder.build_report": ("doctor", "callback", "run"),
    "vlmdoctor.own.one_profiler.claim": ("doctor", "callback", "run"),
    "vlmdoctor.own.traced.TracedWindow._count_flops": ("doctor", "callback", "run"),
    "torch.profiler.record_function": ("doctor", "callback", "run"),  # inside the part marks, in the forward
    "vlmdoctor.own.outputs.diagnose_report": ("doctor", "callback", "run"),
    "vlmdoctor.own.outputs.write_outputs": ("doctor", "callback", "run"),
    "vlmdoctor.own.outputs.show": ("doctor", "callback", "run"),
    "vlmdoctor.own.callback.training_args_config": ("callback",),
    "vlmdoctor.own.child.find_model": ("run",),
}


def _cases() -> list:
    """Every (target, way); in the default run each target once, the ways taken in turn (the others: -m slow)."""
    cases, turn = [], 0
    for target, ways in TARGETS.items():
        first = ways[turn % len(ways)] if len(ways) > 1 else ways[0]
        turn += len(ways) > 1
        for way in ways:
            marks = () if way == first else (pytest.mark.slow,)
            cases.append(pytest.param(target, way, marks=marks, id=f"{way}:{'.'.join(target.split('.')[-2:])}"))
    return cases


CASES = _cases()


def _set(monkeypatch, target: str, value) -> None:
    mod, _, attr = target.rpartition(".")
    try:
        obj = __import__(mod, fromlist=["_"])
    except ImportError:
        m2, _, cls = mod.rpartition(".")
        obj = getattr(__import__(m2, fromlist=["_"]), cls)
    monkeypatch.setattr(obj, attr, value)


def _injected(*_a, **_k):
    raise RuntimeError("injected")


def _doctor(out: Path) -> list[float]:
    import vlmdoctor

    docs = []
    losses = loop(
        N,
        each=lambda i, model, b: docs[0].step(b),
        setup=lambda model: docs.append(vlmdoctor.Doctor(model, out=out, **{**WINDOW, "quiet": False}).__enter__()),
    )
    docs[0].__exit__(None, None, None)
    return losses


def _callback(out: Path) -> list[float]:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from vlmdoctor.own.callback import DoctorCallback

    cb = DoctorCallback(out=out, warmup=1, steps=2, trace_steps=1)
    args = TrainingArguments(output_dir=str(out / "trainer"), report_to=[], per_device_train_batch_size=4)
    state, control = TrainerState(), TrainerControl()

    def setup(model):
        cb.on_train_begin(args, state, control, model=model)
        cb.on_step_begin(args, state, control)

    def each(i, model, b):  # a Trainer's order: a step ends, the next begins
        cb.on_step_end(args, state, control)
        cb.on_step_begin(args, state, control)

    losses = loop(N, each=each, setup=setup)
    cb.on_train_end(args, state, control)
    return losses


def _run_hook(out: Path) -> list[float]:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from vlmdoctor.own.child import _Child, finish_child

    child = _Child({"out": str(out), "warmup": 1, "steps": 2, "trace_steps": 1, "argv": ["train.py"]})
    handle = register_optimizer_step_post_hook(child.on_step)
    try:
        losses = loop(N)
    finally:
        handle.remove()
    finish_child(child, 0, None)
    return losses


WAYS = {"doctor": _doctor, "callback": _callback, "run": _run_hook}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return loop(N)


@pytest.fixture
def fast_reports(monkeypatch):
    """The report's environment without the CPU matmul probe, and no diagnosis (the hooks are the subject)."""
    import vlmdoctor.own.outputs
    import vlmdoctor.run.envinfo

    monkeypatch.setattr(vlmdoctor.run.envinfo, "collect", lambda device: {"device_type": device.type})
    monkeypatch.setattr(vlmdoctor.own.outputs, "diagnose_report", lambda report, *a, **k: report)


@pytest.mark.parametrize("target, way", CASES)
def test_an_error_of_vlmdoctor_never_reaches_the_loop(
    target, way, reference, fast_reports, monkeypatch, tmp_path, capfd
):
    monkeypatch.chdir(tmp_path)  # a rescued report lands here
    _set(monkeypatch, target, property(_injected) if target.endswith(".window_done") else _injected)
    losses = WAYS[way](tmp_path / "out")
    assert losses == reference  # every step ran, with the loop's own results
    said = capfd.readouterr().err  # (the report printed on stdout may name it too: it is the report)
    assert said.count("injected") == 1, said  # said once, not once per step
    # nothing of vlmdoctor's left in the user's process: no profiler, no dispatch mode, no global hooks
    assert not torch.autograd._profiler_enabled()
    assert _python_dispatch._get_current_dispatch_mode() is None
    assert not module_hooks._global_forward_hooks and not module_hooks._global_forward_pre_hooks


@pytest.mark.parametrize("way", WAYS)
def test_the_model_is_freed_once_the_script_drops_it(way, fast_reports, tmp_path):
    """Nothing of vlmdoctor's holds the model after its window: a DistributedDataParallel kept alive past
    destroy_process_group deadlocks torch's gloo group in its destructor or aborts the rank at exit
    (examples/train_ddp.py releases it first; a reference in vlmdoctor would undo that)."""
    from _user_loop import Tiny

    def alive() -> int:
        gc.collect()
        return sum(type(o) is Tiny for o in gc.get_objects())

    before = alive()
    WAYS[way](tmp_path / "out")
    assert alive() == before


def test_a_failing_flop_count_leaves_mfu_null_with_its_reason(reference, fast_reports, monkeypatch, tmp_path):
    """The FLOPs are counted from the profiler's record after the window: a count that fails there gives MFU
    null and says why, and the loop never sees it."""
    import vlmdoctor.run.flopcount

    monkeypatch.setattr(vlmdoctor.run.flopcount, "kineto_ops", _injected)
    assert _doctor(tmp_path / "out") == reference
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "reading the profiler's record failed (RuntimeError: injected)" in report["flops"]["formula"]
    assert report["metrics"]["mfu"] is None


# --- out of memory exits 3, on the host as on the GPU ---------------------------------------------


@pytest.mark.slow  # a real `vlmdoctor run`; the runner's host OOM (tests/test_runner.py) stays in the default run
def test_a_script_that_runs_out_of_host_memory_exits_3(tmp_path, cli_runner):
    from vlmdoctor.cli import app

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(3):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
            raise MemoryError()
            """
        )
    )
    r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--quiet", "--", "python", str(script)])
    assert r.exit_code == 3, r.output
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["status"] == "oom" and report["error"]["type"] == "OutOfMemoryError"


@pytest.mark.parametrize("how", ["w", "replace"])
def test_a_report_json_the_script_writes_into_out_is_kept(tmp_path, cli_runner, monkeypatch, how):
    """The script writes OUT/report.json itself, after vlmdoctor's window (in place with open(..., "w"), or as a
    new file): its file stays byte for byte; vlmdoctor's report goes to a rescue file that the summary names, and
    the exit code says the report is not where it was asked for."""
    from vlmdoctor.cli import app

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "o"
    script = tmp_path / "train.py"
    write = (
        'open(out + "/report.json", "w").write(mine)'
        if how == "w"
        else 'open(out + "/r.tmp", "w").write(mine); os.replace(out + "/r.tmp", out + "/report.json")'
    )
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            import torch
            out = sys.argv[1]
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(10):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            mine = '{{"mine": true}}'
            {write}
            """
        )
    )
    r = cli_runner.invoke(
        app, ["run", "--out", str(out), "--warmup", "1", "--steps", "2", "--", sys.executable, str(script), str(out)]
    )
    assert (out / "report.json").read_text() == '{"mine": true}', r.output
    assert r.exit_code == 1, r.output
    rescued = sorted(Path(tmp_path).glob("vlmdoctor-rescued-*report.json"))
    assert rescued, r.output
    assert json.loads(rescued[-1].read_text())["tool"]["name"] == "vlmdoctor"
    assert str(rescued[-1]) in " ".join(r.output.split())


def test_html_and_json_inside_a_new_out_folder_are_accepted(tmp_path, cli_runner, monkeypatch):
    """`run --out o --html o/report.html` on a folder that does not exist yet: --out creates it, so an output
    inside it is no missing folder (it was refused: 'the folder o does not exist; create it first')."""
    from vlmdoctor.cli import app

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            model = torch.nn.Linear(4, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i in range(8):
                model(torch.randn(2, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
            """
        )
    )
    r = cli_runner.invoke(
        app,
        ["run", "--out", "o", "--html", "o/page.html", "--json", "o/copy.json", "--warmup", "1", "--steps", "2",
         "--quiet", "--", sys.executable, str(script)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "page.html").is_file() and (tmp_path / "o" / "copy.json").is_file()
