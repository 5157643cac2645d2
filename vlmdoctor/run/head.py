"""The LM head and its loss on the labeled positions, shared by the composite model (run/model.py) and the
native transformers classes (run/native.py): one module below both, so neither imports the other for it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def labeled_head_loss(
    owner: nn.Module, hidden: torch.Tensor, loss_index: torch.Tensor, loss_targets: torch.Tensor, head: nn.Module
) -> Any:
    """The LM head and the loss on the rows of `loss_index` (flat over batch x (length - 1)), for the composite
    model and the native classes alike: Liger's FusedCE when `owner.fused_ce`, else `owner.head_loss` (which
    regional compilation swaps for a compiled copy)."""
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, loss_index)
    if owner.fused_ce:
        if owner._fused_loss is None:  # built once, not on every step
            # deferred: liger is an optional extra (and pulls triton), imported only when FusedCE is on
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # deferred: liger, an optional extra

            owner._fused_loss = LigerFusedLinearCrossEntropyLoss()
        loss = owner._fused_loss(head.weight, h, loss_targets, head.bias)
    else:
        loss = owner.head_loss(h, head.weight, head.bias, loss_targets)
    return LossOutput(loss)


def head_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    """The LM head and the cross entropy over the labeled positions, as one function.

    Why one function: regional compilation compiles the repeated layers only, so the loss ran eager.
    On the H100 (0.5b stage 2, batch 54) that was 14.7 ms of softmax kernels and 7.5 ms of casts a
    step over the 151,936-entry vocabulary, which the whole-model graph fuses; compiled as one
    more region, Inductor fuses the cast, the log-softmax and the gather here too.
    """
    return nn.functional.cross_entropy(nn.functional.linear(h, weight, bias).float(), targets)


class LossOutput:
    """The one field of a model output that training reads."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss
