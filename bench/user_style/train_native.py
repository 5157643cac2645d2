"""A user's own VLM training script, profiled the way the torch.profiler tutorial shows.

Deliberately NOT vlmdoctor's runner: a native transformers VLM class built from a config (random
weights), a plain loop, batches built in the loop (no DataLoader unless --dataloader), AdamW, and
`torch.profiler.profile(schedule=schedule(wait=1, warmup=1, active=N), on_trace_ready=...)` or a
plain `with profile(): ...; prof.export_chrome_trace(...)`. With --trainer the same model and data
go through `transformers.Trainer` instead, profiled from a TrainerCallback the way users do it.
The traces it writes are the kind of input vlmdoctor must read without its own markers. Nothing
here imports vlmdoctor.

    python bench/user_style/train_native.py --model llava --weights fp32 --autocast --ckpt --out t.json.gz
    python bench/user_style/train_native.py --model gemma3 --tiny --device cpu --out /tmp/x.json.gz

Models (public config values, random weights; --llm-layers N cuts the LLM's depth, --tiny shrinks
every width for a CPU smoke test):
  llava       LlavaForConditionalGeneration: SigLIP base/16-224 + Qwen2.5-0.5B, 196 image tokens
  qwen2vl     Qwen2VLForConditionalGeneration: Qwen2-VL-2B, a 224x224 image (64 merged tokens)
  smolvlm     Idefics3ForConditionalGeneration: SmolVLM-256M (SigLIP 512 px + SmolLM2-135M), 64 tokens
  gemma3      Gemma3ForConditionalGeneration: Gemma3-4B (SigLIP so400m/14-896 + Gemma3 text), 256
              tokens; the SigLIP tower keeps SiglipVisionConfig's default `vision_use_head=True`, so
              its attention-pooling head runs and Gemma3 discards its output
  paligemma   PaliGemmaForConditionalGeneration: PaliGemma-3B-pt-224 (SigLIP so400m/14-224 + Gemma
              2B), 256 tokens, token_type_ids marking the answer as the suffix
  qwen2_5_vl  Qwen2_5_VLForConditionalGeneration: Qwen2.5-VL-3B, a 224x224 image (64 merged tokens)
  internvl    InternVLForConditionalGeneration: InternVL3-1B (InternViT-300M-448 + Qwen2.5-0.5B),
              one 448x448 tile, 256 tokens

--attn sets the LLM's attention; the towers stay on sdpa.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile
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
SIGLIP_SO400M = dict(
    model_type="siglip_vision_model",
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    patch_size=14,
)
TINY_LLM = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
TINY_VIT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
MODELS = ["llava", "qwen2vl", "smolvlm", "gemma3", "paligemma", "qwen2_5_vl", "internvl"]


def _llm(cfg: dict, args) -> dict:
    """The LLM's config: public values, its depth cut by --llm-layers, every width cut by --tiny."""
    cfg = dict(cfg)
    if args.llm_layers:
        cfg["num_hidden_layers"] = args.llm_layers
    if args.tiny:
        cfg.update(TINY_LLM)
        if "head_dim" in cfg:
            cfg["head_dim"] = 16
    return cfg


def _vit(cfg: dict, args, **tiny) -> dict:
    return dict(cfg, **TINY_VIT, **tiny) if args.tiny else dict(cfg)


