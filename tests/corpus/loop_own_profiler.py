"""A script that runs torch.profiler itself over a few steps and writes its own trace."""

import os

import torch
from _way import TinyLM, batch, save, watch
from torch.profiler import profile, schedule

torch.manual_seed(10)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
losses = []
plan = schedule(wait=2, warmup=1, active=2, repeat=1)
with watch(model) as step, profile(schedule=plan, on_trace_ready=lambda p: p.export_chrome_trace("mine.json")) as prof:
    for _ in range(10):
        b = batch()
        loss = model(**b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
        prof.step()
save(losses, trace_written=os.path.exists("mine.json"))
