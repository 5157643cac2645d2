"""A sampler of the user's own that shuffles with torch.randperm (the global generator), batches of
varying length padded by a collate function. The test runs it with interpreter options through a wrapper
interpreter that sets a variable (as venv and conda shims do): the script records what it was given."""

import os
import sys

import torch
from _way import VOCAB, TinyLM, save, watch
from torch.utils.data import DataLoader, Sampler


class Shuffled(Sampler):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


def collate(lengths: list) -> dict:
    longest = max(lengths)
    ids = torch.zeros(len(lengths), longest, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, VOCAB, (n,))
    return {"input_ids": ids, "labels": ids}


torch.manual_seed(3)
lengths = [8 + (i * 7) % 17 for i in range(40)]
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader([lengths[i] for i in range(40)], batch_size=4, sampler=Shuffled(40), collate_fn=collate)
losses = []
with watch(model) as step:
    for b in loader:
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
save(
    losses,
    warnoptions=sys.warnoptions,
    xoptions=sorted(sys._xoptions),
    wrapper=os.environ.get("WRAPPED_BY"),
    executable=os.path.basename(sys.executable),
)
