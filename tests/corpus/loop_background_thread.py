"""A background upload in a non-daemon thread, then `sys.exit(3)` (a scheduler's 'requeue me' code): the
interpreter waits for the upload before it exits, with the script's own exit code."""

import sys
import threading
import time

import torch
from _way import TinyLM, batch, save, watch

torch.manual_seed(6)
model = TinyLM()
opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)  # a for-loop optimizer
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
save(losses)


def upload(values: list) -> None:
    time.sleep(0.5)
    with open("uploaded.txt", "w") as f:
        f.write(" ".join(float(x).hex() for x in values))


threading.Thread(target=upload, args=(losses,)).start()  # the main script ends now; the upload must still land
sys.exit(3)
