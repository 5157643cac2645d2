"""Leave-one-out arms measured inside one run's process: what `treat` may ask a run to measure after its own timed
windows, and how the request travels to the run (no torch here: the treatment plans arms without loading it).

Why: a leave-one-out arm in a fresh process is a run of 45-80 s (start, model build, compile, warm-up), so ten
changes do not fit a 500 s budget; on qwen2-vl-2b one GPU ablated none of ten changes in three runs of 2026-11-28.
Some knobs can be switched between windows of one process without building the model again: the loader's batch,
padding, order, labeled-rows head, worker processes and pinned memory (another loader over the same data), regional
compilation (the layers' compiled calls set aside, then put back), the frozen tower's no_grad and AdamW's fused
implementation (a flag the step reads each time). A window of the final config and a
window without the change, in turn, make a pair; a few pairs cost seconds, not a run each (run/switch.py measures
them). An arm may also add such a change: a later round of `treat` with no room for fresh pairs measures its
compositions so (doctor/treat.py `one_process`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vlmdoctor.run.config import RunConfig

#: the environment variable that names a run's arms request (a JSON file): set by `run_isolated` for its child only
ARMS_ENV = "VLMDOCTOR_ARMS"
#: knobs switched by giving the step another loader over the same dataset (run/switch.py)
LOADER_KNOBS = ("batch_size", "pad_to_multiple_of", "sampler", "lm_head_labeled_only", "num_workers", "pin_memory")
#: regional compilation, switched off: an arm may turn `compile` off where the run compiled its regions
COMPILE_KNOBS = ("compile", "compile_regions")
#: knobs of the built model and optimizer that a step reads each time: the tower's no_grad, AdamW's fused kernel
#: (not gradient checkpointing: switched around regionally compiled layers, whose recompute torch runs with dynamo
#: disabled, its windows were never checked against fresh processes; not bf16 weights: the model is built again)
MODEL_KNOBS = ("vision_no_grad", "fused_optimizer")
#: knobs of the measurement, not of the training: an arm that differs only in them is the run itself
MEASUREMENT_KNOBS = ("warmup", "steps", "repeats")
#: timed steps in each window
WINDOW_STEPS = 3
#: the most untimed steps before a window's timed ones: they take the switch (a new loader's first batches, memory,
#: a graph compiled for a new shape) until one compiles nothing
SETTLE_STEPS = 3
#: the most rounds (a window of the run's own config, then one of each arm)
MAX_ROUNDS = 4
#: the most seconds a run spends on its arms; windows stop starting past it
ARMS_S = 60.0
#: fewer seconds than this left for the arms: none are asked for
MIN_ARMS_S = 10.0
#: seconds a run with in-process arms keeps after them for what follows (its diagnosis, its report)
ARMS_MARGIN_S = 10.0
#: the fewest seconds of windows a run is started for when its arms are why it runs (treat's later round in one
#: process, the final ablation's run): two rounds of windows, the fewest pairs a verdict reads (four rounds of two
#: windows took 58 s at qwen2-vl-2b's batch 52 on one H200, 2026-11-28)
TWO_ROUNDS_S = 30.0
#: the most arms one run measures (those whose target the traces cannot give them alone first: doctor/treat.py)
MAX_ARMS = 3


def switch_patch(run: RunConfig, arm: RunConfig) -> dict[str, Any] | None:
    """The knobs `arm` sets otherwise than `run`, where a run of `run` can switch to them in its own process; None
    where it cannot (any other knob differs) or nothing differs."""
    a, b = run.to_dict(), arm.to_dict()
    diff = {k: b[k] for k in a if a[k] != b[k] and k not in MEASUREMENT_KNOBS}
    if not diff or any(k not in LOADER_KNOBS + COMPILE_KNOBS + MODEL_KNOBS for k in diff):
        return None
    if any(k in diff for k in COMPILE_KNOBS) and not (
        run.compile != "off" and run.compile_regions and arm.compile == "off"
    ):
        return None  # only regional compilation is set aside; a whole-model graph is not
    if run.objective != "sft" or run.nproc_per_node > 1 or run.grad_accum != 1 or run.packing:
        return None  # one loader of plain micro-batches on one process: what run/switch.py switches
    return {k: v for k, v in diff.items() if k != "compile_regions"}


def write_request(folder: Path, arms: dict[str, dict[str, Any]], seconds: float) -> Path:
    """The request file a child run reads (`ARMS_ENV`): each arm's name and knobs, and the seconds it may spend."""
    path = folder / "arms.json"
    path.write_text(json.dumps({"arms": arms, "seconds": seconds}))
    return path


def read_request() -> tuple[dict[str, dict[str, Any]], float] | None:
    """This run's arms request, or None where none was made or the file is unreadable (the run measures no arms)."""
    where = os.environ.get(ARMS_ENV)
    if not where:
        return None
    try:
        data = json.loads(Path(where).read_text())
        arms = {str(n): dict(p) for n, p in data["arms"].items()}
        return arms, float(data["seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
