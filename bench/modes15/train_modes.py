"""A user's own LoRA / QLoRA / DPO training script for a LLaVA-style VLM, profiled as the torch.profiler
tutorial shows. Nothing here imports vlmdoctor: the traces are the kind of input a user hands it.

    python bench/modes15/train_modes.py --mode lora  --out lora.pt.trace.json.gz
    python bench/modes15/train_modes.py --mode qlora --out qlora.pt.trace.json.gz   # bitsandbytes
    python bench/modes15/train_modes.py --mode dpo   --out dpo.pt.trace.json.gz     # reference = deepcopy
    python bench/modes15/train_modes.py --mode dpo --lora --out dpo_lora.pt.trace.json.gz

The model is LlavaForConditionalGeneration over SigLIP base/16-224 + Qwen2.5-0.5B (random
weights, bench/user_style/train_native.py's configs). LoRA: peft's get_peft_model on the language
model's q,k,v,o,gate,up,down (r=16, alpha=32, dropout 0.05), the projector trains fully, the tower
is frozen. QLoRA: the model is saved once and loaded back with BitsAndBytesConfig(NF4, double
quantization, bf16 compute), as a user loads a checkpoint in 4 bits. DPO: what a first script
does (seed 003's VisualDPOTrainer without its torch.no_grad): ref_model = copy.deepcopy(model),
its forward inside a record_function range named as TRL names the step (compute_ref_log_probs),
or in none (--ref-range "").
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function, schedule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "user_style"))
from train_native import build  # noqa: E402  (the user-style model configs)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model, rank: int, train_projector: bool = True):
    from peft import LoraConfig, get_peft_model

    # adapters on the language model's projections only (the regex keeps the tower's out); under
    # QLoRA the loaded projector held 4-bit weights, which cannot require grad (peft's
    # modules_to_save failed on it on the H100, 2026-11-23), so only the adapters train there
    cfg = LoraConfig(
        r=rank,
        lora_alpha=32,
        lora_dropout=0.05,
        target_modules=r".*language_model.*\.(" + "|".join(TARGETS) + r")$",
        modules_to_save=["multi_modal_projector"] if train_projector else None,
    )
    return get_peft_model(model, cfg)


def logps(model, batch, labels):
    logits = model(**batch).logits[:, :-1].float()
    t = labels[:, 1:]
    lp = torch.log_softmax(logits, -1).gather(2, t.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (lp * (t != -100)).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["lora", "qlora", "dpo"], required=True)
    ap.add_argument("--lora", action="store_true", help="DPO on a LoRA policy (reference: adapters disabled)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--text", type=int, default=256, help="text tokens per row after the image")
    ap.add_argument("--ckpt", action="store_true", help="gradient checkpointing")
    ap.add_argument("--no-grad-ref", action="store_true", help="reference under torch.no_grad(), frozen")
    ap.add_argument("--profile-memory", action="store_true")
    ap.add_argument(
        "--ref-range",
        default="compute_ref_log_probs",
        help="record_function name around the DPO reference forward ('' for none)",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--device", default="cuda", help="cpu only to check the script (bitsandbytes has CPU 4-bit kernels)"
    )
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = a.device
    model, image_id, n_img = build("llava", "sdpa")
    model.to(torch.bfloat16)
    if a.mode == "qlora":
        from transformers import BitsAndBytesConfig, LlavaForConditionalGeneration

        folder = tempfile.mkdtemp(prefix="qlora-ckpt-")
        model.save_pretrained(folder)
        q = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=["vision_tower", "multi_modal_projector", "lm_head"],
        )
        model = LlavaForConditionalGeneration.from_pretrained(
            folder,
            quantization_config=q,
            dtype=torch.bfloat16,
            device_map={"": 0 if dev == "cuda" else "cpu"},
        )
    model.to(dev) if a.mode != "qlora" else None
    model.vision_tower.requires_grad_(False) if hasattr(
        model, "vision_tower"
    ) else model.model.vision_tower.requires_grad_(False)
    if a.ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if a.mode in ("lora", "qlora") or a.lora:
        model = lora(model, a.rank, train_projector=a.mode != "qlora")
    ref = None
    if a.mode == "dpo" and not a.lora:
        ref = copy.deepcopy(model)  # a first script: the copy still requires grad
        if a.no_grad_ref:
            ref.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    B, L = a.batch_size, n_img + a.text

    def batch(rows):
        ids = torch.randint(1000, 100000, (rows, L), device=dev)
        ids[:, 4 : 4 + n_img] = image_id
        labels = ids.clone()
        labels[:, : 4 + n_img + 32] = -100
        pix = torch.randn(rows, 3, 224, 224, device=dev, dtype=torch.bfloat16)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pix}, labels

    def step():
        if a.mode != "dpo":
            inputs, labels = batch(B)
            loss = model(**inputs, labels=labels).loss
        else:
            inputs, labels = batch(2 * B)  # chosen rows, then rejected rows
            pi = logps(model, inputs, labels)
            with record_function(a.ref_range) if a.ref_range else contextlib.nullcontext():
                if a.lora:
                    with model.disable_adapter(), torch.no_grad() if a.no_grad_ref else torch.enable_grad():
                        rl = logps(model, inputs, labels)
                else:
                    with torch.no_grad() if a.no_grad_ref else torch.enable_grad():
                        rl = logps(ref, inputs, labels)
            m = (pi[:B] - rl[:B]) - (pi[B:] - rl[B:])
            loss = -F.logsigmoid(0.1 * m).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        record_shapes=True,
        profile_memory=a.profile_memory,
        schedule=schedule(wait=1, warmup=1, active=2),
        on_trace_ready=lambda p: p.export_chrome_trace(a.out),
    ) as prof:
        for _ in range(4):
            loss = step()
            prof.step()
    sync()
    print(
        json.dumps(
            {
                "mode": a.mode,
                "lora": a.lora,
                "out": a.out,
                "loss": float(loss),
                "wall_s": time.perf_counter() - t0,
                "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None,
            }
        )
    )


if __name__ == "__main__":
    main()
