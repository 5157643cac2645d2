"""A user-style VLM training script: a tiny Qwen2-VL (`Qwen2VLForConditionalGeneration`), a plain loop.

Random weights from a config and synthetic batches (an 8x8-patch image, 16 tokens after the 2x2
merge, and text of varying length, right-padded), so it runs anywhere without downloads. The tests
run it under `vlmdoctor run -- python examples/train_qwen2vl_loop.py`.
"""

from __future__ import annotations

import argparse
import inspect

import torch
from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLModel

IMAGE, VISION_START, VISION_END, PAD = 3, 5, 6, 0


def build_model() -> Qwen2VLForConditionalGeneration:
    cfg = Qwen2VLConfig(
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        text_config=dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=512,
            max_position_embeddings=512,
            pad_token_id=PAD,
            bos_token_id=1,
            eos_token_id=2,
            rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
        ),
        image_token_id=IMAGE,
        video_token_id=4,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Qwen2VLForConditionalGeneration(cfg)


def batch(i: int, b: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    rows, labels = [], []
    for _ in range(b):
        n = int(torch.randint(6, 30, (1,), generator=g))
        text = torch.randint(10, 500, (n,), generator=g).tolist()
        rows.append([1, VISION_START] + [IMAGE] * 16 + [VISION_END] + text)
        labels.append([-100] * 19 + text)
    n = max(map(len, rows))
    ids = torch.tensor([r + [PAD] * (n - len(r)) for r in rows])
    out = {
        "input_ids": ids,
        "attention_mask": (ids != PAD).long(),
        "labels": torch.tensor([r + [-100] * (n - len(r)) for r in labels]),
        "pixel_values": torch.randn(b * 64, 3 * 2 * 4 * 4, generator=g),
        "image_grid_thw": torch.tensor([[1, 8, 8]] * b),
    }
    if "mm_token_type_ids" in inspect.signature(Qwen2VLModel.forward).parameters:  # newer transformers ask for it
        out["mm_token_type_ids"] = (ids == IMAGE).long()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model().to(args.device)
    model.model.visual.requires_grad_(False)
    model.model.visual.merger.requires_grad_(True)  # the projector trains; the tower stays frozen
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model.train()
    for step in range(args.steps):
        b = {k: v.to(args.device) for k, v in batch(step).items()}
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    print("training done", flush=True)


if __name__ == "__main__":
    main()
