"""FLOPs of one real training step of any model, counted by torch's FlopCounterMode, and MFU from them.

vlmdoctor's presets have a FLOP formula (run/flops.py); a user's own model does not. For it, one whole
training step (forward, backward, optimizer) runs under `torch.utils.flop_counter.FlopCounterMode`,
which adds up the FLOPs of the matmuls, convolutions and attention kernels the step dispatches, with
their real shapes. The step counted is untimed: the profiler's wait step after the timed window.
"""

from __future__ import annotations

from typing import Any

from vlmdoctor.run.flops import peak_flops

HOW = (
    "FlopCounterMode over one real training step (the traced window's untimed wait step): matmuls, "
    "convolutions and attention as dispatched, forward and backward, on the padded batch; with gradient "
    "checkpointing the recomputed forward counts too, so this MFU counts executed FLOPs and reads higher than "
    "the model-FLOPs MFU of vlmdoctor's presets where a step pads or recomputes"
)


def compiled(model: Any) -> bool:
    """The model, or a block of it, runs under torch.compile: a dispatch mode around its graphs would recompile them.

    Asked of the model itself (`torch.compile(model)` wraps it; `block.compile()` sets the block's compiled
    call), not of the process: a graph compiled elsewhere in the process (a loss, another model) does not
    stop this model's step from being counted.
    """
    import torch

    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return True
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in modules)


def _counter() -> Any:
    """torch's FlopCounterMode, except that a formula that fails on an op stops the counting instead of
    raising inside the step it counts (a user's step, under Doctor or `vlmdoctor run`)."""
    from torch.utils.flop_counter import FlopCounterMode

    class Guarded(FlopCounterMode):
        failed: str | None = None

        def _count_flops(self, func_packet: Any, out: Any, args: Any, kwargs: Any) -> Any:
            if self.failed is None:
                try:
                    return super()._count_flops(func_packet, out, args, kwargs)
                except Exception as e:
                    self.failed = f"{type(e).__name__}: {e}"[:200]
            return out

    return Guarded(display=False)


class StepFlops:
    """Count one step: `start()` where a step begins, `stop()` where it ends (two calls of the loop's hook)."""

    def __init__(self) -> None:
        self.mode: Any = None
        self.total: float | None = None
        self.reason: str | None = None
        self.padded_tokens: int | None = None

    def start(self, model: Any) -> bool:
        if compiled(model):
            self.reason = "not counted: the model runs under torch.compile (counting would recompile it)"
            return False
        self.mode = _counter()
        self.mode.__enter__()
        return True

    @property
    def running(self) -> bool:
        return self.mode is not None

    def stop(self) -> float | None:
        mode, self.mode = self.mode, None
        if mode is None:
            return None
        mode.__exit__(None, None, None)
        if mode.failed:
            self.total, self.reason = None, f"not counted: the FLOP counter failed ({mode.failed})"
            return None
        self.total = float(mode.get_total_flops())
        if not self.total:
            self.total, self.reason = None, "not counted: the step dispatched no matmul, convolution or attention"
        return self.total


def device_name(env: dict[str, Any]) -> str:
    return str(env.get("gpu") or env.get("cpu_model") or "this CPU")


def peak_of(env: dict[str, Any]) -> tuple[float | None, str, str | None]:
    """(peak FLOP/s, where it came from, why MFU is null when it is)."""
    peak, source = peak_flops(env.get("gpu"))
    return peak, source, None if peak else f"no peak known for {device_name(env)}"


def describe_counted(counter: StepFlops, padded_tokens: int | None) -> dict[str, Any]:
    """The report's `flops` block for a counted step."""
    return {
        "formula": "counted" if counter.total else counter.reason or "not counted",
        "how": HOW,
        "counted_step_flops": counter.total,
        "counted_step_padded_tokens": padded_tokens,
        "scaled_per_step": "by each step's padded tokens over the counted step's" if padded_tokens else None,
    }


def per_step(total: float | None, counted_padded: int | None, padded: list[int]) -> list[float] | float | None:
    """The counted step's FLOPs carried to every timed step, in proportion to its padded tokens when known."""
    if total is None:
        return None
    if counted_padded and padded and all(p > 0 for p in padded):
        return [total * p / counted_padded for p in padded]
    return total
