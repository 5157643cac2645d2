"""`vlmdoctor.Doctor`: measure and diagnose the user's own training loop from inside it.

    with vlmdoctor.Doctor(model, out="doctor-out") as doc:
        for batch in loader:
            ...; opt.step(); opt.zero_grad()
            doc.step(batch)

Steps are the intervals between `doc.step()` calls. After `warmup` steps comes a timed window of
`steps` steps (the device is synchronized at its two ends only, so the loop runs as it always
does), then a traced window (torch.profiler: 1 wait, 1 warm-up, `trace_steps` active steps) with
the model's parts marked. Tokens come from the batch passed to `step()`, or, when none is passed,
from a forward pre-hook that reads the model's `input_ids` / `attention_mask` / `labels`.

The user's training comes first: an error in vlmdoctor's own bookkeeping is logged once and
switches vlmdoctor off; errors from the user's code pass through unchanged. The callback
(`vlmdoctor.callback`) and the launcher (`vlmdoctor.launch`) use the same `Recorder`.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmdoctor import SCHEMA_VERSION, __version__
from vlmdoctor.invisible import kept
from vlmdoctor.report import progress
from vlmdoctor.run import metrics, one_profiler, throughput
from vlmdoctor.run.flopcount import StepFlops, describe_counted, peak_of, per_step
from vlmdoctor.run.metrics import Blocks

IGNORE_INDEX = -100


def _log(msg: str, file: Any = None) -> None:
    """One line on stderr, around any live tqdm bar (report/progress.py); text from the run shown as text."""
    progress.say(msg, file)


# --- tokens -------------------------------------------------------------------------------------


def _get(batch: Any, key: str) -> Any:
    if isinstance(batch, Mapping):
        return batch.get(key)
    return getattr(batch, key, None)


def _pad_id(model: nn.Module | None) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        pid = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(pid, int):
            return pid
    return None


def count_tokens(batch: Any, pad_id: int | None = None) -> dict[str, Any] | None:
    """Real, loss and padded token counts of one micro-batch, as (possibly device) tensors.

    Counts stay on the device so that counting never synchronizes; `.item()` happens once, at the
    window's end. Real tokens: the attention mask's sum, else input_ids that are not padding.
    """
    ids, mask, labels = _get(batch, "input_ids"), _get(batch, "attention_mask"), _get(batch, "labels")
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.dim() == 0):
        ids = None  # features, not token ids
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        mask = None  # not one row of flags per sample (a 4-D attention bias, a scalar): tokens from the ids
    if not isinstance(ids, torch.Tensor) and not isinstance(mask, torch.Tensor):
        return None
    if isinstance(mask, torch.Tensor):
        lengths = mask.sum(1)
        padded, rows = mask.numel(), mask.shape[0]
    elif pad_id is not None and ids.dim() == 2:
        lengths = (ids != pad_id).sum(1)
        padded, rows = ids.numel(), ids.shape[0]
    else:
        lengths = torch.tensor([ids.shape[-1]] * (ids.shape[0] if ids.dim() > 1 else 1))
        padded, rows = ids.numel(), len(lengths)
    loss = (labels != IGNORE_INDEX).sum() if isinstance(labels, torch.Tensor) else None
    return {"real": lengths.sum(), "loss": loss, "padded": padded, "rows": rows, "lengths": lengths}


def guess_sampler(batches: Sequence[Sequence[int]]) -> str | None:
    """'length_bucketed' when samples of similar length share batches, 'random' when not; None: too little data.

    Random batches keep about (B-1)/B of the lengths' variance inside each batch; bucketed ones
    keep little of it. Read from the real lengths of the rows the model saw.
    """
    rows = [list(b) for b in batches if len(b) > 1]
    flat = [x for b in rows for x in b]
    if len(rows) < 2 or len(flat) < 8:
        return None
    total = statistics.pvariance(flat)
    if total == 0:
        return None
    within = sum(statistics.pvariance(b) * len(b) for b in rows) / len(flat)
    return "length_bucketed" if within / total < 0.4 else "random"


# --- the model ----------------------------------------------------------------------------------


def describe_model(model: nn.Module | None) -> dict[str, Any]:
    """Class names of the model and its parts, parameter counts and the dtype the weights are in."""
    from vlmdoctor.run.parts import find_parts

    if model is None:
        return {"class": None, "parts": {}}
    parts = find_parts(model)
    params = list(model.parameters())
    dtypes: dict[str, int] = {}
    for p in params:
        dtypes[str(p.dtype).replace("torch.", "")] = dtypes.get(str(p.dtype).replace("torch.", ""), 0) + p.numel()
    out: dict[str, Any] = {
        "class": type(model).__name__,
        "parts": {k: type(m).__name__ for k, m in parts.items()},
        "params": {
            "total": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "by_part": {
                k: {
                    "total": sum(p.numel() for p in m.parameters()),
                    "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad),
                }
                for k, m in parts.items()
            },
        },
        "param_dtypes": dtypes,
    }
    names = {id(m): name for name, m in model.named_modules()}
    out["paths"] = {k: names[id(m)] for k, m in parts.items() if names.get(id(m))}  # model.<path>, for the advice
    for k in ("vision", "projector", "llm"):
        out[k] = out["parts"].get(k)
    return out


def estimate_stage(desc: dict[str, Any]) -> int | None:
    """1 when only the projector trains, 2 when the LLM trains; None when the parts are not known."""
    by = (desc.get("params") or {}).get("by_part") or {}
    llm = by.get("llm")
    if llm is None:
        return None
    if llm["trainable"] > 0:
        return 2
    proj = by.get("projector")
    return 1 if proj and proj["trainable"] > 0 else None


def _weight_dtype(desc: dict[str, Any]) -> str | None:
    d = desc.get("param_dtypes") or {}
    if not d:
        return None
    main = max(d, key=d.get)
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(main, main)


def _device_of(model: nn.Module | None) -> torch.device:
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def unwrap(model: nn.Module | None) -> tuple[nn.Module | None, str]:
    """The user's model inside DDP / FSDP (`.module`) and torch.compile (`._orig_mod`) wrappers, and how it
    is run in parallel: 'ddp', 'fsdp', 'fsdp2' (fully_shard keeps the module, with FSDP's class mixed in) or
    'none'."""
    parallel = "none"
    try:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):
            parallel = "fsdp2"
    except ImportError:
        pass
    while model is not None:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        name = type(model).__name__
        if name == "DistributedDataParallel":
            parallel = "ddp"
        elif name == "FullyShardedDataParallel":
            parallel = "fsdp"
        model = inner
    return model, parallel


def _next_from(record: dict[str, Any], clock: str = "t") -> float:
    """Where the step after this record starts: its end, or later when work that is not training came between."""
    return record.get("next_from" if clock == "t" else "cpu_next_from", record[clock])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- the recorder --------------------------------------------------------------------------------


class Recorder:
    """Counts tokens and times steps of a loop it does not own, then traces a window of it."""

    def __init__(
        self,
        model: nn.Module | None,
        out: str | Path = "doctor-out",
        warmup: int = 5,
        steps: int = 20,
        trace_steps: int = 2,
        stage: int | None = None,
        source: str = "api",
        config: dict[str, Any] | None = None,
        audience: str = "loop",
        step_offset: int = 0,
    ) -> None:
        from vlmdoctor.rank_join import rank_and_world

        model, self.parallel = unwrap(model)
        self.model = model
        self.out_given = str(out)
        self.out = Path(os.path.abspath(out))  # where the loop started: a loop that changes its folder writes there
        self.rank, self.world = rank_and_world()
        self.step_offset = step_offset  # the user's number of the step before the first one counted here
        self.tell: Any = None  # the progress lines' printer (Doctor sets it on rank 0 unless quiet)
        self.warmup, self.steps, self.trace_steps = (
            max(0, int(warmup)),
            max(1, int(steps)),
            max(0, int(trace_steps)),  # 0: timed only (the gate's paired runs), no traced window
        )
        self.stage_given = stage
        self.source = source
        self.extra_config = dict(config or {})
        self.audience = audience
        self.device = _device_of(model)
        self.pad_id = _pad_id(model)
        self.broken = False
        self.done = False
        self.n = 0  # steps completed
        self.pending: list[dict[str, Any]] = []  # micro-batch counts since the last step
        self.pending_losses: list[torch.Tensor] = []
        self.pending_nograd = 0  # forwards under no_grad since the last step: counted apart, their tokens not
        self.records: list[dict[str, Any]] = []  # per step: t_end, counts, losses
        self.t_start: float | None = None
        self.c_start: float | None = None  # the process's CPU time where the first step starts
        self.window: dict[str, Any] | None = None
        self.prof: Any = None
        self.unmark: Any = None
        self.trace_info: dict[str, Any] | None = None
        self.notes: list[str] = []
        self.hooks: list[Any] = []
        self.batch_seen = False
        self.desc = describe_model(model) if model is not None else {"class": None, "parts": {}}
        self.warmup_asked = self.warmup
        # the warm-up may grow until its last steps agree (throughput.unsettled), by as many steps as were asked;
        # not with several ranks, which must open their windows at the same step without talking to each other
        grows = self.warmup >= throughput.SETTLE_STEPS and self.world == 1
        self.settle_left = min(20, self.warmup) if grows else 0
        self.settled: bool | None = None
        self.flops = StepFlops()  # counted from the traced window's record once it stopped, never on a live step
        self.flops_padded: int | None = None
        self.traced_padded: list[int] = []  # padded tokens of each recorded (active) traced step
        self.excluded_ms: dict[str, float] = {}  # work between steps that is not training, left out of the times
        self.trace_skipped: str | None = None  # why the traced window was not traced (another profiler ran)
        self.profiled_timed_steps = 0  # timed steps during which another profiler ran (their times include it)
        self.profiled_by: str | None = None
        self.busy_at_start: str | None = None  # another profiler ran where the current step started
        self.report: dict[str, Any] | None = None  # built once, by finish()
        self.said: set[str] = set()  # errors of vlmdoctor's own already said (each once)
        with contextlib.suppress(Exception):
            one_profiler.install()  # sessions the script starts are seen, so that one profiler runs at a time

    # -- hooks ------------------------------------------------------------------------------------
    def attach(self) -> None:
        """Forward hooks on the model: tokens from its inputs, the loss from its output."""
        if self.model is None:
            return

        def pre(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self._safe(self._on_forward, args, kwargs)

        def post(_m: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
            self._safe(self._on_output, output)

        self.hooks.append(self.model.register_forward_pre_hook(pre, with_kwargs=True))
        self.hooks.append(self.model.register_forward_hook(post, with_kwargs=True))

    def _on_forward(self, args: tuple, kwargs: dict) -> None:
        if self.done or not self.model.training:
            return
        if not torch.is_grad_enabled():  # a forward that reaches no backward (a stray evaluation): not training
            self.pending_nograd += 1
            return
        batch = dict(kwargs)
        if "input_ids" not in batch and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            batch["input_ids"] = args[0]
        c = count_tokens(batch, self.pad_id)
        if c is not None:
            c["from"] = "hook"
            self.pending.append(c)

    def _on_output(self, output: Any) -> None:
        if self.done or not self.model.training:
            return
        loss = _get(output, "loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.pending_losses.append(loss.detach())

    def _safe(self, fn: Any, *a: Any) -> Any:
        if self.broken:
            return None
        try:
            return fn(*a)
        except Exception as e:  # never the user's training: log once, switch off
            self.fail(e)
            return None

    def fail(self, e: BaseException) -> None:
        """An error of vlmdoctor's own: said once, measurement switched off, hooks and profiler removed; the
        training goes on."""
        if self.broken:
            return
        self.broken = True
        frames = traceback.extract_tb(e.__traceback__)
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
        self.say("internal error, measurement switched off, training goes on", e, where)
        with contextlib.suppress(Exception):
            self._detach()
        with contextlib.suppress(Exception):
            self._stop_profiler()

    def say(self, what: str, e: BaseException, where: str = "") -> None:
        """One line per distinct error of vlmdoctor's own, however often it comes back."""
        key = f"{type(e).__name__}: {e}"
        if key not in self.said:
            self.said.add(key)
            _log(f"{what}: {key}{where}")

    # -- steps ------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Where the first step starts (the first interval is measured from here)."""
        if self.t_start is None:
            self.t_start = time.perf_counter()
            self.c_start = time.process_time()
            self._announce()

    def _announce(self) -> None:
        what = self.desc.get("class") or "your training"
        if self.world > 1:
            what += f" (rank {self.rank} of {self.world}; every rank measures)"
        line = progress.plan_line(what, self.warmup, self.steps, self.trace_steps, self.step_offset, self.out_given)
        self._tell(line)

    def _tell(self, line: str) -> None:
        """A progress line (report/progress.py), where one is asked for."""
        if self.tell is not None:
            self.tell(line)

    def step(self, batch: Any = None, loss: Any = None, **inputs: Any) -> None:
        self._safe(self._step, batch, loss, inputs)

    def _step(self, batch: Any, loss: Any, inputs: dict[str, Any]) -> None:
        if self.done or self.window_done:  # measured: the rest of the run costs nothing
            return
        now = time.perf_counter()
        if self.t_start is None:
            self.t_start = now
            self.c_start = time.process_time()
        if batch is None and inputs:
            batch = inputs
        counts = self.pending
        if batch is not None:
            c = count_tokens(batch, self.pad_id)
            if c is not None:  # the batch the user passed replaces what the hook saw
                counts = [c]
                self.batch_seen = True
        losses = self.pending_losses
        if isinstance(loss, torch.Tensor):
            losses = [loss.detach()]
        nograd, self.pending_nograd = self.pending_nograd, 0
        self.pending, self.pending_losses = [], []
        self.n += 1
        i = self.n
        boundary = i == self.warmup or i == self.warmup + self.steps
        if boundary:
            _sync(self.device)
            now = time.perf_counter()
        self.records.append(
            {"t": now, "cpu": time.process_time(), "counts": counts, "losses": losses[-1:], "nograd": nograd}
        )
        if self.warmup < i <= self.warmup + self.steps and self.busy_at_start:  # another profiler ran over it
            self.profiled_timed_steps += 1
            self.profiled_by = self.busy_at_start
        if self.warmup <= i < self.warmup + self.steps:  # where the next timed step starts
            self.busy_at_start = one_profiler.busy(self)
        if i == self.warmup and self._still_warming():
            self.warmup += 1  # one more warm-up step; the window starts once the steps agree
            return
        if i == self.warmup:
            self._tell(progress.timed_start_line(self.warmup, self.warmup_asked, self.step_offset, self.steps))
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        if i == self.warmup + self.steps:
            self.window = self._summarize(self.warmup, i)
            rank = self.rank if self.world > 1 else None
            self._tell(progress.timed_done_line(self.window, i, self.step_offset, self.trace_steps, rank))
            if self.trace_steps:
                self._start_traced_window()
        elif self.prof is not None:
            if i > self.warmup + self.steps + 2 and self.trace_info is not None:  # an active (recorded) step
                self.trace_info["traced_step_ms"].append((now - _next_from(self.records[-2])) * 1e3)
                self.traced_padded.append(sum(int(c["padded"]) for c in counts))
            with one_profiler.ours(self):
                self.prof.step()
            if i == self.warmup + self.steps + 2:  # recording starts now; metadata before it is dropped
                self._add_metadata()
            if i >= self.warmup + self.steps + 2 + self.trace_steps:
                self._stop_profiler()
                self._detach()
                self._tell(progress.traced_done_line(i, self.step_offset, (self.trace_info or {}).get("path")))

    def _still_warming(self) -> bool:
        """The warm-up's last steps do not agree yet (time per real token): warm up one more step, while allowed."""
        if self.warmup < throughput.SETTLE_STEPS or not self.warmup_asked:
            return False
        per_token = []
        for k in range(max(0, self.warmup - throughput.SETTLE_STEPS), self.warmup):
            prev = self.records[k - 1]["t"] if k >= 1 else self.t_start
            tokens = sum(int(c["real"]) for c in self.records[k]["counts"]) or 1
            per_token.append((self.records[k]["t"] - prev) / tokens)
        self.settled = not throughput.unsettled(per_token)
        if self.settled or self.settle_left <= 0:
            return False
        self.settle_left -= 1
        return True

    def exclude_since_last_step(self, what: str) -> None:
        """Work that is not training ran since the last step ended (the Trainer's evaluation): the next step is
        timed from now, and the time left out is said."""
        if self.done or self.window_done:
            return
        now = time.perf_counter()
        if not self.records:
            if self.t_start is not None:
                self.t_start, self.c_start = now, time.process_time()
            return
        last = self.records[-1]
        left_out = now - _next_from(last)
        last["next_from"], last["cpu_next_from"] = now, time.process_time()
        if self.n >= self.warmup:  # inside the timed or traced window
            self.excluded_ms[what] = self.excluded_ms.get(what, 0.0) + left_out * 1e3

    @property
    def window_done(self) -> bool:
        """The timed and traced windows are over: the rest of the run is not measured."""
        traced = self.trace_info is not None or not self.trace_steps or self.trace_skipped is not None
        return self.window is not None and self.prof is None and traced

    # -- the timed window -------------------------------------------------------------------------
    def _summarize(self, first: int, last: int) -> dict[str, Any]:
        """Steps first+1..last (1-based): their end times minus the previous step's end."""
        recs = self.records
        t0 = _next_from(recs[first - 1]) if first >= 1 else self.t_start
        step_s, step_cpu = [], []
        prev = t0
        cpu = _next_from(recs[first - 1], "cpu") if first >= 1 else self.c_start
        for r in recs[first:last]:
            step_s.append(r["t"] - prev)
            prev = _next_from(r)
            step_cpu.append(r["cpu"] - cpu if cpu is not None else None)
            cpu = _next_from(r, "cpu")
        toks = []
        for r in recs[first:last]:
            cs = r["counts"]
            toks.append(
                (
                    sum(int(c["real"]) for c in cs),
                    sum(int(c["loss"]) for c in cs if c["loss"] is not None),
                    sum(int(c["padded"]) for c in cs),
                    sum(int(c["rows"]) for c in cs),
                    all(c["loss"] is not None for c in cs) and bool(cs),
                    len(cs),
                )
            )
        losses = [float(x) for r in recs[first:last] for x in r["losses"]]
        lengths = [[int(x) for x in c["lengths"].tolist()] for r in recs[first:last] for c in r["counts"]]
        wall = sum(step_s)
        step_ms = [s * 1e3 for s in step_s]
        real_steps = [t[0] for t in toks]
        loss_steps = [t[1] for t in toks] if toks and all(t[4] for t in toks) else None
        padded_steps = [t[2] for t in toks]
        w: dict[str, Any] = {
            "steps": last - first,
            "wall_s": wall,
            # the FLOPs come later, counted on the traced steps (_build_report asks again with them)
            **metrics.window_numbers(step_ms, real_steps, loss_steps, padded_steps, None, None),
            "step_ms": step_ms,
            # the process's CPU time per step: a one-thread CPU run's work, which a neighbour's load does not stretch
            "step_cpu_ms": [c * 1e3 for c in step_cpu] if None not in step_cpu else None,
            "step_real_tokens": real_steps,
            "step_loss_tokens": loss_steps,
            "step_padded_tokens": padded_steps,
            "losses": losses,
            "rows_per_step": statistics.median([t[3] for t in toks]) if toks else None,
            "forwards_per_step": statistics.median([t[5] for t in toks]) if toks else None,
            # forwards under no_grad inside a step (a stray evaluation): not training, their tokens not counted
            "nograd_forwards_per_step": statistics.median([r.get("nograd", 0) for r in recs[first:last]])
            if last > first
            else None,
            "sampler_guess": guess_sampler(lengths),
        }
        if self.device.type == "cuda":
            w["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            w["peak_mem_reserved_gb"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        return w

    # -- the traced window ------------------------------------------------------------------------
    def _start_traced_window(self) -> None:
        """Trace the next steps, unless another profiler runs in this process: one at a time (two end the
        process), so this one then stays timed only and says why."""
        who = {"api": "vlmdoctor.Doctor", "trainer": "vlmdoctor.DoctorCallback", "script": "vlmdoctor run"}
        what = f"{who.get(self.source, 'another vlmdoctor recorder')} (writing to {self.out})"
        why = one_profiler.claim(self, what, self._give_way)
        if why is not None:
            self._skip_trace(f"{why} was already profiling this process")
            return
        try:
            self._start_profiler()
        except Exception as e:  # a profiler that did not start is dropped, never stopped (that would end another)
            self.prof = None
            self.trace_info = None
            if self.unmark is not None:
                with contextlib.suppress(Exception):
                    self.unmark()
                self.unmark = None
            one_profiler.release(self)
            self._skip_trace(f"torch.profiler did not start ({type(e).__name__}: {e})")

    def _skip_trace(self, why: str) -> None:
        self.trace_skipped = why
        _log(f"not tracing: {why}; one profiler at a time. The timed window stands, the training goes on")

    def _give_way(self, why: str) -> None:
        """The script starts its own profiler while this one holds the session: stop ours first, drop its trace."""
        if self.prof is None:
            one_profiler.release(self)
            return
        self._stop_profiler()
        if self.trace_info is not None:
            with contextlib.suppress(OSError):
                Path(self.trace_info["path"]).unlink(missing_ok=True)
        self.trace_info = None
        self._skip_trace(f"{why} during vlmdoctor's traced window, which was stopped for it")

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        from vlmdoctor.run.capture import trace_writer
        from vlmdoctor.run.parts import mark_parts

        if self.world > 1:  # one folder of rank traces per job, named alike by every rank
            from vlmdoctor.rank_join import job_name

            folder = self.out / "trace" / f"vlmdoctor_{self.source}_{job_name()}"
            path = folder / f"vlmdoctor_{self.source}_rank{self.rank}.pt.trace.json.gz"
        else:
            folder = self.out / "trace"
            path = folder / f"vlmdoctor_{self.source}_{time.strftime('%Y%m%d-%H%M%S')}.pt.trace.json.gz"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        memory = self.device.type == "cuda"  # the live memory at the peak (the memory wall's facts), as `profile` does
        self.trace_info = {
            "path": str(path),
            "steps": self.trace_steps,
            "kept": True,
            "schedule": {"wait": 1, "warmup": 1, "active": self.trace_steps},
            "record_shapes": True,
            "with_stack": False,
            "profile_memory": memory,
            "traced_step_ms": [],
        }
        try:  # a folder for the trace, never through a link: without one the trace is lost, not the measurement
            for f in {self.out / "trace", folder}:
                if f.is_symlink() or (f.exists() and not f.is_dir()):
                    raise OSError(f"{f} exists and is not a folder")
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.trace_info |= {"path": None, "lost": f"cannot create {folder}: {e.strerror or e}"}
            one_profiler.release(self)  # no profiler started: the session is free again
            return
        self.unmark = mark_parts(self.model, on_error=self.fail) if self.model is not None else None
        plan = schedule(wait=1, warmup=1, active=self.trace_steps, repeat=1)
        prof = profile(
            activities=activities,
            schedule=plan,
            on_trace_ready=trace_writer(path, self.trace_info),
            record_shapes=True,
            profile_memory=memory,
        )
        with one_profiler.ours(self):
            prof.__enter__()
        self.prof = prof  # only once it started: a profiler that failed to start is never stopped

    def _add_metadata(self) -> None:
        """What is known of the run travels in the trace (as vlmdoctor's own runs do), so the rules see it."""
        meta = {
            "schema_version": SCHEMA_VERSION,
            "tool_version": __version__,
            "config": self.rule_config(),
            "model": self.desc,
            "source": self.source,
        }
        if self.window is not None:  # the timed window's measurements, so `analyze` of this trace sees them too
            from vlmdoctor.run.capture import measured_metadata

            meta["metrics"] = measured_metadata(_blocks(self.window, self.device, None).metrics)
        self.prof.add_metadata_json("vlmdoctor", json.dumps(meta, default=str))

    def _stop_profiler(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            try:
                with one_profiler.ours(self):
                    prof.__exit__(None, None, None)
            except Exception as e:
                _log(f"the profiler did not stop cleanly: {type(e).__name__}: {e}")
            else:
                self._count_flops(prof)
        one_profiler.release(self)
        if self.unmark is not None:
            unmark, self.unmark = self.unmark, None
            unmark()
        if self.trace_info is not None and self.trace_info.get("path"):
            p = Path(self.trace_info["path"])
            written = "lost" not in self.trace_info and p.is_file()
            self.trace_info["bytes"] = p.stat().st_size if written else None
            if not written:
                self.trace_info["path"] = None

    def _count_flops(self, prof: Any) -> None:
        """The traced steps' FLOPs from the profiler's record, after the window: nothing runs on a live step."""
        active = len((self.trace_info or {}).get("traced_step_ms") or [])
        if not active:
            return
        self.flops.count(prof, active)
        padded = self.traced_padded[:active]
        self.flops_padded = round(sum(padded) / len(padded)) if padded and all(padded) else None

    # -- the report -------------------------------------------------------------------------------
    def rule_config(self) -> dict[str, Any]:
        """What is known of the run, under run-config knob names where one applies (rules read them)."""
        cfg: dict[str, Any] = {
            "source": self.source,
            "model": self.desc.get("class"),
            "vision": self.desc.get("vision"),
            "llm": self.desc.get("llm"),
            "projector": self.desc.get("projector"),
        }
        stage = self.stage_given if self.stage_given is not None else estimate_stage(self.desc)
        cfg["stage"] = stage
        cfg["stage_source"] = "given" if self.stage_given is not None else ("estimated" if stage else "unknown")
        wd = _weight_dtype(self.desc)
        if wd:
            cfg["weight_dtype"] = wd
        with warnings.catch_warnings():  # transformers 5 renamed it; read whichever there is, quietly
            warnings.simplefilter("ignore")
            gc = getattr(
                self.model,
                "is_activation_checkpointing",
                getattr(self.model, "is_gradient_checkpointing", None),
            )
        if isinstance(gc, bool):
            cfg["gradient_checkpointing"] = gc
        impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
        if impl in ("sdpa", "eager", "flash_attention_2"):
            cfg["attention"] = {"flash_attention_2": "flash"}.get(impl, impl)
        cfg["device"] = self.device.type
        if self.parallel != "none":
            cfg["parallel"] = self.parallel
        if self.world > 1:
            cfg["world_size"] = self.world
        cfg["warmup"], cfg["steps"], cfg["trace_steps"] = self.warmup, self.steps, self.trace_steps
        cfg.update(self.extra_config)
        if self.window and self.window.get("rows_per_step") and "batch_size" not in cfg:
            fw = self.window.get("forwards_per_step") or 1
            cfg["batch_size"] = int(self.window["rows_per_step"] / max(fw, 1))
        if self.window and self.window.get("sampler_guess") and "sampler" not in cfg:
            cfg["sampler"] = self.window["sampler_guess"]
            cfg["sampler_source"] = "measured: spread of the real lengths inside batches"
        return cfg

    def _detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.pending, self.pending_losses = [], []

    def finish(self) -> dict[str, Any] | None:
        """Stop measuring and build the report of what was measured (the analysis comes after); once (None
        when building it failed)."""
        if self.done:
            return self.report
        self.done = True
        self._detach()
        self._stop_profiler()
        self.report = self._build_report()
        return self.report

    def _build_report(self) -> dict[str, Any]:
        from vlmdoctor.run import envinfo

        env = envinfo.collect(self.device)
        report: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "tool": {"name": "vlmdoctor", "version": __version__},
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "status": "ok",
            "kind": "profile",
            "model": self.desc,
            "env": env,
        }
        peak, peak_source, no_peak = peak_of(env)
        report["flops"] = describe_counted(self.flops, self.flops_padded) | {
            "peak_flops": peak,
            "peak_source": peak_source,
        }
        if self.flops.total is None and self.flops.reason is None:
            report["flops"]["formula"] = (
                "not counted: no traced window (another profiler ran), whose recorded steps are the ones counted"
                if self.trace_skipped is not None
                else "not counted: the loop ended before the traced window recorded a step"
                if self.trace_steps
                else "not counted: no traced window (trace_steps=0), whose recorded steps are the ones counted"
            )
        n = self.n
        notes = list(self.notes)
        window = self.window
        if window is None and n >= 1:  # the loop ended before the window: measure what ran
            # inside the warm-up: every step but the first (one-time costs), when there is another
            first = self.warmup if n > self.warmup else (1 if n > 1 else 0)
            window = self.window = self._summarize(first, n)
            notes.append(
                f"the loop ran {n} step(s), fewer than the {self.warmup} warm-up + {self.steps} timed "
                f"asked for: the numbers are over steps {first + 1}..{n}"
                + (" (warm-up steps included)" if first < self.warmup else "")
            )
        if n < self.warmup + self.steps + (2 + self.trace_steps if self.trace_steps else 0):
            script = self.source == "script"  # `vlmdoctor run`: flags, and the first optimizer step is not counted
            notes.append(progress.fit_hint(n, self.warmup_asked, self.steps, self.trace_steps, script, int(script)))
        if window is not None and (window.get("nograd_forwards_per_step") or 0) > 0:
            notes.append(
                f"{window['nograd_forwards_per_step']:g} forward(s) per step ran under no_grad (an evaluation inside "
                "the step?): not training, so their tokens are not counted; their time is in the step"
            )
        for what, ms in self.excluded_ms.items():
            notes.append(
                f"{what} ran between steps of the measured windows ({ms:,.0f} ms): left out of the step times"
                + ("; the trace holds it" if self.trace_info is not None else "")
            )
        if self.profiled_timed_steps:
            notes.append(
                f"{self.profiled_by} ran during {self.profiled_timed_steps} of the timed steps: their times "
                "include its overhead"
            )
        if window is not None and self.trace_skipped is not None:
            notes.append(f"not traced: {self.trace_skipped} (one profiler at a time); timed only, no diagnosis")
        elif window is not None and self.trace_info is None and not self.trace_steps:
            notes.append("not traced (trace steps 0): timed only, no facts and no diagnosis")
        elif window is not None and self.trace_info is None:
            notes.append("no traced window: the loop ended first, so there are no facts and no diagnosis")
        elif self.trace_info is not None and self.trace_info.get("lost"):
            from vlmdoctor.run.capture import lost_note

            notes.append(lost_note(self.trace_info["lost"]))
        elif self.trace_info is not None and self.n < self.warmup + self.steps + 2 + self.trace_steps:
            notes.append("the loop ended inside the traced window: the trace holds fewer steps than asked")
        report["config"] = self.rule_config()
        if window is None:
            report["status"] = "error"
            report["error"] = {
                "type": "NoSteps",
                "message": "no training step was seen: call doc.step() once per "
                "optimizer step (or check that the optimizer steps)",
            }
            report["notes"] = notes
            return report
        step_flops = per_step(self.flops.total, self.flops_padded, window.get("step_padded_tokens") or [])
        if step_flops is not None:
            window["step_flops"] = step_flops if isinstance(step_flops, list) else [step_flops] * window["steps"]
        window |= metrics.window_numbers(
            window["step_ms"],
            window["step_real_tokens"],
            window.get("step_loss_tokens"),
            window.get("step_padded_tokens"),
            window.get("step_flops"),
            peak,
        )
        if window["real_tokens_per_s"] is None:
            notes.append(
                "no tokens seen: the model was not called with input_ids / attention_mask keyword "
                "arguments (with vlmdoctor.Doctor, pass the batch: doc.step(batch))"
            )
        mfu_reason = no_peak or f"FLOPs {report['flops']['formula']}"
        report["metrics"], report["stats"], report["throughput"] = _blocks(window, self.device, peak, mfu_reason)
        report["warmup"] = {
            "asked": self.warmup_asked,
            "steps": self.warmup,
            "settle_steps": self.warmup - self.warmup_asked,
            "settled": self.settled,
        }
        report["repeats"] = [
            {k: v for k, v in window.items() if k != "losses"}
            | {"final_loss": window["losses"][-1] if window["losses"] else None}
        ]
        report["data"] = {
            "source": self.source,
            "tokens_from": "batch" if self.batch_seen else "forward hook",
            "steps_seen": n,
        }
        if self.trace_info is not None:
            report["trace"] = dict(self.trace_info) | {"untraced_step_ms_median": report["metrics"]["step_ms"]}
        report["notes"] = notes
        if report["metrics"]["loss_finite"] is False:
            report["status"] = "nan_loss"
            report["error"] = {"type": "NonFiniteLoss", "message": "the loss was NaN or inf in a timed step"}
        return report


def _blocks(w: dict[str, Any], device: torch.device, peak: float | None, mfu_reason: str | None = None) -> Blocks:
    """The report's metrics, stats and throughput of the one timed window, by the one writer (run/metrics.py):
    the same names and meanings as vlmdoctor's own runs, so gate, compare and HTML read both."""
    return metrics.write(
        [w],
        peak=peak,
        device_total_gb=metrics.device_total_gb(device),
        spread_of=metrics.SPREAD_USER,
        mfu_reason=mfu_reason,
    )


# --- from a measured report to prescriptions ---------------------------------------------------


def diagnose_report(
    report: dict[str, Any], audience: str, rules_dirs: Sequence[str] = (), selection: Any = None
) -> dict[str, Any]:
    """Trace -> facts -> findings, plus CPU part times and the fix in the user's terms, in place.

    A trace the analyzer cannot read leaves `facts = {"trace.error": ...}`, never an exception.
    """
    from vlmdoctor.doctor.advice import add_advice
    from vlmdoctor.doctor.diagnosis import examine

    trace = report.get("trace") or {}
    if report.get("status") not in ("ok", "nan_loss") or not trace.get("path"):
        return report
    try:
        examine(report, rules_dirs, selection=selection)
    except Exception as e:  # the analyzer on a trace it was not written for
        report["facts"] = {"trace.error": f"{type(e).__name__}: {e}"}
        report.pop("diagnosis", None)
        report.pop("findings", None)
        report.pop("muted", None)
    if "diagnosis" in report:
        add_advice(report, audience)
    return report


REPORT, HTML = "report.json", "report.html"
#: the longest traced window: a profiler left on for the rest of a long training would fill memory and disk
MAX_TRACE_STEPS = 1000
#: the window's bounds (`Doctor`, `DoctorCallback`, `vlmdoctor run`'s flags): steps, not a resource to exhaust
WINDOW_LIMITS = {"warmup": (0, 10**6), "steps": (1, 10**6), "trace_steps": (0, MAX_TRACE_STEPS)}


def argument_problem(out: Any, warmup: Any, steps: Any, trace_steps: Any, stage: Any, model: Any = None) -> str | None:
    """What is wrong with the arguments of `Doctor` (and `DoctorCallback`), in words; None: nothing. Said, and the
    training left unmeasured: a wrong argument never raises into the training, and an out= that is a link or a
    file is never written through (as `vlmdoctor run --out`)."""
    if model is not None and not isinstance(model, nn.Module):
        return f"model= must be a torch.nn.Module (or None), got {type(model).__name__}"

    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(out, (str, os.PathLike)) or not str(out):
        return f"out= must be a folder path, got {out!r}"[:200]
    if os.path.islink(out) or (os.path.exists(out) and not os.path.isdir(out)):
        return f"out={str(out)!r} exists and is not a folder (a link or a file): vlmdoctor writes only into a folder"
    for name, value in (("warmup", warmup), ("steps", steps), ("trace_steps", trace_steps)):
        low, high = WINDOW_LIMITS[name]
        if not whole(value) or not low <= value <= high:
            return f"{name} must be a whole number from {low} to {high:,}, got {value!r}"[:200]
    if isinstance(stage, bool) or (stage is not None and stage not in (1, 2)):
        return f"stage must be 1, 2 or None, got {stage!r}"[:200]
    return None


def existing_outputs(out: str | Path) -> list[Path]:
    """The outputs of an earlier run in this folder: never replaced without force (`vlmdoctor run`: --force)."""
    return [p for p in (Path(out) / REPORT, Path(out) / HTML) if p.exists() or p.is_symlink()]


def write_outputs(report: dict[str, Any], out: Path, json_path: str | None = None, html: bool = True) -> Path:
    """out/report.json and its page out/report.html (and a copy at --json) through the one file writer.

    A page that cannot be drawn costs the page only: the report is written first, and a note says why.
    """
    from vlmdoctor.files import write_json

    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT
    if html:
        try:
            from vlmdoctor.report.html import profile_html, write_html

            write_html(profile_html(report), out / HTML, force=True)  # refused up front, before the run
        except Exception as e:
            report.setdefault("notes", []).append(f"the HTML page could not be written: {type(e).__name__}: {e}")
    write_json(report, str(path))
    if json_path:
        write_json(report, json_path)
    return path


def gather_ranks(report: dict[str, Any], rec: Recorder) -> dict[str, Any] | None:
    """Several ranks: a rank other than 0 hands what it measured to rank 0 (None: nothing more to do here);
    rank 0 joins the ranks into the job's report (vlmdoctor/rank_join.py). One rank: the report as it is."""
    from vlmdoctor import rank_join

    if rec.world == 1:
        return report
    try:
        if rec.rank != 0:
            rank_join.write_part(report, rec.out, rec.rank)
            return None
        if "distributed" not in report:  # joined once, also when asked again
            rank_join.join(report, rec.out, rec.world)
    except Exception as e:  # this rank's own numbers stand
        rec.say("could not join the ranks' numbers, rank 0's own are kept", e)
    return report


def output_paths(report: dict[str, Any], out: Path) -> dict[str, str | None]:
    """Where the report, its page and the trace (a folder of rank traces for several ranks) are."""
    tr = report.get("trace") or {}
    several = len(tr.get("rank_paths") or []) > 1
    return {
        "report": str(out / REPORT) if (out / REPORT).exists() else None,
        "html": str(out / HTML) if (out / HTML).exists() else None,
        "trace": tr.get("dir") if several else tr.get("path"),
        "ranks": str(len(tr["rank_paths"])) if several else None,
    }


def show(report: dict[str, Any], file: Any = None) -> None:
    """The metrics and the prescriptions, 80 columns wide, around any live tqdm bar."""
    from vlmdoctor.report.console import render_own

    progress.emit(lambda c: render_own(report, c), file or sys.stdout)


def show_summary(report: dict[str, Any], paths: dict[str, str | None], file: Any = None) -> None:
    """The short summary that ends the training's output (report/summary.py)."""
    from vlmdoctor.report.summary import render_summary

    progress.emit(lambda c: render_summary(report, c, paths), file or sys.stdout)


class Doctor:
    """Measure and diagnose a training loop from inside it; see the module docstring.

    Under a launcher (torchrun, accelerate launch) every rank measures its own steps and rank 0
    alone prints and writes the job's report (vlmdoctor/rank_join.py).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        out: str | Path = "doctor-out",
        warmup: int = 5,
        steps: int = 20,
        trace_steps: int = 2,
        stage: int | None = None,
        config: dict[str, Any] | None = None,
        audience: str = "loop",
        quiet: bool = False,
        rules_dirs: Sequence[str] = (),
        source: str = "api",
        force: bool = False,
        step_offset: int = 0,
    ) -> None:
        args = (model, out, warmup, steps, trace_steps, stage, config, audience, quiet, rules_dirs, source, force)
        with kept():
            try:
                self._setup(*args, step_offset)
            except Exception as e:  # whatever the arguments, the constructor never raises into the training
                self._refuse(
                    f"vlmdoctor.Doctor: {type(e).__name__}: {e}"[:300] + ": this run is not measured; training goes on"
                )

    def _refuse(self, why: str) -> None:
        """This run is not measured, said once (rank 0): the loop runs as it would without vlmdoctor, and nothing
        is written."""
        if getattr(self, "rec", None) is None:
            self.rec = Recorder(None, "doctor-out", 0, 1, 0)
        self.rec.done = self.rec.broken = True
        self.lead = self.rec.rank == 0
        self.quiet, self.rules_dirs = True, []
        self.report, self.reported, self.summarized, self.refused = None, False, False, True
        if self.lead:
            _log(why)

    def _setup(
        self,
        model: nn.Module | None,
        out: str | Path,
        warmup: int,
        steps: int,
        trace_steps: int,
        stage: int | None,
        config: dict[str, Any] | None,
        audience: str,
        quiet: bool,
        rules_dirs: Sequence[str],
        source: str,
        force: bool,
        step_offset: int,
    ) -> None:
        bad = argument_problem(out, warmup, steps, trace_steps, stage, model)
        if bad:  # a wrong argument is said, never raised into the training: the loop runs, unmeasured
            model, out, warmup, steps, trace_steps, stage = None, "doctor-out", 0, 1, 0, None
        window = (warmup, steps, trace_steps, stage, source, config, audience, step_offset)
        try:
            self.rec = Recorder(model, out, *window)
        except Exception as e:  # a model vlmdoctor cannot read: the loop runs, unmeasured
            self.rec = Recorder(None, out, *window)
            self.rec.fail(e)
        self.lead = self.rec.rank == 0
        self.quiet = quiet or not self.lead
        if not self.quiet:
            self.rec.tell = progress.say
        self.rules_dirs = list(rules_dirs)
        self.report: dict[str, Any] | None = None
        self.reported = False
        self.summarized = False
        existing = [] if force or bad else existing_outputs(out)
        if bad:
            why = f"vlmdoctor.Doctor: {bad}: this run is not measured; training goes on"
        elif existing:  # the rule of `vlmdoctor run`: an earlier report stays, unless force=True
            why = (
                f"{existing[0]} exists: this run is not measured (force=True replaces it, "
                "or out= another folder); training goes on"
            )
        else:
            why = None
        self.refused = False
        if why is not None:
            self._refuse(why)

    def __enter__(self) -> Doctor:
        if not self.refused:
            with kept():
                self.rec._safe(self.rec.attach)
                self.rec._safe(self.rec.begin)
        return self

    def step(self, batch: Any = None, *, loss: Any = None, **inputs: Any) -> None:
        """Call once per optimizer step, after it; the batch (or its tensors as keywords) is optional.

        Once the traced window is over, the report is written and printed at once (the loop
        goes on, unmeasured), so a long training does not hold it back until its end.
        """
        with kept():
            try:
                self.rec.step(batch, loss, **inputs)
                if not self.reported and not self.refused and self.rec.window_done:
                    self.write_report()
            except Exception as e:  # vlmdoctor's own error: said once, the loop goes on
                self.rec.fail(e)

    @property
    def window_done(self) -> bool:
        try:
            return self.rec.window_done
        except Exception as e:
            self.rec.fail(e)
            return True

    def write_report(self) -> dict[str, Any] | None:
        """Stop; analyze, write out/report.json and its page, and print the prescriptions (rank 0), or hand
        the numbers to rank 0 (the other ranks). Runs once. Whatever fails in here is said in one line and the
        loop goes on; a report that was measured is kept (in `self.report`, and in a rescue file when out/
        cannot be written)."""
        if self.reported or self.refused:
            return self.report
        with kept():
            return self._write_report()

    def _write_report(self) -> dict[str, Any] | None:
        self.reported = True
        try:
            report = self.rec.finish()
        except Exception as e:
            self.rec.fail(e)
            return None
        if report is None:
            return None
        if self.rec.broken:
            report.setdefault("notes", []).append(
                "vlmdoctor hit an internal error during the run and stopped measuring; the numbers may be partial"
            )
        if gather_ranks(report, self.rec) is None:
            return None  # a rank other than 0: rank 0 holds its numbers
        self.report = report
        try:
            diagnose_report(report, self.rec.audience, self.rules_dirs)
        except Exception as e:  # the measurement stands without its diagnosis
            report["diagnosis_error"] = f"{type(e).__name__}: {e}"
            self.rec.say("the diagnosis failed, the measurement is kept", e)
        try:
            path = write_outputs(report, self.rec.out)
        except Exception as e:  # through the one writer; what it could not write is kept in a rescue file
            from vlmdoctor.files import json_text, rescue

            try:
                kept = f"it was saved to {rescue('report.json', json_text(report).encode())}"
            except Exception as e2:
                kept = f"it could not be saved elsewhere either ({type(e2).__name__}: {e2})"
            self.rec.say(f"could not write {self.rec.out / 'report.json'} ({kept})", e)
            return report
        try:
            if not self.quiet:
                show(report)
                page = self.rec.out / HTML
                written = f"{path}, {page}" if page.exists() else str(path)
                self.rec._tell(f"report written: {written}; training goes on, unmeasured")
        except Exception as e:
            self.rec.say(f"could not print the report (it is in {path})", e)
        return report

    def finish(self) -> dict[str, Any] | None:
        """The end of training: the report of what was measured (if not written yet), then the summary;
        returns the report."""
        if self.refused:
            return None
        self.write_report()
        with kept():
            self._summarize_once()
        return self.report

    def _summarize_once(self) -> None:
        if self.report is not None and not self.quiet and not self.summarized:
            self.summarized = True
            try:
                show_summary(self.report, output_paths(self.report, self.rec.out))
            except Exception as e:
                self.rec.say("could not print the summary", e)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        self.finish()
        return False  # the user's exception, if any, goes on unchanged
