"""The same tiny LLaVA as train_llava_loop.py, trained by `transformers.Trainer` with vlmdoctor's callback.

The one vlmdoctor line is `callbacks=[DoctorCallback(...)]`. CPU by default; needs accelerate
(as every Trainer does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llava_loop import batches, build_model  # noqa: E402

from vlmdoctor import DoctorCallback  # noqa: E402


class Samples(torch.utils.data.Dataset):
    """Single samples cut from the loop example's synthetic batches."""

    def __init__(self, n: int) -> None:
        it = batches(1)
        self.items = [{k: v[0] for k, v in next(it).items()} for _ in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample of the batch."""
    n = max(len(x["input_ids"]) for x in items)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((n - len(t),), value, dtype=t.dtype)])

    return {
        "input_ids": torch.stack([pad(x["input_ids"], 0) for x in items]),
        "attention_mask": torch.stack([pad(x["attention_mask"], 0) for x in items]),
        "labels": torch.stack([pad(x["labels"], -100) for x in items]),
        "pixel_values": torch.stack([x["pixel_values"] for x in items]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="doctor-out")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = build_model()
    model.model.vision_tower.requires_grad_(False)
    targs = TrainingArguments(
        output_dir="hf-out",
        max_steps=args.steps,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Samples(256),
        data_collator=collate,
        callbacks=[DoctorCallback(out=args.out, warmup=3, steps=5, trace_steps=2)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
