"""The patient: a LLaVA-style VLM (vision tower -> projector -> LLM) built from the zoo.

Each part runs inside a `record_function` range (`vlmdoctor::vision`, `::projector`, `::llm`)
so that trace analysis can attribute GPU time to model parts through the ops that launched it.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from vlmdoctor.errors import UsageError
from vlmdoctor.run.head import head_loss, labeled_head_loss
from vlmdoctor.run.native import native_catalogue
from vlmdoctor.run.zoo import ModelSpec, llm_specs, loading_checkpoints, presets, resolve, vision_specs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Projector(nn.Module):
    """Pixel shuffle (space-to-depth over the patch grid), then a linear or 2-layer MLP map."""

    def __init__(self, in_dim: int, out_dim: int, factor: int, kind: str) -> None:
        super().__init__()
        self.factor = factor
        d = in_dim * factor * factor
        if kind == "linear":
            self.proj = nn.Linear(d, out_dim)
        elif kind == "mlp2x_gelu":  # LLaVA-1.5
            self.proj = nn.Sequential(nn.Linear(d, out_dim), nn.GELU(), nn.Linear(out_dim, out_dim))
        else:
            raise UsageError(f"unknown projector {kind!r}; valid projectors: linear, mlp2x_gelu")

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, tokens, c = x.shape
        r = self.factor
        if r > 1:
            g = math.isqrt(tokens)
            x = x.view(n, g // r, r, g // r, r, c).permute(0, 1, 3, 2, 4, 5).reshape(n, (g // r) ** 2, r * r * c)
        return self.proj(x)


class VLM(nn.Module):
    """Vision tower + projector + causal LM; image features replace the `<|image_pad|>` embeddings."""

    def __init__(self, spec: ModelSpec, vision: nn.Module, projector: Projector, llm: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.vision = vision
        self.projector = projector
        self.llm = llm
        self.image_pad_id = spec.llm["special_tokens"]["image_pad"]
        self.drop_cls = spec.vision["family"] in ("clip", "dinov2")
        self.vision_no_grad = False
        self.fused_ce = False  # Liger FusedCE, for the labeled-only head path
        self._fused_loss: nn.Module | None = None
        self.head_loss = head_loss  # regional compilation swaps in a compiled copy

    def set_vision_no_grad(self, on: bool) -> None:
        """Run the frozen tower under torch.no_grad() or not (the native class's switch of the same name)."""
        self.vision_no_grad = on

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Frozen tower forward; under no_grad only when the run config asks for it."""
        ctx = torch.no_grad() if self.vision_no_grad else nullcontext()
        with record_function("vlmdoctor::vision"), ctx:
            feats = self.vision(pixel_values=pixel_values).last_hidden_state
        return feats[:, 1:] if self.drop_cls else feats

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        vision_features: torch.Tensor | None = None,
        loss_index: torch.Tensor | None = None,
        loss_targets: torch.Tensor | None = None,
    ) -> Any:
        feats = self.encode_images(pixel_values) if vision_features is None else vision_features
        with record_function("vlmdoctor::projector"):
            image_embeds = self.projector(feats.to(self.projector.dtype))
        with record_function("vlmdoctor::llm"):
            embeds = self.llm.get_input_embeddings()(input_ids)
            mask = (input_ids == self.image_pad_id).unsqueeze(-1)
            embeds = embeds.masked_scatter(mask, image_embeds.to(embeds.dtype))
            if loss_index is not None:
                return self._labeled_loss(embeds, attention_mask, position_ids, loss_index, loss_targets)
            return self.llm(
                inputs_embeds=embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                labels=labels,
                use_cache=False,
            )

    def _labeled_loss(
        self,
        embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        loss_index: torch.Tensor,
        loss_targets: torch.Tensor,
    ) -> Any:
        """LM head and cross entropy on the positions that predict a label only.

        `loss_index` indexes the flattened (batch, length - 1) positions whose next token is a
        label; the collator computes it on the host, so selecting them costs no device sync. The
        mean over these positions equals transformers' causal-LM loss over the same labels.
        """
        hidden = self.llm.model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return labeled_head_loss(self, hidden, loss_index, loss_targets, self.llm.get_output_embeddings())


def _vision_class(family: str):
    from transformers import (  # deferred: transformers
        CLIPVisionConfig,
        CLIPVisionModel,
        Dinov2Config,
        Dinov2Model,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    return {
        "siglip": (SiglipVisionModel, SiglipVisionConfig),
        "clip": (CLIPVisionModel, CLIPVisionConfig),
        "dinov2": (Dinov2Model, Dinov2Config),
    }[family]


def _llm_config(family: str, values: dict[str, Any]):
    from transformers import LlamaConfig, Qwen2Config  # deferred: transformers

    return {"qwen2": Qwen2Config, "llama": LlamaConfig}[family](**values)


def build_model(
    spec: ModelSpec,
    weight_dtype: str = "fp32",
    attention: str = "sdpa",
    weights: str = "random",
    device: str | torch.device = "cpu",
) -> VLM:
    """Random weights from the shipped configs, or `from_pretrained` when asked and reachable."""
    from transformers import AutoModelForCausalLM  # deferred: transformers

    dtype = DTYPES[weight_dtype]
    vattn, lattn = vision_attn_implementation(attention), llm_attn_implementation(attention)
    vcls, vcfg_cls = _vision_class(spec.vision["family"])
    with torch.device(device):
        if weights == "pretrained":
            vision, llm = _load_pretrained(spec, vcls, (vattn, lattn), dtype, device)
        else:
            vcfg = vcfg_cls(**spec.vision["config"])
            vision = vcls._from_config(vcfg, attn_implementation=vattn, dtype=dtype)
            lcfg = _llm_config(spec.llm["family"], spec.llm["config"])
            llm = AutoModelForCausalLM.from_config(lcfg, attn_implementation=lattn, dtype=dtype)
        projector = Projector(
            spec.vision["config"]["hidden_size"], spec.projector_out, spec.pixel_shuffle, spec.projector
        )
        projector.to(dtype)
    llm.config.use_cache = False
    return VLM(spec, vision, projector, llm)


def llm_attn_implementation(attention: str) -> str:
    """The transformers `attn_implementation` of the LLM for the `attention` knob.

    `flex` runs the LLM on FlexAttention: transformers turns packed position ids into a BlockMask
    (masking_utils.find_packed_sequence_indices), so the kernel skips the blocks between samples
    instead of SDPA reading a dense block-diagonal mask. The SDPA backends (flash, efficient, ...)
    are chosen around the step by `sdpa_kernel`; the model itself is built on SDPA for them.
    """
    return {"eager": "eager", "flex": "flex_attention"}.get(attention, "sdpa")


def vision_attn_implementation(attention: str) -> str:
    """The tower's `attn_implementation`: SDPA even under `flex`.

    The tower sees fixed-length, unmasked patch sequences (no packing there), which SDPA already
    runs on its fused kernels; FlexAttention would add a compile for no skipped blocks.
    """
    return "eager" if attention == "eager" else "sdpa"


def _load_pretrained(
    spec: ModelSpec, vcls, attn: tuple[str, str], dtype: torch.dtype, device
) -> tuple[nn.Module, nn.Module]:
    from transformers import AutoModelForCausalLM  # deferred: transformers

    for part in (spec.vision, spec.llm):
        if not part.get("hub_id"):
            raise UsageError(f"{part['name']} has no published checkpoint; use --weights random")
    extra = {"vision_use_head": False} if spec.vision["family"] == "siglip" else {}
    with loading_checkpoints(spec.vision["hub_id"], spec.llm["hub_id"]):
        vision = vcls.from_pretrained(spec.vision["hub_id"], attn_implementation=attn[0], dtype=dtype, **extra)
        llm = AutoModelForCausalLM.from_pretrained(spec.llm["hub_id"], attn_implementation=attn[1], dtype=dtype)
    return vision.to(device), llm.to(device)


def apply_stage(model: VLM, stage: int) -> None:
    """Stage 1: projector trains; stage 2: LLM + projector train. The vision tower is always frozen."""
    model.vision.requires_grad_(False)
    model.vision.eval()
    model.projector.requires_grad_(True)
    model.llm.requires_grad_(stage == 2)
    model.llm.train()


def enable_gradient_checkpointing(model: VLM, use_reentrant: bool) -> None:
    llm = model.llm
    enable = getattr(llm, "activation_checkpointing_enable", None) or llm.gradient_checkpointing_enable
    enable({"use_reentrant": use_reentrant})


def enable_input_require_grads(model: VLM) -> None:
    """What LLaVA-style trainers do with checkpointing, on each sub-model that has input embeddings.

    transformers hooks the input embeddings of a model so that their outputs require grad. On
    the vision tower that makes every activation after the patch embedding part of an autograd
    graph although no tower weight trains: the tower saves activations and runs a backward.
    """
    for part in (model.vision, model.llm):
        part.enable_input_require_grads()


def param_counts(model: VLM) -> dict[str, int]:
    def count(m: nn.Module, trainable: bool = False) -> int:
        return sum(p.numel() for p in m.parameters() if p.requires_grad or not trainable)

    return {
        "vision": count(model.vision),
        "projector": count(model.projector),
        "llm": count(model.llm),
        "total": count(model),
        "trainable": count(model, trainable=True),
    }


def catalogue() -> list[dict[str, Any]]:
    """Rows for `vlmdoctor models`: presets, towers and LLMs with parameter counts (built on the meta device)."""
    rows = []
    for name, p in presets().items():
        spec = resolve(name)
        counts = param_counts(build_model(spec, device="meta"))
        rows.append(
            {
                "kind": "preset",
                "name": name,
                "params": counts["total"],
                "image_tokens": spec.image_tokens,
                "head_dim": f"{spec.vision_head_dim}/{spec.llm_head_dim}",
                "notes": p["about"],
                "counts": counts,
            }
        )
    rows += native_catalogue()  # native transformers classes: layers, hidden, heads and head dim as vision/LLM
    tiny = resolve("tiny")
    for name, v in vision_specs().items():
        spec = ModelSpec("-", v, tiny.llm, "linear", 1)
        c = v["config"]
        rows.append(
            {
                "kind": "vision",
                "name": name,
                "params": param_counts(build_model(spec, device="meta"))["vision"],
                "layers": c["num_hidden_layers"],
                "hidden": c["hidden_size"],
                "heads": c["num_attention_heads"],
                "head_dim": spec.vision_head_dim,
                "notes": f"{v['input_size']}px, {spec.patch_grid}x{spec.patch_grid} patches",
            }
        )
    for name, lspec in llm_specs().items():
        spec = ModelSpec("-", tiny.vision, lspec, "linear", 1)
        c = lspec["config"]
        rows.append(
            {
                "kind": "llm",
                "name": name,
                "params": param_counts(build_model(spec, device="meta"))["llm"],
                "layers": c["num_hidden_layers"],
                "hidden": c["hidden_size"],
                "heads": f"{c['num_attention_heads']}/{c['num_key_value_heads']}",
                "head_dim": spec.llm_head_dim,
                "notes": f"vocab {c['vocab_size']}" + (", tied" if c.get("tie_word_embeddings") else ""),
            }
        )
    return rows
