"""Native transformers VLM classes as patients: LLaVA, Qwen2-VL and Idefics3 (SmolVLM) built from shipped configs.

The composite model (model.py) is vlmdoctor's own; these are the classes a user trains with
`*ForConditionalGeneration.from_pretrained(...)`, so what they dispatch is what a user's run
dispatches: LLaVA's MLP projector on every patch, Qwen2-VL's windowless ViT with its patch merger
and multimodal RoPE, Idefics3's pixel shuffle connector. Each class gets the same synthetic data
lengths model (data.SyntheticVQA + Collator, so real, loss and padded tokens are counted the same
way), and `NativeVLM.forward` turns the collated batch into the inputs the class expects:

  LLaVA     pixel_values [B, 3, H, W]; one `image_token_id` per patch feature
  Qwen2-VL  pixel_values [sum(t*h*w), C*tp*p*p] (flattened patches, as its image processor makes
            them) + image_grid_thw [B, 3]; (h*w)/merge^2 image pad tokens; position ids left to the
            model, which builds its 3-D multimodal RoPE positions from input_ids
  Idefics3  pixel_values [B, 1, 3, H, W] + pixel_attention_mask [B, 1, H, W]; (H/patch)^2 / scale^2
            image tokens (one image per sample, no tile splitting)

Parts are found with parts.find_parts and marked with parts.mark_parts, so traces carry the same
`vlmdoctor::vision|projector|llm` ranges as the composite model's.
"""

from __future__ import annotations

import warnings
from types import MethodType
from typing import Any

import torch
from torch import nn

from vlmdoctor.errors import UsageError
from vlmdoctor.run.head import head_loss, labeled_head_loss
from vlmdoctor.run.native_spec import NativeSpec, is_native, resolve_native  # noqa: F401 (this module's API)
from vlmdoctor.run.parts import find_parts, mark_parts
from vlmdoctor.run.zoo import loading_checkpoints, native_presets, refuse_composite_only

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _classes(cls_name: str) -> tuple[type, type]:
    import transformers  # deferred: transformers

    config_cls = {
        "LlavaForConditionalGeneration": "LlavaConfig",
        "Qwen2VLForConditionalGeneration": "Qwen2VLConfig",
        "Idefics3ForConditionalGeneration": "Idefics3Config",
    }[cls_name]
    return getattr(transformers, cls_name), getattr(transformers, config_cls)


def hf_config(spec: NativeSpec):
    _, config_cls = _classes(spec.cls_name)
    return config_cls(**spec.config)


def check_native(cfg: Any, spec: NativeSpec, device: torch.device) -> None:
    """Knobs the native classes cannot honour: one clear line each, before anything is built."""
    refuse_composite_only(cfg.model, cfg.to_dict())
    if cfg.data != "synthetic":
        raise UsageError(
            f"--data FILE is not supported for the native preset {spec.preset!r} yet: its tokens come "
            "from the synthetic length model; use --data synthetic or a composite preset"
        )
    if cfg.weights == "pretrained" and not spec.hub_id:
        raise UsageError(f"{spec.preset} has no published checkpoint; use --weights random")


# ------------------------------------------------------------------------------------------------
class NativeVLM(nn.Module):
    """A native transformers VLM behind the runner's batch interface.

    `forward` takes what data.Collator makes (input_ids, labels, attention_mask, position_ids,
    pixel_values [B, 3, H, W]) and hands the class the inputs it expects.
    """

    def __init__(self, spec: NativeSpec, hf: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.hf = hf
        self.parts = find_parts(hf)  # a plain dict: the modules stay registered under `hf` only
        missing = [p for p in ("vision", "projector", "llm") if p not in self.parts]
        if missing:
            raise RuntimeError(f"{spec.cls_name}: parts not found: {', '.join(missing)}")
        self._unmark = mark_parts(hf)
        self._no_grad_hooks: list[Any] = []
        self.fused_ce = False  # Liger FusedCE on the labeled rows (lm_head_labeled_only), as the composite model does
        self._fused_loss: nn.Module | None = None
        self.head_loss = head_loss  # regional compilation swaps in a compiled copy

    @property
    def input_dtype(self) -> torch.dtype:
        """What floating inputs (pixels) are cast to: the projector's weight dtype, as for the composite model."""
        return next(self.parts["projector"].parameters()).dtype

    def set_vision_no_grad(self, on: bool) -> None:
        """Run the tower under torch.no_grad() through hooks.

        A projector nested in it (Qwen2-VL's merger) keeps grad."""
        for h in self._no_grad_hooks:
            h.remove()
        self._no_grad_hooks = []
        if not on:
            return
        self._no_grad_hooks += _grad_mode_hooks(self.parts["vision"], False)
        if _contains(self.parts["vision"], self.parts["projector"]):
            self._no_grad_hooks += _grad_mode_hooks(self.parts["projector"], True)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        loss_index: torch.Tensor | None = None,
        loss_targets: torch.Tensor | None = None,
    ) -> Any:
        """The class's own forward and loss; with `loss_index` (lm_head_labeled_only) the class's base model
        (`.model`, every class here has one) for the hidden states, then the LM head and the loss on the
        labeled rows only, as the composite model does: the same loss, without the unlabeled rows' logits."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "use_cache": False,
        }
        if loss_index is None:
            kwargs["labels"] = labels
        name = self.spec.cls_name
        if name.startswith("Qwen2VL"):
            vc = self.spec.vision_config
            kwargs["pixel_values"], kwargs["image_grid_thw"] = qwen2vl_patches(
                pixel_values, vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"]
            )
            # position ids: the model builds its 3-D multimodal RoPE positions from the token types and the
            # grid; the types are what the processor returns (1 on image tokens, 0 on text)
            kwargs["mm_token_type_ids"] = (input_ids == self.spec.config["image_token_id"]).int()
        elif name.startswith("Idefics3"):
            b, c, h, w = pixel_values.shape
            kwargs["pixel_values"] = pixel_values.unsqueeze(1)
            kwargs["pixel_attention_mask"] = torch.ones((b, 1, h, w), dtype=torch.bool, device=pixel_values.device)
            kwargs["position_ids"] = position_ids
        else:
            kwargs["pixel_values"] = pixel_values
            kwargs["position_ids"] = position_ids
        if loss_index is None:
            return self.hf(**kwargs)
        hidden = self.hf.model(**kwargs).last_hidden_state
        return labeled_head_loss(self, hidden, loss_index, loss_targets, self.hf.get_output_embeddings())


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _grad_mode_hooks(module: nn.Module, enabled: bool) -> list[Any]:
    """Forward hooks that run `module` with grad mode `enabled` and restore the caller's mode after."""
    saved: list[bool] = []

    def pre(_m: nn.Module, _args: Any) -> None:
        saved.append(torch.is_grad_enabled())
        torch.set_grad_enabled(enabled)

    def post(_m: nn.Module, _args: Any, _out: Any) -> None:
        if saved:
            torch.set_grad_enabled(saved.pop())

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]


