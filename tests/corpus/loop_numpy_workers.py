"""Augmentation from numpy and random, a shuffled DataLoader with two worker processes (their seeds come
from torch's global generator), numpy reseeded in each worker."""

import random

import numpy as np
import torch
from _way import SEQ, VOCAB, TinyLM, save, watch
from torch.utils.data import DataLoader, Dataset, get_worker_info


class Samples(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict:
        ids = torch.from_numpy(np.random.randint(1, VOCAB, SEQ)) + random.randint(0, 1) * 0
        return {"input_ids": ids, "labels": ids}


def init(worker: int) -> None:
    np.random.seed(get_worker_info().seed % 2**32)


if __name__ == "__main__":
    torch.manual_seed(2)
    np.random.seed(2)
    random.seed(2)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(Samples(), batch_size=4, shuffle=True, num_workers=2, worker_init_fn=init)
    losses = []
    with watch(model) as step:
        for b in loader:
            if np.random.rand() < 0.5:  # numpy in the main process too
                b["input_ids"] = b["input_ids"].flip(1)
            loss = model(**b)["loss"]
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            step(b)
    save(losses, tail=[float(np.random.rand()), random.random()])
