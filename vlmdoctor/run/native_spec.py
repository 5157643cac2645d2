"""The native transformers VLM presets as data: class, config and token counts, without torch.

The FLOP model and the trace analysis read these; building the model (run/native.py) needs torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.run.zoo import llm_specs, native_presets, vision_specs


def is_native(model: str) -> bool:
    return model in native_presets()


@dataclass(frozen=True)
class NativeSpec:
    """A native VLM class, its full config and what the data builder needs (tokens, image size)."""

    preset: str
    cls_name: str
    hub_id: str | None
    config: dict[str, Any]  # the class's config kwargs, sub-configs as dicts
    llm: dict[str, Any]  # {"name", "special_tokens", "text_token_range", "config"}: what data.SyntheticVQA reads
    vision: dict[str, Any]  # {"name", "input_size", "config"}
    image_tokens: int
    about: str

    @property
    def text_config(self) -> dict[str, Any]:
        return self.config["text_config"]

    @property
    def vision_config(self) -> dict[str, Any]:
        return self.config["vision_config"]

    @property
    def patch_size(self) -> int:
        return self.vision_config["patch_size"]

    @property
    def patches(self) -> int:
        """Patch tokens the tower runs on per image."""
        return (self.vision["input_size"] // self.patch_size) ** 2

    @property
    def vision_hidden(self) -> int:
        c = self.vision_config
        return c["embed_dim"] if self.cls_name.startswith("Qwen2VL") else c["hidden_size"]

    @property
    def vision_heads(self) -> int:
        c = self.vision_config
        return c.get("num_heads") or c["num_attention_heads"]

    @property
    def vision_layers(self) -> int:
        c = self.vision_config
        return c.get("depth") or c["num_hidden_layers"]

    @property
    def vision_head_dim(self) -> int:
        return self.vision_hidden // self.vision_heads

    @property
    def llm_head_dim(self) -> int:
        c = self.text_config
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    @property
    def merge(self) -> int:
        """Patch features folded into one LLM token (per side)."""
        if self.cls_name.startswith("Qwen2VL"):
            return self.vision_config["spatial_merge_size"]
        if self.cls_name.startswith("Idefics3"):
            return self.config["scale_factor"]
        return 1

    @property
    def projector(self) -> str:
        if self.cls_name.startswith("Qwen2VL"):
            return f"patch merger {self.merge}x{self.merge} (LayerNorm + 2-layer GELU MLP)"
        if self.cls_name.startswith("Idefics3"):
            return f"pixel shuffle x{self.merge} then linear"
        return f"2-layer {self.config.get('projector_hidden_act', 'gelu').upper()} MLP"

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "class": self.cls_name,
            "native": True,
            "vision": self.vision["name"],
            "llm": self.llm["name"],
            "projector": self.projector,
            "image_tokens": self.image_tokens,
            "vision_patches": self.patches,
            "vision_head_dim": self.vision_head_dim,
            "llm_head_dim": self.llm_head_dim,
        }


def resolve_native(model: str) -> NativeSpec:
    """A native preset -> its spec; the LLaVA presets reuse the shipped tower and LLM configs."""
    entry = native_presets()[model]
    cls_name = entry["class"]
    config = json.loads(json.dumps(entry["config"]))  # a deep copy: the cached entry stays as shipped
    if cls_name == "LlavaForConditionalGeneration":
        v, lspec = vision_specs()[entry["vision"]], llm_specs()[entry["llm"]]
        if v["family"] != "siglip":
            raise UsageError(f"{model}: the native LLaVA presets are built for SigLIP towers, not {v['family']}")
        config["vision_config"] = {**v["config"], "model_type": "siglip_vision_model"}
        config["text_config"] = {**lspec["config"], "model_type": lspec["family"]}
        config["image_token_index"] = lspec["special_tokens"]["image_pad"]
        image_tokens = (v["input_size"] // v["config"]["patch_size"]) ** 2
        config["image_seq_length"] = image_tokens
        llm = {
            "name": lspec["name"],
            "special_tokens": lspec["special_tokens"],
            "text_token_range": lspec["text_token_range"],
            "config": lspec["config"],
        }
        vision = {"name": v["name"], "input_size": v["input_size"], "config": v["config"]}
        return NativeSpec(model, cls_name, entry.get("hub_id"), config, llm, vision, image_tokens, entry["about"])
    size = entry["input_size"]
    vc = config["vision_config"]
    grid = size // vc["patch_size"]
    merge = vc["spatial_merge_size"] if cls_name.startswith("Qwen2VL") else config["scale_factor"]
    if size % vc["patch_size"] or grid % merge:
        raise UsageError(
            f"{model}: {size}px is not a whole number of {merge}x{merge} groups of {vc['patch_size']}px patches"
        )
    llm = {
        "name": f"{model} text model",
        "special_tokens": entry["special_tokens"],
        "text_token_range": entry["text_token_range"],
        "config": config["text_config"],
    }
    vision = {"name": f"{model} vision tower", "input_size": size, "config": vc}
    return NativeSpec(model, cls_name, entry.get("hub_id"), config, llm, vision, (grid // merge) ** 2, entry["about"])