def qwen2vl_patches(pixels: torch.Tensor, patch: int, temporal: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, C, H, W] images -> Qwen2-VL's flattened patches [B*h*w, C*tp*p*p] and grid_thw [B, 3].

    The same layout as Qwen2VLImageProcessor: a still image is repeated `temporal` times, patches
    are ordered merge-group by merge-group so that the merger folds neighbours.
    """
    b, c, h, w = pixels.shape
    gh, gw = h // patch, w // patch
    x = pixels.unsqueeze(1).expand(b, temporal, c, h, w)
    x = x.reshape(b, 1, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    flat = x.reshape(b * gh * gw, c * temporal * patch * patch)
    grid = torch.tensor([[1, gh, gw]], dtype=torch.long, device=pixels.device).expand(b, 3)
    return flat, grid


def build_native(
    spec: NativeSpec,
    weight_dtype: str = "fp32",
    attention: str = "sdpa",
    weights: str = "random",
    device: str | torch.device = "cpu",
) -> NativeVLM:
    """Random weights from the shipped config, or the class's `from_pretrained` when asked and reachable."""
    cls, _ = _classes(spec.cls_name)
    dtype = DTYPES[weight_dtype]
    attn: str | dict[str, str] = "eager" if attention == "eager" else "sdpa"
    if attention == "flex":
        # transformers takes one implementation per sub-config (modeling_utils.set_attn_implementation):
        # the language model on FlexAttention, the tower and the class itself on SDPA (fixed-length patches)
        attn = {"": "sdpa", "text_config": "flex_attention", "vision_config": "sdpa"}
    try:
        if weights == "pretrained":
            hf = _load_pretrained(spec, cls, attn, dtype).to(device)
        else:
            with torch.device(device):
                hf = cls._from_config(hf_config(spec), attn_implementation=attn, dtype=dtype)
    except ValueError as e:  # e.g. Qwen2VLTextModel: "does not support ... flex_attention" (transformers 5.23)
        if attention != "flex" or "flex_attention" not in str(e):
            raise
        raise UsageError(
            f"transformers cannot run {spec.cls_name}'s language model on FlexAttention "
            f"({str(e).split('.')[0]}); use --attention sdpa"
        ) from None
    hf.config.use_cache = False
    return NativeVLM(spec, hf)


def _load_pretrained(spec: NativeSpec, cls: type, attn: str | dict[str, str], dtype: torch.dtype) -> nn.Module:
    if not spec.hub_id:
        raise UsageError(f"{spec.preset} has no published checkpoint; use --weights random")
    with loading_checkpoints(spec.hub_id):
        return cls.from_pretrained(spec.hub_id, attn_implementation=attn, dtype=dtype)


# --- stages and knobs ---------------------------------------------------------------------------
def apply_native_stage(model: NativeVLM, stage: int) -> None:
    """Vision frozen always; stage 1: projector only (grads still flow through the frozen LLM); stage 2: + LLM.

    The LM head belongs to the LLM side: it trains in stage 2 (tied heads are the embedding).
    """
    hf, parts = model.hf, model.parts
    hf.train()
    hf.requires_grad_(stage == 2)
    parts["vision"].requires_grad_(False)
    parts["vision"].eval()
    parts["projector"].requires_grad_(True)
    parts["projector"].train()


