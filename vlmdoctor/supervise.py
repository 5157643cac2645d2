"""The processes vlmdoctor starts (a training script, a profile run, torchrun): owned, stopped, never orphaned.

Every child starts in a session of its own, so that it and everything it starts form one process
group that vlmdoctor alone signals (a terminal's Ctrl-C reaches vlmdoctor only; vlmdoctor passes
it on). The promises (docs/files.md, "Child processes"):
- SIGINT, SIGTERM and SIGHUP to vlmdoctor reach the whole group, and processes the child started in
  sessions of their own (torchrun's ranks); whatever still runs `GRACE_S` seconds later is killed;
- when the child exits, processes it left running are stopped the same way, and its output is no
  longer waited for (a helper that holds the child's stdout cannot keep vlmdoctor waiting);
- a time limit stops the group the same way;
- a child outlives vlmdoctor by no more than a moment, even when vlmdoctor is killed outright (SIGKILL, the
  out-of-memory killer): on Linux it starts by asking the kernel for SIGTERM when its parent dies;
- temporary folders a child makes under `SCRATCH_ENV` live inside a folder its caller removes,
  so a child killed outright leaves none behind; the folder of a vlmdoctor killed outright is removed
  by the next one (`sweep_stale`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TypeVar

from vlmdoctor.errors import UsageError
from vlmdoctor.files import check_output_dir

#: seconds between the polite signal (SIGINT / SIGTERM) and SIGKILL; tests lower it
GRACE_S = 10.0
#: seconds one run of a configuration may take by default (sweep --timeout, gate --timeout, treat --trial-timeout)
RUN_TIMEOUT_S = 900
#: seconds the output of a child that exited is still read (from processes it left that are not in its group)
DRAIN_S = 1.0
#: seconds between two looks at a running child
POLL_S = 0.05
#: free space below which an output folder is refused before a child starts (a report and a short trace fit)
MIN_FREE_BYTES = 16 * 2**20
#: environment variable naming the folder a child makes its temporary folders in (removed by the parent)
SCRATCH_ENV = "VLMDOCTOR_SCRATCH"

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached vlmdoctor. A KeyboardInterrupt, so that it unwinds the way Ctrl-C does:
    children stopped, temporary folders removed, what was measured kept."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_of(exc: BaseException) -> int:
    """The signal an interruption stands for, to pass on to the children: SIGINT for Ctrl-C."""
    return exc.signum if isinstance(exc, Terminated) else signal.SIGINT


def interrupted_exit_code(exc: BaseException) -> int:
    """128 + the signal, as a shell reports it: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(signal_of(exc))


def describe_interruption(exc: BaseException) -> str:
    """'interrupted (Ctrl-C)', 'interrupted (SIGTERM)'."""
    return (
        "interrupted (" + ("Ctrl-C" if signal_of(exc) == signal.SIGINT else signal.Signals(signal_of(exc)).name) + ")"
    )


_received: list[int] = []


def _raise_terminated(signum: int, _frame: object) -> None:
    _received.append(signum)
    raise Terminated(signum)


def terminated_by() -> int | None:
    """The signal (SIGTERM, SIGHUP) that `handle_termination` turned into `Terminated` in this process, if one
    came: the CLI's exit code says it even where a library caught the exception as a Ctrl-C (typer's 130)."""
    return _received[-1] if _received else None


def handle_termination() -> None:
    """SIGTERM and SIGHUP raise `Terminated` in the main thread instead of ending the process on the spot
    (which would skip every `finally`: children orphaned, temporary folders left). A handler the
    embedding program installed is left alone."""
    if sys.platform == "win32":
        return
    with contextlib.suppress(ValueError):  # not the main thread: nothing to install
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) in (signal.SIG_DFL, None):
                signal.signal(sig, _raise_terminated)


# --- output folders --------------------------------------------------------------------------------


def check_room(path: str | os.PathLike | None, flag: str = "", need: int | None = None) -> None:
    """An output folder (or a file's folder) with less than `need` bytes free is refused up front:
    a full disk found after the script ran would cost the measurement."""
    if path is None or str(path) in ("", "-"):
        return
    need = MIN_FREE_BYTES if need is None else need
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except OSError:
        return  # the writability checks name the problem
    free = st.f_bavail * st.f_frsize
    if free < need:
        label = f"{flag} {path}" if flag else str(path)
        raise UsageError(
            f"{label}: only {_size(free)} free on the disk of {folder}; "
            f"vlmdoctor needs at least {_size(need)} there before it starts a run"
        )


def check_folder(path: str | os.PathLike | None, flag: str = "") -> None:
    """A folder a child will write into: a folder (or creatable), writable, with room on its disk."""

    check_output_dir(path, flag)
    check_room(path, flag)


