"""Model zoo: vision towers and LLMs built from configs shipped in the package.

The JSON files under `vlmdoctor/configs/` hold the public config values of each checkpoint,
so architectures are exact and nothing needs the network. Random weights are the default;
`weights="pretrained"` calls `from_pretrained` on the hub id and says clearly when the hub or
the local cache cannot provide it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from vlmdoctor.errors import UsageError

CONFIG_DIR = resources.files("vlmdoctor.run") / "configs"


@cache
def _load_dir(kind: str) -> dict[str, dict[str, Any]]:
    out = {}
    for entry in sorted((CONFIG_DIR / kind).iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".json"):
            spec = json.loads(entry.read_text())
            out[spec["name"]] = spec
    return out


def vision_specs() -> dict[str, dict[str, Any]]:
    return _load_dir("vision")


def llm_specs() -> dict[str, dict[str, Any]]:
    return _load_dir("llm")


@cache
def presets() -> dict[str, dict[str, Any]]:
    return json.loads((CONFIG_DIR / "presets.json").read_text())


@dataclass(frozen=True)
class ModelSpec:
    """A composed VLM: which tower, which LLM, which projector."""

    preset: str
    vision: dict[str, Any]
    llm: dict[str, Any]
    projector: str
    pixel_shuffle: int

    @property
    def patch_grid(self) -> int:
        return self.vision["input_size"] // self.vision["config"]["patch_size"]

    @property
    def image_tokens(self) -> int:
        return (self.patch_grid // self.pixel_shuffle) ** 2

    @property
    def vision_head_dim(self) -> int:
        c = self.vision["config"]
        return c["hidden_size"] // c["num_attention_heads"]

    @property
    def llm_head_dim(self) -> int:
        c = self.llm["config"]
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    @property
    def projector_in(self) -> int:
        return self.vision["config"]["hidden_size"] * self.pixel_shuffle**2

    @property
    def projector_out(self) -> int:
        return self.llm["config"]["hidden_size"]

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "vision": self.vision["name"],
            "llm": self.llm["name"],
            "projector": (
                f"pixel shuffle x{self.pixel_shuffle} then {self.projector} {self.projector_in}->{self.projector_out}"
            ),
            "image_tokens": self.image_tokens,
            "vision_head_dim": self.vision_head_dim,
            "llm_head_dim": self.llm_head_dim,
        }


def resolve(
    model: str,
    vision: str | None = None,
    llm: str | None = None,
    projector: str | None = None,
    pixel_shuffle: int | None = None,
) -> ModelSpec:
    """Preset plus overrides -> spec; unknown names are user errors that list the valid ones."""
    table = presets()
    if model not in table:
        raise UsageError(f"unknown model preset {model!r}; valid presets: {', '.join(table)}")
    p = table[model]
    vname, lname = vision or p["vision"], llm or p["llm"]
    if vname not in vision_specs():
        raise UsageError(f"unknown vision tower {vname!r}; valid towers: {', '.join(vision_specs())}")
    if lname not in llm_specs():
        raise UsageError(f"unknown LLM {lname!r}; valid LLMs: {', '.join(llm_specs())}")
    spec = ModelSpec(
        preset=model,
        vision=vision_specs()[vname],
        llm=llm_specs()[lname],
        projector=projector or p["projector"],
        pixel_shuffle=pixel_shuffle or p["pixel_shuffle"],
    )
    if spec.patch_grid % spec.pixel_shuffle:
        raise UsageError(
            f"pixel shuffle x{spec.pixel_shuffle} does not divide the {spec.patch_grid}x{spec.patch_grid} patch grid "
            f"of {vname}; choose a factor that divides {spec.patch_grid}"
        )
    return spec


# --- native transformers classes (built in run/native.py) ------------------------------------------
#: knobs that only the composite model implements: (name, why), refused for native presets
COMPOSITE_ONLY = (
    ("vision", "the tower is part of the native class's config"),
    ("llm", "the LLM is part of the native class's config"),
    ("projector", "the projector is part of the native class's config"),
    ("pixel_shuffle", "the projector is part of the native class's config"),
    ("cache_vision_features", "the native class runs its tower inside its own forward"),
    ("packing", "the native classes' position ids (Qwen2-VL's 3-D RoPE) are built per padded row"),
)


@cache
def native_presets() -> dict[str, dict[str, Any]]:
    """Native presets by name, from configs/native/*.json."""
    out = {}
    for entry in sorted((CONFIG_DIR / "native").iterdir(), key=lambda p: p.name):
        if entry.name.endswith(".json"):
            spec = json.loads(entry.read_text())
            out[spec["name"]] = spec
    return out


def refuse_composite_only(model: str, knobs: dict[str, Any]) -> None:
    """One clear line for a knob that only the composite model implements, set on a native preset."""
    if model not in native_presets():
        return
    for name, why in COMPOSITE_ONLY:
        if knobs.get(name) not in (None, False):
            raise UsageError(
                f"--{name.replace('_', '-')} is not supported for the native preset {model!r}: {why}; "
                "drop it or use a composite preset (0.5b, 1.5b, tiny)"
            )


@contextlib.contextmanager
def loading_checkpoints(*hub_ids: str) -> Iterator[None]:
    """`from_pretrained` inside: hub retries are quiet, and an unreachable hub is one clear UsageError."""
    from huggingface_hub.utils import logging as hub_logging  # deferred: transformers' hub client
    from transformers.utils import logging as tf_logging  # deferred: transformers

    hub_logging.set_verbosity_error()  # one clear message below instead of a retry warning per attempt
    tf_logging.set_verbosity_error()
    try:
        yield
    except Exception as e:  # the hub raises many types; all mean "not reachable / not cached"
        many = len(hub_ids) > 1
        raise UsageError(
            f"could not load pretrained weights ({', '.join(hub_ids)}): "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. The hub is not reachable and the "
            f"{'checkpoints are' if many else 'checkpoint is'} not in the local Hugging Face cache; run with "
            "--weights random (the default)."
        ) from None
