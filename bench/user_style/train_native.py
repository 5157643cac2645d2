"""A user's own VLM training script, profiled the way the torch.profiler tutorial shows.

Deliberately NOT vlmdoctor's runner: a native transformers VLM class built from a config (random
weights), a plain loop, batches built in the loop (no DataLoader unless --dataloader), AdamW, and
`torch.profiler.profile(schedule=schedule(wait=1, warmup=1, active=N), on_trace_ready=...)` or a
plain `with profile(): ...; prof.export_chrome_trace(...)`. The traces it writes are the kind of
input vlmdoctor must read without its own markers. Nothing here imports vlmdoctor.

    python bench/user_style/train_native.py --model llava --weights fp32 --autocast --ckpt --out t.json.gz

Models (public config values, random weights):
  llava    LlavaForConditionalGeneration: SigLIP base/16-224 + Qwen2.5-0.5B, 196 image tokens
  qwen2vl  Qwen2VLForConditionalGeneration: Qwen2-VL-2B, a 224x224 image (64 merged tokens)
  smolvlm  Idefics3ForConditionalGeneration: SmolVLM-256M (SigLIP 512 px + SmolLM2-135M), 64 tokens
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule

QWEN25_05B = dict(
    model_type="qwen2",
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
)
SIGLIP_B16 = dict(
    model_type="siglip_vision_model",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=224,
    patch_size=16,
)


def build(name: str, attn: str):
    import transformers as T

    if name == "llava":
        cfg = T.LlavaConfig(
            vision_config=SIGLIP_B16,
            text_config=QWEN25_05B,
            image_token_id=151655,
            vision_feature_select_strategy="full",
            vision_feature_layer=-1,
        )
        cfg._attn_implementation = attn
        model = T.LlavaForConditionalGeneration(cfg)
        return model, cfg.image_token_id, (224 // 16) ** 2
    if name == "qwen2vl":
        text = dict(
            QWEN25_05B,
            model_type="qwen2_vl_text",
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        )
        vision = dict(
            depth=32,
            embed_dim=1280,
            hidden_size=1536,
            num_heads=16,
            mlp_ratio=4,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        )
        cfg = T.Qwen2VLConfig(
            vision_config=vision, text_config=text, image_token_id=151655, vision_start_token_id=151652
        )
        cfg._attn_implementation = attn
        model = T.Qwen2VLForConditionalGeneration(cfg)
        return model, cfg.image_token_id, (224 // 14) ** 2 // 4
    if name == "smolvlm":
        vision = dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            image_size=512,
            patch_size=16,
        )
        text = dict(
            model_type="llama",
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49280,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
        cfg = T.Idefics3Config(vision_config=vision, text_config=text, scale_factor=4, image_token_id=49190)
        cfg._attn_implementation = attn
        model = T.Idefics3ForConditionalGeneration(cfg)
        return model, cfg.image_token_id, (512 // 16) ** 2 // 16
    raise SystemExit(f"unknown model {name}")


def make_batch(name: str, image_token: int, n_img: int, bsz: int, device, dtype, gen: torch.Generator):
    """A VQA-shaped batch: prompt, the image tokens, a question and an answer; right padding."""
    lens = torch.randint(120, 420, (bsz,), generator=gen)
    total = int(lens.max()) + n_img
    ids = torch.zeros(bsz, total, dtype=torch.long)
    mask = torch.zeros(bsz, total, dtype=torch.long)
    labels = torch.full((bsz, total), -100, dtype=torch.long)
    for i, n in enumerate(lens.tolist()):
        text = torch.randint(1000, 30000, (n,), generator=gen)
        row = torch.cat([text[:8], torch.full((n_img,), image_token), text[8:]])
        ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
        answer = n // 2
        labels[i, len(row) - answer : len(row)] = row[len(row) - answer :]
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name == "llava":
        batch["pixel_values"] = torch.randn(bsz, 3, 224, 224, generator=gen)
    elif name == "qwen2vl":
        grid = torch.tensor([[1, 16, 16]] * bsz)
        batch["pixel_values"] = torch.randn(bsz * 256, 3 * 2 * 14 * 14, generator=gen)
        batch["image_grid_thw"] = grid
        import inspect

        import transformers as T

        if "mm_token_type_ids" in inspect.signature(T.Qwen2VLModel.forward).parameters:  # newer transformers
            batch["mm_token_type_ids"] = (ids == image_token).int()
    else:
        batch["pixel_values"] = torch.randn(bsz, 1, 3, 512, 512, generator=gen)
        batch["pixel_attention_mask"] = torch.ones(bsz, 1, 512, 512, dtype=torch.bool)
    out = {}
    for k, v in batch.items():
        v = v.to(device, non_blocking=True)
        out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


def vision_module(model):
    inner = model.model
    return getattr(inner, "vision_tower", None) or getattr(inner, "visual", None) or inner.vision_model


def projector_module(model):
    inner = model.model
    return getattr(inner, "multi_modal_projector", None) or getattr(inner, "connector", None) or inner.visual.merger


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llava", choices=["llava", "qwen2vl", "smolvlm"])
    ap.add_argument("--weights", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--autocast", action="store_true", help="torch.autocast(bf16) around the forward")
    ap.add_argument("--stage", type=int, default=2, help="1: projector only; 2: projector + LLM")
    ap.add_argument("--ckpt", action="store_true", help="model.gradient_checkpointing_enable()")
    ap.add_argument(
        "--liger",
        default="",
        help="comma list for apply_liger_kernel_to_<class>: rope,rms_norm,swiglu,fused_linear_cross_entropy",
    )
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8, help="steps before the profiled ones")
    ap.add_argument("--active", type=int, default=2)
    ap.add_argument(
        "--recipe",
        default="schedule",
        choices=["schedule", "plain"],
        help="schedule: the tutorial's schedule + on_trace_ready; plain: with profile() around steps",
    )
    ap.add_argument("--record-shapes", action="store_true")
    ap.add_argument("--profile-memory", action="store_true")
    ap.add_argument("--with-stack", action="store_true")
    ap.add_argument("--with-modules", action="store_true")
    ap.add_argument("--dataloader", action="store_true", help="batches through a DataLoader")
    ap.add_argument(
        "--loader-workers", type=int, default=2, help="its worker processes (0: built in the loop's process)"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True, help="trace file (.json or .json.gz)")
    args = ap.parse_args()

    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    with device:  # random init on the device: a user's from_pretrained(device_map=...) lands there too
        model, image_token, n_img = build(args.model, args.attn)
    model.to(device=device, dtype=dtype)
    if args.liger:
        import liger_kernel.transformers as L

        flags = {k: True for k in args.liger.split(",")}
        fn = {
            "llava": L.apply_liger_kernel_to_llava,
            "qwen2vl": L.apply_liger_kernel_to_qwen2_vl,
            "smolvlm": L.apply_liger_kernel_to_smolvlm,
        }[args.model]
        fn(model=model, **{"fused_linear_cross_entropy": False, **flags})
    for p in vision_module(model).parameters():
        p.requires_grad_(False)
    if args.stage == 1:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in projector_module(model).parameters():
            p.requires_grad_(True)
    if args.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(0)

    if args.dataloader:

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 10_000

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return make_batch(args.model, image_token, n_img, args.batch_size, "cpu", dtype, g)

        loader = iter(
            torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=args.loader_workers, pin_memory=True)
        )
        next_batch = lambda: {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}  # noqa: E731
    else:
        next_batch = lambda: make_batch(args.model, image_token, n_img, args.batch_size, device, dtype, gen)  # noqa

    def train_step() -> float:
        batch = next_batch()
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        with ctx:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch["attention_mask"].sum().item()

    tokens, t0 = 0, None
    for i in range(args.steps):
        if i == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        n = train_step()
        if i >= 2:
            tokens += n
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    tps = tokens / (time.perf_counter() - t0)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    opts = dict(
        activities=acts,
        record_shapes=args.record_shapes,
        profile_memory=args.profile_memory,
        with_stack=args.with_stack,
        with_modules=args.with_modules,
    )
    if args.recipe == "schedule":

        def on_ready(p):
            p.export_chrome_trace(args.out)

        with profile(schedule=schedule(wait=1, warmup=1, active=args.active), on_trace_ready=on_ready, **opts) as prof:
            for _ in range(2 + args.active):
                train_step()
                prof.step()
    else:
        with profile(**opts) as prof:
            for _ in range(args.active):
                train_step()
        prof.export_chrome_trace(args.out)
    print(
        json.dumps(
            {
                "out": args.out,
                "tokens_per_s": round(tps, 1),
                "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
                "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2)
                if device.type == "cuda"
                else None,
                "device_mem_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2)
                if device.type == "cuda"
                else None,
                "args": vars(args),
                "torch": torch.__version__,
                "transformers": __import__("transformers").__version__,
                "size_bytes": os.path.getsize(args.out),
            }
        )
    )


if __name__ == "__main__":
    main()
