"""Run one probe case as a hostile user would meet it, observe everything it leaves, and judge it.

A case (cases.py) is a command line (a `vlmdoctor` command, or a user's script that uses `vlmdoctor.Doctor`
or `DoctorCallback`), the files it starts from, signals to send at given moments, mounts (a small tmpfs
for a full disk, a read-only one) and what it must do. `run_case` runs it in a folder of its own:

    CASE/work      the current folder: the inputs, the outputs
    CASE/outside   files the command has no business touching (a link out of `work` points here)
    CASE/tmp       TMPDIR (and `tempfile.tempdir`) of the command and of everything it starts

and observes: the exit code, stdout and stderr, every file of `work` and `outside` before and after
(kind and SHA-256), the processes of the case still running once it ended (every process it started
carries a marker in its environment, found in /proc), what is left in `tmp`, the peak RSS of the
command and its children (wait4), the wall time under a hard limit. `judge` turns that into defects of
the issue's classes; a case with none is OK.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# --- the classes of the issue (docs/reliability.md) --------------------------------------------------------

CRASH = "crash of the user's training"
CHANGE = "change of the user's training"  # its losses, files or exit code differ from the plain run's
ORPHAN = "orphaned process"
LOSS = "data loss"
SECURITY = "security defect"
INTERNAL = "internal error on bad input"
WRONG = "silently wrong result"
HANG = "hang"
BLOWUP = "resource blow-up"
LEAK = "leak of processes or temp files"
OK = "OK"
#: the order a case's verdict is chosen in when it shows several defects (the gravest first)
CLASSES = (CRASH, CHANGE, ORPHAN, LOSS, SECURITY, INTERNAL, WRONG, HANG, BLOWUP, LEAK)

#: seconds a process of the case may outlive the command before it counts as orphaned (a launcher that got
#: SIGTERM when vlmdoctor died stops its workers first)
LINGER_S = 10.0
#: a case's peak RSS above this, for an input of at most 10 MB compressed, is a blow-up
RSS_LIMIT_MB = 2048
MARKER = "VLMDOCTOR_PROBE_CASE"
#: raw terminal control characters that must never reach the console from an input
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f\x80-\x9f\u202a-\u202e\u2066-\u2069]")


@dataclass
class Signal:
    """Send `sig` once `when` holds: 't:SECONDS' after start, 'out:REGEX' (stdout or stderr), 'file:PATH'
    (under work), 'proc:TEXT' (a process of the case whose command line holds TEXT, not the command itself).

    to: 'parent' (the command), 'group' (its process group, as a terminal's Ctrl-C), 'child:TEXT'
    (the processes of the case whose command line holds TEXT), 'one:TEXT' (the newest of them)."""

    when: str
    sig: int
    to: str = "parent"
    delay: float = 0.0  # seconds more after the trigger


@dataclass
class Case:
    id: str
    command: str  # profile, analyze, ..., api, callback
    input: str  # the input class: signal, full-disk, read-only, concurrent, symlink, fifo, special, huge, ...
    expect: str  # the expected behaviour, in words
    argv: list[str]  # a vlmdoctor command line (without 'vlmdoctor'), or ['python', SCRIPT, ...] (kind='python')
    setup: Callable[[Ctx], None] | None = None
    kind: str = "cli"  # cli: `vlmdoctor ARGV`; python: the case's own interpreter runs ARGV[1:]
    code: int | tuple[int, ...] | None = 2  # expected exit code(s); None: not judged
    needles: tuple[str, ...] = ()  # words the one error line (or, for code 0, the output) must hold
    one_line: bool | None = None  # exactly one 'error:' line on stderr (default: when the expected code is 2)
    may_change: tuple[str, ...] = ()  # globs (relative to CASE) of files that may change or go
    creates: tuple[str, ...] = ()  # globs (relative to CASE) that must exist afterwards
    absent: tuple[str, ...] = ()  # globs (relative to CASE) that must not exist afterwards
    signals: list[Signal] = field(default_factory=list)
    timeout: float = 90.0
    check: Callable[[Ctx, Obs], list[tuple[str, str]]] | None = None
    hostile_text: bool = False  # the inputs hold terminal control sequences: none may reach the console raw
    user_training: bool = False  # the script prints USER-OK when its loop ended with its own results
    env: dict[str, str] = field(default_factory=dict)
    stdin: str | None = None  # text on stdin (else /dev/null)
    concurrent: list[str] | None = None  # a second command started with the first (vlmdoctor ARGV, or python ...)
    cwd: str = ""  # the current folder, under work
    stdout_lines: int | None = None  # the reader of stdout goes away after this many lines (`| head -N`)
    aims: str | None = None  # the class this case is aimed at first (default: from its input, AIMS)
    temp_ok: tuple[
        str, ...
    ] = ()  # globs of what the user's own command leaves in TMPDIR, as it would without vlmdoctor
    heavy: bool = False  # runs training steps (tens of seconds); the fast ones run in CI
    ci: bool = False  # one of the generated tests of its class (tests/test_probe_cases.py)

    def codes(self) -> tuple[int, ...] | None:
        return None if self.code is None else (self.code,) if isinstance(self.code, int) else tuple(self.code)


#: the class of defect each input class is aimed at first (every case is judged in every class)
AIMS = {
    "signal": ORPHAN,
    "processes": ORPHAN,
    "hang": HANG,
    "fifo": HANG,
    "special": HANG,
    "full-disk": LOSS,
    "read-only": LOSS,
    "output": LOSS,
    "concurrent": LOSS,
    "symlink": SECURITY,
    "path-traversal": SECURITY,
    "code-injection": SECURITY,
    "hostile-string": SECURITY,
    "wrong-type": INTERNAL,
    "bad-value": INTERNAL,
    "deep": INTERNAL,
    "truncated": INTERNAL,
    "terminal": INTERNAL,
    "closed-pipe": INTERNAL,
    "huge": BLOWUP,
    "oom": WRONG,
    "baseline": WRONG,
    "user-error": CRASH,
    "profiler": CRASH,
    "observer": CHANGE,
    "settings": WRONG,
    "trace-key": WRONG,
    "report-field": WRONG,
    "duplicate": WRONG,
}


def aims(c: Case) -> str:
    """The class a case is aimed at first: its own, else the user's training for the API and the callback, else
    its input's."""
    if c.aims:
        return c.aims
    if c.command in ("api", "callback"):
        return CRASH
    return AIMS.get(c.input, WRONG)


class MountRefused(Exception):
    """This machine does not let the probe mount a tmpfs (not root, or a container without the right): the
    cases of full disks and read-only folders are skipped, and said."""


@dataclass
class Ctx:
    """A case's folders, and the mounts it made (undone after the case)."""

    root: Path
    work: Path
    outside: Path
    tmp: Path
    mounts: list[Path] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def tmpfs(self, rel: str, size: str = "256k", ro: bool = False, fill: Callable[[Path], None] | None = None) -> Path:
        """A tmpfs of `size` at work/REL (or CASE/REL for 'tmp'): a full disk, or read-only after `fill`."""
        where = self.root / rel if rel in ("tmp", "outside") else self.work / rel
        where.mkdir(parents=True, exist_ok=True)
        try:
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
        except OSError as e:  # no mount command
            raise MountRefused(str(e)) from None
        if r.returncode:
            raise MountRefused(r.stderr.decode(errors="replace").strip() or f"mount exited {r.returncode}")
        self.mounts.append(where)
        if fill is not None:
            fill(where)
        if ro:
            self.remount_ro(where)
        return where

    def remount_ro(self, where: Path) -> None:
        r = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True)
        if r.returncode:
            raise MountRefused(r.stderr.decode(errors="replace").strip())

    def fill(self, where: Path, leave: int = 0) -> None:
        """Fill a tmpfs up to `leave` bytes free."""
        st = os.statvfs(where)
        free = st.f_bavail * st.f_frsize - leave
        with contextlib.suppress(OSError), open(where / ".ballast", "wb") as f:
            while free > 0:
                n = min(free, 1 << 16)
                f.write(b"\0" * n)
                free -= n
            f.flush()

    def unmount(self) -> None:
        for m in reversed(self.mounts):
            r = subprocess.run(["umount", str(m)], capture_output=True)
            if r.returncode:
                subprocess.run(["umount", "-l", str(m)], capture_output=True)
        self.mounts.clear()


