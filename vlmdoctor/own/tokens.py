"""The tokens of the step under way: counted from the batch the user passes, or read from the model's inputs by a
forward pre-hook, and the loss from its output; handed to the step clock when the step ends.

Counts stay on the device so that counting never synchronizes; `.item()` happens once, at the window's end.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import torch

IGNORE_INDEX = -100


def get(batch: Any, key: str) -> Any:
    """A batch's field, whether the batch is a mapping or an object with attributes (a model's output too)."""
    if isinstance(batch, Mapping):
        return batch.get(key)
    return getattr(batch, key, None)


def count_tokens(batch: Any, pad_id: int | None = None) -> dict[str, Any] | None:
    """Real, loss and padded token counts of one micro-batch, as (possibly device) tensors.

    Counts stay on the device so that counting never synchronizes; `.item()` happens once, at the
    window's end. Real tokens: the attention mask's sum, else input_ids that are not padding.
    """
    ids, mask, labels = get(batch, "input_ids"), get(batch, "attention_mask"), get(batch, "labels")
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.dim() == 0):
        ids = None  # features, not token ids
    if isinstance(mask, torch.Tensor) and mask.dim() != 2:
        mask = None  # not one row of flags per sample (a 4-D attention bias, a scalar): tokens from the ids
    if not isinstance(ids, torch.Tensor) and not isinstance(mask, torch.Tensor):
        return None
    if isinstance(mask, torch.Tensor):
        lengths = mask.sum(1)
        padded, rows = mask.numel(), mask.shape[0]
    elif pad_id is not None and ids.dim() == 2:
        lengths = (ids != pad_id).sum(1)
        padded, rows = ids.numel(), ids.shape[0]
    else:
        lengths = torch.tensor([ids.shape[-1]] * (ids.shape[0] if ids.dim() > 1 else 1))
        padded, rows = ids.numel(), len(lengths)
    loss = (labels != IGNORE_INDEX).sum() if isinstance(labels, torch.Tensor) else None
    return {"real": lengths.sum(), "loss": loss, "padded": padded, "rows": rows, "lengths": lengths}


def guess_sampler(batches: Sequence[Sequence[int]]) -> str | None:
    """'length_bucketed' when samples of similar length share batches, 'random' when not; None: too little data.

    Random batches keep about (B-1)/B of the lengths' variance inside each batch; bucketed ones
    keep little of it. Read from the real lengths of the rows the model saw.
    """
    rows = [list(b) for b in batches if len(b) > 1]
    flat = [x for b in rows for x in b]
    if len(rows) < 2 or len(flat) < 8:
        return None
    total = statistics.pvariance(flat)
    if total == 0:
        return None
    within = sum(statistics.pvariance(b) * len(b) for b in rows) / len(flat)
    return "length_bucketed" if within / total < 0.4 else "random"


class TokenCounter:
    """The micro-batches of the step under way: their token counts and last loss, and the forwards that ran under
    no_grad (not training: counted apart, their tokens not)."""

    def __init__(self, pad_id: int | None) -> None:
        self.pad_id = pad_id
        self.pending: list[dict[str, Any]] = []  # micro-batch counts since the last step
        self.losses: list[torch.Tensor] = []
        self.nograd = 0  # forwards under no_grad since the last step
        self.batch_seen = False  # the user passed a batch to step(): its counts replace the hook's

    def on_forward(self, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook, on a training forward: the tokens of its inputs."""
        if not torch.is_grad_enabled():  # a forward that reaches no backward (a stray evaluation): not training
            self.nograd += 1
            return
        batch = dict(kwargs)
        if "input_ids" not in batch and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            batch["input_ids"] = args[0]
        c = count_tokens(batch, self.pad_id)
        if c is not None:
            c["from"] = "hook"
            self.pending.append(c)

    def on_output(self, output: Any) -> None:
        """The model's forward hook, on a training forward: the loss it returned."""
        loss = get(output, "loss")
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self.losses.append(loss.detach())

    def take(self, batch: Any, loss: Any) -> tuple[list[dict[str, Any]], list[torch.Tensor], int]:
        """The step ended: its counts (the batch passed, else what the hook saw), losses and no-grad forwards;
        the counter starts the next step empty."""
        counts = self.pending
        if batch is not None:
            c = count_tokens(batch, self.pad_id)
            if c is not None:  # the batch the user passed replaces what the hook saw
                counts = [c]
                self.batch_seen = True
        losses = [loss.detach()] if isinstance(loss, torch.Tensor) else self.losses
        nograd, self.nograd = self.nograd, 0
        self.clear()
        return counts, losses, nograd

    def clear(self) -> None:
        """The counts and losses not yet handed over are dropped (the hooks are gone)."""
        self.pending, self.losses = [], []
