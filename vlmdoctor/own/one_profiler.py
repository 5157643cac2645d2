"""One torch.profiler session per process: vlmdoctor never starts a second one, and gives way to the script's.

torch keeps one profiler session per process (kineto's): a second session prepared or started
while one runs fails, and tearing the failed one down ends the first, so the process dies in the
next profiler step (SIGSEGV in torch 2.13). That is what two `vlmdoctor.Doctor`s on one loop, or
`vlmdoctor run` on a script that uses one, did to the user's training.

So every vlmdoctor recorder asks `busy()` before its traced window and traces only when no other
session runs (another recorder's, or the script's own torch.profiler); otherwise it says why in
one line and keeps its timed numbers. `install()` wraps torch's three session calls (prepare,
enable, disable) so that sessions are seen whoever starts them; when the script starts its own
profiler while a recorder holds the session, the recorder stops its trace first and the
script's profiler runs as it would without vlmdoctor.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class _Holder:
    """A recorder that holds (or is about to hold) the profiler: what it is, and how to make it stop."""

    what: str
    give_way: Callable[[str], None]


_holders: dict[int, _Holder] = {}  # id(recorder) -> holder; at most one traces at a time
_session: dict[str, Any] = {"by": None}  # who prepared or started the running session: "user", id(recorder), None
_ours = threading.local()  # set while a recorder itself calls into torch.profiler
_lock = threading.RLock()
_installed: dict[str, Any] = {}
_early: list[weakref.ref] = []  # profilers already entered when watching started


@contextlib.contextmanager
def ours(owner: object) -> Iterator[None]:
    """Profiler calls made inside this block are the recorder's own (not the script's)."""
    prev = getattr(_ours, "owner", None)
    _ours.owner = id(owner)
    try:
        yield
    finally:
        _ours.owner = prev


def _wrap_start(fn: Callable[..., Any]) -> Callable[..., Any]:
    def start(*args: Any, **kwargs: Any) -> Any:
        mine = getattr(_ours, "owner", None)
        if mine is None:  # the script starts a profiler: a recorder that holds the session gives way first
            _give_way_to_script()
        result = fn(*args, **kwargs)
        _session["by"] = mine if mine is not None else "user"
        return result

    start.__wrapped__ = fn  # type: ignore[attr-defined]
    return start


def _wrap_stop(fn: Callable[..., Any]) -> Callable[..., Any]:
    def stop(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            _session["by"] = None

    stop.__wrapped__ = fn  # type: ignore[attr-defined]
    return stop


def install() -> None:
    """Watch torch's profiler sessions from now on (once per process; harmless if torch changed its names)."""
    with _lock:
        if _installed:
            return
        try:
            import torch.autograd.profiler as ap  # deferred: torch
        except Exception:
            return
        for name, wrap in (
            ("_prepare_profiler", _wrap_start),
            ("_enable_profiler", _wrap_start),
            ("_disable_profiler", _wrap_stop),
        ):
            fn = getattr(ap, name, None)
            if callable(fn) and not hasattr(fn, "__wrapped__"):
                _installed[name] = fn
                setattr(ap, name, wrap(fn))
        _installed.setdefault("done", True)
        _early.extend(_entered_before())


def _give_way_to_script() -> None:
    with _lock:
        holders = list(_holders.items())
    for _key, holder in holders:
        with contextlib.suppress(Exception):  # never in the way of the script's own profiler
            holder.give_way("the script started its own torch.profiler")


def _torch_profiling() -> bool:
    """A torch profiler session is recording (on any thread), or one is prepared that vlmdoctor saw start."""
    try:
        import torch  # deferred: torch
        import torch.autograd.profiler as ap  # deferred: torch
    except Exception:
        return False
    if getattr(ap, "_is_profiler_enabled", False):
        return True
    with contextlib.suppress(Exception):
        if torch.autograd._profiler_enabled():
            return True
    return _session["by"] == "user"


def _running(o: Any) -> bool:
    """A torch.autograd.profiler.profile that was entered (prepared) and not yet exited."""
    return bool(getattr(o, "entered", False)) and getattr(o, "kineto_results", 1) is None


def _entered_before() -> list[weakref.ref]:
    """Profilers the script entered before vlmdoctor watched (prepared, in their warm-up steps, where
    torch's flags do not show them yet): found once, by their objects, when watching starts."""
    try:
        from torch.autograd.profiler import profile  # deferred: torch
    except Exception:
        return []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [weakref.ref(o) for o in gc.get_objects() if isinstance(o, profile) and _running(o)]


def busy(me: object) -> str | None:
    """Why `me` must not start a profiler now (another one runs in this process), in words; None when free."""
    with _lock:
        for key, holder in _holders.items():
            if key != id(me):
                return holder.what
    if _torch_profiling() or any((o := r()) is not None and _running(o) for r in _early):
        return "the script's own torch.profiler"
    return None


def claim(me: object, what: str, give_way: Callable[[str], None]) -> str | None:
    """Take the profiler for `me`; returns why not (and takes nothing) when another one runs."""
    with _lock:
        why = busy(me)
        if why is None:
            _holders[id(me)] = _Holder(what, give_way)
        return why


def release(me: object) -> None:
    with _lock:
        _holders.pop(id(me), None)
