"""The observer must not change the patient: each script of tests/corpus/ runs plain and under every way in
(`vlmdoctor run`, `Doctor`, `DoctorCallback`, `vlmdoctor run -- torchrun`), and the losses (bit for bit),
every file the script writes and its exit code must be the same.

The corpus is written for this test as users write training scripts: dropout with seeded and unseeded
generators, numpy and random augmentation in DataLoader workers, a sampler of its own, a no-grad forward
inside the step, a bare `except:`, an atexit checkpoint, a non-daemon upload thread, a crash reporter in
`sys.excepthook`, `sys.exit(3)`, a compiled model, a LoRA model, the script's own torch.profiler,
interpreter options through a wrapper interpreter, a Trainer with evaluation and gradient accumulation,
DDP on gloo. The only difference allowed is the one each way in is there to make: its own report, outside
the script's folder, and, under DoctorCallback, its metrics in the Trainer's log (the corpus script drops
`vlmdoctor/` entries before it writes the losses).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

CORPUS = Path(__file__).resolve().parent / "corpus"
sys.path.insert(0, str(CORPUS))
from _compare import SHIM, written  # noqa: E402

PY = sys.executable
WINDOW = ["--warmup", "1", "--steps", "2", "--trace-steps", "1"]  # as _way.WINDOW, for `vlmdoctor run`


@dataclass(frozen=True)
class Case:
    script: str
    ways: tuple[str, ...] = ("run", "doctor")
    code: int = 0
    flags: tuple[str, ...] = ()  # interpreter options, given to the wrapper interpreter
    volatile: tuple[str, ...] = ()  # files compared by presence only: their content holds times
    ranks: int = 0  # under torchrun with this many processes
    replay_seed: bool = False  # unseeded: the plain run replays the seed the watched run started from
    evaluates: bool = False  # a Trainer evaluating inside the measured window
    traced: bool = True  # vlmdoctor traces a window (not while the script's own profiler runs)
    gpu: bool = False  # the GPU subset: run where CUDA is (the GPU run is recorded in docs/reliability.md)
    libraries: bool = False  # a library's training (Trainer, peft, DDP, compile): tests/test_differential_libs.py


CASES = [
    Case("loop_dropout_seeded.py"),
    Case("loop_unseeded.py", replay_seed=True),
    Case("loop_no_grad_eval.py"),
    Case("loop_numpy_workers.py"),
    Case("loop_custom_sampler.py", flags=("-X", "faulthandler", "-W", "error::FutureWarning", "-B")),
    Case("loop_bare_except.py"),
    Case("loop_atexit_checkpoint.py", code=1),
    Case("loop_background_thread.py", code=3),
    Case("loop_compiled.py", libraries=True),
    Case("loop_own_profiler.py", volatile=("mine.json",), traced=False),
    Case("loop_lora.py", libraries=True),
    Case("trainer_eval_accum.py", ways=("run", "callback"), evaluates=True, libraries=True),
    Case("ddp_gloo.py", ways=("run", "doctor"), ranks=2, libraries=True),
    Case("gpu_bf16_sdpa.py", gpu=True),
    Case("gpu_autocast_dropout.py", gpu=True),
    Case("gpu_compiled.py", gpu=True),
]


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def params(libraries: bool = False) -> list:
    """The cases of one of the two test files (two files: pytest-xdist gives each its own worker); the GPU
    subset runs where CUDA is and says it skipped elsewhere."""
    out = []
    for c in CASES:
        if c.libraries != libraries:
            continue
        marks = [pytest.mark.skipif(not _cuda(), reason="the GPU subset needs CUDA")] if c.gpu else []
        out.append(pytest.param(c, id=c.script.removesuffix(".py"), marks=marks))
    return out


def _env(tmp: Path, way: str, out: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CORPUS_", "VLMDOCTOR_"))}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if way in ("doctor", "callback"):
        env |= {"CORPUS_WAY": way, "CORPUS_OUT": str(out)}
    return env


def _wrapper(tmp: Path) -> str:
    """A wrapper interpreter, as venv and conda shims are: it sets a variable and runs python."""
    path = tmp / "python-wrapped"
    path.write_text(f'#!/bin/sh\nWRAPPED_BY=shim exec {PY} "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _command(case: Case, tmp: Path) -> list[str]:
    script = str(CORPUS / case.script)
    if case.ranks:
        return [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.ranks}", script]
    interpreter = [_wrapper(tmp), *case.flags] if case.flags else [PY]
    return [*interpreter, script]


def _run(case: Case, way: str, tmp: Path, seed: str | None = None) -> tuple[int, dict[str, bytes | None], str]:
    """The script's exit code, the files it wrote in its folder, and its output."""
    cwd, out = tmp / f"{way}-cwd", tmp / f"{way}-out"
    cwd.mkdir()
    cmd = _command(case, tmp)
    if seed is not None:  # plain python with torch's generator started where the watched run's started
        cmd = [PY, "-c", SHIM, seed, *cmd[1:]]
    if way == "run":
        cmd = [PY, "-m", "vlmdoctor", "run", "--out", str(out), *WINDOW, "--quiet", "--", *cmd]
    p = subprocess.run(cmd, cwd=cwd, env=_env(tmp, way, out), capture_output=True, text=True, timeout=300)
    return p.returncode, written(cwd, case.volatile), p.stdout[-3000:] + p.stderr[-3000:]


def _report(tmp: Path, way: str) -> dict:
    path = tmp / f"{way}-out" / "report.json"
    assert path.is_file(), f"{way}: no report"
    return json.loads(path.read_text())


