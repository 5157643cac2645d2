"""Small VLMs of native transformers classes, built from a config with random weights (no download).

A user's helper module for the corpus scripts (habits.py, dist_habits.py): it imports torch and
transformers, never vlmdoctor. Each entry builds one class at two sizes:

  gpu   (default) an LLM of 4 layers at width 3072 (the class's own vocabulary and token ids) and a
        vision tower of 2 layers at width 1024, so that a training step of batch 8 takes ~80-180 ms
        on one H100 (estimate.py) and two profiled steps gzip to well under 2 MB;
  tiny  (--tiny) every width cut to 64, two layers: a CPU smoke test.

`spec(name, tiny)` returns a Spec: the config, the model class, and `image(gen, side)` giving the
token ids one image takes in the text (its start/end markers included) and that image's pixel
tensors; `sample(...)` makes one training example (prompt, image, question, answer as labels),
`collate(...)` pads examples into a batch, `build(...)` makes the model on a device in a dtype.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch

# the LLM and vision tower widths of each size (a class keeps its own vocabulary and token ids)
LLM = {
    "gpu": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=24, num_key_value_heads=8
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
}
VIT = {
    "gpu": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=16),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}


@dataclasses.dataclass
class Spec:
    name: str
    cls: type
    config: object
    image: Callable  # (gen, side) -> (list[int] tokens for one image, {name: tensor for one image})
    side: int  # the default image side (pixels)
    sides: tuple = ()  # other sides the class takes (varying image sizes)
    cat_pixels: tuple = ()  # pixel keys concatenated along dim 0 across samples (others are stacked)
    extra: Callable | None = None  # (ids, attention_mask, batch) -> extra model inputs
    vocab: int = 32000  # text tokens are drawn below this
    note: str = ""


def _size(tiny: bool) -> str:
    return "tiny" if tiny else "gpu"


TEXT_OVERRIDES: dict = {}  # set by spec(text=...): win over the class's own values


def _llm(tiny: bool, **kw) -> dict:
    return {**LLM[_size(tiny)], **kw, **TEXT_OVERRIDES}


def _vit(tiny: bool, **kw) -> dict:
    return dict(VIT[_size(tiny)], **kw)


# ---------------------------------------------------------------------------------------------------
def _idefics2(T, tiny):
    """Idefics2: SigLIP-like NaViT tower (patch 14) + perceiver resampler (64 latents) + Mistral LLM."""
    text = _llm(tiny, model_type="mistral", vocab_size=32003, sliding_window=None, max_position_embeddings=4096)
    vision = _vit(tiny, image_size=980, patch_size=14)
    perceiver = dict(
        hidden_act="silu",
        hidden_size=text["hidden_size"],
        rms_norm_eps=1e-5,
        resampler_n_latents=64,
        resampler_depth=2 if not tiny else 1,
        resampler_n_heads=16 if not tiny else 4,
        resampler_head_dim=96 if not tiny else 16,
        num_key_value_heads=4 if not tiny else 2,
    )
    cfg = T.Idefics2Config(
        vision_config=vision,
        perceiver_config=perceiver,
        text_config=text,
        image_token_id=32001,
        tie_word_embeddings=False,
    )
    fake = 32000  # <fake_token_around_image> stand-in

    def image(gen, side):
        toks = [fake] + [32001] * 64 + [fake]
        px = torch.randn(1, 1, 3, side, side, generator=gen)
        return toks, {"pixel_values": px, "pixel_attention_mask": torch.ones(1, 1, side, side, dtype=torch.bool)}

    return Spec(
        "idefics2",
        T.Idefics2ForConditionalGeneration,
        cfg,
        image,
        side=112 if tiny else 378,
        sides=(84, 112) if tiny else (336, 378, 420),
        vocab=32000,
    )


def _mllama(T, tiny):
    """Mllama (Llama 3.2 Vision): tiled ViT with global layers + cross-attention layers in the LLM."""
    text = _llm(tiny, model_type="mllama_text_model", vocab_size=128256)
    n = text["num_hidden_layers"]  # one more layer: a cross-attention layer after every second self-attention one
    text.update(num_hidden_layers=n + max(1, n // 2), cross_attention_layers=[3 * i + 2 for i in range(max(1, n // 2))])
    v = _vit(tiny)
    vision = dict(
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_hidden_layers=v["num_hidden_layers"],
        num_global_layers=1,
        attention_heads=v["num_attention_heads"],
        image_size=56 if tiny else 448,
        patch_size=14,
        max_num_tiles=4,
        intermediate_layers_indices=[0],
        vision_output_dim=v["hidden_size"] * 2,
    )
    cfg = T.MllamaConfig(vision_config=vision, text_config=text, image_token_index=128256)
    side = vision["image_size"]

    def image(gen, side_):
        # one tile (aspect ratio 1x1: id 1), the other three tiles padding, as the processor does
        px = torch.zeros(1, 1, 4, 3, side, side)
        px[:, :, 0] = torch.randn(3, side, side, generator=gen)
        return [128256], {
            "pixel_values": px,
            "aspect_ratio_ids": torch.tensor([[1]]),
            "aspect_ratio_mask": torch.tensor([[[1, 0, 0, 0]]]),
        }

    def extra(ids, mask, batch):
        # cross_attention_mask (B, L, images, tiles): text from the image token on attends to tile 0
        b, n = ids.shape
        cam = torch.zeros(b, n, 1, 4, dtype=torch.long)
        for i in range(b):
            pos = int((ids[i] == 128256).nonzero()[0])
            cam[i, pos:, 0, 0] = 1
        return {"cross_attention_mask": cam}

    return Spec("mllama", T.MllamaForConditionalGeneration, cfg, image, side=side, extra=extra, vocab=128000)


def _mistral3(T, tiny):
    """Mistral3 (Mistral Small 3.1): Pixtral tower (2D RoPE, patch 16) + 2x2 patch merger + Mistral LLM."""
    text = _llm(
        tiny,
        model_type="mistral",
        vocab_size=131072,
        sliding_window=None,
        head_dim=128 if not tiny else 16,
        max_position_embeddings=8192,
    )
    vision = _vit(tiny, model_type="pixtral", image_size=1024, patch_size=16, head_dim=64 if not tiny else 16)
    cfg = T.Mistral3Config(
        vision_config=vision, text_config=text, image_token_index=10, spatial_merge_size=2, tie_word_embeddings=False
    )
    IMG, BREAK, END = 10, 12, 13

    def image(gen, side):
        rows = side // 16 // 2
        toks = []
        for r in range(rows):  # [IMG] x cols, [IMG_BREAK] per row, [IMG_END] last (as the processor lays them)
            toks += [IMG] * rows + ([BREAK] if r < rows - 1 else [END])
        return toks, {
            "pixel_values": torch.randn(1, 3, side, side, generator=gen),
            "image_sizes": torch.tensor([[side, side]]),
        }

    return Spec(
        "mistral3",
        T.Mistral3ForConditionalGeneration,
        cfg,
        image,
        side=64 if tiny else 448,
        sides=(64, 96) if tiny else (384, 448, 512),
        cat_pixels=("image_sizes",),
        vocab=32000,
    )


def _aya_vision(T, tiny):
    """AyaVision: SigLIP tower + pixel-shuffle (2x) SwiGLU projector + Cohere2 LLM (sliding + global layers)."""
    text = _llm(tiny, model_type="cohere2", vocab_size=256000, sliding_window=4096, max_position_embeddings=8192)
    n = text["num_hidden_layers"]  # Command-A-Vision's pattern: every 4th layer global, the last one too
    text["layer_types"] = [
        "full_attention" if (i + 1) % 4 == 0 or i == n - 1 else "sliding_attention" for i in range(n)
    ]
    vision = _vit(tiny, model_type="siglip_vision_model", image_size=56 if tiny else 364, patch_size=14)
    cfg = T.AyaVisionConfig(
        vision_config=vision,
        text_config=text,
        downsample_factor=2,
        image_token_index=255036,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    side = vision["image_size"]
    n = (side // 14 // 2) ** 2

    def image(gen, side_):
        return [255033] + [255036] * n + [255034], {"pixel_values": torch.randn(1, 3, side, side, generator=gen)}

    return Spec("aya_vision", T.AyaVisionForConditionalGeneration, cfg, image, side=side, vocab=200000)


def _qwen_grid(image_token, start, end, patch, temporal=2, merge=2):
    def image(gen, side):
        g = side // patch
        px = torch.randn(g * g, 3 * temporal * patch * patch, generator=gen)
        return [start] + [image_token] * (g * g // merge**2) + [end], {
            "pixel_values": px,
            "image_grid_thw": torch.tensor([[1, g, g]]),
        }

    return image


def _mm_token_types(Model, image_token):
    """Newer transformers take mm_token_type_ids (1 on image tokens) for the multimodal RoPE; older ones don't."""
    if "mm_token_type_ids" not in inspect.signature(Model.forward).parameters:
        return None
    return lambda ids, mask, batch: {"mm_token_type_ids": (ids == image_token).int()}


