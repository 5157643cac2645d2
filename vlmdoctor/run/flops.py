"""Model FLOPs of one training step, and the device's peak, for MFU.

MFU = model FLOPs per second / peak dense bf16 FLOP/s of the device.

Model FLOPs count the useful work of what the stage really computes, on real (non-padding)
tokens only, so padding, recompute and casts are waste that lowers MFU:
  LLM, per sample of L real tokens (P = weights of all linear layers of the decoder and the
  LM head, d_att = heads x head_dim, n = layers):
    forward  F_llm = 2 * P * L  +  4 * n * d_att * L (L + 1) / 2        (causal attention)
    stage 2: forward + full backward      = 3 * F_llm            (activation + weight grads)
    stage 1: forward + activation grads   = 2 * F_lin + 3 * F_att  (no weight grads, but the
             attention backward still needs dQ, dK, dV to reach the projector)
  Vision tower (frozen, forward only), per image of N tokens (P_v = linear weights, the patch
  convolution included as a linear map; CLIP and DINOv2 add a CLS token, N = patches + 1, and
  their patch embedding, P_e weights, runs on the patches only):
    F_vis = 2 * P_v * N - 2 * P_e * (N - patches) + 4 * n_v * d_v * N^2   (bidirectional attention)
    zero when vision features are cached (the tower does not run)
  Projector, per image of T output tokens (P_p weights): forward + weight grad = 2 * 2 * P_p * T
    (no input gradient: the tower is frozen)

When the LM head runs on labeled positions only (lm_head_labeled_only), its 2 * h * V FLOPs
per token are counted for those positions only: work not done is not counted.

Native transformers classes (run/native.py) use the same formula with what each class computes
(`FlopModel.from_native`):
  LLaVA     tower on every patch (N = (H/p)^2, no CLS with SigLIP); projector = 2-layer MLP
            (P_p = d_v*h + h*h) on every patch feature (T = N)
  Qwen2-VL  tower on N = (H/p)^2 patches, patch embedding a Conv3d over 2 temporal copies
            (3*2*p*p*d_v weights), full attention within each image; projector = the patch
            merger MLP (P_p = (4 d_v)^2 + 4 d_v * h) on T = N/4 merged tokens (its LayerNorm and
            the GELU are left out)
  Idefics3  tower on N = (H/p)^2 patches; projector = pixel shuffle (no FLOPs) + linear
            (P_p = d_v * s^2 * h) on T = N / s^2 tokens
  LLM       the formula above with the class's text config (an untied LM head counts as P_llm).
Approximations: biases, position embeddings, norms and RoPE (Qwen2-VL's 3-D RoPE included)
are left out, as above. With gradient checkpointing a native class also enables input-embedding
grads (transformers does it), so its frozen tower builds a graph and runs a backward: that is
waste, not model work, and is not counted.

Training modes (run/modes.py, docs/modes.md):
  LoRA / QLoRA (stage 2 only): the base LLM is frozen but the backward still needs its input
    gradients to reach earlier adapters and the projector, so the base costs forward + input-grad
    GEMMs = 2 * F_lin + 3 * F_att (as stage 1), and each adapted layer (d_in -> d_out, rank r)
    adds 6 * r * (d_in + d_out) per token: forward of A and B, their input grads, their weight
    grads. QLoRA computes the same (its dequantization is not model work).
  DPO: the policy runs on the chosen and the rejected row of each pair (2B rows, each with its
    image) in its training mode; the reference adds a forward on both rows: F_llm + F_vis +
    2 * P_p * T per row, none when its log-probs were precomputed (that pass is reported apart).
    A reference that tracks grad and gets a backward does waste, not model work: not counted.

Gradient-checkpoint recompute is not model work and is not counted (that is the usual MFU
convention, as opposed to hardware FLOPs). Embedding lookups, norms, activations, the
softmax and the optimizer are left out: they are a few percent of the matmul FLOPs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vlmdoctor.run.native_spec import is_native, resolve_native
from vlmdoctor.run.zoo import ModelSpec, resolve

#: dense bf16 tensor-core peak (no sparsity), from NVIDIA's data sheets; first match wins
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989.4e12),  # SXM5 / HBM3
    ("H200", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("L40S", 362e12),
    ("L40", 181.05e12),
    ("L4", 121e12),
]


def peak_flops(device_name: str | None) -> tuple[float | None, str]:
    """(peak FLOP/s, where it came from); None for CPUs and unknown GPUs."""
    if not device_name:
        return None, "no GPU: MFU is not defined for CPU runs"
    for key, value in PEAK_BF16_FLOPS:
        # whole words only: "L4" must not match "L40"
        if re.search(rf"(?<![A-Za-z0-9]){re.escape(key)}(?![A-Za-z0-9])", device_name, re.IGNORECASE):
            return value, f"dense bf16 peak of {key} ({value / 1e12:.1f} TFLOP/s, data sheet)"
    return None, f"peak of {device_name!r} unknown: MFU left out"


@dataclass(frozen=True)
class FlopModel:
    """Per-token and per-image FLOP coefficients of a composed VLM."""

    llm_linear_params: int
    llm_layers: int
    llm_attn_dim: int
    vision_linear_params: int
    vision_layers: int
    vision_dim: int
    vision_patches: int
    projector_params: int
    image_tokens: int
    llm_head_params: int = 0
    vision_embed_params: int = 0  # the patch embedding, part of vision_linear_params
    vision_extra_tokens: int = 0  # tokens the tower adds after embedding patches (CLS): no patch-embedding FLOPs

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> FlopModel:
        lc, vc = spec.llm["config"], spec.vision["config"]
        h, inter, layers = lc["hidden_size"], lc["intermediate_size"], lc["num_hidden_layers"]
        hd = spec.llm_head_dim
        q, kv = lc["num_attention_heads"] * hd, lc["num_key_value_heads"] * hd
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter  # q,k,v,o + gate,up,down
        llm_linear = layers * per_layer + h * lc["vocab_size"]  # + LM head
        vh = vc["hidden_size"]
        vinter = vc.get("intermediate_size") or vh * vc.get("mlp_ratio", 4)
        patch = vc["patch_size"]
        vision_linear = vc["num_hidden_layers"] * (4 * vh * vh + 2 * vh * vinter) + 3 * patch * patch * vh
        grid = spec.patch_grid
        extra = 1 if spec.vision["family"] in ("clip", "dinov2") else 0  # the CLS token
        patches = grid * grid + extra
        d_in = spec.projector_in
        proj = d_in * spec.projector_out + (spec.projector_out**2 if spec.projector == "mlp2x_gelu" else 0)
        return cls(
            llm_linear,
            layers,
            q,
            vision_linear,
            vc["num_hidden_layers"],
            vh,
            patches,
            proj,
            spec.image_tokens,
            h * lc["vocab_size"],
            3 * patch * patch * vh,
            extra,
        )

    @classmethod
    def from_native(cls, spec: Any) -> FlopModel:
        """The coefficients of a native transformers VLM class (a native.NativeSpec)."""
        lc, vc = spec.text_config, spec.vision_config
        h, inter, layers = lc["hidden_size"], lc["intermediate_size"], lc["num_hidden_layers"]
        hd = spec.llm_head_dim
        q, kv = lc["num_attention_heads"] * hd, lc["num_key_value_heads"] * hd
        llm_linear = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + h * lc["vocab_size"]
        vh, p = spec.vision_hidden, spec.patch_size
        if spec.cls_name.startswith("Qwen2VL"):
            vinter = vh * vc["mlp_ratio"]
            embed = vc.get("in_channels", 3) * vc["temporal_patch_size"] * p * p * vh
            merged = vh * spec.merge**2
            proj = merged * merged + merged * h
        elif spec.cls_name.startswith("Idefics3"):
            vinter = vc["intermediate_size"]
            embed = vc.get("num_channels", 3) * p * p * vh
            proj = vh * spec.merge**2 * h
        else:  # LLaVA: MLP projector on every patch feature
            vinter = vc["intermediate_size"]
            embed = vc.get("num_channels", 3) * p * p * vh
            proj = vh * h + h * h
        vision_linear = spec.vision_layers * (4 * vh * vh + 2 * vh * vinter) + embed
        return cls(
            llm_linear,
            layers,
            q,
            vision_linear,
            spec.vision_layers,
            vh,
            spec.patches,
            proj,
            spec.image_tokens,
            h * lc["vocab_size"],
        )

    def llm_forward(self, lengths: list[int], head_tokens: int | None = None) -> tuple[float, float]:
        """(linear, attention) forward FLOPs for samples with these real lengths.

        head_tokens: positions the LM head runs on when it runs on labeled positions only;
        None when it runs on every token.
        """
        lin = 2.0 * self.llm_linear_params * sum(lengths)
        if head_tokens is not None:
            lin -= 2.0 * self.llm_head_params * (sum(lengths) - head_tokens)
        att = 4.0 * self.llm_layers * self.llm_attn_dim * sum(L * (L + 1) / 2 for L in lengths)
        return lin, att

    def vision_forward(self, images: int) -> float:
        n = self.vision_patches
        embed_skipped = 2.0 * self.vision_embed_params * self.vision_extra_tokens  # CLS is not a patch
        return images * (
            2.0 * self.vision_linear_params * n - embed_skipped + 4.0 * self.vision_layers * self.vision_dim * n * n
        )

    def step(
        self,
        lengths: list[int],
        stage: int,
        vision_cached: bool = False,
        head_tokens: int | None = None,
        mode: Mode | None = None,
    ) -> dict[str, float]:
        """Model FLOPs of one optimizer step over rows of these real lengths (one image each).

        With DPO the rows are the chosen and the rejected row of every pair (2B rows).
        """
        mode = mode or Mode()
        lin, att = self.llm_forward(lengths, head_tokens)
        if mode.train == "full":
            llm = 3.0 * (lin + att) if stage == 2 else 2.0 * lin + 3.0 * att
            adapters = 0.0
        else:  # frozen base: forward + input-grad GEMMs only; adapters: forward + both grads
            llm = 2.0 * lin + 3.0 * att
            adapters = 6.0 * mode.adapter_params * sum(lengths)
        vision = 0.0 if vision_cached else self.vision_forward(len(lengths))
        projector = 4.0 * self.projector_params * self.image_tokens * len(lengths)
        reference = 0.0
        if mode.objective == "dpo" and mode.reference_in_step:  # forward only, on both rows of every pair
            reference = lin + att + vision + 2.0 * self.projector_params * self.image_tokens * len(lengths)
        return {
            "llm": llm + adapters,
            "adapters": adapters,
            "vision": vision,
            "projector": projector,
            "reference": reference,
            "total": llm + adapters + vision + projector + reference,
        }


@dataclass(frozen=True)
class Mode:
    """What a training mode computes beyond the stage: LoRA adapters, DPO's reference forward.

    adapter_params: sum of r * (d_in + d_out) over the LoRA-adapted layers (their weight count);
    reference_in_step: False when reference log-probs were precomputed before the timed steps.
    """

    train: str = "full"
    adapter_params: int = 0
    objective: str = "sft"
    reference_in_step: bool = True


def flop_model(model: str, cfg: dict[str, Any] | None = None) -> FlopModel:
    """The FLOP model of a preset (composite with the config's overrides, or native); UsageError if unknown."""

    if is_native(model):
        return FlopModel.from_native(resolve_native(model))
    cfg = cfg or {}
    return FlopModel.from_spec(
        resolve(model, cfg.get("vision"), cfg.get("llm"), cfg.get("projector"), cfg.get("pixel_shuffle"))
    )


def describe() -> dict[str, Any]:
    """The formula as text, for the report."""
    return {
        "llm_stage2": "3 * (2*P_llm*L + 2*n*d_att*L*(L+1))",
        "llm_stage1": "2 * 2*P_llm*L + 3 * 2*n*d_att*L*(L+1)",
        "vision": "2*P_vis*N + 4*n_vis*d_vis*N^2 per image, forward only; 0 when features are cached",
        "projector": "4*P_proj*T per image",
        "native_classes": "LLaVA: N=T=patches, MLP projector; Qwen2-VL: N=patches, merger MLP on T=N/4; "
        "Idefics3: N=patches, linear on T=N/scale^2 (FlopModel.from_native)",
        "lora": "frozen base: 2 * 2*P_llm*L + 3 * 2*n*d_att*L*(L+1) (no weight-grad GEMMs); "
        "adapters: 6 * r*(d_in+d_out) "
        "per adapted layer per token (forward + input grad + weight grad)",
        "dpo": "policy on the chosen and the rejected row of each pair; reference forward on both: "
        "2*P_llm*L + 2*n*d_att*L*(L+1) + vision + 2*P_proj*T per row (0 when precomputed)",
        "counted_on": "real tokens only; recompute, padding and casts are not model FLOPs; with lm_head_labeled_only "
        "the LM head counts the labeled positions it runs on",
        "peak": "dense bf16 tensor-core peak of the device (data sheet)",
    }
