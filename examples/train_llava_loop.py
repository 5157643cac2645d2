"""A user-style VLM training script: a LLaVA (SigLIP tower + Qwen2 LLM) in a plain loop.

What somebody's own training looks like: `from_pretrained` on a checkpoint, a Dataset of tokenized
samples, a DataLoader with a padding collator, AdamW, `loss.backward()`. The checkpoint is made
locally with random weights (no downloads): `--size tiny` (hidden size 64, 2 layers: CPU, seconds)
or `--size 0.5b` (SigLIP base/16-224 + Qwen2.5-0.5B, their public config values: one GPU).

    python examples/train_llava_loop.py --steps 30                       # no vlmdoctor inside
    vlmdoctor run -- python examples/train_llava_loop.py --steps 30      # doctored, unchanged
    python examples/train_llava_loop.py --steps 30 --api                 # vlmdoctor.Doctor in the loop

The docs and tests use it as "somebody's own training"; the tests also paste vlmdoctor's fixes
into it and run it (tests/test_advice_pasted.py).
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import LlavaConfig, LlavaForConditionalGeneration, Qwen2Config, SiglipVisionConfig

IMAGE_TOKEN = 3
PAD = 0
#: the model sizes: (vision config, text config, image side, text lengths (question, answer))
SIZES = {
    "tiny": (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, patch_size=8),
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=512,
        ),
        32,
        ((8, 40), (4, 24)),
    ),
    "0.5b": (  # SigLIP base/16-224 and Qwen2.5-0.5B, their public config values
        dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, patch_size=16),
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        224,
        ((40, 200), (20, 120)),
    ),
}


def build_model(hidden: int = 64, layers: int = 2, size: str = "tiny") -> LlavaForConditionalGeneration:
    """The model from its config, random weights (`hidden`, `layers`: the tiny one's width and depth)."""
    vision, text, side, _ = SIZES[size]
    if size == "tiny":
        vision = vision | dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
        text = text | dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers)
    cfg = LlavaConfig(
        vision_config=SiglipVisionConfig(image_size=side, **vision),
        text_config=Qwen2Config(pad_token_id=PAD, max_position_embeddings=4096, **text),
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        pad_token_id=PAD,
    )
    return LlavaForConditionalGeneration(cfg)


def checkpoint(size: str = "tiny") -> str:
    """A local checkpoint folder of the model (random weights, bf16 for 0.5b), made once and reused."""
    folder = Path(os.environ.get("VLMDOCTOR_EXAMPLES_CACHE", Path(tempfile.gettempdir()) / "vlmdoctor-examples"))
    path = folder / f"llava-{size}"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = build_model(size=size)
        if size != "tiny":
            model = model.to(torch.bfloat16)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=folder))
        model.save_pretrained(tmp)
        try:
            tmp.rename(path)  # whole or not at all
        except OSError:  # another process made it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def image_tokens(size: str = "tiny") -> int:
    vision, _, side, _ = SIZES[size]
    return (side // vision["patch_size"]) ** 2


def sample(rng: random.Random, size: str = "tiny") -> dict[str, list[int]]:
    """One chat-like sample: the image's tokens, a question, an answer (only the answer is learned)."""
    (q0, q1), (a0, a1) = SIZES[size][3]
    vocab = SIZES[size][1]["vocab_size"]
    q, a = rng.randint(q0, q1), rng.randint(a0, a1)
    ids = [1] + [IMAGE_TOKEN] * image_tokens(size) + [rng.randint(10, vocab - 1) for _ in range(q + a)]
    return {"input_ids": ids, "labels": [-100] * (len(ids) - a) + ids[len(ids) - a :]}


class Samples(Dataset):
    """Tokenized samples with their image (random pixels)."""

    def __init__(self, n: int, size: str = "tiny", seed: int = 0) -> None:
        rng = random.Random(seed)
        side = SIZES[size][2]
        self.items = [sample(rng, size) | {"pixel_values": torch.randn(3, side, side)} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


def processor(
    input_ids: list[list[int]],
    labels: list[list[int]],
    images: list[torch.Tensor],
    padding: bool = True,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """The model's inputs, as a transformers processor returns them: rows right-padded to the longest (or
    to a multiple of `pad_to_multiple_of`), the attention mask, the labels, the images' pixels."""
    n = max(len(r) for r in input_ids)
    if pad_to_multiple_of:
        n = -(-n // pad_to_multiple_of) * pad_to_multiple_of

    def pad(row: list[int], value: int) -> list[int]:
        return list(row) + [value] * (n - len(row))

    return {
        "input_ids": torch.tensor([pad(r, PAD) for r in input_ids]),
        "attention_mask": torch.tensor([pad([1] * len(r), 0) for r in input_ids]),
        "labels": torch.tensor([pad(r, -100) for r in labels]),
        "pixel_values": torch.stack(images),
    }


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """A batch of tokenized samples, padded by the processor."""
    ids, labels = [x["input_ids"] for x in items], [x["labels"] for x in items]
    return processor(ids, labels, [x["pixel_values"] for x in items], padding=True)


def batches(batch_size: int, seed: int = 0, size: str = "tiny"):
    """Endless padded batches of fresh samples (for tests that drive a model by hand)."""
    rng = random.Random(seed)
    side = SIZES[size][2]
    while True:
        items = [sample(rng, size) | {"pixel_values": torch.randn(3, side, side)} for _ in range(batch_size)]
        yield collate(items)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2), help="1: projector only; 2: LLM + projector")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--api", action="store_true", help="measure with vlmdoctor.Doctor inside the loop")
    ap.add_argument("--out", default="doctor-out", help="with --api: where the report goes")
    ap.add_argument("--fail-at", type=int, default=None, help="raise an error at this step (to test failure handling)")
    args = ap.parse_args()

    model = LlavaForConditionalGeneration.from_pretrained(checkpoint(args.size))
    model.to(args.device)
    torch.manual_seed(0)
    model.model.vision_tower.requires_grad_(False)
    if args.stage == 1:
        model.model.language_model.requires_grad_(False)
        model.lm_head.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    ds = Samples(16 * args.batch_size, args.size)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, collate_fn=collate)

    doc = None
    if args.api:
        import vlmdoctor

        doc = vlmdoctor.Doctor(model, out=args.out, warmup=3, steps=5, trace_steps=2, stage=args.stage, force=True)
        doc.__enter__()
    model.train()
    for step, batch in zip(range(args.steps), itertools.chain.from_iterable(itertools.repeat(loader))):
        if args.fail_at is not None and step == args.fail_at:
            raise RuntimeError(f"the training script failed on purpose at step {step}")
        batch = {k: v.to(args.device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if doc is not None:
            doc.step(batch)
        if step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    print("training done", flush=True)
    if doc is not None:
        doc.__exit__(None, None, None)


if __name__ == "__main__":
    main()
