"""A seeded loop with dropout: every batch and dropout mask drawn from torch's global generator."""

import torch
from _way import TinyLM, batch, save, watch

torch.manual_seed(0)
model = TinyLM(dropout=0.2)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
with watch(model) as step:
    for _ in range(10):
        b = batch()
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
save(losses, after=torch.rand(3).tolist())