@dataclass
class Obs:
    rc: int | None
    stdout: str
    stderr: str
    wall_s: float
    timed_out: bool
    peak_rss_mb: float
    before: dict[str, tuple]
    after: dict[str, tuple]
    procs_left: list[str]
    temp_left: list[str]
    signals_sent: list[str]
    second: dict[str, Any] | None = None  # the concurrent command's exit code and output

    @property
    def out(self) -> str:
        return self.stdout + self.stderr

    def error_lines(self) -> list[str]:
        return [x for x in self.stderr.splitlines() if x.startswith("error:")]


@dataclass
class Result:
    case: Case
    obs: Obs | None
    defects: list[tuple[str, str]]
    setup_error: str | None = None
    skipped: str | None = None  # why the case could not run here (no tmpfs mount)

    @property
    def verdict(self) -> str:
        for cls in CLASSES:
            if any(d[0] == cls for d in self.defects):
                return cls
        return OK

    def record(self) -> dict[str, Any]:
        """One line of the JSONL: the case, what was observed, the verdict."""
        c, o = self.case, self.obs
        rec: dict[str, Any] = {
            "id": c.id,
            "command": c.command,
            "input": c.input,
            "expect": c.expect,
            "argv": c.argv,
            "verdict": self.verdict,
            "defects": [{"class": k, "what": w} for k, w in self.defects],
        }
        if self.setup_error:
            rec["setup_error"] = self.setup_error
        if self.skipped:
            rec["skipped"] = self.skipped
        if o is not None:
            changed = {k: v for k, v in o.after.items() if o.before.get(k) != v}
            rec["observed"] = {
                "exit_code": o.rc,
                "stdout_head": _head(o.stdout),
                "stderr_head": _head(o.stderr),
                "wall_s": round(o.wall_s, 2),
                "timed_out": o.timed_out,
                "peak_rss_mb": round(o.peak_rss_mb, 1),
                "files_before": _some({k: list(v) for k, v in sorted(o.before.items())}),
                "files_changed_or_new": _some({k: list(v) for k, v in sorted(changed.items())}),
                "files_gone": sorted(k for k in o.before if k not in o.after),
                "processes_left": o.procs_left,
                "temp_left": o.temp_left,
                "signals_sent": o.signals_sent,
            }
            if o.second is not None:
                rec["observed"]["second_command"] = o.second
        return rec


