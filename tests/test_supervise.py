"""vlmdoctor owns the processes it starts: signals reach the whole group, SIGKILL follows a grace
period, nothing is orphaned, no temporary folder outlives a run, and output folders are checked
before a child starts.

Real child processes: tiny pure-Python scripts (no torch) under a small supervising driver, with
the grace period lowered; the commands themselves (`run`, `sweep`, `treat`, `gate`, `profile`)
are checked for their output folders without starting anything.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from _badinput import invoke

from vlmdoctor import supervise

ROOT = Path(__file__).resolve().parents[1]
GRACE = 0.6

#: the supervised script: records its pids, then behaves as its mode says
CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    mode, folder = sys.argv[1], sys.argv[2]
    pids = [os.getpid()]
    def polite(signum, _frame):  # a well-behaved script: says it was asked, then exits
        open(os.path.join(folder, "asked"), "w").write(signal.Signals(signum).name)
        sys.exit(128 + signum)
    if mode in ("ignores", "grandchild-ignores"):
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
    else:
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(s, polite)
    if mode.startswith("grandchild") or mode == "daemon":
        # a helper that inherits stdout and ignores SIGTERM; the daemon leaves the group (own session)
        helper = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
        g = subprocess.Popen([sys.executable, "-c", helper], start_new_session=(mode == "daemon"))
        pids.append(g.pid)
    with open(os.path.join(folder, "pids.tmp"), "w") as f:
        f.write(" ".join(map(str, pids)))
    os.replace(os.path.join(folder, "pids.tmp"), os.path.join(folder, "pids"))
    print("child up", flush=True)
    if mode == "daemon" or mode == "grandchild-exits":
        sys.exit(0)
    time.sleep(60)
    """
)

#: the supervisor: vlmdoctor's supervise.run, with SIGTERM handled as the CLI handles it
DRIVER = textwrap.dedent(
    f"""
    import json, sys
    from vlmdoctor import supervise
    supervise.GRACE_S, supervise.DRAIN_S = {GRACE}, 0.2
    supervise.handle_termination()
    timeout = float(sys.argv[1]) or None
    try:
        out = supervise.run(sys.argv[2:], timeout=timeout, echo=sys.stdout.buffer)
        print("OUTCOME", json.dumps(out.__dict__), flush=True)
    except KeyboardInterrupt as e:
        print("STOPPED", supervise.describe_interruption(e), flush=True)
        sys.exit(supervise.interrupted_exit_code(e))
    """
)


def _alive(pid: int) -> bool:
    """The process runs (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _wait_for(path: Path, seconds: float = 20.0) -> None:
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("supervise")
    (d / "child.py").write_text(CHILD)
    (d / "driver.py").write_text(DRIVER)
    return d


# (script mode, what ends it, the driver's exit code, the signal the script is first asked with)
CASES = [
    ("obeys", signal.SIGINT, 130, "SIGINT"),
    ("obeys", signal.SIGTERM, 143, "SIGTERM"),
    ("obeys", signal.SIGHUP, 129, "SIGHUP"),
    ("ignores", signal.SIGINT, 130, None),  # SIGKILL after the grace period
    ("ignores", signal.SIGTERM, 143, None),
    ("grandchild", signal.SIGTERM, 143, "SIGTERM"),  # the helper ignores SIGTERM: killed all the same
    ("obeys", "timeout", 0, "SIGTERM"),
    ("ignores", "timeout", 0, None),
    ("grandchild-exits", None, 0, None),  # the script ends; its helper holds stdout and would hang a reader
    ("daemon", None, 0, None),  # the helper left the group (own session): found all the same
]


@pytest.mark.parametrize("mode, end, code, asked", CASES, ids=[f"{c[0]}-{getattr(c[1], 'name', c[1])}" for c in CASES])
def test_nothing_of_the_group_outlives_the_supervisor(scripts, tmp_path, mode, end, code, asked):
    timeout = "1.0" if end == "timeout" else "0"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    driver = subprocess.Popen(
        [
            sys.executable,
            str(scripts / "driver.py"),
            timeout,
            sys.executable,
            str(scripts / "child.py"),
            mode,
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    pids: list[int] = []
    passed = False
    try:
        _wait_for(tmp_path / "pids")
        pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
        if isinstance(end, signal.Signals):
            driver.send_signal(end)
        out, _ = driver.communicate(timeout=30)
        took = time.monotonic() - t0
        assert driver.returncode == code, out
        assert "child up" in out  # the script's output passed through
        if end == "timeout":
            assert '"timed_out": true' in out
        if end is None:  # the script ended by itself: its helper was stopped, not waited for
            assert '"left_running": 1' in out and took < GRACE + 10
        asked_file = tmp_path / "asked"
        assert (asked_file.read_text() if asked_file.exists() else None) == asked  # the polite signal came first
        if mode == "ignores":
            assert took >= GRACE  # it was given its grace period before SIGKILL
        end_t = time.monotonic() + 5
        while any(_alive(p) for p in pids) and time.monotonic() < end_t:
            time.sleep(0.05)
        assert not [p for p in pids if _alive(p)], out
        with pytest.raises(ProcessLookupError):  # the group is gone
            os.killpg(pids[0], 0)
        passed = True
    finally:  # a failing case leaves nothing running either
        if not passed:
            for pid in [driver.pid, *pids]:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
        driver.wait()


# --- temporary folders ------------------------------------------------------------------------------

#: a stand-in interpreter for a run: makes its temporary folder where vlmdoctor says, ignores SIGTERM, hangs
FAKE_PYTHON = """#!/bin/sh
trap '' TERM INT
[ -n "$VLMDOCTOR_SCRATCH" ] && mkdir -p "$VLMDOCTOR_SCRATCH/vlmdoctor-trace-left"
mkdir -p "$TMPDIR/../child-ran"
exec sleep 60
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(supervise, "GRACE_S", 0.3)
    py = tmp_path / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    return py, temp


