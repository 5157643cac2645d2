"""A loop that skips bad batches with a bare `except:` around the whole step."""

import torch
from _way import TinyLM, batch, save, watch

torch.manual_seed(4)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses, skipped = [], []
with watch(model) as step:
    for i in range(12):
        try:
            b = batch()
            if i % 5 == 4:
                raise ValueError("a bad batch")
            loss = model(**b)["loss"]
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step(b)
        except:  # noqa: E722
            skipped.append(i)
        opt.zero_grad()
save(losses, skipped=skipped)
