"""The LLaVA of train_llava_loop.py trained by `transformers.Trainer`, with vlmdoctor's callback.

As VLM Trainer scripts usually are: the dataset holds raw samples (an image, a question, an answer)
and the collator makes the model's inputs from them (here: ids from the raw token lists, padding,
the labels of the answer). The one vlmdoctor line is `callbacks=[DoctorCallback(...)]`; `--no-doctor`
leaves it out. Needs accelerate, as every Trainer does. CPU by default (`--device cuda` for a GPU).

    python examples/train_llava_trainer.py --steps 30 --out doctor-out
    torchrun --nproc-per-node 2 examples/train_llava_trainer.py --steps 30   # DDP: every rank measures
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import LlavaForConditionalGeneration, Trainer, TrainingArguments

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llava_loop import IMAGE_TOKEN, SIZES, checkpoint, image_tokens, processor  # noqa: E402

from vlmdoctor import DoctorCallback  # noqa: E402


class RawSamples(Dataset):
    """Raw samples: an image and the question's and answer's tokens; the collator builds the inputs."""

    def __init__(self, n: int, size: str = "tiny", seed: int = 0) -> None:
        rng = random.Random(seed)
        (q0, q1), (a0, a1) = SIZES[size][3]
        vocab, side = SIZES[size][1]["vocab_size"], SIZES[size][2]
        self.items = [
            {
                "image": torch.randn(3, side, side),
                "question": [rng.randint(10, vocab - 1) for _ in range(rng.randint(q0, q1))],
                "answer": [rng.randint(10, vocab - 1) for _ in range(rng.randint(a0, a1))],
            }
            for _ in range(n)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return self.items[i]


class Collator:
    """Raw samples -> input_ids (BOS, the image's tokens, question, answer), attention mask, labels, pixels."""

    def __init__(self, size: str = "tiny") -> None:
        self.image = [IMAGE_TOKEN] * image_tokens(size)

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        rows = [[1] + self.image + x["question"] + x["answer"] for x in items]
        labels = [[-100] * (len(r) - len(x["answer"])) + x["answer"] for r, x in zip(rows, items)]
        return processor(rows, labels, [x["image"] for x in items], padding=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--out", default="doctor-out")
    ap.add_argument("--no-doctor", action="store_true", help="train without vlmdoctor's callback")
    ap.add_argument("--tqdm", action="store_true", help="the Trainer's progress bar (off: one line per log)")
    args = ap.parse_args()
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint(args.size))
    model.model.vision_tower.requires_grad_(False)
    torch.manual_seed(0)
    targs = TrainingArguments(
        output_dir=str(Path(args.out) / "hf"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        use_cpu=args.device == "cpu",
        report_to=[],
        save_strategy="no",
        logging_steps=10,
        disable_tqdm=not args.tqdm,
        remove_unused_columns=False,  # the collator reads the raw columns
    )
    doctor = [] if args.no_doctor else [DoctorCallback(out=args.out, warmup=3, steps=5, trace_steps=2, force=True)]
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=RawSamples(16 * args.batch_size, args.size),
        data_collator=Collator(args.size),
        callbacks=doctor,
    )
    trainer.train()


if __name__ == "__main__":
    main()