def _some(files: dict[str, Any], n: int = 40) -> dict[str, Any]:
    """At most n entries (a case of 2,000 rule files lists 40 and how many more)."""
    if len(files) <= n:
        return files
    kept = dict(list(files.items())[:n])
    kept["..."] = f"{len(files) - n} more"
    return kept


def _head(text: str, lines: int = 4) -> list[str]:
    return [x[:300] for x in text.splitlines()[:lines]]


# --- observing -----------------------------------------------------------------------------------------------


def snapshot(*roots: Path, base: Path) -> dict[str, tuple]:
    """Every entry under the roots, relative to base: its kind, and the SHA-256 of regular files."""
    out: dict[str, tuple] = {}
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                p = Path(dirpath) / name
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                rel = str(p.relative_to(base))
                if stat.S_ISREG(st.st_mode):
                    try:
                        h = hashlib.sha256()
                        with open(p, "rb") as f:
                            for chunk in iter(lambda f=f: f.read(1 << 20), b""):
                                h.update(chunk)
                        out[rel] = ("file", h.hexdigest()[:16])
                    except OSError as e:
                        out[rel] = ("file", f"unreadable: {e.strerror}")
                elif stat.S_ISLNK(st.st_mode):
                    out[rel] = ("link", os.readlink(p))
                elif stat.S_ISDIR(st.st_mode):
                    out[rel] = ("dir",)
                else:
                    out[rel] = ("special", stat.S_IFMT(st.st_mode))
    return out


