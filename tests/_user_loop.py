"""A user's training loop in miniature, for the tests of what vlmdoctor must never do to it
(tests/test_user_process.py): a tiny model with named parts, its loss in its output, seeded batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Tiny(nn.Module):
    """Named parts (so that vlmdoctor's part marks hook in), input_ids in, a loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.llm = nn.Embedding(50, 8)
        self.projector = nn.Linear(8, 8)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict[str, Any]:
        return {"loss": self.projector(self.llm(input_ids)).pow(2).mean()}


def batch(i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(1, 50, (4, 6), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


Hook = Callable[..., Any]


def loop(n: int, each: Hook | None = None, before: Hook | None = None, setup: Hook | None = None) -> list[float]:
    """n optimizer steps of a seeded model; `setup(model)` once, `before(i)` and `each(i, model, batch)` per step.
    Returns the losses: the loop's own results, to compare with a run without vlmdoctor."""
    torch.manual_seed(0)
    model = Tiny()
    if setup is not None:
        setup(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(n):
        if before is not None:
            before(i)
        b = batch(i)
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if each is not None:
            each(i, model, b)
    return losses
