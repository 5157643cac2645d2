"""torch.compile that finishes: one graph for every sequence length, caches kept, compile time apart.

Three ladders on the H100 had their compile trial time out (200-240 s) and one profile spent six
minutes of its run compiling: every new sequence length was a new graph. So when compile is on:

- the sequence and batch dimensions of every batch tensor are marked dynamic before the first
  call, so Inductor compiles one graph with a symbolic length and batch instead of one per
  shape (the rule that prescribes compile also pads to a multiple of 64, which leaves few
  lengths to see anyway), and a later trial with a larger batch finds it in the cache;
- the compile caches can live in a folder the caller names (`cache_env`), so that the trials of
  one treatment reuse what the first compiled;
- the graphs compiled are counted before and after the timed windows: a recompile inside them is
  reported, because its seconds would count as step time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

#: batch entries whose dimension 1 is the token sequence
SEQUENCE_KEYS = ("input_ids", "attention_mask", "labels", "position_ids")
#: 1-D entries whose length is the number of labeled tokens (the LM head on labeled positions)
FLAT_KEYS = ("loss_index", "loss_targets")


def cache_env(folder: str | Path) -> dict[str, str]:
    """Environment for child processes: Inductor's and Triton's caches in `folder` (made absolute)."""
    root = Path(folder).resolve()
    return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}


def compile_model(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """torch.compile with the run config's mode ('default' is torch's None)."""
    return torch.compile(model, mode=None if mode == "default" else mode)


def set_shape_padding(on: bool) -> None:
    """Inductor's shape_padding (the foveated-VLM roadmap's item 6), set before anything compiles.

    Inductor pads matmul dimensions to tensor-core-friendly multiples when it is on. torch has
    had it on by default since 2.1, so the knob's useful setting is off, for a with/without pair.
    """
    import torch._inductor.config as inductor_config  # deferred: torch

    inductor_config.shape_padding = on


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of every stack of same-class layers (decoder layers, the tower's encoder layers), outermost first.

    Found by structure, not by name, so that any transformers class works: an nn.ModuleList of
    two or more children of one class. A stack inside a block already taken is left to it.
    """
    blocks: list[torch.nn.Module] = []
    todo = [model]
    while todo:
        m = todo.pop(0)
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(c) for c in m}) == 1:
            blocks.extend(m)
            continue
        todo.extend(m.children())
    return blocks


def compile_regions(model: torch.nn.Module, mode: str) -> int:
    """Regional compilation: each repeated layer compiled in place, and the LM head with its loss.

    Why: compiling the whole 1.5b model took 346 s on the H100 (a treatment's 10 minutes hold
    little else). The layers of a stack share their code, and dynamo treats a module's parameters
    as inputs (inline_inbuilt_nn_modules, torch >= 2.5), so one compiled graph serves every layer
    of the stack: the compile cost is about one layer's, not the model's. The LM head and the
    cross entropy (`head_loss`, on the labeled positions, when Liger's FusedCE does not take them)
    are one more region, since eager they cast and normalize the whole vocabulary unfused. What
    stays eager (the embeddings, the final norm, the projector) is a few kernels a step.
    """
    m = None if mode == "default" else mode
    blocks = repeated_blocks(model)
    for b in blocks:
        b.compile(mode=m)
    owner = next((x for x in model.modules() if callable(getattr(x, "head_loss", None))), None)
    if owner is not None and not getattr(owner, "fused_ce", False):
        owner.head_loss = _rows_dynamic(torch.compile(owner.head_loss, mode=m))
        return len(blocks) + 1
    return len(blocks)


def _rows_dynamic(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """The compiled head-and-loss region, its rows marked dynamic before each call.

    The labeled count changes every step and the region's input is an intermediate tensor, which
    `mark_lengths_dynamic` does not reach: marked here, one graph serves every count. Marking is
    done outside the graph, where dynamo allows it.
    """

    @functools.wraps(compiled)
    def call(h: torch.Tensor, *rest: Any) -> Any:
        torch._dynamo.maybe_mark_dynamic(h, 0)
        return compiled(h, *rest)

    return call


def compile_vlm(
    vlm: torch.nn.Module, mode: str, vision: str = "model", shape_padding: bool = True, regions: bool = False
) -> torch.nn.Module:
    """The callable a training step runs: the whole model compiled, or its parts each on their own.

    vision='model': one torch.compile over the whole model (what --compile always did).
    vision='fullgraph' (roadmap item 5): the tower is compiled on its own with fullgraph=True and
    dynamic=False, since its input is a fixed-size image and a graph break there is a bug to see,
    not to paper over. A compiled outer model would inline the tower's compiled module and drop
    those options, so then the LLM decoder (`llm.model`, which both loss paths call) is compiled
    on its own instead of the whole model, and the projector, one linear map, stays eager. The
    decoder's input is then the embeddings the model computes, which `mark_lengths_dynamic` does
    not reach: dynamo recompiles once, dynamic, at the second length it sees (on CPU, tiny-dino:
    3 graphs after 3 steps, then none), inside a warm-up of 10 steps.
    """
    if mode == "off" and vision == "model":
        return vlm
    set_shape_padding(shape_padding)
    if regions and mode != "off":
        compile_regions(vlm, mode)
        return vlm
    if vision == "model":
        return compile_model(vlm, mode)
    m = None if mode in ("off", "default") else mode
    vlm.vision = torch.compile(vlm.vision, mode=m, fullgraph=True, dynamic=False)
    if mode != "off":
        vlm.llm.model = torch.compile(vlm.llm.model, mode=m)
    return vlm


def compiled(cfg: Any) -> bool:
    """Whether a run config compiles anything (the warm-up and recompile bookkeeping need it).

    `attention: flex` compiles too: transformers compiles flex_attention (and the BlockMask builder)
    in the first steps, and once more when the row shapes turn dynamic.
    """
    return (
        cfg.compile != "off"
        or getattr(cfg, "compile_vision", "model") != "model"
        or getattr(cfg, "attention", "sdpa") == "flex"
    )


def mark_lengths_dynamic(batch: dict[str, Any]) -> None:
    """Mark the sequence and the batch dimension dynamic, so a new length or batch size reuses the graph.

    The batch too: `treat` sizes the batch from measured memory in a later round, and a graph with
    a fixed batch is then compiled again (about 110 s at 0.5b on the H100) where a symbolic batch
    finds the compiled graph in the treatment's cache. `maybe_mark_dynamic`: where the model's
    code needs a fixed size, dynamo specializes instead of raising.
    """
    ids = batch.get("input_ids")
    rows = ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else None
    for k in SEQUENCE_KEYS:
        t = batch.get(k)
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    for k in FLAT_KEYS:
        t = batch.get(k)
        if isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(t, 0)
    if rows and rows > 1:  # every tensor with one entry per sample: the token tensors and the images
        for k, t in batch.items():
            if k not in FLAT_KEYS and isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == rows:
                torch._dynamo.maybe_mark_dynamic(t, 0)


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (each recompile adds one)."""
    from torch._dynamo.utils import counters  # deferred: torch

    return int(counters["stats"]["unique_graphs"])


def compile_cache_dirs() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
