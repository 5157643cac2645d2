"""The final checkpoint is saved by an atexit handler, as some training scripts do; the script then fails
(an evaluation set is missing) and a crash reporter of its own in `sys.excepthook` writes what it saw:
exit code 1, the excepthook given the script's own frames, the checkpoint still saved."""

import atexit
import hashlib
import sys

import torch
from _way import TinyLM, batch, save, watch


def report_crash(kind, value, tb) -> None:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename.rsplit("/", 1)[-1])
        tb = tb.tb_next
    with open("crash.txt", "w") as f:
        f.write(f"{kind.__name__}: {value}; frames {frames}\n")
    sys.__excepthook__(kind, value, None)


sys.excepthook = report_crash
torch.manual_seed(5)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


@atexit.register
def final_checkpoint() -> None:
    torch.save(model.state_dict(), "final.pt")
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values())).hexdigest()
    with open("final.sha256", "w") as f:
        f.write(digest)


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
raise RuntimeError("evaluation data missing")
