"""DistributedDataParallel on gloo, two ranks under torchrun, each its own shard (DistributedSampler)."""

import gc
import os

import torch
import torch.distributed as dist
from _way import TinyLM, save, watch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(14)
ids = torch.randint(1, 96, (64, 16))
model = DistributedDataParallel(TinyLM())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(ids, batch_size=4, sampler=DistributedSampler(ids, seed=0))
losses = []
with watch(model) as step:
    for b in loader:
        loss = model(input_ids=b, labels=b)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step({"input_ids": b})
save(losses, name=f"losses_rank{rank}.json", world=int(os.environ["WORLD_SIZE"]))
# DDP lives in a reference cycle: left to the interpreter's exit, torch 2.13's gloo aborts a rank about 1 run
# in 4 with no vlmdoctor in the process ("terminate called without an active exception", or a corrupted
# heap). Released here, a crash at exit under a way in is vlmdoctor's, and the test sees it.
del model, opt
gc.collect()
dist.destroy_process_group()
