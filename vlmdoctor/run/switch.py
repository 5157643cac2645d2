"""The leave-one-out arms a treatment asked a run to measure in its own process (run/arms.py: which knobs, and why).

After the run's timed and traced windows: rounds of short windows, the run's own config first and then each arm; a
window of the run's config and the arm's window after it make a pair, whose ratio (the run's real tokens/s over the
arm's) is the change's own worth in that round. An arm switches the loader (another loader over the same dataset:
its batch, padding, order, labeled-rows head, workers or pinned memory), may set regional compilation aside
(each compiled layer's call put back after), and may flip what a step reads each time: the frozen tower's no_grad,
AdamW's fused implementation (its step counts moved to where that implementation keeps them; put back after). Each
window starts with untimed steps, which take the switch: a new loader's first batches (its workers' start), the
caching allocator's new blocks (emptied before each switch, so one config's cached blocks do not crowd the other's).

What it cannot measure it says: an arm that runs out of memory is out of memory without the change in this process
(the final config needs it); one that fails otherwise is an error; neither stops the other arms. The run's own
numbers are taken before any of this and are never touched by it.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from vlmdoctor.errors import first_line, is_out_of_memory
from vlmdoctor.run.arms import COMPILE_KNOBS, LOADER_KNOBS, MAX_ROUNDS, MODEL_KNOBS, SETTLE_STEPS, WINDOW_STEPS
from vlmdoctor.run.compile import graphs_compiled, repeated_blocks
from vlmdoctor.run.head import head_loss
from vlmdoctor.run.patient import Patient, cycle, make_loader, release, sync

Step = Callable[[Patient], tuple[torch.Tensor, dict[str, Any]]]


class _Arm:
    """One arm in flight: its knobs, its batches (None: the run's own loader), what its windows measured."""

    def __init__(self, name: str, patch: dict[str, Any]) -> None:
        self.name, self.patch = name, patch
        self.batches: Iterator[dict[str, Any]] | None = None
        self.status, self.error = "ok", None
        self.tokens_per_s: list[float] = []
        self.ratios: list[float] = []
        self.recompiled = 0  # windows whose timed steps compiled a graph: their pair is not counted
        self.window_s = 0.0

    def record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "patch": self.patch,
            "status": self.status,
            "tokens_per_s": self.tokens_per_s,
            "ratios": self.ratios,
            "recompiled": self.recompiled,
        }
        if self.error:
            out["error"] = self.error
        return out


def measure(p: Patient, arms: dict[str, dict[str, Any]], seconds: float, step: Step) -> dict[str, Any]:
    """Rounds of windows (the run's config, then each arm still running) while a round's next window fits in
    `seconds`, at most MAX_ROUNDS; the patient is left as it was found (its loader, its compiled layers)."""
    t_end = time.monotonic() + seconds
    own_batches = p.batches
    live = [_Arm(n, dict(patch)) for n, patch in arms.items()]
    every = list(live)
    finals: list[float] = []
    final_s = 0.0
    rounds = 0
    stopped = "rounds"
    try:
        for a in list(live):
            try:
                a.batches = _batches(p, a.patch)
            except Exception as e:  # a loader that cannot be built ends that arm only
                a.status, a.error = "error", f"{type(e).__name__}: {first_line(e)}"
                live.remove(a)
        while rounds < MAX_ROUNDS and live:
            if time.monotonic() + final_s + min(a.window_s for a in live) > t_end:
                stopped = "time"
                break
            t = time.monotonic()
            final, again = _window(p, own_batches, step)
            final_s = time.monotonic() - t
            if again:  # the run's own window compiled: no pair this round
                rounds += 1
                continue
            finals.append(final)
            # the arms with the fewest pairs first: where the time ends inside a round, each has what the others have
            for a in sorted(live, key=lambda x: len(x.ratios)):
                if time.monotonic() + a.window_s > t_end:
                    stopped = "time"
                    continue
                t = time.monotonic()
                got = _arm_window(p, a, own_batches, step)
                a.window_s = time.monotonic() - t
                if got is None:
                    live.remove(a)
                    continue
                if got[1]:
                    a.recompiled += 1
                    continue
                a.tokens_per_s.append(got[0])
                a.ratios.append(final / got[0])
            rounds += 1
            if stopped == "time":
                break
    finally:
        p.batches = own_batches
        for a in every:
            a.batches = None  # the arm's loader and its workers go with it
        gc.collect()
    return {
        "window_steps": WINDOW_STEPS,
        "rounds": rounds,
        "stopped": stopped,
        "seconds": seconds - max(0.0, t_end - time.monotonic()),
        "final_tokens_per_s": finals,
        "arms": {a.name: a.record() for a in every},
    }


def _batches(p: Patient, patch: dict[str, Any]) -> Iterator[dict[str, Any]] | None:
    """The arm's batches: another loader over the run's dataset where it sets a loader knob, else None (the run's)."""
    knobs = {k: v for k, v in patch.items() if k in LOADER_KNOBS}
    if not knobs:
        return None
    cfg = p.cfg.replace(source="an in-process arm", **knobs)
    if len(p.dataset) < cfg.batch_size:  # a loader without one batch would cycle forever
        raise ValueError(f"the data holds {len(p.dataset)} samples, fewer than one batch of {cfg.batch_size}")
    collator = copy.copy(p.collator)
    collator.multiple, collator.labeled_only = cfg.pad_to_multiple_of, cfg.lm_head_labeled_only
    return cycle(make_loader(cfg, p.dataset, collator, p.device))


