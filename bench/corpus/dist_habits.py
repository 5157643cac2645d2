"""A user's data-parallel VLM training script (torchrun), one habit after another, each rank profiled.

Plain torch.distributed: DDP or FSDP2 (torch.distributed.fsdp.fully_shard) around a native transformers
VLM built from a config (random weights, see vlms.py), a DataLoader per rank, AdamW. For each habit
the model is built afresh, trained a few warm steps, then four steps under
`torch.profiler.profile(schedule=schedule(wait=1, warmup=1, active=2))`; every rank writes its own
trace OUTDIR/<habit>/rank<K>.pt.trace.json.gz (export_chrome_trace, then gzip). Rank 0 prints one
JSON line per habit (model class, versions, devices, every rank's step times). Nothing here imports
vlmdoctor.

    torchrun --standalone --nproc-per-node 2 bench/corpus/dist_habits.py --outdir /tmp/d --habits ddp_healthy
    torchrun --standalone --nproc-per-node 2 bench/corpus/dist_habits.py --outdir /tmp/d --tiny --device cpu  # gloo

NCCL on --device cuda (one GPU per rank: LOCAL_RANK), gloo on --device cpu. Works with 2 or 4 ranks;
in the straggler habits rank 1 is the odd one out and every other rank is like rank 0. A habit that
raises is reported (rank 0's JSON line says "failed") and the next one runs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gzip
import json
import os
import shutil
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vlms  # noqa: E402

HABITS = {
    "ddp_healthy": "control: DDP defaults (bucket_cap_mb=25, find_unused_parameters=False), same work on every rank",
    "ddp_find_unused": "DDP(find_unused_parameters=True) on a model whose parameters are all used",
    "ddp_bucket1": "DDP(bucket_cap_mb=1): an all-reduce per gradient tensor (41 a step instead of 13)",
    "ddp_bucket100": "DDP(bucket_cap_mb=100): 6 large all-reduces a step (the contrast to ddp_bucket1)",
    "ddp_accum_sync": "gradient accumulation over 2 micro-batches, each one all-reduced (no no_sync)",
    "ddp_accum_nosync": "gradient accumulation over 2 micro-batches, the first under model.no_sync() (the contrast)",
    "ddp_long_rank1": "rank 1 is given texts twice as long as the other ranks' (more tokens: a straggler by work)",
    "ddp_slow_loader_rank1": "rank 1's dataset sleeps 40 ms per sample (a slow read): a straggler by data",
    "fsdp2_reshard": "FSDP2 fully_shard per layer + root, reshard_after_forward=True, on a model that fits one GPU",
    "fsdp2_noreshard": "FSDP2 as fsdp2_reshard with reshard_after_forward=False (no all-gather again in backward)",
    "fsdp2_prefetch2": "FSDP2 as fsdp2_reshard, explicit forward/backward prefetch of the next two layers",
}


# the LLM of the distributed runs: narrower than habits.py's (many gradient tensors of a few MB, so the
# bucket size matters), a 32k vocabulary; ~330M parameters with mistral3: it fits one GPU many times over
DIST_TEXT = dict(
    hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4, vocab_size=32768
)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--habits", default=",".join(HABITS), help="comma list (default: all)")
    ap.add_argument("--outdir", required=True, help="OUTDIR/<habit>/rank<K>.pt.trace.json.gz")
    ap.add_argument("--model", default="mistral3", help="a key of vlms.MAKERS (one whose parameters all get grads)")
    ap.add_argument("--llm-layers", type=int, default=4)
    ap.add_argument("--vit-layers", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=0, help="per rank (0: 8; 2 with --tiny)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    return ap.parse_args()


class Examples(torch.utils.data.Dataset):
    """Rank r's item i: its own seed; text lengths x `scale`; `sleep_s` per item (a slow read)."""

    def __init__(self, spec, rank, bsz, lo, hi, scale=1, sleep_s=0.0):
        self.spec, self.rank, self.bsz, self.lo, self.hi = spec, rank, bsz, lo, hi
        self.scale, self.sleep_s = scale, sleep_s

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        g = torch.Generator().manual_seed(1_000_000 * (self.rank + 1) + i)
        # rows of a batch within 10% of its longest (length-grouped), the longest drawn per batch
        step, row = divmod(i, self.bsz)
        top = int(torch.randint(self.lo, self.hi, (1,), generator=torch.Generator().manual_seed(500 + step)))
        n = top if row == 0 else int(torch.randint(int(top * 0.9), top + 1, (1,), generator=g))
        n *= self.scale
        return {
            k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in vlms.sample(self.spec, g, n).items()
        }


def layer_lists(model):
    """The repeated blocks (nn.ModuleList named *layers): the LLM's decoder layers, the tower's encoder layers."""
    return [m for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and name.endswith("layers")]


