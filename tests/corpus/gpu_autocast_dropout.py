"""On a GPU: fp32 weights under bf16 autocast, dropout drawing from the CUDA generator, batches made on
the GPU from it too."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from _way import VOCAB, TinyLM, save, watch  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.manual_seed(21)
model = TinyLM(dropout=0.2).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
with watch(model) as step:
    for _ in range(12):
        ids = torch.randint(1, VOCAB, (16, 64), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step({"input_ids": ids})
save(losses, after=torch.rand(2, device="cuda").tolist())