def _arm_window(p: Patient, a: _Arm, own: Iterator[dict[str, Any]], step: Step) -> tuple[float, bool] | None:
    """The arm's window (over the run's own batches where it sets no loader knob); None where it could not run (its
    status says why: oom or error)."""
    try:
        with contextlib.ExitStack() as arm:
            if any(k in a.patch for k in COMPILE_KNOBS):
                arm.enter_context(_eager(p))
            if any(k in a.patch for k in MODEL_KNOBS):
                arm.enter_context(_model_knobs(p, a.patch))
            return _window(p, a.batches or own, step)
    except Exception as e:  # an arm that fails ends that arm only; the run's own numbers are already taken
        oom = is_out_of_memory(e)
        a.status, a.error = ("oom", None) if oom else ("error", f"{type(e).__name__}: {first_line(e)}")
    # outside the handler: the exception's frames (and the tensors they hold) are gone before the memory is freed
    _release(p)
    return None


def _window(p: Patient, batches: Iterator[dict[str, Any]], step: Step) -> tuple[float, bool]:
    """Untimed steps until one compiles no new graph (at most SETTLE_STEPS), then WINDOW_STEPS timed ones: their real
    tokens per second of wall time, and whether dynamo compiled a graph in them (a compile's seconds are no step's:
    on one H200, qwen2-vl-2b windows of two steps read x4.9 without the batch and x8.7 without padding to 64, where
    fresh processes read x2.4 and x1.2)."""
    p.batches = batches
    _release(p)
    for _ in range(SETTLE_STEPS):
        before = graphs_compiled()
        step(p)
        sync(p.device)
        if graphs_compiled() == before:
            break
    before = graphs_compiled()
    t0 = time.perf_counter()
    tokens = 0
    for _ in range(WINDOW_STEPS):
        _, counts = step(p)
        tokens += counts["real_tokens"]
    sync(p.device)
    return tokens / (time.perf_counter() - t0), graphs_compiled() != before


@contextlib.contextmanager
def _eager(p: Patient) -> Iterator[None]:
    """Regional compilation set aside: each compiled layer runs its eager call, the LM head its eager loss; put back
    after, the compiled graphs still in dynamo's cache."""
    blocks = [(b, b._compiled_call_impl) for b in repeated_blocks(p.vlm)]
    owner = next((m for m in p.vlm.modules() if callable(getattr(m, "head_loss", None))), None)
    compiled_head = owner.head_loss if owner is not None else None
    try:
        for b, _ in blocks:
            b._compiled_call_impl = None
        if owner is not None:
            owner.head_loss = head_loss
        yield
    finally:
        for b, c in blocks:
            b._compiled_call_impl = c
        if owner is not None:
            owner.head_loss = compiled_head


@contextlib.contextmanager
def _model_knobs(p: Patient, patch: dict[str, Any]) -> Iterator[None]:
    """The tower's no_grad and AdamW's implementation as the arm sets them; the run's own put back after."""
    own = [(g.get("fused"), g.get("foreach")) for g in p.optimizer.param_groups]
    try:
        if "vision_no_grad" in patch:
            p.vlm.set_vision_no_grad(bool(patch["vision_no_grad"]))
        if "fused_optimizer" in patch:  # as AdamW(fused=True) sets it, or torch's default (foreach on a GPU)
            _set_implementation(p.optimizer, [(True, None) if patch["fused_optimizer"] else (None, None)] * len(own))
        yield
    finally:
        if "vision_no_grad" in patch:
            p.vlm.set_vision_no_grad(p.cfg.vision_no_grad)
        if "fused_optimizer" in patch:
            _set_implementation(p.optimizer, own)


def _set_implementation(optimizer: torch.optim.Optimizer, flags: list[tuple[Any, Any]]) -> None:
    """Each group's (fused, foreach), which AdamW's step reads at every call. The fused kernel keeps each step count
    on the parameter's device, foreach without capturable on the CPU (where torch's own `__setstate__` puts them), so
    the counts move with the flags; the moments stay where they are."""
    for group, (fused, foreach) in zip(optimizer.param_groups, flags, strict=True):
        group["fused"], group["foreach"] = fused, foreach
        on_device = bool(group.get("capturable")) or bool(fused)
        for q in group["params"]:
            state = optimizer.state.get(q)
            count = state.get("step") if state else None
            if isinstance(count, torch.Tensor):
                state["step"] = count.to(q.device if on_device else "cpu")


def _release(p: Patient) -> None:
    """Gradients dropped and the allocator's cache emptied: the next window allocates what its config needs (a CPU
    has no cache to empty, and a collection there costs every window time)."""
    p.optimizer.zero_grad(set_to_none=True)
    if p.device.type == "cuda":
        release(p.device)
