"""Worker processes of the analyzer: one call each (a part of a trace file, one rank's file) in a fresh interpreter.

`python -m vlmdoctor.trace.worker` reads a pickled (function, args) on standard input and writes the
pickled result on standard output. A fresh interpreter runs nothing of its caller's: multiprocessing's
spawn would re-run the caller's main script (a user's training loop, when the API analyzes from
inside it), and fork would copy a process that may hold torch's threads.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class WorkerError(RuntimeError):
    """A worker process died or answered nothing."""


def cpus() -> int:
    """The cores this process may run on (os.cpu_count where the platform cannot say)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Worker:
    """`fn(*args)` in a new interpreter; `result()` waits for it and returns its value or raises its error."""

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where this vlmdoctor is imported from
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlmdoctor.trace.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL))
        self.proc.stdin.close()

    def result(self) -> Any:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        code = self.proc.wait()
        if not out:
            raise WorkerError(f"an analyzer worker process exited with {code} and no answer")
        ok, value = pickle.loads(out)
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def run_all(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], here: int = 0) -> list[Any]:
    """Each call's value, in order; the first `here` calls run in this process while the others run
    in workers. The first error raised (here or in a worker) is raised, after every worker is stopped."""
    workers = [Worker(fn, *args) for fn, args in calls[here:]]
    try:
        mine = [fn(*args) for fn, args in calls[:here]]
        return mine + [w.result() for w in workers]
    finally:
        for w in workers:
            w.stop()


def _serve() -> None:
    fn, args = pickle.load(sys.stdin.buffer)
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything the call prints must not mix with the answer
    try:
        answer = (True, fn(*args))
    except Exception as e:  # the caller raises it
        answer = (False, e)
    try:
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # an error that does not pickle still says what it was
        data = pickle.dumps((False, WorkerError(f"{type(e).__name__}: {e}")))
    out.write(data)
    out.flush()


if __name__ == "__main__":
    _serve()