def run_habit(habit, args, rank, world, device, out_dir) -> dict:
    cuda = device.type == "cuda"
    torch.manual_seed(0)  # the same weights on every rank
    spec = vlms.spec(args.model, args.tiny, args.llm_layers, args.vit_layers, None if args.tiny else DIST_TEXT)
    model = vlms.build(spec, device, torch.bfloat16)
    model.train()
    opt_kw = dict(lr=1e-5)
    info = {}

    if habit.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard

        reshard = habit != "fsdp2_noreshard"
        blocks = []
        for layers in layer_lists(model):
            for block in layers:
                fully_shard(block, reshard_after_forward=reshard)
                blocks.append(block)
        fully_shard(model, reshard_after_forward=reshard)
        if habit == "fsdp2_prefetch2":
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
                block.set_modules_to_backward_prefetch(blocks[max(0, i - 2) : i][::-1])
        info["sharded_blocks"] = len(blocks)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp_kw = dict(device_ids=[device.index] if cuda else None)
        if habit == "ddp_find_unused":
            ddp_kw["find_unused_parameters"] = True
        if habit == "ddp_bucket1":
            ddp_kw["bucket_cap_mb"] = 1
        if habit == "ddp_bucket100":
            ddp_kw["bucket_cap_mb"] = 100
        wrapped = DDP(model, **ddp_kw)

    params = [p for p in wrapped.parameters() if p.requires_grad]
    try:
        opt = torch.optim.AdamW(params, fused=cuda, **opt_kw)
        info["optimizer"] = "AdamW(fused=True)" if cuda else "AdamW(foreach)"
    except Exception as e:  # fused AdamW refused these parameters: the default implementation
        opt = torch.optim.AdamW(params, **opt_kw)
        info["optimizer"] = f"AdamW(default; fused refused: {type(e).__name__})"

    lo, hi = (16, 48) if args.tiny else (512, 1024)
    accum = 2 if habit.startswith("ddp_accum") else 1
    bsz = args.batch_size or (2 if args.tiny else 8)
    micro = max(1, bsz // accum)  # accumulation: the batch in micro-batches (same samples per optimizer step)
    scale = 2 if habit == "ddp_long_rank1" and rank == 1 else 1
    sleep_s = 0.04 if habit == "ddp_slow_loader_rank1" and rank == 1 else 0.0
    ds = Examples(spec, rank, micro, lo, hi, scale, sleep_s)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=micro,
        num_workers=2,
        pin_memory=cuda,
        persistent_workers=False,
        collate_fn=lambda ex: vlms.collate(spec, ex),
    )
    batches = iter(loader)

    def train_step() -> int:
        tokens = 0
        for k in range(accum):
            host = next(batches)
            tokens += int(host["attention_mask"].sum())  # counted on the host copy: no device sync
            batch = vlms.to_device(host, device, torch.bfloat16, non_blocking=cuda)
            sync_ctx = wrapped.no_sync() if habit == "ddp_accum_nosync" and k < accum - 1 else contextlib.nullcontext()
            with sync_ctx:
                loss = wrapped(**batch).loss / accum
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return tokens

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm_s = []
    for _ in range(args.warm):
        t0 = time.perf_counter()
        train_step()
        sync()
        warm_s.append(round(time.perf_counter() - t0, 4))

    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, f"rank{rank}.pt.trace.json.gz")
    tmp_json = out[: -len(".gz")]

    def on_ready(p):
        p.export_chrome_trace(tmp_json)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    host_s = []
    dist.barrier()
    sync()
    t_win = time.perf_counter()
    with profile(activities=acts, schedule=schedule(wait=1, warmup=1, active=2), on_trace_ready=on_ready) as prof:
        for _ in range(4):
            t0 = time.perf_counter()
            train_step()
            host_s.append(round(time.perf_counter() - t0, 4))  # the host's time in the step (unsynced)
            prof.step()
    sync()
    window_s = round(time.perf_counter() - t_win, 3)
    with open(tmp_json, "rb") as f, gzip.open(out, "wb", compresslevel=9) as g:
        shutil.copyfileobj(f, g)
    os.remove(tmp_json)
    mine = {
        "rank": rank,
        "warm_step_s": warm_s,
        "window_host_step_s": host_s,
        "window_s": window_s,
        "peak_mem_gb": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "size_bytes": os.path.getsize(out),
        "text_scale": scale,
        "sleep_s_per_sample": sleep_s,
    }
    return {"class": spec.cls.__name__, "accum": accum, "micro_batch": micro, "text_tokens": [lo, hi], **info}, mine


def main():
    args = parse_args()
    cuda = args.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group(
        "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120), **({"device_id": device} if cuda else {})
    )
    import transformers

    for habit in [h for h in args.habits.split(",") if h]:
        if habit not in HABITS:
            raise SystemExit(f"unknown habit {habit}; choose from {', '.join(HABITS)}")
        t0 = time.perf_counter()
        try:
            common, mine = run_habit(habit, args, rank, world, device, os.path.join(args.outdir, habit))
            failed = None
        except Exception as e:  # report and go on with the next habit (a collective may hang: the driver's timeout)
            traceback.print_exc()
            common, mine, failed = {}, {"rank": rank}, f"{type(e).__name__}: {e}"[:500]
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        ranks = [None] * world
        dist.all_gather_object(ranks, {"mine": mine, "failed": failed})
        if rank == 0:
            line = {
                "habit": habit,
                "habit_says": HABITS[habit],
                "model": args.model,
                **common,
                "world_size": world,
                "backend": dist.get_backend(),
                "ranks": [r["mine"] for r in ranks],
                "failed": [f"rank {i}: {r['failed']}" for i, r in enumerate(ranks) if r["failed"]] or None,
                "outdir": os.path.join(args.outdir, habit),
                "run_s": round(time.perf_counter() - t0, 1),
                "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
                "transformers": transformers.__version__,
                "tiny": args.tiny,
                "command": " ".join(["torchrun", "...", *sys.argv]),
            }
            print(json.dumps(line), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