def check_file_folders(**outputs: str | os.PathLike | None) -> None:
    """Room on the disk of each output file's folder (`json=..., csv=...`: flags without dashes)."""
    for flag, path in outputs.items():
        if path is not None and str(path) not in ("", "-"):
            check_room(Path(path).parent, "--" + flag.replace("_", "-"))


def check_temp() -> None:
    """The temp folder, where each child run writes its report (and its trace when diagnosed): writable, with room."""

    temp = tempfile.gettempdir()
    check_output_dir(temp, "the temp folder (TMPDIR)")
    check_room(temp, "the temp folder (TMPDIR)")


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


#: the file naming the process that owns a temporary folder (its pid and start time), for `sweep_stale`
OWNER = ".vlmdoctor-owner"


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None if it is gone (or there is no /proc)."""
    p = _proc(pid)
    return None if p is None else p.start


def _here() -> str:
    """This host and PID namespace: a pid means something only where it was taken (a temp folder shared by
    containers or hosts holds folders of processes this one cannot see)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "?"
    return f"{os.uname().nodename}:{ns}".replace(" ", "_")


def sweep_stale(parent: str | os.PathLike) -> list[Path]:
    """Remove the temporary folders in `parent` whose owning vlmdoctor is gone: one killed outright (SIGKILL,
    the out-of-memory killer) cannot remove its own, so the next one does. Only folders that carry an `OWNER`
    file written on this host, in this PID namespace, by this user, naming a process that no longer runs are
    touched; anything else in the temp folder is left alone."""
    gone = []
    here = _here()
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith("vlmdoctor-") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                with open(os.path.join(entry.path, OWNER)) as f:
                    pid_text, start_text, where = f.read(512).split()
                pid, start = int(pid_text), int(start_text)
            except (OSError, ValueError):
                continue
            if where == here and _started(pid) != start:  # gone, or its pid now names another process
                shutil.rmtree(entry.path, ignore_errors=True)
                gone.append(Path(entry.path))
    return gone


def temp_folder(prefix: str = "vlmdoctor-", dir: str | None = None) -> Path:
    """A new temporary folder owned by this process (`OWNER`), made after the stale ones of processes that
    were killed outright are swept from the same parent. The caller removes it."""
    parent = dir or tempfile.gettempdir()
    sweep_stale(parent)
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=dir))
    start = _started(os.getpid())
    if start is not None:
        with contextlib.suppress(OSError):
            (path / OWNER).write_text(f"{os.getpid()} {start} {_here()}\n")
    return path


@contextlib.contextmanager
def scratch(prefix: str = "vlmdoctor-", dir: str | None = None) -> Iterator[Path]:
    """A temporary folder that is removed however the block ends; children make theirs inside it
    (through `SCRATCH_ENV`), so a child killed outright leaves nothing behind either, and one left by a
    vlmdoctor killed outright is removed by the next (`sweep_stale`)."""
    path = temp_folder(prefix, dir)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def scratch_dir() -> str | None:
    """Where this process makes its temporary folders when its parent asked (`SCRATCH_ENV`); else None (the
    system's temp folder)."""
    d = os.environ.get(SCRATCH_ENV)
    return d if d and os.path.isdir(d) else None


# --- the process table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    pgid: int
    start: int  # clock ticks after boot
    zombie: bool


