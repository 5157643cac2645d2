"""A compiled model (torch.compile through AOTAutograd; the CPU machine has no need of a C compiler)."""

import torch
from _way import TinyLM, batch, save, watch

torch.manual_seed(9)
model = TinyLM(dropout=0.0)
compiled = torch.compile(model, backend="aot_eager")
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
with watch(compiled) as step:
    for _ in range(10):
        b = batch()
        loss = compiled(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
save(losses)