@pytest.mark.parametrize("side", ["profile run (sweep, treat, gate)", "script run (gate --remeasure-baseline)"])
def test_a_timed_out_run_leaves_no_temporary_folder(fake_python, tmp_path, side):
    """A run killed outright (it ignores SIGTERM) made its temporary folder inside the supervisor's, which goes."""
    from vlmdoctor.own.launch import measure_script
    from vlmdoctor.run.config import RunConfig
    from vlmdoctor.run.runner import run_isolated

    py, temp = fake_python
    if side.startswith("profile"):
        report = run_isolated(RunConfig(model="tiny", device="cpu"), timeout=0.5, python=str(py))
    else:
        (tmp_path / "train.py").write_text("print('hi')\n")
        report = measure_script(["python", "train.py"], str(tmp_path), 1, 2, python=str(py), timeout=0.5)
    assert report["status"] == "timeout"
    assert (tmp_path / "child-ran").is_dir()  # the stand-in really ran and made its folder
    assert list(temp.iterdir()) == []
    if sys.platform.startswith("linux"):  # orphans are this process's own business again once the run is over
        import ctypes

        flag = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(37, ctypes.byref(flag), 0, 0, 0)  # PR_GET_CHILD_SUBREAPER
        assert flag.value == 0


# --- an interrupted sweep keeps its finished rows --------------------------------------------------

SWEEP = ["--set", "model=tiny", "--set", "device=cpu"]


@pytest.mark.parametrize(
    "interruption, code", [(KeyboardInterrupt(), 130), (supervise.Terminated(signal.SIGTERM), 143)]
)
def test_an_interrupted_sweep_keeps_the_finished_rows(tmp_path, monkeypatch, interruption, code):
    import vlmdoctor.run.runner as runner

    calls = []

    def one_run(cfg, timeout=None, diagnose=True, **_k):
        calls.append(cfg.batch_size)
        if len(calls) == 3:
            raise interruption  # the parent was interrupted while the third run was in flight
        metrics = {"real_tokens_per_s": 100.0 * len(calls), "pad_fraction": 0.1, "step_ms": 10.0}
        return {"status": "ok", "config": cfg.to_dict(), "metrics": metrics | {"step_ms_p10": 9.0, "step_ms_p90": 11.0}}

    monkeypatch.setattr(runner, "run_isolated", one_run)
    csv = tmp_path / "rows.csv"
    r = invoke(["sweep", *SWEEP, "--set", "batch_size=1,2,3,4", "--csv", str(csv)])
    assert r.exit_code == code, r.output
    assert "2 of 4 run(s) finished" in r.output and "Traceback" not in r.output
    lines = csv.read_text().splitlines()
    assert len(lines) == 3 and "batch_size=1" in lines[1] and "batch_size=2" in lines[2]


# --- output folders are checked before a child starts ---------------------------------------------

SCRIPT = "import pathlib, sys; pathlib.Path(sys.argv[1]).write_text('the script ran')\n"


def _commands(tmp_path: Path, out: Path) -> dict[str, list[str]]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    base = tmp_path / "base.json"
    base.write_text("{}")
    return {
        "run --out": ["run", "--out", str(out), "--", "python", str(script), str(tmp_path / "ran")],
        "run --json": ["run", "--out", str(tmp_path / "o"), "--json", str(out / "r.json"), "--", "python", str(script)],
        "profile --trace-dir": ["profile", "--model", "tiny", "--device", "cpu", "--trace-dir", str(out)],
        "treat --out": ["treat", "--model", "tiny", "--device", "cpu", "--out", str(out)],
        "sweep --csv": ["sweep", *SWEEP, "--set", "batch_size=1,2", "--csv", str(out / "s.csv")],
        "gate --junit": ["gate", "--baseline", str(base), "--current", str(base), "--junit", str(out / "j.xml")],
    }


