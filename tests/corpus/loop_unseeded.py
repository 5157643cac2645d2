"""No seed anywhere: torch's generator starts from a seed of its own (the test replays it plainly)."""

import torch
from _way import TinyLM, batch, save, watch

seed = torch.initial_seed()
model = TinyLM()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
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
save(losses, seed=str(seed))
