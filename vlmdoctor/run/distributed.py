"""Several processes, one per GPU: launching them through torchrun, and what each rank does.

A distributed run is launched with PyTorch's own launcher (`python -m torch.distributed.run`),
one process per GPU; each process runs `vlmdoctor.run.rank_worker`, which calls `run_profile`.
Inside it, this module sets up the process group from the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE), wraps the model (DDP, or FSDP2's `fully_shard` per decoder layer and the
root, the frozen vision tower replicated), deals each rank its own shard of every global batch,
and gathers the ranks' measurements to rank 0, which writes the one report.

Backend: nccl on CUDA, gloo on the CPU (real collectives, no GPU needed).
"""

from __future__ import annotations

import contextlib
import gc
import os
import platform
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vlmdoctor.errors import UsageError
from vlmdoctor.run import metrics
from vlmdoctor.run.config import GPUS, NNODES, RunConfig
from vlmdoctor.run.parts import find_parts

#: NVLink multicast (NVLS / symmetric-memory multicast) off in every process on a GPU: the project's
#: GPU hosts do not support it, and NCCL or symmetric memory would otherwise try it and fail or hang
NVLINK_MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

WORKER = "vlmdoctor.run.rank_worker"


def is_distributed(cfg: RunConfig) -> bool:
    """A config that runs through torchrun: several processes, or a wrapper around one (its own cost)."""
    return cfg.nproc_per_node > 1 or cfg.parallel != "none"


# --- the launcher side ---------------------------------------------------------------------------
@dataclass
class Rendezvous:
    """torchrun's options for finding the other nodes; launcher-only, not run-config knobs.

    One node (the default) uses torchrun's --standalone: a local rendezvous on a free port.
    """

    nnodes: str = NNODES  # "N" or "MIN:MAX" (elastic)
    node_rank: int | None = None
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None

    def multi_node(self) -> bool:
        return self.nnodes not in ("1", "1:1")

    def check(self) -> None:
        if not re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", self.nnodes):
            raise UsageError(f"--nnodes must be N or MIN:MAX (positive integers), got {self.nnodes!r}")
        if self.node_rank is not None and self.node_rank < 0:
            raise UsageError(f"--node-rank must be an integer >= 0, got {self.node_rank}")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise UsageError(f"--master-port must be a port number 1..65535, got {self.master_port}")
        if self.multi_node() and not (self.rdzv_endpoint or self.master_addr):
            raise UsageError(
                f"--nnodes {self.nnodes} needs the rendezvous: --rdzv-endpoint HOST:PORT (with "
                "--rdzv-backend c10d) or --master-addr HOST --master-port PORT (with --node-rank)"
            )

    def args(self) -> list[str]:
        """torchrun's rendezvous arguments."""
        given = self.rdzv_endpoint or self.master_addr or self.master_port or self.rdzv_backend
        if not self.multi_node() and not given:
            return ["--standalone"]
        out = ["--nnodes", self.nnodes]
        for flag, value in (
            ("--node-rank", self.node_rank),
            ("--rdzv-backend", self.rdzv_backend),
            ("--rdzv-endpoint", self.rdzv_endpoint),
            ("--rdzv-id", self.rdzv_id),
            ("--master-addr", self.master_addr),
            ("--master-port", self.master_port),
        ):
            if value is not None:
                out += [flag, str(value)]
        return out


def torchrun_command(
    cfg: RunConfig,
    worker_args: list[str],
    rdzv: Rendezvous | None = None,
    python: str | None = None,
    log_dir: str | None = None,
) -> list[str]:
    """`python -m torch.distributed.run ... -m vlmdoctor.run.rank_worker ARGS`: one process per GPU.

    `log_dir`: where torchrun keeps its per-run folder (without one it makes a `torchelastic_*` folder in
    the temp folder and never removes it)."""
    rdzv = rdzv or Rendezvous()
    return [
        python or sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv.args(),
        "--nproc-per-node",
        str(cfg.nproc_per_node),
        "--max-restarts",
        "0",
        *(["--log-dir", log_dir] if log_dir else []),
        "-m",
        WORKER,
        *worker_args,
    ]


