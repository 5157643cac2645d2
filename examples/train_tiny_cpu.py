"""A user's own training script at its smallest: a tiny token model, a plain loop, CPU, seconds.

What a CI job gates with `vlmdoctor run` + `vlmdoctor gate --remeasure-baseline` (docs/ci.md), and
what the tests run: once unchanged on both sides (the gate must pass) and once with `--eval-forward 3`,
which adds three forwards under `torch.no_grad()` to every step (a stray evaluation: about twice the step
time; it must fail, though the tokens the model sees per step are four times as many: vlmdoctor counts the
tokens of the training forward only).
`--work 2` runs the model's block twice per step on the same tokens: the block holds about 97% of the
model's multiply-adds, so it nearly doubles the step.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


class TinyLM(nn.Module):
    """Embedding, one MLP block applied `work` times, a small head: the block holds nearly all the FLOPs."""

    def __init__(self, vocab: int = 64, dim: int = 256, work: int = 1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.work = work

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        for _ in range(self.work):
            h = h + self.block(h)
        logits = self.head(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--work", type=int, default=1, help="times the block runs per step (2: twice the work)")
    p.add_argument("--eval-forward", type=int, default=0, help="no-grad forwards in every step (a stray evaluation)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = TinyLM(work=args.work)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for _ in range(args.steps):
        ids = torch.randint(0, 64, (args.batch, args.seq))
        loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for _ in range(args.eval_forward):
            with torch.no_grad():
                model(input_ids=ids, labels=ids)
    print(f"done: loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
