"""What a user adds to a loop to watch it with vlmdoctor.Doctor, switched on by CORPUS_WAY=doctor, and the
tiny models and the loss file the corpus scripts share (tests/test_differential.py runs them).

Plain (no CORPUS_WAY) nothing of vlmdoctor is imported: the script is what it would be without it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch
from torch import nn

VOCAB, WIDTH, SEQ, BATCH = 96, 32, 16, 4
#: the Doctor's window in every corpus script: 1 warm-up, 2 timed, then the traced window (1 wait, 1 warm-up,
#: 1 recorded step): measured by step 6, well before each script's end. CORPUS_WINDOW="W,S,T" sets another
#: (the probe's observer family tries windows that end early, late, or never)
_W = [int(x) for x in os.environ.get("CORPUS_WINDOW", "1,2,1").split(",")]
WINDOW = dict(warmup=_W[0], steps=_W[1], trace_steps=_W[2])


class TinyLM(nn.Module):
    """Embedding, one transformer layer with dropout, a head: called with input_ids and labels."""

    def __init__(self, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.block = nn.TransformerEncoderLayer(WIDTH, 2, 64, dropout=dropout, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        logits = self.head(self.block(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


def batch(generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator:
    """`step(batch)` after each optimizer step: vlmdoctor.Doctor's under CORPUS_WAY=doctor, else nothing."""
    if os.environ.get("CORPUS_WAY") != "doctor":
        yield lambda *a, **k: None
        return
    import vlmdoctor

    with vlmdoctor.Doctor(model, out=os.environ["CORPUS_OUT"], quiet=True, **WINDOW) as doc:
        yield doc.step


def save(losses: list, name: str = "losses.json", **extra: object) -> None:
    """The losses bit for bit (float.hex), and whatever else the script wants compared."""
    with open(name, "w") as f:
        json.dump({"losses": [float(x).hex() for x in losses], **extra}, f, indent=1)