@pytest.mark.parametrize("case", params())
def test_the_training_is_the_same_under_every_way_in(case: Case, tmp_path: Path) -> None:
    same_under_every_way_in(case, tmp_path)


def same_under_every_way_in(case: Case, tmp_path: Path) -> None:
    """Each watched run against a plain run: the exit code, the files and the losses bit for bit."""
    watched = {way: _run(case, way, tmp_path) for way in case.ways}
    plain: dict[str, tuple] = {}
    for way, (w_code, w_files, w_said) in watched.items():
        # unseeded: torch's generator starts from a seed of its own in each process; each watched run is
        # compared with a plain run started from its seed
        seed = json.loads(w_files["losses.json"])["seed"] if case.replay_seed else None
        if seed not in plain:
            plain[seed] = _run(case, f"plain{len(plain)}", tmp_path, seed)
        code, files, said = plain[seed]
        if case.gpu and f"again{seed}" not in plain:  # bit for bit needs a plain run that repeats itself
            plain[f"again{seed}"] = again = _run(case, f"plain-again{len(plain)}", tmp_path, seed)
            assert again[1] == files, f"two plain runs differ: no bit-for-bit comparison possible\n{again[2]}"
        assert code == case.code, said
        assert any(name.startswith("losses") for name in files), said
        assert w_code == code, f"{way}: exit code {w_code}, plain {code}\n{w_said}"
        assert sorted(w_files) == sorted(files), f"{way}: other files\n{w_said}"
        for name, content in files.items():
            assert w_files[name] == content, f"{way}: {name} differs\n{w_said}"
        report = _report(tmp_path, way)
        assert report["status"] in ("ok", "error"), report.get("error")
        metrics = report.get("metrics") or {}
        assert metrics.get("real_tokens_per_s"), f"{way}: nothing measured\n{w_said}"
        # FLOPs from the traced window's record, for every class of step (no-grad forwards, compiled, LoRA)
        if case.traced:
            assert metrics.get("flops_per_step"), f"{way}: {report['flops']['formula']}"
        else:  # one profiler at a time: the script's own ran, so no trace and no FLOPs, said
            assert "another profiler ran" in report["flops"]["formula"]
        if case.evaluates:  # the Trainer's evaluations inside the window are not timed as training
            assert any("evaluation ran between steps" in n for n in report["notes"]), report["notes"]


def _stopped(script: str, tmp: Path) -> tuple[subprocess.CompletedProcess, Path]:
    cwd, out = tmp / "cwd", tmp / "out"
    cwd.mkdir()
    cmd = [PY, "-m", "vlmdoctor", "run", "--out", str(out), *WINDOW, "--quiet", "--stop-after-window", "--"]
    cmd += [PY, str(CORPUS / script)]
    p = subprocess.run(cmd, cwd=cwd, env=_env(tmp, "run", out), capture_output=True, text=True, timeout=300)
    return p, cwd


def test_the_stop_after_the_window_runs_the_scripts_exit_work(tmp_path: Path) -> None:
    """The stop ends the loop (its final save and its failure never come: exit 0), and the atexit checkpoint is
    still written."""
    p, cwd = _stopped("loop_atexit_checkpoint.py", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    said = p.stdout + p.stderr  # the script's output, ours among it, is passed through to stdout
    assert "stopped the script after the measured window" in said
    assert not (cwd / "losses.json").exists() and (cwd / "final.pt").is_file()


def test_a_stop_swallowed_by_a_bare_except_still_stops_and_says_so(tmp_path: Path) -> None:
    """A bare `except:` around the step catches the stop; the next optimizer step ends the process, says why,
    and the script's exit work runs."""
    p, cwd = _stopped("loop_bare_except.py", tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    said = p.stdout + p.stderr  # the script's output, ours among it, is passed through to stdout
    assert said.count("caught the stop") == 1, said[-2000:]
    assert not (cwd / "losses.json").exists()  # stopped: the loop never reached its end
    assert json.loads((tmp_path / "out" / "report.json").read_text())["status"] == "ok"


@pytest.mark.parametrize(
    "command, interpreter, rest",
    [
        (["/venv/bin/python3.12", "-O", "-W", "error", "-X", "dev", "t.py", "-O"], 6, ["t.py", "-O"]),
        (["python", "-OO", "-u", "-B", "-I", "-m", "pkg.train", "--lr", "1"], 5, ["-m", "pkg.train", "--lr", "1"]),
        (["./python-wrapped", "-Wignore", "-Xfrozen_modules=off", "t.py"], 3, ["t.py"]),
        (["t.py", "--steps", "3"], 1, ["t.py", "--steps", "3"]),
    ],
    ids=["venv-flags", "module", "wrapper", "no-interpreter"],
)
def test_the_users_interpreter_and_its_options_are_kept(tmp_path, monkeypatch, command, interpreter, rest):
    """`vlmdoctor run` runs the interpreter the user named with every option given (none dropped, none
    added), and vlmdoctor's bootstrap, then the script's own arguments untouched."""
    from vlmdoctor.own.launch import BOOTSTRAP, child_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    cmd = child_command(command)
    expected = command[:interpreter] if command[0] != "t.py" else [sys.executable]
    assert cmd == [*expected, "-c", BOOTSTRAP, *rest]


def test_a_folder_with_main_runs_as_python_runs_it(tmp_path, monkeypatch):
    from vlmdoctor.own.launch import split_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__main__.py").write_text("")
    assert split_command(["python", "app"])[1] == ["app"]
