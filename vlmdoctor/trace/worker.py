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
import threading
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


def idle_cores() -> int:
    """Cores no other work is using, by the 1-minute load average (at least 1; the cores where the platform has
    no load average): splitting one file pays only where a second core is free, its worker's start and its
    tables' trip back cost about a third of the reading (a 1 GiB trace on a busy 2-core machine: 14 s of CPU
    in two processes against 10 s in one, no sooner done)."""
    try:
        return max(1, min(cpus(), round(cpus() - os.getloadavg()[0])))
    except OSError:
        return cpus()


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


def run_pool(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], limit: int) -> list[Any]:
    """Each call's value, in order, at most `limit` at a time: this process runs calls too, and a worker
    slot takes the next call as soon as its last one ends, so files of unequal size keep every core busy
    (run_all's rounds wait for their slowest). The first error raised is raised, after every worker is
    stopped; the slots' threads have all ended when this returns."""
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []
    order = iter(range(len(calls)))
    lock = threading.Lock()
    live: list[Worker] = []

    def take() -> int | None:
        with lock:
            return None if errors else next(order, None)

    def fail(e: BaseException) -> None:
        with lock:
            errors.append(e)
            for w in live:  # the others are stopped at once; their own errors are not the first
                w.stop()

    def slot() -> None:  # a thread: one worker process at a time
        while (i := take()) is not None:
            with lock:
                if errors:
                    return
                w = Worker(calls[i][0], *calls[i][1])
                live.append(w)
            try:
                out[i] = w.result()
            except BaseException as e:
                if not errors:
                    fail(e)
            finally:
                w.stop()
                with lock:
                    live.remove(w)

    threads = [threading.Thread(target=slot, daemon=True) for _ in range(min(limit, len(calls)) - 1)]
    for t in threads:
        t.start()
    try:
        while (i := take()) is not None:
            out[i] = calls[i][0](*calls[i][1])
    except BaseException as e:
        fail(e)
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return out


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