def case_processes(tag: str, exclude: int | None = None) -> dict[int, str]:
    """Live processes (not zombies) whose environment holds this case's marker: pid -> command line."""
    found = {}
    want = f"{MARKER}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == exclude:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat", "rb") as f:
                st = f.read()
            if st[st.rfind(b")") + 2 : st.rfind(b")") + 3] == b"Z":
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            found[int(name)] = cmd
        except OSError:
            continue
    return found


def _kill_case(tag: str) -> None:
    for _ in range(3):
        procs = case_processes(tag)
        if not procs:
            return
        for pid in procs:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


class _Reader(threading.Thread):
    """Reads a pipe to its end into memory (at most `cap` bytes kept; the count goes on); with `lines`, it
    closes the pipe once that many lines came, as `| head -N` does."""

    def __init__(self, pipe: Any, cap: int = 4 << 20, lines: int | None = None) -> None:
        super().__init__(daemon=True)
        self.pipe, self.cap, self.buf, self.total, self.lines = pipe, cap, bytearray(), 0, lines

    def run(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while True:
                chunk = self.pipe.read1(65536) if hasattr(self.pipe, "read1") else self.pipe.read(65536)
                if not chunk:
                    break
                self.total += len(chunk)
                if len(self.buf) < self.cap:
                    self.buf += chunk[: self.cap - len(self.buf)]
                if self.lines is not None and self.buf.count(b"\n") >= self.lines:
                    del self.buf[_nth_line_end(self.buf, self.lines) :]
                    self.pipe.close()
                    break

    def text(self) -> str:
        return self.buf.decode("utf-8", "replace")


def _nth_line_end(buf: bytearray, n: int) -> int:
    at = -1
    for _ in range(n):
        at = buf.index(b"\n", at + 1)
    return at + 1


def command_line(case: Case, argv: list[str]) -> list[str]:
    if argv and argv[0] == "python":
        return [sys.executable, *argv[1:]]
    return [sys.executable, "-c", "from vlmdoctor.cli import main; main()", *argv]


def _env(ctx: Ctx, case: Case, tag: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GITHUB_STEP_SUMMARY", "PYTEST_CURRENT_TEST")}
    env.update(
        {
            MARKER: tag,
            "TMPDIR": str(ctx.tmp),
            "OMP_NUM_THREADS": "1",
            "COLUMNS": "80",
            "PYTHONPATH": str(ROOT) + ((os.pathsep + env["PYTHONPATH"]) if env.get("PYTHONPATH") else ""),
            "TERM": "xterm",  # a terminal that would act on control sequences
            "PROBE_WORK": str(ctx.work),
            "PROBE_OUTSIDE": str(ctx.outside),
            "PROBE_ROOT": str(ROOT),
        }
    )
    env.pop("FORCE_COLOR", None)
    env.update({k: _fill(v, ctx) for k, v in case.env.items()})
    return env


def _fill(text: str, ctx: Ctx) -> str:
    """{work}, {outside}, {tmp}, {root} in a case's text (other braces, as in code, are left alone)."""
    for key, value in (("work", ctx.work), ("outside", ctx.outside), ("tmp", ctx.tmp), ("root", ROOT)):
        text = text.replace("{" + key + "}", str(value))
    return text


def _fmt(argv: list[str], ctx: Ctx) -> list[str]:
    return [_fill(a, ctx) for a in argv]


def _trigger(when: str, start: float, ctx: Ctx, readers: list[_Reader], tag: str, pid: int) -> bool:
    kind, _, what = when.partition(":")
    if kind == "t":
        return time.monotonic() - start >= float(what)
    if kind == "out":
        return any(re.search(what, r.text()) for r in readers)
    if kind == "file":
        return (ctx.work / what).exists()
    if kind == "proc":
        return any(what in cmd for p, cmd in case_processes(tag, exclude=pid).items())
    raise ValueError(when)


def _send(s: Signal, proc: subprocess.Popen, tag: str) -> str:
    if s.to == "parent":
        with contextlib.suppress(OSError):
            os.kill(proc.pid, s.sig)
        return f"{signal.Signals(s.sig).name} to the command"
    if s.to == "group":
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, s.sig)
        return f"{signal.Signals(s.sig).name} to the command's process group"
    if s.to.startswith(("child:", "one:")):
        kind, _, text = s.to.partition(":")
        hit = sorted(p for p, cmd in case_processes(tag, exclude=proc.pid).items() if text in cmd)
        hit = hit[-1:] if kind == "one" else hit  # one: the newest of them (one rank of several)
        for p in hit:
            with contextlib.suppress(OSError):
                os.kill(p, s.sig)
        return f"{signal.Signals(s.sig).name} to {len(hit)} process(es) matching {text!r}"
    raise ValueError(s.to)


def observe(case: Case, ctx: Ctx, tag: str) -> Obs:
    """Run the case's command (and its concurrent twin), send its signals, wait (hard limit), observe."""
    env = _env(ctx, case, tag)
    argv = command_line(case, _fmt(case.argv, ctx))
    before = snapshot(ctx.work, ctx.outside, base=ctx.root)
    second = None
    if case.concurrent:
        second = subprocess.Popen(
            command_line(case, _fmt(case.concurrent, ctx)),
            cwd=ctx.work / case.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    start = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=ctx.work / case.cwd,
        env=env,
        stdin=subprocess.PIPE if case.stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own group: a terminal's Ctrl-C is simulated on it; a hang is killed whole
    )
    if case.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.write(case.stdin.encode())
            proc.stdin.close()
    readers = [_Reader(proc.stdout, lines=case.stdout_lines), _Reader(proc.stderr)]
    for r in readers:
        r.start()
    pending = list(case.signals)
    sent: list[str] = []
    timed_out = False
    status = rusage = None
    armed: float | None = None
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = time.monotonic()
        if now - start > case.timeout:
            timed_out = True
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            _kill_case(tag)
            pid, status, rusage = os.wait4(proc.pid, 0)
            break
        if pending:
            s = pending[0]
            if armed is None and _trigger(s.when, start, ctx, readers, tag, proc.pid):
                armed = now + s.delay
            if armed is not None and now >= armed:
                sent.append(f"{_send(s, proc, tag)} at {now - start:.1f} s")
                pending.pop(0)
                armed = None
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.monotonic() - start
    for r in readers:
        r.join(timeout=5)
    sec_obs = None
    if second is not None:
        try:
            sout, serr = second.communicate(timeout=max(5.0, case.timeout - wall))
            sec_obs = {"exit_code": second.returncode, "stderr_head": _head(serr.decode("utf-8", "replace"))}
        except subprocess.TimeoutExpired:
            with contextlib.suppress(OSError):
                os.killpg(second.pid, signal.SIGKILL)
            second.communicate()
            sec_obs = {"exit_code": None, "timed_out": True}
    left = case_processes(tag)
    settle = time.monotonic() + LINGER_S  # what the command stopped (or what its death stops) has a moment to go
    while left and time.monotonic() < settle:
        time.sleep(0.2)
        left = case_processes(tag)
    _kill_case(tag)
    peak = rusage.ru_maxrss / 1024 if rusage is not None else 0.0
    temp_left = sorted(str(p.relative_to(ctx.tmp)) for p in ctx.tmp.rglob("*")) if ctx.tmp.exists() else []
    return Obs(
        rc=proc.returncode,
        stdout=readers[0].text(),
        stderr=readers[1].text(),
        wall_s=wall,
        timed_out=timed_out,
        peak_rss_mb=peak,
        before=before,
        after=snapshot(ctx.work, ctx.outside, base=ctx.root),
        procs_left=[f"{p}: {c[:200]}" for p, c in left.items()],
        temp_left=temp_left,
        signals_sent=sent,
        second=sec_obs,
    )


# --- judging ---------------------------------------------------------------------------------------------------

#: what torch keeps in the temp folder across runs on purpose (its compiler caches), and the probe's own ballast
TORCH_CACHES = ("torchinductor_*", ".ballast")
#: names an interrupted or failed write, or a temporary trace, leaves behind
LEFTOVER = re.compile(r"(\.tmp$|\.probe$|^\.vlmdoctor|^vlmdoctor-trace-|^vlmdoctor-gate-|^vlmdoctor-scratch|^tmp)")


def _matches(rel: str, globs: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(rel, g) or rel.startswith(g.rstrip("*").rstrip("/") + "/") for g in globs)


def judge(case: Case, obs: Obs, ctx: Ctx) -> list[tuple[str, str]]:
    """The defects the observation shows, by class; [] is OK."""
    d = _process(case, obs) + _files(case, obs) + _exit(case, obs) + _leftovers(case, obs)
    if case.hostile_text:
        raw = CONTROL.search(obs.out.replace("\n", "").replace("\r", ""))
        if raw:
            d.append((SECURITY, f"a raw control character {raw.group()!r} reached the console"))
    if case.check is not None:
        d.extend(case.check(ctx, obs))
    return d


def _process(case: Case, obs: Obs) -> list[tuple[str, str]]:
    """The user's loop, what still runs, how long, how much memory."""
    d = []
    if obs.timed_out:
        d.append((HANG, f"still running after {case.timeout:.0f} s; killed"))
    if case.user_training and "USER-OK" not in obs.stdout:
        why = "SIGSEGV" if obs.rc == -11 else f"exit {obs.rc}"
        d.append((CRASH, f"the training loop did not end with its own results ({why})"))
    if obs.procs_left:
        d.append((ORPHAN, f"{len(obs.procs_left)} process(es) of the case still running: {obs.procs_left[0]}"))
    if obs.peak_rss_mb > RSS_LIMIT_MB:
        d.append((BLOWUP, f"peak RSS {obs.peak_rss_mb:,.0f} MB"))
    return d


def _files(case: Case, obs: Obs) -> list[tuple[str, str]]:
    """Nothing the user had changed or lost (unless the case allows it), nothing written outside, no code run."""
    d = []
    for rel, was in obs.before.items():
        now = obs.after.get(rel)
        if now != was and not _matches(rel, case.may_change):
            what = "removed" if now is None else "changed"
            d.append((SECURITY if rel.startswith("outside/") else LOSS, f"{rel} {what}"))
    for rel in obs.after:
        if rel.startswith("outside/") and rel not in obs.before:
            d.append((SECURITY, f"{rel} written outside the folders the command was given"))
    if any(Path(rel).name == "PWNED" for rel in obs.after):
        d.append((SECURITY, "code from an input ran (a PWNED file appeared)"))
    for g in case.creates:
        if not any(fnmatch.fnmatch(rel, g) for rel in obs.after):
            d.append((LOSS if "report" in g or "json" in g else WRONG, f"{g} was not written"))
    for g in case.absent:
        hit = [rel for rel in obs.after if fnmatch.fnmatch(rel, g)]
        if hit:
            d.append((WRONG, f"{hit[0]} exists"))
    return d


def _exit(case: Case, obs: Obs) -> list[tuple[str, str]]:
    """The exit code, the one error line, the words the output must hold, no internal error."""
    d = []
    out = obs.out
    internal = ("Traceback (most recent call last)" in obs.stderr and case.kind == "cli") or "internal error" in out
    if internal:
        d.append((INTERNAL, _first_match(out, r"(internal error.*|Traceback.*)")))
    codes = case.codes()
    if codes is not None and obs.rc not in codes and not obs.timed_out and not internal:
        if obs.rc == 1 and 2 in codes:
            d.append((INTERNAL, f"exit 1 (an internal failure) where a bad input is exit 2: {_last(obs.stderr)}"))
        else:
            d.append((WRONG, f"exit {obs.rc}, expected {' or '.join(map(str, codes))}: {_last(obs.stderr)}"))
    one = case.one_line if case.one_line is not None else (codes == (2,))
    if one and obs.rc == 2 and len(obs.error_lines()) != 1:
        d.append((WRONG, f"{len(obs.error_lines())} error lines on stderr, expected one"))
    for n in case.needles:
        if n.lower() not in out.lower():
            d.append((WRONG, f"the output does not say {n!r}"))
    return d


def _leftovers(case: Case, obs: Obs) -> list[tuple[str, str]]:
    """Temp files: in TMPDIR (but those the output names, and torch's own caches), and beside the outputs."""
    d = []
    announced = [t for t in obs.temp_left if Path(t).name in obs.out]
    allowed = (*case.temp_ok, *TORCH_CACHES)
    stray = [
        t
        for t in obs.temp_left
        if t not in announced and not _within_announced(t, announced) and not _matches(t, allowed)
    ]
    if stray:
        d.append((LEAK, f"left in the temp folder: {', '.join(stray[:3])}"))
    work_left = [
        rel
        for rel in obs.after
        if rel not in obs.before and rel.startswith("work/") and LEFTOVER.search(Path(rel).name)
    ]
    if work_left:
        d.append((LEAK, f"left beside the outputs: {', '.join(work_left[:3])}"))
    return d


def _within_announced(t: str, announced: list[str]) -> bool:
    return any(t.startswith(a.rstrip("/") + "/") for a in announced)


def _first_match(text: str, pattern: str) -> str:
    m = re.search(pattern, text)
    return m.group(0)[:300] if m else ""


def _last(text: str) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1][:300] if lines else "(no output)"


