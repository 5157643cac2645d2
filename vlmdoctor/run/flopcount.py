"""FLOPs of a user's training step counted from what the profiler recorded, and MFU from them.

vlmdoctor's presets have a FLOP formula (run/flops.py); a user's own model does not. Its FLOPs are
counted from the traced window after it ended: every matmul, convolution and attention op the
profiler recorded (with `record_shapes`), at its recorded input shapes, forward and backward. Nothing
runs on the user's live step: no dispatch mode, no hook. A dispatch-mode counter on the live step
(torch's FlopCounterMode) raised into the user's code on a no-grad forward, and its attention formula
refused grouped-query shapes; counting the recorded ops after the window cannot reach the training,
and a failed count leaves MFU null with its reason.

Each op is counted once, at the outermost counted op of its thread (`aten::linear` runs
`aten::addmm`: the addmm is counted; `aten::scaled_dot_product_attention` runs a backend kernel op:
the outer op is counted).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vlmdoctor.run.flops import peak_flops

HOW = (
    "counted from the traced window's recorded ops after it ended (record_shapes): matmuls, convolutions and "
    "attention at their recorded shapes, forward and backward, on the padded batch, over the traced steps; with "
    "gradient checkpointing the recomputed forward counts too, so this MFU counts executed FLOPs and reads higher "
    "than the model-FLOPs MFU of vlmdoctor's presets where a step pads or recomputes"
)


@dataclass(frozen=True)
class Op:
    """One recorded host op: its name, input shapes (`[]` for a scalar or None), the values of its scalar
    inputs where recorded, its time span and thread."""

    name: str
    dims: Sequence[Any]
    concrete: Sequence[Any]
    start: float
    end: float
    thread: int


def _ints(shape: Any) -> list[int] | None:
    if isinstance(shape, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in shape):
        return list(shape)
    return None


def _gemm(dims: Sequence[Any], first: int) -> float | None:
    """2*M*K*N (times the batch) of the two operands at dims[first], dims[first+1]."""
    a, b = (_ints(d) for d in dims[first : first + 2]) if len(dims) >= first + 2 else (None, None)
    if not a or not b or len(a) != len(b) or len(a) not in (2, 3):
        return None
    batch = a[0] if len(a) == 3 else 1
    m, k = a[-2], a[-1]
    n = b[-1]
    return 2.0 * batch * m * k * n


def _attn_flops(dims: Sequence[Any], first: int) -> float | None:
    """Q@K^T and P@V: 2*B*Hq*Sq*Sk*(D + Dv), any number of key/value heads (grouped-query attention)."""
    q, k, v = (_ints(d) for d in dims[first : first + 3]) if len(dims) >= first + 3 else (None, None, None)
    if not q or not k or not v or len(q) < 3 or len(k) < 3 or len(v) < 3:
        return None
    sq, d = q[-2], q[-1]
    sk, dv = k[-2], v[-1]
    return 2.0 * math.prod(q[:-2]) * sq * sk * (d + dv)


def _conv_out(x: list[int], w: list[int], concrete: Sequence[Any]) -> list[int] | None:
    """The output's spatial size from the recorded stride, padding and dilation (convolution's args 3-5)."""
    spatial = len(x) - 2
    cfg = []
    for i, default in ((3, 1), (4, 0), (5, 1)):
        value = concrete[i] if len(concrete) > i else None
        value = [default] * spatial if value is None else value
        value = [value] * spatial if isinstance(value, int) else value
        if not isinstance(value, (list, tuple)) or len(value) != spatial:
            return None
        cfg.append(value)
    stride, pad, dil = cfg
    return [(x[2 + i] + 2 * pad[i] - dil[i] * (w[2 + i] - 1) - 1) // stride[i] + 1 for i in range(spatial)]


def _conv(op: Op, backward: bool) -> float | None:
    """2 * N * Cout * out-positions * (Cin/groups * kernel) forward; the backward of input and weight twice that."""
    first = 1 if backward else 0
    x, w = (_ints(d) for d in op.dims[first : first + 2]) if len(op.dims) >= first + 2 else (None, None)
    if not x or not w or len(x) != len(w) or len(x) < 3:
        return None
    concrete = list(op.concrete[first:]) if op.concrete else []
    out = _conv_out(x, w, concrete)
    if out is None or min(out) <= 0:
        return None
    forward = 2.0 * x[0] * w[0] * math.prod(out) * math.prod(w[1:])
    return 2 * forward if backward else forward


#: the GEMMs counted, each with the index of its first matrix operand among its recorded inputs
GEMMS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::baddbmm": 1}
CONVOLUTIONS = ("aten::convolution", "aten::_convolution")


def _attention(name: str) -> bool:
    """Scaled-dot-product attention, the outer op or any backend's, forward or backward."""
    return name.startswith("aten::") and "attention" in name and "dot_product" in name