def _proc(pid: int) -> _Proc | None:
    """Process `pid` from /proc/PID/stat; None if it is gone (or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()  # the name may hold spaces and parentheses
    if len(fields) < 20:
        return None
    return _Proc(pid, int(fields[1]), int(fields[2]), int(fields[19]), fields[0] == b"Z")


def _table() -> dict[int, _Proc]:
    """Every process this user can see, from /proc (empty where there is no /proc)."""
    procs = {}
    with contextlib.suppress(OSError):
        names = os.listdir("/proc")
        for name in names:
            if not name.isdigit():
                continue
            p = _proc(int(name))
            if p is not None:
                procs[p.pid] = p
    return procs


def _descendants(root: int, procs: dict[int, _Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)
    found, todo = set(), [root]
    while todo:
        for c in children.get(todo.pop(), []):
            if c not in found:
                found.add(c)
                todo.append(c)
    return found


_reaping = {"depth": 0, "was": True}
#: runs in progress in this process, in several threads at once (treat's ablation on several GPUs): the pids of
#: their children, so that one run never takes another's child for an orphan of its own, stops it or reaps it
_live: set[int] = set()
_live_lock = threading.RLock()
#: when `stop_all` was called (time.monotonic()): every run started before then stops
_stopped_at: list[float] = []


def stop_all() -> None:
    """Stop every run in progress in this process, in every thread (each stops its group as on Ctrl-C and raises
    KeyboardInterrupt in its thread): a signal reaches the main thread only. Runs started afterwards run."""
    _stopped_at.append(time.monotonic())


T = TypeVar("T")


def at_once(jobs: list[Callable[[], T]], name: str, stop: threading.Event | None = None) -> list[T]:
    """Each job in a thread of its own, all at once (each job's runs are subprocesses): their results, in order.
    On Ctrl-C (the main thread's) or a job's error, seen as soon as it happens: `stop` is set (a job checks it
    before it starts another run), every run in progress stops (`stop_all`), and the error is raised again."""
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix=name) as pool:
        futures = [pool.submit(job) for job in jobs]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)  # not after the jobs before it have finished
            for f in futures:
                if f.done() and f.exception() is not None:
                    f.result()
            return [f.result() for f in futures]
        except BaseException:
            if stop is not None:
                stop.set()
            stop_all()
            raise


def _others(procs: dict[int, _Proc], own: int) -> set[int]:
    """The processes of the other runs in progress: their children, the children's groups and descendants."""
    with _live_lock:
        roots = _live - {own}
    found = set(roots) | {p.pid for p in procs.values() if p.pgid in roots}
    for r in roots:
        found |= _descendants(r, procs)
    return found


@contextlib.contextmanager
def _subreaper() -> Iterator[None]:
    """While a child runs, orphans of its processes are re-parented to this process instead of init, so
    that one that left the child's group (a daemon, a rank in its own session) is still found and
    stopped. Switched back off afterwards (a program that uses vlmdoctor as a library keeps its
    own orphans' fate)."""
    libc = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL(None, use_errno=True)
    if libc is not None and _reaping["depth"] == 0:
        was = ctypes.c_int(0)
        with contextlib.suppress(Exception):
            libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
            _reaping["was"] = bool(was.value)
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    with _live_lock:
        _reaping["depth"] += 1
    try:
        yield
    finally:
        with _live_lock:
            _reaping["depth"] -= 1
            if libc is not None and _reaping["depth"] == 0 and not _reaping["was"]:
                with contextlib.suppress(Exception):
                    libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class _Group:
    """A child and every process it started: its process group, its descendants, and the orphans of
    both that were re-parented to this process."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.start = _table().get(proc.pid, _Proc(proc.pid, 0, 0, 0, False)).start

    def members(self) -> set[int]:
        """Live processes of the child (the child itself excluded): its group, its descendants, and
        processes re-parented to this one that started after it (orphans of the child's tree)."""
        with _live_lock:  # a run starting in another thread registers its child before this looks
            procs = _table()
            others = _others(procs, self.pid)
        me = os.getpid()
        found = {p.pid for p in procs.values() if p.pgid == self.pid}
        found |= _descendants(self.pid, procs)
        adopted = {p.pid for p in procs.values() if p.ppid == me and p.pid != self.pid and p.start >= self.start}
        for a in adopted - others:
            found |= {a} | _descendants(a, procs)
        found.discard(self.pid)
        return {pid for pid in found - others if pid in procs and not procs[pid].zombie}

    def exited(self) -> bool:
        """The child exited (it stays a zombie, not reaped, so its pid and group id cannot be reused meanwhile)."""
        if self.proc.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def signal(self, sig: int, members: set[int] | None = None) -> None:
        """`sig` to the group, the child and each member outside the group."""
        if not self.exited():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        for pid in members if members is not None else self.members():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def reap(self) -> None:
        """Collect the exit status of the child and of adopted orphans that ended (no zombies left)."""
        with contextlib.suppress(ChildProcessError):
            self.proc.wait()
        me = os.getpid()
        with _live_lock:
            others = set(_live)
        for p in _table().values():
            if p.ppid == me and p.zombie and p.pid != self.pid and p.start >= self.start and p.pid not in others:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(p.pid, os.WNOHANG)


# --- running a child -------------------------------------------------------------------------------

#: what a child runs first (Linux): SIGTERM to it when vlmdoctor dies, however it dies (a parent killed
#: outright runs no `finally`), then the command itself in the same process (exec)
_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys\n"
    f"ctypes.CDLL(None).prctl({_PR_SET_PDEATHSIG}, int(signal.SIGTERM), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(128 + signal.SIGTERM)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _tied_to_us(cmd: Sequence[str], env: dict[str, str] | None) -> list[str]:
    """`cmd`, started so that it ends when this process does (Linux; elsewhere as it is). A command that
    cannot be found is left as it is, for Popen to say so."""
    cmd = list(cmd)
    path = (env if env is not None else os.environ).get("PATH")
    if not sys.platform.startswith("linux") or not cmd or shutil.which(cmd[0], path=path) is None:
        return cmd
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]


@dataclass
class Outcome:
    """How a supervised child ended."""

    returncode: int  # the child's exit code; -N: ended by signal N
    timed_out: bool = False
    left_running: int = 0  # processes the child left running when it exited (stopped by vlmdoctor)


class _Pump:
    """Copies the child's output, as it comes, to a log file and to the terminal."""

    def __init__(self, fd: int | None, log: IO[bytes] | None, echo: IO[bytes] | None) -> None:
        self.fd, self.log, self.echo = fd, log, echo
        self.sel = selectors.DefaultSelector()
        if fd is not None:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    @property
    def open(self) -> bool:
        return self.fd is not None

    def pump(self, wait: float) -> None:
        """Copy what is there, waiting up to `wait` seconds for something to come."""
        if self.fd is None:
            time.sleep(wait)
            return
        if not self.sel.select(wait):
            return
        while self.fd is not None:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return
            if not chunk:
                self.close()
                return
            for sink in (self.log, self.echo):
                if sink is not None:
                    with contextlib.suppress(OSError, ValueError):  # a closed terminal must not stop the copy
                        sink.write(chunk)
                        sink.flush()

    def drain(self, seconds: float) -> None:
        """Read until the end of the output, or until `seconds` pass (a process outside reach holds it)."""
        end = time.monotonic() + seconds
        while self.open and time.monotonic() < end:
            self.pump(min(POLL_S, max(0.0, end - time.monotonic())))
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            self.sel.unregister(self.fd)
            os.close(self.fd)
            self.fd = None
        self.sel.close()


def run(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    timeout: float | None = None,
    log: IO[bytes] | None = None,
    echo: IO[bytes] | None = None,
    stdin: int | None = subprocess.DEVNULL,
) -> Outcome:
    """Run `cmd` as an owned process group, its output (stdout and stderr) to `log` and, as it comes, to `echo`.

    An interruption of this process (Ctrl-C: KeyboardInterrupt; SIGTERM, SIGHUP: `Terminated`)
    is passed on to the group, which gets `GRACE_S` seconds before SIGKILL; then it is raised
    again. A `timeout` stops the group the same way (SIGTERM) and says so in the outcome.
    """
    with _subreaper():
        return _run(cmd, env, cwd, timeout, log, echo, stdin)


def _run(
    cmd: Sequence[str],
    env: dict[str, str] | None,
    cwd: str | os.PathLike | None,
    timeout: float | None,
    log: IO[bytes] | None,
    echo: IO[bytes] | None,
    stdin: int | None,
) -> Outcome:
    piped = echo is not None
    stdout: int | IO[bytes] = subprocess.PIPE if piped else (log if log is not None else subprocess.DEVNULL)
    started = time.monotonic()
    with _live_lock:  # registered before any other run's look for orphans can see it
        proc = subprocess.Popen(
            _tied_to_us(cmd, env),
            stdin=stdin,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        _live.add(proc.pid)
    group = _Group(proc)
    pump = _Pump(proc.stdout.fileno() if piped and proc.stdout else None, log, echo)
    timed_out = False
    left = 0
    try:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not group.exited():
            if _stopped_at and _stopped_at[-1] >= started:  # stop_all, from the thread a signal reached
                raise KeyboardInterrupt
            if deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                _stop(group, signal.SIGTERM, pump)
                break
            pump.pump(POLL_S)
        else:
            leftover = group.members()
            if leftover:  # the child is done; what it left running is stopped, not orphaned
                left = len(leftover)
                _stop(group, signal.SIGTERM, pump)
    except BaseException as e:
        _stop(group, signal_of(e) if isinstance(e, KeyboardInterrupt) else signal.SIGTERM, pump)
        raise
    finally:
        pump.drain(DRAIN_S)
        group.reap()
        with _live_lock:
            _live.discard(proc.pid)
        if proc.stdout is not None:
            with contextlib.suppress(OSError):
                proc.stdout.close()
    return Outcome(proc.returncode, timed_out, left)


def _stop(group: _Group, sig: int, pump: _Pump) -> None:
    """`sig` to every process of the group; SIGKILL to those still there after `GRACE_S` seconds (or at once,
    when a second interruption comes meanwhile)."""
    group.signal(sig)
    end = time.monotonic() + GRACE_S
    try:
        while time.monotonic() < end:
            if group.exited() and not group.members():
                return
            pump.pump(POLL_S)
    except KeyboardInterrupt:  # a second Ctrl-C: no more waiting
        pass
    finally:
        members = group.members()  # looked up again: a rank still held by its launcher is found now
        if members or not group.exited():
            group.signal(signal.SIGKILL, members)
            _wait_gone(group)


def _wait_gone(group: _Group, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and (not group.exited() or group.members()):
        time.sleep(POLL_S)