_SETUP = threading.Lock()  # setups import libraries (transformers' tokenizers): one at a time


def default_signals() -> None:
    """No ignored SIGINT, SIGTERM or SIGHUP in the commands the probe starts (call it in the main thread).

    A process started in the background by a shell (`cmd &`, nohup) ignores SIGINT or SIGHUP, and an ignored
    signal stays ignored in every program it starts: the signal cases would then probe nothing."""
    for sig, default in (
        (signal.SIGINT, signal.default_int_handler),
        (signal.SIGTERM, signal.SIG_DFL),
        (signal.SIGHUP, signal.SIG_DFL),
    ):
        if signal.getsignal(sig) == signal.SIG_IGN:
            signal.signal(sig, default)


def run_case(case: Case, base: Path, keep: bool = False) -> Result:
    """Set the case up in base/ID, run it, judge it, undo its mounts (and remove its folder unless keep)."""
    root = base / re.sub(r"[^A-Za-z0-9_.-]+", "_", case.id)
    if root.exists():
        shutil.rmtree(root)
    ctx = Ctx(root, root / "work", root / "outside", root / "tmp")
    for p in (ctx.work, ctx.outside, ctx.tmp):
        p.mkdir(parents=True)
    (ctx.outside / "secret.txt").write_text("the user's private notes\n")
    tag = uuid.uuid4().hex
    try:
        try:
            if case.setup is not None:
                with _SETUP:
                    case.setup(ctx)
        except MountRefused as e:
            return Result(case, None, [], skipped=f"cannot mount a tmpfs here: {e}")
        except Exception as e:  # the probe's own problem: said, not judged
            return Result(case, None, [], setup_error=f"{type(e).__name__}: {e}")
        obs = observe(case, ctx, tag)
        try:
            defects = judge(case, obs, ctx)
        except Exception as e:
            defects = [(WRONG, f"the case's own check failed: {type(e).__name__}: {e}")]
        return Result(case, obs, defects)
    finally:
        _kill_case(tag)
        ctx.unmount()
        if not keep:
            _rmtree(root)


def _rmtree(root: Path) -> None:
    for dirpath, _dirs, _files in os.walk(root):
        with contextlib.suppress(OSError):
            os.chmod(dirpath, 0o755)
    shutil.rmtree(root, ignore_errors=True)


def load_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