@pytest.fixture
def nothing_starts(monkeypatch):
    """Any child process, or any measurement, fails the test: the refusal must come first."""
    import vlmdoctor.run.runner as runner

    def started(*_a, **_k):
        raise AssertionError("a run started before the output folder was checked")

    monkeypatch.setattr(supervise, "run", started)
    monkeypatch.setattr(runner, "run_profile", started)
    monkeypatch.setattr(runner, "run_isolated", started)


@pytest.mark.parametrize("problem", ["full", "read-only"])
@pytest.mark.parametrize(
    "command", ["run --out", "run --json", "profile --trace-dir", "treat --out", "sweep --csv", "gate --junit"]
)
def test_a_full_or_read_only_output_folder_is_refused_before_anything_runs(
    tmp_path, monkeypatch, nothing_starts, command, problem
):
    out = tmp_path / "out"
    out.mkdir()
    args = _commands(tmp_path, out)[command]
    if problem == "full":
        real = os.statvfs

        def statvfs(path):
            st = real(path)
            if Path(path).resolve() == out.resolve():
                return os.statvfs_result((st.f_bsize, 4096, 100, 10, 10, 100, 10, 10, 0, 255))
            return st

        monkeypatch.setattr(os, "statvfs", statvfs)
    else:
        real = tempfile.mkstemp

        def mkstemp(*a, dir=None, **k):  # what a read-only mount answers to a probe file (root included)
            if dir is not None and Path(dir).resolve() == out.resolve():
                raise OSError(errno.EROFS, "Read-only file system")
            return real(*a, dir=dir, **k)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    r = invoke(args)
    assert r.exit_code == 2, r.output
    flag = command.split()[1]
    assert flag in r.output and ("free" in r.output if problem == "full" else "Read-only" in r.output)
    assert not (tmp_path / "ran").exists()


def test_check_room_says_how_much_is_free(tmp_path, monkeypatch):
    monkeypatch.setattr(supervise, "MIN_FREE_BYTES", 2**62)  # more than any disk has
    with pytest.raises(supervise.UsageError, match=r"--out .*: only .* free on the disk .* at least"):
        supervise.check_room(tmp_path / "not" / "yet", "--out")  # a folder still to be made: its nearest parent
    monkeypatch.setattr(supervise, "MIN_FREE_BYTES", 1)
    supervise.check_room(tmp_path / "not" / "yet", "--out")