def child_env(on_gpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment torchrun and its workers get: NVLink multicast off on a GPU, unless the user set it."""
    env = dict(os.environ if base is None else base)
    if on_gpu:
        for k, v in NVLINK_MULTICAST_OFF.items():
            env.setdefault(k, v)
    return env


def check_launch(cfg: RunConfig, device: torch.device) -> None:
    """What the launcher can refuse before any process starts."""
    if device.type == "cuda" and cfg.nproc_per_node > torch.cuda.device_count():
        raise UsageError(
            f"--nproc-per-node {cfg.nproc_per_node} asks for one GPU per process, but this node "
            f"has {torch.cuda.device_count()} visible GPU(s)"
        )
    if cfg.compile == "reduce-overhead" and is_distributed(cfg):
        raise UsageError(
            "--compile reduce-overhead (CUDA graphs) is not supported with --parallel ddp/fsdp2 here; "
            "use --compile default"
        )


# --- the rank side ---------------------------------------------------------------------------------
@dataclass
class Dist:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def setup(cfg: RunConfig, device: torch.device) -> tuple[Dist, torch.device]:
    """Join the process group torchrun prepared; each rank takes the GPU of its local rank."""

    if not in_torchrun():
        raise UsageError(
            f"--parallel {cfg.parallel} runs under torchrun; launch it with vlmdoctor profile "
            "--nproc-per-node N (which starts torchrun), not as a plain process"
        )
    local = int(os.environ["LOCAL_RANK"])
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, **kwargs)
    return Dist(dist.get_rank(), dist.get_world_size(), local, backend), device


def teardown() -> None:
    """Leave the process group with nothing of the run left to collect at interpreter exit."""
    # the run's DistributedDataParallel sits in a reference cycle; collected at exit, after the group,
    # torch 2.13's gloo aborts the rank about 1 run in 4 ("terminate called without an active exception")
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def model_parts(vlm: nn.Module) -> dict[str, nn.Module]:
    """Vision tower, projector and LLM of the composite model or of a native class."""
    parts = getattr(vlm, "parts", None)
    if isinstance(parts, dict):
        return parts

    return find_parts(vlm)


def decoder_layers(vlm: nn.Module) -> list[nn.Module]:
    """The LLM's decoder layers: its largest ModuleList of same-class blocks (any transformers decoder)."""
    llm = model_parts(vlm).get("llm", vlm)
    best: list[nn.Module] = []
    best_size = 0
    for m in llm.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > best_size:
                best, best_size = list(m), size
    return best


def _replicated_params(vlm: nn.Module) -> set[nn.Parameter]:
    """The frozen vision tower's parameters: every rank keeps a whole copy (no gradient, nothing to shard)."""
    parts = model_parts(vlm)
    vision, projector = parts.get("vision"), parts.get("projector")
    if vision is None:
        return set()
    inside = {id(p) for p in projector.parameters()} if projector is not None else set()
    return {p for p in vision.parameters() if not p.requires_grad and id(p) not in inside}


def wrap(vlm: nn.Module, cfg: RunConfig, d: Dist, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    """DDP around the model, or FSDP2 in place; returns the module to call and what was done."""
    if cfg.parallel == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        model = DDP(
            vlm,
            device_ids=ids,
            bucket_cap_mb=cfg.ddp_bucket_cap_mb,
            find_unused_parameters=False,
            static_graph=cfg.gradient_checkpointing and cfg.checkpoint_use_reentrant,
        )
        trainable = sum(p.numel() for p in vlm.parameters() if p.requires_grad)
        return model, {
            "wrapper": "DistributedDataParallel",
            "bucket_cap_mb": cfg.ddp_bucket_cap_mb,
            "synced_params": trainable,
        }
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # deferred: torch

    layers = decoder_layers(vlm)
    if not layers:
        raise UsageError(
            f"--parallel fsdp2: no decoder layers found in {cfg.model}'s LLM (no ModuleList of "
            "identical blocks); use --parallel ddp"
        )
    bf16 = cfg.autocast == "bf16" or cfg.weight_dtype == "bf16"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    replicated = _replicated_params(vlm)
    layer_class = type(layers[0]).__name__  # fully_shard renames the class (FSDP<name>)
    for layer in layers:
        fully_shard(layer, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    # the root: embeddings, norm, LM head, projector; the root's parameters stay gathered between
    # forward and backward (resharding right before backward would gather them again at once)
    fully_shard(vlm, mp_policy=mp, reshard_after_forward=False, ignored_params=replicated or None)
    if cfg.fsdp_prefetch:
        k = cfg.fsdp_prefetch
        for i, layer in enumerate(layers):
            ahead = layers[i + 1 : i + 1 + k]
            if ahead:
                layer.set_modules_to_forward_prefetch(ahead)
        for i, layer in enumerate(layers):
            behind = layers[max(0, i - k) : i][::-1]
            if behind:
                layer.set_modules_to_backward_prefetch(behind)
    return vlm, {
        "wrapper": "fully_shard",
        "sharded_layers": len(layers),
        "layer_class": layer_class,
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"} if bf16 else None,
        "reshard_after_forward": cfg.reshard_after_forward,
        "forward_prefetch": cfg.fsdp_prefetch,
        "replicated_params": sum(p.numel() for p in replicated),
    }


def micro_batch(model: nn.Module, vlm: nn.Module, cfg: RunConfig, last: bool):
    """Around one micro-batch's forward and backward: skip the gradient sync on all but the last, if asked.

    `model` is what the step calls (DDP, maybe around a compiled module), `vlm` the module FSDP2 sharded.
    """
    if not cfg.accum_no_sync or cfg.grad_accum == 1:
        return contextlib.nullcontext()
    if cfg.parallel == "ddp":
        return contextlib.nullcontext() if last else model.no_sync()
    vlm.set_requires_gradient_sync(last)  # FSDP2: reduce-scatter on the last micro-batch only
    return contextlib.nullcontext()


# --- data: each rank its own shard of every global batch ---------------------------------------------
class RankBatches(torch.utils.data.Sampler):
    """Global batches (batch_size x world samples, in the single-process sampler's order), rank-strided.

    As DistributedSampler does, rank r takes samples r, r + world, ... of each global batch. With
    `balance` the global batch is sorted by length and dealt out so that the ranks' token sums are
    close (longest first, each to the rank with the fewest tokens that still has room): the ranks
    then finish their steps together instead of waiting for the one that drew the long samples.
    """

    def __init__(
        self, inner: Iterator[list[int]] | Any, lengths: list[int], rank: int, world: int, balance: bool
    ) -> None:
        self.inner, self.lengths, self.rank, self.world, self.balance = inner, lengths, rank, world, balance

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.inner:
            yield deal(batch, self.lengths, self.world, self.balance)[self.rank]


def deal(batch: list[int], lengths: list[int], world: int, balance: bool) -> list[list[int]]:
    """One global batch -> one micro-batch per rank (equal sample counts)."""
    if not balance:
        return [batch[r::world] for r in range(world)]
    per = len(batch) // world
    shards: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for i in sorted(batch, key=lambda j: -lengths[j]):
        r = min((r for r in range(world) if len(shards[r]) < per), key=lambda r: (tokens[r], r))
        shards[r].append(i)
        tokens[r] += lengths[i]
    return shards


# --- gathering the ranks' numbers to rank 0 --------------------------------------------------------
def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def rank_summary(rank: int, windows: list[dict[str, Any]], metrics: dict[str, Any], host: str) -> dict[str, Any]:
    """What one rank tells rank 0: its per-window counts and its own metrics."""
    return {
        "rank": rank,
        "host": host,
        "windows": [
            {
                "wall_s": w["wall_s"],
                "real_tokens": sum(w["step_real_tokens"]),
                "step_ms": w["step_ms"],
                "step_real_tokens": w["step_real_tokens"],
                "loss_tokens": w["loss_tokens_per_s"] * w["wall_s"],
                "model_flops": w["model_tflops_per_s"] * w["wall_s"] * 1e12,
            }
            for w in windows
        ],
        "step_ms": metrics["step_ms"],
        "real_tokens": sum(sum(w["step_real_tokens"]) for w in windows),
        "real_tokens_per_s": metrics["real_tokens_per_s"],
        "pad_fraction": metrics["pad_fraction"],
        "peak_mem_gb": metrics["peak_mem_gb"],
        "peak_mem_reserved_gb": metrics.get("peak_mem_reserved_gb"),
        "host_peak_rss_gb": metrics["host_peak_rss_gb"],
        "final_loss": metrics["final_loss"],
    }


def param_digest(model: nn.Module) -> list[float]:
    """Sum and sum of squares of the trainable weights (whole tensors, also when sharded), in float64.

    Ranks that synchronised their gradients hold the same weights after the optimizer step; ranks
    that did not differ here, since each trained on its own shard of the data.
    """
    total, squares = 0.0, 0.0
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad:
                continue
            t = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2: gathers the shards (all ranks call)
            t = t.detach().double()
            total += t.sum().item()
            squares += t.square().sum().item()
    return [total, squares]


def combine(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's ranks side by side: their tokens, the slowest and fastest rank, the largest peak memory. The job's
    rates are the one writer's (run/metrics.py: `joined`, `job_by_totals`)."""
    slowest = max(ranks, key=lambda r: (r["step_ms"], -r["rank"]))
    fastest = min(ranks, key=lambda r: (r["step_ms"], r["rank"]))
    return {
        "real_tokens": sum(r["real_tokens"] for r in ranks),
        "slowest_rank": slowest["rank"],
        "slowest_step_ms": slowest["step_ms"],
        "fastest_step_ms": fastest["step_ms"],
        # how much longer the slowest rank's median step is than the fastest's: the others wait that long
        "step_imbalance": slowest["step_ms"] / fastest["step_ms"] - 1.0 if fastest["step_ms"] > 0 else None,
        "peak_mem_gb": max((r["peak_mem_gb"] for r in ranks if r["peak_mem_gb"] is not None), default=None),
    }


#: knobs that may differ between a distributed run and its one-GPU reference: those of the several-GPUs panel
DIST_KNOBS = tuple(f.name for f in fields(RunConfig) if f.metadata["panel"] == GPUS)


def one_gpu_config(cfg: RunConfig) -> RunConfig:
    """The same run on one GPU in one plain process: the reference of the scaling efficiency."""
    return cfg.replace(source="one-GPU reference", nproc_per_node=1, parallel="none")


def rank_threads_env(cfg: RunConfig) -> dict[str, str]:
    """The CPU threads torchrun gives each rank, for the one-GPU reference to run under the same.

    torchrun sets OMP_NUM_THREADS=1 in every rank when it starts several per node and the variable is
    unset; a reference left at torch's default (a thread per core) measured another host side: on a
    64-core host with two references side by side, 0.5b's step took 478 ms against 125 ms on each of
    2 DDP ranks, and the scaling efficiency read 397% (bench/results/2026-11-27-4xh200-issue42)."""
    if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def check_reference(cfg: dict[str, Any], ref: dict[str, Any], where: str) -> None:
    """A one-GPU reference report must be the same config but for the knobs of distribution."""
    ref_cfg = ref.get("config") or {}
    if ref_cfg.get("nproc_per_node", 1) != 1 or ref_cfg.get("parallel", "none") != "none":
        raise UsageError(
            f"{where}: not a one-GPU report (nproc_per_node={ref_cfg.get('nproc_per_node')}, "
            f"parallel={ref_cfg.get('parallel')}); give a report of the same config run with "
            "--nproc-per-node 1 and no --parallel"
        )
    differ = sorted(
        k
        for k in set(cfg) | set(ref_cfg)
        if k not in DIST_KNOBS and k in cfg and cfg.get(k) != ref_cfg.get(k, RunConfig().to_dict().get(k))
    )
    if differ:
        raise UsageError(
            f"{where}: its config differs from this run's in {', '.join(differ[:8])}; the scaling "
            "efficiency needs the same config on one GPU"
        )
    if ref.get("status") != "ok" or not (ref.get("metrics") or {}).get("real_tokens_per_s"):
        raise UsageError(
            f"{where}: the one-GPU run did not finish (status {ref.get('status')!r}); it has no "
            "tokens/s to compare with"
        )


def merge_ranks(
    report: dict[str, Any],
    place: Dist,
    patient: Any,
    windows: list[dict[str, Any]],
    peak: float | None,
) -> None:
    """Every rank's numbers to every rank; the report's metrics become the job's.

    metrics.real_tokens_per_s, model_tflops_per_s and mfu are global (all ranks' tokens over the
    slowest rank's time, run/metrics.py), step_ms is the slowest rank's median step, peak_mem_gb the largest;
    `repeats` holds global per-step samples (tokens summed over ranks, the longest rank's step
    time), so that the gate's significance test judges the job. Each rank's own numbers are kept
    under distributed.ranks. `patient`: this rank's (runner.Patient).
    """

    own = rank_summary(place.rank, windows, report["metrics"], platform.node())
    own["trace"] = (report.get("trace") or {}).get("path")
    own["loss_finite"] = report["metrics"]["loss_finite"]
    own["param_digest"] = param_digest(patient.vlm)
    ranks = gather(own)
    # the job's steps, window by window: per step the slowest rank's time and all ranks' tokens
    job = [metrics.joined([r["windows"][w] for r in ranks]) for w in range(len(windows))]
    job_blocks = metrics.write(job, peak=None, device_total_gb=None, spread_of=("real_tokens_per_s",))
    # the job's headline by the one estimator over them; loss tokens and FLOPs follow it (metrics.job_by_totals)
    numbers = metrics.job_by_totals(ranks, job_blocks.throughput["real_tokens_per_s"], peak)
    whole = {k: numbers[k] for k in metrics.RATES} | combine(ranks)
    slow = [r for r in ranks if r["rank"] == whole["slowest_rank"]][0]
    slow_blocks = metrics.write(slow["windows"], peak=None, device_total_gb=None, spread_of=())  # its step times
    m = report["metrics"]
    m.update(
        numbers,
        step_ms=slow_blocks.metrics["step_ms"],
        step_ms_p10=slow_blocks.metrics["step_ms_p10"],
        step_ms_p90=slow_blocks.metrics["step_ms_p90"],
        peak_mem_gb=whole["peak_mem_gb"],
        loss_finite=all(r["loss_finite"] for r in ranks),
    )
    report["repeats"] = [
        {
            "steps": windows[w]["steps"],
            "wall_s": max(r["windows"][w]["wall_s"] for r in ranks),
            "real_tokens_per_s": job[w]["real_tokens_per_s"],
            "step_ms": job[w]["step_ms"],
            "step_real_tokens": job[w]["step_real_tokens"],
            "final_loss": windows[w]["losses"][-1],
        }
        for w in range(len(windows))
    ]
    est = job_blocks.throughput
    est.update(model_tflops_per_s=m["model_tflops_per_s"], mfu=m["mfu"], loss_tokens_per_s=m["loss_tokens_per_s"])
    report["throughput"] = est
    stats = report.get("stats") or {}
    for key in metrics.SPREAD_OWN:
        stats.pop(key, None)  # rank 0's spread would pass for the job's
    stats["real_tokens_per_s"] = job_blocks.stats["real_tokens_per_s"]
    stats["step_ms"] = slow_blocks.stats["step_ms"] | {"rank": whole["slowest_rank"]}
    report["distributed"] = {
        "world_size": place.world,
        "nproc_per_node": patient.cfg.nproc_per_node,
        "nnodes": max(1, place.world // patient.cfg.nproc_per_node),
        "parallel": patient.cfg.parallel,
        "backend": place.backend,
        "wrap": patient.wrap_info,
        "global": whole,
        # synchronised gradients leave every rank with the same weights (the digest: sum, sum of squares)
        "params_identical": all(r["param_digest"] == ranks[0]["param_digest"] for r in ranks),
        "ranks": [{k: v for k, v in r.items() if k != "windows"} for r in ranks],
    }
    if report.get("trace"):
        paths = [r["trace"] for r in ranks]
        report["trace"]["rank_paths"] = paths
        report["trace"]["dir"] = str(Path(report["trace"]["path"]).parent)
