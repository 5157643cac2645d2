"""On a GPU: a model compiled by torch.compile (Inductor's Triton kernels), bf16 autocast."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from _way import VOCAB, TinyLM, save, watch  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.manual_seed(22)
model = TinyLM(dropout=0.0).cuda()
compiled = torch.compile(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
with watch(compiled) as step:
    for _ in range(12):
        ids = torch.randint(1, VOCAB, (16, 64), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step({"input_ids": ids})
save(losses)