@pytest.fixture
def tmpfs(tmp_path):
    """A real 64 KB tmpfs, mounted read-write then read-only; skipped where mounting is not allowed."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_real_small_or_read_only_mount_is_refused_before_the_script_runs(tmpfs, tmp_path, nothing_starts):
    args = _commands(tmp_path, tmpfs / "o")["run --out"]
    r = invoke(args)  # 64 KB free: less than a report and a trace need
    assert r.exit_code == 2 and "free on the disk" in r.output, r.output
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    r = invoke(args)
    assert r.exit_code == 2 and "Read-only" in r.output, r.output
    assert not (tmp_path / "ran").exists()


# --- `vlmdoctor run`: an interruption after the window keeps the report ---------------------------

TRAINING = """
import os, pathlib, sys, time, torch
pathlib.Path(sys.argv[1]).write_text(str(os.getpid()))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(100000):  # trains on long after the measured window
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
"""


@pytest.mark.parametrize(
    "sig, code",
    [
        pytest.param(signal.SIGTERM, 143, id="SIGTERM"),
        pytest.param(signal.SIGINT, 130, id="SIGINT", marks=pytest.mark.slow),
    ],
)
def test_an_interrupted_run_keeps_the_measured_report_and_stops_the_script(tmp_path, sig, code):
    script, out, pid_file = tmp_path / "train.py", tmp_path / "out", tmp_path / "pid"
    script.write_text(TRAINING)
    cmd = [sys.executable, "-m", "vlmdoctor", "run", "--out", str(out), "--warmup", "1", "--steps", "2"]
    cmd += ["--trace-steps", "1", "--quiet", "--", "python", str(script), str(pid_file)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _wait_for(out / "report.json", 120)  # the window is measured; the script trains on
        run.send_signal(sig)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == code, err
    report = json.loads((out / "report.json").read_text())
    assert report["metrics"]["steps_per_repeat"] == 2 and report["interrupted"].startswith("interrupted")
    assert "What was measured is kept" in err and "Traceback" not in err  # (the script's own goes to stdout)
    assert not _alive(int(pid_file.read_text()))


def test_the_next_run_sweeps_the_temp_folder_of_a_vlmdoctor_killed_outright(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine = supervise.temp_folder("vlmdoctor-ranks-", dir=str(tmp_path))  # owned by this live process
    orphan = tmp_path / "vlmdoctor-ranks-killed"
    orphan.mkdir()
    (orphan / "config.json").write_text("{}")
    here = supervise._here()
    (orphan / supervise.OWNER).write_text(f"{dead.pid} 1 {here}\n")
    elsewhere = tmp_path / "vlmdoctor-ranks-other-container"  # a pid of another host or PID namespace
    elsewhere.mkdir()
    (elsewhere / supervise.OWNER).write_text(f"{dead.pid} 1 otherhost:pid:[1]\n")
    reused = tmp_path / "vlmdoctor-trace-reused"  # its pid now names a live process that started later
    reused.mkdir()
    (reused / supervise.OWNER).write_text(f"{os.getpid()} 1 {here}\n")
    unmarked = tmp_path / "vlmdoctor-someone-elses"  # no owner file: never touched
    unmarked.mkdir()
    other = tmp_path / "user-data"
    other.mkdir()
    (other / supervise.OWNER).write_text(f"{dead.pid} 1 {here}\n")
    gone = supervise.sweep_stale(tmp_path)
    assert sorted(p.name for p in gone) == ["vlmdoctor-ranks-killed", "vlmdoctor-trace-reused"]
    assert mine.is_dir() and unmarked.is_dir() and other.is_dir() and elsewhere.is_dir()
    assert not orphan.exists() and not reused.exists()
    with supervise.scratch("vlmdoctor-x-", dir=str(tmp_path)) as s:
        assert (s / supervise.OWNER).read_text().split()[0] == str(os.getpid())
    assert not s.exists() and mine.is_dir()


def test_sigterm_while_typer_parses_exits_143_not_its_130(tmp_path: Path) -> None:
    """typer turns a KeyboardInterrupt raised while it builds the command line into exit 130: a SIGTERM
    then (vlmdoctor's Terminated) is still said and exits 143, as the shell and a scheduler expect."""
    code = (
        "import os, signal, typer.core as t\n"
        "c = t.TyperGroup.__mro__[1]  # the Command class typer uses (its own vendored click)\n"
        "g = c.make_context\n"
        "def f(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return g(*a, **k)\n"
        "c.make_context = f\n"
        "from vlmdoctor.cli import main; main()\n"
    )
    r = subprocess.run([sys.executable, "-c", code, "models"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 143, (r.returncode, r.stderr[-500:])
    assert r.stderr.strip().splitlines()[-1] == "interrupted (SIGTERM)"


# --- runs in several threads at once (treat's ablation on several GPUs) --------------------------------------


def _in_threads(*runs: tuple[str, list[str], float]) -> dict[str, tuple]:
    """Each (name, command, delay) run through supervise.run in its own thread; name -> (outcome, seconds)."""
    import threading

    out: dict[str, tuple] = {}

    def go(name: str, cmd: list[str], delay: float) -> None:
        time.sleep(delay)
        t = time.monotonic()
        try:
            out[name] = (supervise.run(cmd), time.monotonic() - t)
        except KeyboardInterrupt:
            out[name] = ("stopped", time.monotonic() - t)

    threads = [threading.Thread(target=go, args=r) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_runs_in_two_threads_do_not_take_each_others_child_for_an_orphan():
    """A run that ends first once stopped the other thread's child as a process its own child left running."""
    out = _in_threads(("short", ["sleep", "1"], 0.0), ("long", ["sleep", "3"], 0.3))
    short, (long, s_long) = out["short"][0], out["long"]
    assert short.returncode == 0 and short.left_running == 0
    assert long.returncode == 0 and long.left_running == 0 and s_long >= 2.9  # it ran its 3 s


def test_what_a_run_leaves_is_still_stopped_while_another_thread_runs():
    out = _in_threads(("leaves", ["sh", "-c", "sleep 30 & exit 0"], 0.0), ("other", ["sleep", "2"], 0.1))
    leaves, s_leaves = out["leaves"]
    assert leaves.returncode == 0 and leaves.left_running == 1 and s_leaves < 20
    assert out["other"][0].returncode == 0 and out["other"][0].left_running == 0


def test_stop_all_stops_the_runs_of_every_thread_and_not_later_ones():
    import threading

    timer = threading.Timer(0.8, supervise.stop_all)
    timer.start()
    out = _in_threads(*((f"r{i}", ["sleep", "20"], 0.0) for i in range(3)))
    timer.join()
    assert all(o == "stopped" and s < 15 for o, s in out.values()), out
    assert supervise.run(["sleep", "0.1"]).returncode == 0  # a run started afterwards runs
