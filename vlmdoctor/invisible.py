"""The user's random streams, kept: whatever vlmdoctor runs inside the user's process leaves them as it found them.

Python's `random`, numpy's global generator, torch's CPU generator and each initialized CUDA device's
generator are saved on the way into vlmdoctor's code and put back on the way out. vlmdoctor's own code
draws nothing on purpose (its probes have generators of their own), but the libraries it imports and
calls may: rich draws from `random` when it is imported. A draw there shifted every later batch, dropout
mask and sampler of the user's training. Entry points (Doctor's, the callback's, `vlmdoctor run`'s hooks)
run under `kept()`; the forward hooks, which run on every forward and call no library, do not.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Iterator
from typing import Any


def _save() -> list[tuple[Any, Any]]:
    """(restore function, state) of each stream that exists in this process now."""
    saved: list[tuple[Any, Any]] = [(random.setstate, random.getstate())]
    np = sys.modules.get("numpy")
    if np is not None:
        saved.append((np.random.set_state, np.random.get_state()))
    torch = sys.modules.get("torch")
    if torch is not None:
        saved.append((torch.set_rng_state, torch.get_rng_state()))
        if torch.cuda.is_initialized():
            saved.append((torch.cuda.set_rng_state_all, torch.cuda.get_rng_state_all()))
    return saved


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Run vlmdoctor's code; the user's random streams are as they were afterwards, whatever it did."""
    try:
        saved = _save()
    except Exception:  # a stream that cannot be read cannot be changed by restoring it either
        saved = []
    try:
        yield
    finally:
        for restore, state in saved:
            with contextlib.suppress(Exception):
                restore(state)
