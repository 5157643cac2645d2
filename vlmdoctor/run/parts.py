"""Which submodule of a VLM is the vision tower, the projector and the LLM, and marking them in a trace.

vlmdoctor's own model runs its parts inside `record_function("vlmdoctor::<part>")` ranges. A
user's model (a native transformers VLM class, or their own) has no such ranges, so the parts are
found by attribute name and class (LLaVA, Qwen2-VL / Qwen2.5-VL, Idefics3 / SmolVLM, PaliGemma,
and common custom names), and `mark_parts` puts the same ranges around them with forward hooks.
A model that matches none falls back to its largest direct submodules, labelled by name.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a model is handled: matching class names in a trace needs none
    from torch import nn

PARTS = ("vision", "projector", "llm")

#: attribute paths per part, most specific first; the first that exists wins
PART_PATHS: dict[str, tuple[str, ...]] = {
    # Qwen2-VL keeps its patch merger (the projector) inside `visual`: the merger is listed first so
    # that its hook nests inside the vision range and its time goes to the projector
    "projector": (
        "model.visual.merger",
        "visual.merger",
        "model.multi_modal_projector",
        "multi_modal_projector",
        "model.connector",
        "connector",
        "mm_projector",
        "model.mm_projector",
        "projector",
        "vision_proj",
        "model.vision_proj",
    ),
    "vision": (
        "model.vision_tower",
        "vision_tower",
        "model.visual",
        "visual",
        "model.vision_model",
        "vision_model",
        "vision_encoder",
        "model.vision_encoder",
        "vision",
        "visual_encoder",
        "image_encoder",
    ),
    "llm": (
        "model.language_model",
        "language_model",
        "model.text_model",
        "text_model",
        "llm",
        "lm",
        "language_model.model",
        "text_decoder",
        "decoder",
    ),
}

#: class-name patterns, for traces recorded with `with_modules`/`with_stack` (`nn.Module: SiglipVisionModel_0`)
CLASS_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("projector", re.compile(r"(Projector|Connector|PatchMerger|Merger|Resampler|Adapter)(_\d+)?$", re.I)),
    ("vision", re.compile(r"(Vision|Visual|ViT|Siglip|Clip(?!Text)|Dinov2|ImageEncoder|PatchEmbed)", re.I)),
    (
        "llm",
        re.compile(
            r"(TextModel|Qwen\d?(_\d)?Model|Qwen\d?VLTextModel|LlamaModel|MistralModel|GemmaModel|"
            r"Gemma\d?Model|Phi\d?Model|SmolLM|CausalLM|DecoderLayer|LanguageModel)",
            re.I,
        ),
    ),
)


def part_of_class(class_name: str) -> str | None:
    """The part a module class belongs to, from its name alone (None when the name says nothing)."""
    for part, rx in CLASS_PATTERNS:
        if rx.search(class_name):
            return part
    return None


def _get(model: nn.Module, path: str) -> nn.Module | None:
    from torch import nn  # deferred: torch

    obj: Any = model
    for name in path.split("."):
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def find_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The vision tower, projector and LLM of a VLM, by attribute name; by size when no name matches."""
    found: dict[str, nn.Module] = {}
    for part in PART_PATHS:
        for path in PART_PATHS[part]:
            m = _get(model, path)
            if m is not None and m is not model and all(m is not other for other in found.values()):
                found[part] = m
                break
    if "vision" in found or "llm" in found:
        return found
    # unknown model: the largest direct submodules, the biggest as the LLM, then by class name
    children = sorted(model.named_children(), key=lambda kv: -sum(p.numel() for p in kv[1].parameters()))
    for name, child in children:
        part = part_of_class(type(child).__name__) or part_of_class(name)
        if part and part not in found:
            found[part] = child
    if "llm" not in found and children:
        found.setdefault("llm", children[0][1])
    return found


def mark_parts(model: nn.Module, on_error: Callable[[BaseException], None] | None = None) -> Callable[[], None]:
    """Put `vlmdoctor::<part>` ranges around each part's forward; returns a function that removes them.

    The ranges are what vlmdoctor's trace analysis reads to attribute GPU time to parts, for
    forward kernels directly and for backward kernels through the autograd sequence numbers.
    With `on_error` (a user's model, whose forward vlmdoctor does not own), an error of the marking
    is passed to it and the marks stop, instead of raising inside the model's forward.
    """
    from torch.profiler import record_function  # deferred: torch

    handles = []
    broken: list[BaseException] = []

    def guarded(fn: Callable[..., None]) -> Callable[..., None]:
        if on_error is None:
            return fn

        def call(*args: Any) -> None:
            if broken:
                return
            try:
                fn(*args)
            except Exception as e:
                broken.append(e)
                on_error(e)

        return call

    for part, module in find_parts(model).items():
        ranges: list[Any] = []

        def pre(_m: nn.Module, _args: Any, part: str = part, ranges: list[Any] = ranges) -> None:
            r = record_function(f"vlmdoctor::{part}")
            r.__enter__()
            ranges.append(r)

        def post(_m: nn.Module, _args: Any, _out: Any, ranges: list[Any] = ranges) -> None:
            if ranges:
                ranges.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(guarded(pre)))
        handles.append(module.register_forward_hook(guarded(post), always_call=True))

    def remove() -> None:
        for h in handles:
            h.remove()

    return remove
