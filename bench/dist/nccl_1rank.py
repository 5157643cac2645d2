"""Record one rank's trace of DDP and FSDP2 training through NCCL, the way a user's script does.

    torchrun --nproc-per-node 1 bench/dist/nccl_1rank.py --parallel ddp --out DIR

A plain training loop on a Qwen2 decoder built from the 0.5b preset's shipped config (random
weights, bf16), torch.profiler with schedule(wait=1, warmup=1, active=2) and one trace file per
rank. With one GPU the process group has one rank: the collectives run (NCCL kernels, the
record_param_comms ops with their sizes) but move no data between GPUs. What it is for: the
format of communication events that this torch writes, for the trace layer's tests.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule
from transformers import Qwen2Config, Qwen2ForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("--parallel", choices=("ddp", "fsdp2"), required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--batch-size", type=int, default=4)
ap.add_argument("--seq", type=int, default=512)
ap.add_argument("--grad-accum", type=int, default=2)
args = ap.parse_args()

dist.init_process_group("nccl")
rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
shipped = Path(__file__).resolve().parents[2] / "vlmdoctor" / "run" / "configs" / "llm" / "qwen2.5-0.5b-instruct.json"
config = Qwen2Config(**json.loads(shipped.read_text())["config"])
config.num_hidden_layers = args.layers
model = Qwen2ForCausalLM(config).to(torch.bfloat16).cuda()
if args.parallel == "ddp":
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model, device_ids=[local])
else:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
out = Path(args.out)
out.mkdir(parents=True, exist_ok=True)


def ready(p):
    p.export_chrome_trace(str(out / f"{args.parallel}_rank{rank}.pt.trace.json"))


with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
             schedule=schedule(wait=1, warmup=1, active=2), on_trace_ready=ready) as prof:
    for step in range(5):
        for micro in range(args.grad_accum):  # no no_sync(): every micro-batch syncs its gradients
            ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device="cuda")
            loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        prof.step()
dist.destroy_process_group()
print(json.dumps({"parallel": args.parallel, "rank": rank, "loss": float(loss)}))