def _qwen3_vl(T, tiny, moe=False):
    """Qwen3-VL: ViT (patch 16, 2D RoPE, deepstack taps) + 2x2 merger + Qwen3 LLM with interleaved M-RoPE."""
    text = _llm(
        tiny,
        vocab_size=151936,
        head_dim=128 if not tiny else 16,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20] if not tiny else [3, 3, 2],
            "mrope_interleaved": True,
        },
    )
    if moe:  # Qwen3-VL-30B-A3B's router (128 experts, top 8) at cut widths
        text.update(
            num_experts=32 if not tiny else 8,
            num_experts_per_tok=4 if not tiny else 2,
            moe_intermediate_size=768 if not tiny else 32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    v = _vit(tiny)
    vision = dict(
        depth=v["num_hidden_layers"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_attention_heads"],
        out_hidden_size=text["hidden_size"],
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[0, 1],
    )
    Cfg, Model = (
        (T.Qwen3VLMoeConfig, T.Qwen3VLMoeForConditionalGeneration)
        if moe
        else (T.Qwen3VLConfig, T.Qwen3VLForConditionalGeneration)
    )
    cfg = Cfg(
        vision_config=vision,
        text_config=text,
        image_token_id=151655,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=False,
    )
    return Spec(
        "qwen3_vl_moe" if moe else "qwen3_vl",
        Model,
        cfg,
        _qwen_grid(151655, 151652, 151653, 16),
        side=64 if tiny else 448,
        sides=(64, 96, 128) if tiny else tuple(range(320, 513, 32)),
        cat_pixels=("pixel_values", "image_grid_thw"),
        extra=_mm_token_types(Model, 151655),
        vocab=150000,
    )


def _glm4v(T, tiny):
    """GLM-4.1V: ViT (patch 14, Conv3d patch embed, 2D RoPE) + merger + GLM-4 LLM with M-RoPE."""
    text = _llm(
        tiny,
        vocab_size=151552,
        max_position_embeddings=32768,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [8, 12, 12] if not tiny else [1, 1, 2],
        },
    )
    v = _vit(tiny)
    vision = dict(
        depth=v["num_hidden_layers"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_attention_heads"],
        out_hidden_size=text["hidden_size"],
        patch_size=14,
        image_size=336,
        spatial_merge_size=2,
        temporal_patch_size=2,
    )
    cfg = T.Glm4vConfig(vision_config=vision, text_config=text)
    Model = T.Glm4vForConditionalGeneration
    return Spec(
        "glm4v",
        Model,
        cfg,
        _qwen_grid(151343, 151339, 151340, 14),
        side=56 if tiny else 448,
        sides=(56, 84, 112) if tiny else tuple(range(280, 505, 28)),
        cat_pixels=("pixel_values", "image_grid_thw"),
        extra=_mm_token_types(Model, 151343),
        vocab=150000,
    )


def _janus(T, tiny):
    """Janus (understanding path): SigLIP-like tower (384 px, patch 16: 576 tokens) + MLP aligner + Llama LLM."""
    text = _llm(tiny, model_type="llama", vocab_size=102400, max_position_embeddings=4096)
    v = _vit(tiny)
    side = 64 if tiny else 384
    vision = dict(
        hidden_size=v["hidden_size"],
        num_hidden_layers=v["num_hidden_layers"],
        num_attention_heads=v["num_attention_heads"],
        image_size=side,
        patch_size=16,
        projection_dim=text["hidden_size"],
        num_image_tokens=(side // 16) ** 2,
    )
    # the generation path (VQ-VAE, generation head) is built but not used by understanding
    vq = dict(
        embed_dim=8,
        num_embeddings=1024 if tiny else 16384,
        base_channels=32 if tiny else 64,
        channel_multiplier=[1, 1, 2],
        latent_channels=32 if tiny else 128,
        num_res_blocks=1,
        projection_dim=text["hidden_size"],
        image_token_embed_dim=text["hidden_size"],
        num_patches=8,
    )
    cfg = T.JanusConfig(text_config=text, vision_config=vision, vq_config=vq, image_token_id=100581)
    n = (side // 16) ** 2

    def image(gen, side_):
        return [100016] + [100581] * n + [100593], {"pixel_values": torch.randn(1, 3, side, side, generator=gen)}

    return Spec("janus", T.JanusForConditionalGeneration, cfg, image, side=side, vocab=100000)


def _deepseek_vl(T, tiny):
    """DeepSeek-VL (1.3B layout): SigLIP tower (384 px, patch 16: 576 tokens) + MLP aligner + Llama LLM."""
    text = _llm(tiny, model_type="llama", vocab_size=102400, max_position_embeddings=4096)
    side = 64 if tiny else 384
    vision = _vit(tiny, model_type="siglip_vision_model", image_size=side, patch_size=16)
    cfg = T.DeepseekVLConfig(text_config=text, vision_config=vision, image_token_id=100015)
    n = (side // 16) ** 2

    def image(gen, side_):
        return [100015] * n, {"pixel_values": torch.randn(1, 3, side, side, generator=gen)}

    return Spec("deepseek_vl", T.DeepseekVLForConditionalGeneration, cfg, image, side=side, vocab=100000)


def _blip2(T, tiny):
    """BLIP-2: ViT (patch 14) + Q-Former (32 queries, cross-attention every 2nd layer) + OPT LLM."""
    t = _llm(tiny)
    text = dict(
        model_type="opt",
        vocab_size=50304,
        hidden_size=t["hidden_size"],
        ffn_dim=t["hidden_size"] * 4,
        num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"],
        word_embed_proj_dim=t["hidden_size"],
        max_position_embeddings=2048,
    )
    side = 56 if tiny else 364
    vision = _vit(tiny, image_size=side, patch_size=14)
    qformer = dict(
        hidden_size=64 if tiny else 768,
        intermediate_size=128 if tiny else 3072,
        num_hidden_layers=2 if tiny else 4,
        num_attention_heads=4 if tiny else 12,
        cross_attention_frequency=2,
        encoder_hidden_size=vision["hidden_size"],
    )
    cfg = T.Blip2Config(
        vision_config=vision, qformer_config=qformer, text_config=text, num_query_tokens=32, image_token_index=50265
    )

    def image(gen, side_):
        return [50265] * 32, {"pixel_values": torch.randn(1, 3, side, side, generator=gen)}

    return Spec("blip2", T.Blip2ForConditionalGeneration, cfg, image, side=side, vocab=50000)


MAKERS = {
    "idefics2": _idefics2,
    "mllama": _mllama,
    "mistral3": _mistral3,
    "aya_vision": _aya_vision,
    "qwen3_vl": _qwen3_vl,
    "qwen3_vl_moe": lambda T, tiny: _qwen3_vl(T, tiny, moe=True),
    "glm4v": _glm4v,
    "janus": _janus,
    "deepseek_vl": _deepseek_vl,
    "blip2": _blip2,
}


CLASSES = {
    "idefics2": "Idefics2ForConditionalGeneration",
    "mllama": "MllamaForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "aya_vision": "AyaVisionForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "janus": "JanusForConditionalGeneration",
    "deepseek_vl": "DeepseekVLForConditionalGeneration",
    "blip2": "Blip2ForConditionalGeneration",
}


def resolve(name: str) -> str:
    """A key of MAKERS from a key or a transformers class name (Glm4vForConditionalGeneration -> glm4v)."""
    if name in MAKERS:
        return name
    by_class = {v.lower(): k for k, v in CLASSES.items()}
    if name.lower() in by_class:
        return by_class[name.lower()]
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MAKERS)} (or their class names)")


def spec(name: str, tiny: bool, llm_layers: int = 0, vit_layers: int = 0, text: dict | None = None) -> Spec:
    """The class's Spec; llm_layers / vit_layers (0: the size's default) override the depths, `text`
    any of the LLM's config values (widths, vocab_size)."""
    import transformers as T

    saved = {k: dict(v) for k, v in LLM.items()}, {k: dict(v) for k, v in VIT.items()}
    try:
        if llm_layers:
            LLM[_size(tiny)]["num_hidden_layers"] = llm_layers
        if vit_layers:
            VIT[_size(tiny)]["num_hidden_layers"] = vit_layers
        TEXT_OVERRIDES.update(text or {})
        return MAKERS[resolve(name)](T, tiny)
    finally:
        LLM.clear(), LLM.update(saved[0]), VIT.clear(), VIT.update(saved[1]), TEXT_OVERRIDES.clear()


def build(s: Spec, device, dtype, attn: str = "sdpa"):
    """The model with random weights on `device` in `dtype`, every sub-model on `attn`."""
    cfg = s.config
    cfg._attn_implementation = attn
    for key in ("text_config", "vision_config", "qformer_config", "perceiver_config"):
        sub = getattr(cfg, key, None)
        if sub is not None:
            sub._attn_implementation = attn
    with torch.device(device):
        model = s.cls(cfg)
    model.to(dtype)
    model.config.use_cache = False
    return model


SEQ_PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}


def sample(s: Spec, gen: torch.Generator, n_text: int, side: int | None = None) -> dict:
    """One training example: an 8-token prompt, the image, a question and an answer (the labels)."""
    toks, px = s.image(gen, side or s.side)
    text = torch.randint(100, s.vocab, (n_text,), generator=gen)
    ids = torch.cat([text[:8], torch.tensor(toks), text[8:]])
    labels = torch.full_like(ids, -100)
    answer = n_text // 2
    labels[-answer:] = ids[-answer:]
    return {"input_ids": ids, "labels": labels, **px}


def collate(s: Spec, examples: list[dict], pad_to: int | None = None) -> dict:
    """Pad the token rows to the longest (or to `pad_to`), stack (or concatenate) the pixel tensors."""
    width = max(len(e["input_ids"]) for e in examples)
    width = max(width, pad_to or 0)
    out = {}
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = e["input_ids"]
        labels[i, :n] = e["labels"]
        mask[i, :n] = 1
    out = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for k in examples[0]:
        if k in out:
            continue
        vals = [e[k] for e in examples]
        out[k] = torch.cat(vals)  # each example's tensor carries a leading dim of 1 (or its patch count)
    if s.extra is not None:
        out.update(s.extra(ids, mask, out))
    return out


def to_device(batch: dict, device, dtype, non_blocking: bool = True) -> dict:
    """Floats in the model's dtype; the copy from pinned (or not) host memory."""
    out = {}
    for k, v in batch.items():
        if v.is_floating_point():
            v = v.to(dtype)
        out[k] = v.to(device, non_blocking=non_blocking)
    return out