def enable_native_checkpointing(model: NativeVLM, use_reentrant: bool) -> None:
    """The class's own switch, as a user calls it (it also enables input-embedding grads, as transformers does)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias is what user scripts call
        model.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def apply_native_liger(model: NativeVLM, cfg: Any) -> None:
    """Liger through the class's own patch function, with the run config's flags (vision LayerNorm left alone)."""
    import liger_kernel.transformers as lk  # deferred: liger, an optional extra

    hf, name = model.hf, model.spec.cls_name
    flags = {"rope": cfg.liger_rope, "rms_norm": cfg.liger_rms_norm, "swiglu": cfg.liger_swiglu}
    fce = cfg.liger_fused_linear_cross_entropy
    if cfg.lm_head_labeled_only:  # the head and loss run on the labeled rows, through Liger's FusedCE loss there
        model.fused_ce, fce = fce, False
    if name.startswith("Llava"):
        lk.apply_liger_kernel_to_llava(cross_entropy=False, fused_linear_cross_entropy=fce, model=hf, **flags)
    elif name.startswith("Qwen2VL"):
        lk.apply_liger_kernel_to_qwen2_vl(
            cross_entropy=False, fused_linear_cross_entropy=fce, layer_norm=False, model=hf, **flags
        )
    else:
        _liger_idefics3(hf, fce, flags)


def _liger_idefics3(hf: nn.Module, fce: bool, flags: dict[str, bool]) -> None:
    """apply_liger_kernel_to_smolvlm's steps, on an Idefics3 instance.

    liger-kernel's smolvlm function accepts SmolVLM classes only (an isinstance check), while
    SmolVLM-256M loads as Idefics3ForConditionalGeneration, the same layout (model.text_model,
    model.vision_model, model.connector, lm_head). So its two steps are applied here: the
    text model's Llama patch with the flags, and its fused-linear-cross-entropy forward bound to
    the instance.
    """
    import liger_kernel.transformers as lk  # deferred: liger, an optional extra

    lk.apply_liger_kernel_to_llama(
        cross_entropy=False, fused_linear_cross_entropy=False, model=hf.model.text_model, **flags
    )
    if fce:
        from liger_kernel.transformers.model.smolvlm import lce_forward  # deferred: liger, an optional extra

        hf.forward = MethodType(lce_forward, hf)


# --- counting ------------------------------------------------------------------------------------
def native_param_counts(model: NativeVLM) -> dict[str, int]:
    """Parameters per part; `llm` is everything that is neither tower nor projector (LM head included)."""
    parts = model.parts
    proj = {id(p) for p in parts["projector"].parameters()}
    vision = {id(p) for p in parts["vision"].parameters()} - proj
    every = {id(p): p for p in model.hf.parameters()}  # unique: tied weights count once

    def count(ids: set[int], trainable: bool = False) -> int:
        return sum(every[i].numel() for i in ids if i in every and (every[i].requires_grad or not trainable))

    llm = set(every) - proj - vision
    return {
        "vision": count(vision),
        "projector": count(proj),
        "llm": count(llm),
        "total": count(set(every)),
        "trainable": count(set(every), trainable=True),
    }


def native_catalogue() -> list[dict[str, Any]]:
    """Rows for `vlmdoctor models`, built on the meta device (no memory, no time)."""
    rows = []
    for name in native_presets():
        spec = resolve_native(name)
        counts = native_param_counts(build_native(spec, device="meta"))
        rows.append(
            {
                "kind": "native",
                "name": name,
                "params": counts["total"],
                "image_tokens": spec.image_tokens,
                "layers": f"{spec.vision_layers}/{spec.text_config['num_hidden_layers']}",
                "hidden": f"{spec.vision_hidden}/{spec.text_config['hidden_size']}",
                "heads": f"{spec.vision_heads}/{spec.text_config['num_attention_heads']}",
                "head_dim": f"{spec.vision_head_dim}/{spec.llm_head_dim}",
                "notes": f"{spec.cls_name.removesuffix('ForConditionalGeneration')}, {spec.image_tokens} image tokens",
                "about": spec.about,
                "counts": counts,
            }
        )
    return rows


def configure(model: NativeVLM, cfg: Any, train_mode: Any = None) -> None:
    """The run config's model knobs, in the composite model's order: stage, no_grad tower, Liger, training mode
    (`train_mode()` puts LoRA on the LLM part), checkpointing, input grads."""
    apply_native_stage(model, cfg.stage)
    model.set_vision_no_grad(cfg.vision_no_grad)
    if cfg.uses_liger:
        apply_native_liger(model, cfg)
    if train_mode is not None and cfg.train != "full":
        model.mode_info = train_mode()
        proj = {id(p) for p in model.parts["projector"].parameters()}
        for name, p in model.hf.named_parameters():  # the LM head and embeddings sit outside the LLM part
            p.requires_grad_(id(p) in proj or "lora_" in name)
    if cfg.gradient_checkpointing:
        enable_native_checkpointing(model, cfg.checkpoint_use_reentrant)
    if cfg.input_require_grads:
        model.hf.enable_input_require_grads()
