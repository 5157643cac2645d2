"""A stray evaluation forward under torch.no_grad() inside every training step (the model left in train mode)."""

import torch
from _way import TinyLM, batch, save, watch

torch.manual_seed(1)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses, evals = [], []
with watch(model) as step:
    for _ in range(10):
        b = batch()
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            evals.append(model(**batch())["loss"].item())
        losses.append(loss.item())
        step(b)
save(losses, evals=[float(x).hex() for x in evals])