def counted(name: str) -> bool:
    """Whether an op of this name is one the count reads (the rest are skipped cheaply)."""
    return name in GEMMS or name in CONVOLUTIONS or name == "aten::convolution_backward" or _attention(name)


def op_flops(op: Op) -> float | None:
    """The op's FLOPs; None for an op that is not counted (or whose shapes do not say)."""
    name = op.name
    if name in GEMMS:
        return _gemm(op.dims, GEMMS[name])
    if name in CONVOLUTIONS:
        return _conv(op, False)
    if name == "aten::convolution_backward":
        return _conv(op, True)
    if _attention(name):
        if name.endswith("_backward"):  # (grad_out, q, k, v, ...): four matmuls, twice the forward's
            fwd = _attn_flops(op.dims, 1)
            return None if fwd is None else 2 * fwd
        return _attn_flops(op.dims, 0)
    return None


def count(ops: Iterable[Op]) -> tuple[float, int, int]:
    """(FLOPs, ops counted, counted-kind ops whose shapes did not say) over the outermost counted ops of each
    thread: an op inside another counted op of its thread is the same work."""
    by_thread: dict[int, list[Op]] = {}
    for op in ops:
        if counted(op.name):
            by_thread.setdefault(op.thread, []).append(op)
    total, n, unknown = 0.0, 0, 0
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda o: (o.start, -o.end))
        outer_end = -math.inf
        for op in thread_ops:
            if op.start < outer_end:  # nested in the op counted last
                continue
            outer_end = op.end
            f = op_flops(op)
            if f is None:
                unknown += 1
            else:
                total += f
                n += 1
    return total, n, unknown


def kineto_ops(prof: Any) -> list[Op]:
    """The host ops of a stopped torch.profiler session, from its in-memory results (no trace file read)."""
    results = prof.profiler.kineto_results
    out = []
    for e in results.events():
        if e.device_type().name != "CPU":
            continue
        name = e.name()
        if not counted(name):
            continue
        start = e.start_ns()
        concrete = e.concrete_inputs() if hasattr(e, "concrete_inputs") else []
        out.append(Op(name, e.shapes(), list(concrete), start, start + e.duration_ns(), e.start_thread_id()))
    return out


class StepFlops:
    """The FLOPs of the traced window's steps, counted from the profiler's record once it stopped."""

    def __init__(self) -> None:
        self.total: float | None = None  # per traced step
        self.reason: str | None = None
        self.ops = 0
        self.unknown = 0

    def count(self, prof: Any, steps: int) -> None:
        """Count the stopped profiler's record: `steps` active steps. Never raises: a failure is the reason."""
        try:
            total, self.ops, self.unknown = count(kineto_ops(prof))
        except Exception as e:
            why = f"{type(e).__name__}: {e}"[:200]
            self.total, self.reason = None, f"not counted: reading the profiler's record failed ({why})"
            return
        if not total or steps <= 0:
            self.total = None
            self.reason = "not counted: the traced steps recorded no matmul, convolution or attention op with shapes"
            return
        self.total = total / steps


def device_name(env: dict[str, Any]) -> str:
    return str(env.get("gpu") or env.get("cpu_model") or "this CPU")


def peak_of(env: dict[str, Any]) -> tuple[float | None, str, str | None]:
    """(peak FLOP/s, where it came from, why MFU is null when it is)."""
    peak, source = peak_flops(env.get("gpu"))
    return peak, source, None if peak else f"no peak known for {device_name(env)}"


def describe_counted(counter: StepFlops, padded_tokens: int | None) -> dict[str, Any]:
    """The report's `flops` block for a counted window."""
    return {
        "formula": "counted" if counter.total else counter.reason or "not counted",
        "how": HOW,
        "counted_step_flops": counter.total,
        "counted_step_padded_tokens": padded_tokens,
        "counted_ops": counter.ops,
        "uncounted_ops": counter.unknown,
        "scaled_per_step": "by each step's padded tokens over the counted steps'" if padded_tokens else None,
    }


def per_step(total: float | None, counted_padded: int | None, padded: list[int]) -> list[float] | float | None:
    """The counted FLOPs per step carried to every timed step, in proportion to its padded tokens when known."""
    if total is None:
        return None
    if counted_padded and padded and all(p > 0 for p in padded):
        return [total * p / counted_padded for p in padded]
    return total
