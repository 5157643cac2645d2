"""A user-style VLM training script: a tiny LLaVA (SigLIP tower + Qwen2 LLM), a plain loop.

Random weights built from a config and synthetic batches, so it runs anywhere (CPU by default)
without downloads. The docs and tests use it as "somebody's own training" for
`vlmdoctor run -- python examples/train_llava_loop.py`, and `--api` shows the in-code way in.
"""

from __future__ import annotations

import argparse
import random

import torch
from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig

IMAGE_TOKEN = 3
PAD = 0


def build_model(hidden: int = 64, layers: int = 2) -> LlavaForConditionalGeneration:
    vision = SiglipVisionConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        image_size=32,
        patch_size=8,
    )
    text = Qwen2Config(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=512,
        pad_token_id=PAD,
        max_position_embeddings=512,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        pad_token_id=PAD,
    )
    return LlavaForConditionalGeneration(cfg)


def batches(batch_size: int, seed: int = 0, image_tokens: int = 16):
    """Chat-like samples of varying length, right-padded: image tokens, a question, an answer."""
    rng = random.Random(seed)
    while True:
        rows, labels = [], []
        for _ in range(batch_size):
            q, a = rng.randint(8, 40), rng.randint(4, 24)
            ids = [1] + [IMAGE_TOKEN] * image_tokens + [rng.randint(10, 511) for _ in range(q + a)]
            rows.append(ids)
            labels.append([-100] * (1 + image_tokens + q) + ids[1 + image_tokens + q :])
        n = max(len(r) for r in rows)
        input_ids = torch.tensor([r + [PAD] * (n - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (n - len(r)) for r in labels])
        mask = torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])
        yield {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": lab,
            "pixel_values": torch.randn(batch_size, 3, 32, 32),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2), help="1: projector only; 2: LLM + projector")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--api", action="store_true", help="measure with vlmdoctor.Doctor inside the loop")
    ap.add_argument("--out", default="doctor-out", help="with --api: where the report goes")
    ap.add_argument("--fail-at", type=int, default=None, help="raise an error at this step (to test failure handling)")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build_model().to(args.device)
    model.model.vision_tower.requires_grad_(False)
    if args.stage == 1:
        model.model.language_model.requires_grad_(False)
        model.lm_head.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    data = batches(args.batch_size)

    doc = None
    if args.api:
        import vlmdoctor

        doc = vlmdoctor.Doctor(model, out=args.out, warmup=3, steps=5, trace_steps=2, stage=args.stage)
        doc.__enter__()
    model.train()
    for step in range(args.steps):
        if args.fail_at is not None and step == args.fail_at:
            raise RuntimeError(f"the training script failed on purpose at step {step}")
        batch = {k: v.to(args.device) for k, v in next(data).items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if doc is not None:
            doc.step(batch)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if doc is not None:
        doc.__exit__(None, None, None)
    print("training done", flush=True)


if __name__ == "__main__":
    main()