def _llava(T, args):
    cfg = T.LlavaConfig(
        vision_config=_vit(SIGLIP_B16, args),
        text_config=_llm(QWEN25_05B, args),
        image_token_id=151655,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    return cfg, T.LlavaForConditionalGeneration, cfg.image_token_id, (224 // 16) ** 2


def _qwen_vl(T, args, v25: bool):
    if v25:  # Qwen2.5-VL-3B
        text = dict(QWEN25_05B, model_type="qwen2_5_vl_text", hidden_size=2048, intermediate_size=11008)
        text.update(num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000)
        vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048)
        vision.update(window_size=112, fullatt_block_indexes=[7, 15, 23, 31], hidden_act="silu")
    else:  # Qwen2-VL-2B
        text = dict(QWEN25_05B, model_type="qwen2_vl_text", hidden_size=1536, intermediate_size=8960)
        text.update(num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)
        vision = dict(depth=32, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)
    vision.update(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    text = _llm(text, args)
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3] if args.tiny else [16, 24, 24]}
    if args.tiny:
        vision.update(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, embed_dim=64)
        vision["out_hidden_size" if v25 else "hidden_size"] = 64
        vision = {k: v for k, v in vision.items() if v25 or k != "intermediate_size"}
        if v25:
            vision.update(fullatt_block_indexes=[1])
            vision.pop("embed_dim")
    Cfg, Model = (
        (T.Qwen2_5_VLConfig, T.Qwen2_5_VLForConditionalGeneration)
        if v25
        else (T.Qwen2VLConfig, T.Qwen2VLForConditionalGeneration)
    )
    cfg = Cfg(vision_config=vision, text_config=text, image_token_id=151655, vision_start_token_id=151652)
    return cfg, Model, cfg.image_token_id, (224 // 14) ** 2 // 4


def _smolvlm(T, args):
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
    cfg = T.Idefics3Config(
        vision_config=_vit(vision, args), text_config=_llm(text, args), scale_factor=4, image_token_id=49190
    )
    return cfg, T.Idefics3ForConditionalGeneration, cfg.image_token_id, (512 // 16) ** 2 // 16


def _gemma3(T, args):
    text = dict(
        model_type="gemma3_text",
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=262208,
        sliding_window=1024,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )
    # SiglipVisionConfig's default head (what Gemma3Config() builds when no vision_config is given)
    vision = _vit(dict(SIGLIP_SO400M, image_size=896, vision_use_head=True), args, image_size=224)
    n_img = 16 if args.tiny else 256
    cfg = T.Gemma3Config(
        vision_config=vision,
        text_config=_llm(text, args),
        mm_tokens_per_image=n_img,
        image_token_index=262144,
        boi_token_index=255999,
        eoi_token_index=256000,
    )
    return cfg, T.Gemma3ForConditionalGeneration, 262144, n_img


def _paligemma(T, args):
    text = dict(
        model_type="gemma",
        hidden_size=2048,
        intermediate_size=16384,
        num_hidden_layers=18,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=257216,
        hidden_activation="gelu_pytorch_tanh",
    )
    text = _llm(text, args)
    proj = text["hidden_size"]
    vision = _vit(dict(SIGLIP_SO400M, image_size=224, vision_use_head=False, projection_dim=proj), args)
    cfg = T.PaliGemmaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=257152,
        vocab_size=257216,
        projection_dim=proj,
        hidden_size=proj,
    )
    return cfg, T.PaliGemmaForConditionalGeneration, 257152, (224 // 14) ** 2


def _internvl(T, args):
    vision = dict(
        model_type="internvl_vision",
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=[448, 448],
        patch_size=[14, 14],
        layer_scale_init_value=0.1,
        norm_type="layer_norm",
        use_qk_norm=False,
        use_mean_pooling=True,
    )
    side = 224 if args.tiny else 448
    vision = _vit(vision, args, image_size=[side, side])
    n_img = (side // 14) ** 2 // 4
    cfg = T.InternVLConfig(
        vision_config=vision,
        text_config=_llm(QWEN25_05B, args),
        image_token_id=151667,
        image_seq_length=n_img,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    return cfg, T.InternVLForConditionalGeneration, 151667, n_img


def build(args):
    """The model on the current device, sdpa in the towers and --attn in the LLM."""
    import transformers as T

    makers = {
        "llava": _llava,
        "qwen2vl": lambda T, a: _qwen_vl(T, a, v25=False),
        "qwen2_5_vl": lambda T, a: _qwen_vl(T, a, v25=True),
        "smolvlm": _smolvlm,
        "gemma3": _gemma3,
        "paligemma": _paligemma,
        "internvl": _internvl,
    }
    cfg, Model, image_token, n_img = makers[args.model](T, args)
    cfg._attn_implementation = "sdpa"
    cfg.text_config._attn_implementation = args.attn
    return Model(cfg), image_token, n_img


def image_inputs(args, bsz: int, gen: torch.Generator) -> dict:
    """Pixels in each class's own layout."""
    if args.model in ("qwen2vl", "qwen2_5_vl"):
        return {
            "pixel_values": torch.randn(bsz * 256, 3 * 2 * 14 * 14, generator=gen),
            "image_grid_thw": torch.tensor([[1, 16, 16]] * bsz),
        }
    if args.model == "smolvlm":
        return {
            "pixel_values": torch.randn(bsz, 1, 3, 512, 512, generator=gen),
            "pixel_attention_mask": torch.ones(bsz, 1, 512, 512, dtype=torch.bool),
        }
    side = {"gemma3": 896, "internvl": 448}.get(args.model, 224)
    side = 224 if args.tiny else side
    return {"pixel_values": torch.randn(bsz, 3, side, side, generator=gen)}


def make_batch(args, image_token: int, n_img: int, bsz: int, device, dtype, gen: torch.Generator):
    """A VQA-shaped batch: prompt, the image tokens, a question and an answer; right padding."""
    lens = torch.randint(args.min_text, args.max_text, (bsz,), generator=gen)
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
    batch.update(image_inputs(args, bsz, gen))
    if args.model == "gemma3":  # its processor marks the image tokens (bidirectional attention among them)
        batch["token_type_ids"] = (ids == image_token).long()
    elif args.model == "paligemma":  # its processor marks the suffix (the answer) with 1
        batch["token_type_ids"] = (labels != -100).long()
    elif args.model in ("qwen2vl", "qwen2_5_vl"):
        import inspect

        import transformers as T

        if "mm_token_type_ids" in inspect.signature(T.Qwen2VLModel.forward).parameters:  # newer transformers
            batch["mm_token_type_ids"] = (ids == image_token).int()
    out = {}
    for k, v in batch.items():
        v = v.to(device, non_blocking=True)
        out[k] = v.to(dtype) if v.is_floating_point() else v
    return out


SEQ_PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100, "token_type_ids": 0, "mm_token_type_ids": 0}


def collate(examples: list[dict]) -> dict:
    """A user's collator: pad the token rows to the longest, stack or concatenate the pixels."""
    out = {}
    width = max(e["input_ids"].shape[1] for e in examples)
    for k in examples[0]:
        if k in SEQ_PAD:
            rows = [torch.nn.functional.pad(e[k], (0, width - e[k].shape[1]), value=SEQ_PAD[k]) for e in examples]
            out[k] = torch.cat(rows)
        else:
            out[k] = torch.cat([e[k] for e in examples])
    return out


def vision_module(model):
    inner = model.model
    return getattr(inner, "vision_tower", None) or getattr(inner, "visual", None) or inner.vision_model


def projector_module(model):
    inner = model.model
    return getattr(inner, "multi_modal_projector", None) or getattr(inner, "connector", None) or inner.visual.merger


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llava", choices=MODELS)
    ap.add_argument("--tiny", action="store_true", help="shrink every width (a CPU smoke test)")
    ap.add_argument("--llm-layers", type=int, default=0, help="cut the LLM to this many layers (0: public depth)")
    ap.add_argument("--weights", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument(
        "--autocast", action="store_true", help="torch.autocast(bf16) around the forward; with --trainer: bf16=True"
    )
    ap.add_argument("--stage", type=int, default=2, help="1: projector only; 2: projector + LLM")
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing (non-reentrant)")
    ap.add_argument(
        "--liger",
        default="",
        help="comma list for apply_liger_kernel_to_<class>: rope,rms_norm,swiglu,fused_linear_cross_entropy",
    )
    ap.add_argument("--attn", default="sdpa", help="the LLM's attn_implementation")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--min-text", type=int, default=120, help="shortest text row (tokens)")
    ap.add_argument("--max-text", type=int, default=420, help="longest text row (tokens, exclusive)")
    ap.add_argument("--steps", type=int, default=8, help="steps before the profiled ones")
    ap.add_argument("--active", type=int, default=2)
    ap.add_argument(
        "--recipe",
        default="schedule",
        choices=["schedule", "plain", "none"],
        help="schedule: the tutorial's schedule + on_trace_ready; plain: with profile() around steps; "
        "none: no profiler (the script as run under `vlmdoctor run --`, which brings its own)",
    )
    ap.add_argument("--record-shapes", action="store_true")
    ap.add_argument("--profile-memory", action="store_true")
    ap.add_argument("--with-stack", action="store_true")
    ap.add_argument("--with-modules", action="store_true")
    ap.add_argument("--dataloader", action="store_true", help="batches through a DataLoader")
    ap.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        help="DataLoader worker processes (0: built in the loop's process); with --trainer: dataloader_num_workers",
    )
    ap.add_argument("--trainer", action="store_true", help="train through transformers.Trainer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True, help="trace file (.json or .json.gz)")
    return ap.parse_args()


def prepare(args, device, dtype):
    """Build, cast, patch and freeze the model as a user's script would."""
    with device:  # random init on the device: a user's from_pretrained(device_map=...) lands there too
        model, image_token, n_img = build(args)
    model.to(device=device, dtype=dtype)
    if args.liger:
        import liger_kernel.transformers as L

        flags = {k: True for k in args.liger.split(",")}
        name = {"qwen2vl": "qwen2_vl", "llava": "llava", "smolvlm": "smolvlm"}.get(args.model, args.model)
        fn = getattr(L, f"apply_liger_kernel_to_{name}")
        fn(model=model, **{"fused_linear_cross_entropy": False, **flags})
    for p in vision_module(model).parameters():
        p.requires_grad_(False)
    if args.stage == 1:
        for p in model.parameters():
            p.requires_grad_(False)
        for p in projector_module(model).parameters():
            p.requires_grad_(True)
    if args.ckpt and not args.trainer:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    return model, image_token, n_img


def profiler_options(args, device) -> dict:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return dict(
        activities=acts,
        record_shapes=args.record_shapes,
        profile_memory=args.profile_memory,
        with_stack=args.with_stack,
        with_modules=args.with_modules,
    )


def run_loop(args, model, image_token, n_img, device, dtype) -> dict:
    """The plain loop: warm steps timed, then the profiled ones."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator().manual_seed(0)

    if args.dataloader:

        class DS(torch.utils.data.Dataset):
            def __len__(self):
                return 10_000

            def __getitem__(self, i):
                g = torch.Generator().manual_seed(i)
                return make_batch(args, image_token, n_img, args.batch_size, "cpu", dtype, g)

        loader = iter(
            torch.utils.data.DataLoader(DS(), batch_size=None, num_workers=args.loader_workers, pin_memory=True)
        )
        next_batch = lambda: {k: v.to(device, non_blocking=True) for k, v in next(loader).items()}  # noqa: E731
    else:
        next_batch = lambda: make_batch(args, image_token, n_img, args.batch_size, device, dtype, gen)  # noqa

    def train_step() -> float:
        batch = next_batch()
        ctx = torch.autocast(device.type, dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        with ctx:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return batch["attention_mask"].sum().item()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens, t0 = 0, None
    for i in range(args.steps):
        if i == 2:
            sync()
            t0 = time.perf_counter()
        n = train_step()
        if i >= 2:
            tokens += n
    sync()
    dt = time.perf_counter() - t0
    opts = profiler_options(args, device)
    if args.recipe == "none":
        for _ in range(2 + args.active):
            train_step()
    elif args.recipe == "schedule":

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
    return {"tokens_per_s": round(tokens / dt, 1), "s_per_step": round(dt / (args.steps - 2), 4)}


def run_trainer(args, model, image_token, n_img, device, dtype) -> dict:
    """The same model and data through transformers.Trainer, profiled from a TrainerCallback."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Examples(torch.utils.data.Dataset):
        def __len__(self):
            return 10_000

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            return make_batch(args, image_token, n_img, 1, "cpu", dtype, g)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    opts = profiler_options(args, device)
    timing = {}

    class ProfilerCallback(TrainerCallback):
        """Start torch.profiler after the warm steps; step it at each step's end."""

        prof = None

        def on_step_begin(self, targs, state, control, **kw):
            if state.global_step == 2:
                sync()
                timing["t0"] = time.perf_counter()
            if state.global_step == args.steps and self.prof is None:
                sync()
                timing["t1"] = time.perf_counter()
                self.prof = profile(
                    schedule=schedule(wait=1, warmup=1, active=args.active, repeat=1),
                    on_trace_ready=lambda p: p.export_chrome_trace(args.out),
                    **opts,
                )
                self.prof.start()

        def on_step_end(self, targs, state, control, **kw):
            if self.prof is not None:
                self.prof.step()

        def on_train_end(self, targs, state, control, **kw):
            if self.prof is not None:
                self.prof.stop()

    outdir = tempfile.mkdtemp(prefix="trainer_")
    targs = TrainingArguments(
        output_dir=outdir,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps + 2 + args.active,
        learning_rate=1e-5,
        bf16=args.autocast,
        gradient_checkpointing=args.ckpt,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.ckpt else None,
        dataloader_num_workers=args.loader_workers,
        remove_unused_columns=False,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=Examples(), data_collator=collate, callbacks=[ProfilerCallback()]
    )
    trainer.train()
    dt = timing["t1"] - timing["t0"]
    return {"s_per_step": round(dt / (args.steps - 2), 4), "trainer_optim": str(targs.optim)}


def main() -> None:
    args = parse_args()
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (steps 3.. are timed)")
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.weights == "bf16" else torch.float32
    t_start = time.perf_counter()
    model, image_token, n_img = prepare(args, device, dtype)
    t_built = time.perf_counter() - t_start
    run = run_trainer if args.trainer else run_loop
    measured = run(args, model, image_token, n_img, device, dtype)
    cuda = device.type == "cuda"
    print(
        json.dumps(
            {
                "out": args.out,
                **measured,
                "build_s": round(t_built, 1),
                "run_s": round(time.perf_counter() - t_start, 1),
                "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
                "peak_reserved_gb": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
                "device_mem_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2) if cuda else None,
                "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
                "command": shlex.join(["python", *sys.argv]),
                "args": vars(args),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "transformers": __import__("transformers").__version__,
                "n_params": sum(p.numel() for p in model.parameters()),
                "size_bytes": os.path.getsize(args.out) if os.path.exists(args.out) else None,
            }
        )
    )


if __name__ == "__main__":
    main()
