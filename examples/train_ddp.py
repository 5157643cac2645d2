"""The LLaVA of train_llava_loop.py under plain DDP: what a user's data-parallel script looks like.

    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 30
    vlmdoctor run -- torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 30
    torchrun --standalone --nproc-per-node 2 examples/train_ddp.py --steps 30 --api   # Doctor on every rank

One process per rank (gloo on the CPU, nccl on GPUs), each rank its own shard of the data
(DistributedSampler), the model wrapped in DistributedDataParallel the way most scripts write it,
`model = DistributedDataParallel(model)`: its attributes are then `model.module.<...>`, and its
forward is what synchronizes the gradients. With --api, vlmdoctor.Doctor measures on every rank and
rank 0 alone prints and writes the job's report. The tests paste vlmdoctor's fixes into it and check
that the ranks' weights stay identical (tests/test_advice_ddp.py).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from transformers import LlavaForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_llava_loop import SIZES, Samples, checkpoint, collate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=4, help="per rank")
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--api", action="store_true", help="measure with vlmdoctor.Doctor on every rank")
    ap.add_argument("--out", default="doctor-out")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and args.size != "tiny"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, local = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if rank == 0:
        checkpoint(args.size)  # made once, before the others read it
    dist.barrier()
    model = LlavaForConditionalGeneration.from_pretrained(checkpoint(args.size)).to(device)
    model.model.vision_tower.requires_grad_(False)
    model = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ds = Samples(32 * args.batch_size, args.size)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=DistributedSampler(ds, seed=0), collate_fn=collate)

    doc = None
    if args.api:
        import vlmdoctor

        doc = vlmdoctor.Doctor(model, out=args.out, warmup=2, steps=4, trace_steps=1, force=True)
        doc.__enter__()
    model.train()
    for step, batch in zip(range(args.steps), itertools.chain.from_iterable(itertools.repeat(loader))):
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if doc is not None:
            doc.step(batch)
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        print("training done", flush=True)
    if doc is not None:
        doc.__exit__(None, None, None)
    # DDP released before its process group: alive there (it sits in a reference cycle), torch 2.13's gloo
    # group deadlocks in its destructor on the GIL, or a rank aborts at exit, in about 1 CPU run in 4
    del model, opt, doc
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
