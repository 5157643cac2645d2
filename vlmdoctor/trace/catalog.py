"""The fact catalogue: every fact vlmdoctor computes, declared once, with its unit, meaning, what records it and
the one module that computes it.

The rule engine's allow-list of fact names and its "record with ..." hints (doctor/rules.py), the table of
facts in docs/analysis.md and `vlmdoctor facts` are generated from here; tests/test_catalog.py checks the
families against it on the committed traces. A name in angle brackets is a template: `kernels.<class>.ms`
stands for one fact per kernel class (PLACEHOLDERS says which values).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from vlmdoctor import docgen
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace.kernels import KERNEL_CLASSES

#: what a fact needs recorded, in the order a missing fact's hint is looked for: (name, what records it)
NEEDS = {
    "trace": "any torch.profiler trace",
    "gpu": "a GPU trace (ProfilerActivity.CUDA)",
    "memory": "profile_memory=True",
    "shapes": "record_shapes=True",
    "stack": "with_stack=True (records the nn.Module hierarchy)",
    "cpu": "a CPU-only trace",
    "collectives": "a trace with collectives (a distributed run)",
    "ranks": "a folder of per-rank traces of one job",
    "report": "the run report (vlmdoctor profile: the untraced, timed windows)",
    "run": "a trace written by vlmdoctor (its run config in the trace)",
}

#: the needs a missing fact's hint can name, and how the facts show that option was on already
_HINTED = {
    "gpu": lambda f: f.get("trace.gpu_kernels", True),
    "memory": lambda f: f.get("trace.recorded.memory", True),
    "shapes": lambda f: f.get("trace.recorded.shapes", True),
    "stack": lambda f: f.get("part.source", "none") != "none",
}

MODEL_PARTS = ("vision", "projector", "llm")
_KERNEL_CLASSES = [c for c, _, _ in KERNEL_CLASSES] + ["memcpy", "memset", "triton_other", "other"]
_KNOBS = list(RunConfig.__dataclass_fields__)

#: template placeholders: the values each stands for (a regex), and how the docs describe them
PLACEHOLDERS: dict[str, tuple[str, str]] = {
    "part": ("|".join(MODEL_PARTS), "a model part: vision, projector, llm"),
    "slice": (
        "loss|optimizer|other|unattributed",
        "GPU time outside the model parts: loss, optimizer, other, unattributed",
    ),
    "phase": ("forward|backward|recompute|optimizer|unattributed", "forward, backward, recompute, optimizer"),
    "class": (
        "|".join(_KERNEL_CLASSES),
        "a kernel class of trace/kernels.py (KERNEL_CLASSES; memcpy, memset, triton_other, other)",
    ),
    "liger": ("rms_norm|swiglu|rope|cross_entropy", "a Liger kernel: rms_norm, swiglu, rope, cross_entropy"),
    "backend": ("cudnn|flash|efficient|math|flash_cpu", "an SDPA backend: cudnn, flash, efficient, math, flash_cpu"),
    "direction": ("HtoD|DtoH|DtoD|HtoH|PtoP|other", "a copy direction: HtoD, DtoH, DtoD, HtoH, PtoP, other"),
    "option": ("shapes|memory|stack", "a profiler option: shapes, memory, stack"),
    "dtype": ("fp32|bf16|fp16", "a matmul dtype: fp32, bf16, fp16"),
    "kind": ("[a-z_]+", "a collective: all_reduce, all_gather, reduce_scatter, broadcast, ..."),
    "written": (
        "eager|math|mha",
        "attention written out as matmul + softmax: eager, SDPA's math path, nn.MultiheadAttention",
    ),
    "cast": ("weight|input|island", "a cast's kind: a weight's, a GEMM input's, an fp32 island's"),
    "knob": ("|".join(_KNOBS), "a knob of the run config (`vlmdoctor profile --help`)"),
    "account": (
        "[a-z0-9_]+",
        "a busy account of trace/families/busy.py (BUSY_ACCOUNTS): gemm_bf16, communication, ...",
    ),
    "cause": ("[a-z_]+", "a host cause of trace/families/idle.py (HOST_CAUSES): launch, dispatch, allocator, ..."),
}


@dataclass(frozen=True)
class Fact:
    """One fact (or a template of facts): what it is, what it needs recorded, and where it is computed."""

    name: str
    unit: str
    meaning: str
    needs: tuple[str, ...]
    producer: str  # the module that computes it, the only one that writes it
    unfixtured: str = ""  # why no committed trace produces it ("" when one does)
    joined: str = ""  # how trace/ranks.py states it for a folder of rank traces, when it does

    @property
    def pattern(self) -> re.Pattern[str]:
        return _pattern(self.name)

    @property
    def is_template(self) -> bool:
        return "<" in self.name


@cache
def _pattern(name: str) -> re.Pattern[str]:
    parts = re.split(r"<([a-z]+)>", name)
    rx = "".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p][0]})" for i, p in enumerate(parts))
    return re.compile(rx)


_T = "vlmdoctor.trace"
_F = f"{_T}.families"
DRIVER = f"{_T}.facts"
MEASURED = f"{_T}.measured"


def _group(producer: str, needs: tuple[str, ...], rows: list[tuple[str, ...]], **extra: str) -> list[Fact]:
    """Facts of one producer with the same needs: rows of (name, unit, meaning[, unfixtured])."""
    out = []
    for row in rows:
        name, unit, meaning, *rest = row
        out.append(Fact(name, unit, meaning, needs, producer, rest[0] if rest else "", **extra))
    return out


_ALL = "joined over ranks: true when every rank's trace has it"
_MAX = "joined over ranks: the largest rank's value"

FACTS: list[Fact] = [
    # --- the trace itself and the run's config: the driver ---------------------------------------------------
    *_group(
        DRIVER,
        ("trace",),
        [
            ("trace.written_by_vlmdoctor", "bool", "the trace carries vlmdoctor's metadata (its own run)"),
            ("trace.windows_from", "text", "where the step windows come from: ProfilerStep, or the whole trace"),
            ("trace.steps", "count", "steps analyzed (ProfilerStep windows, or 1 for the whole trace)"),
            ("trace.gpu_kernels", "bool", "the trace holds GPU kernels"),
            ("trace.partial", "bool", "some facts are left out (no GPU kernels, no step markers)"),
            ("trace.warnings", "list", "what the analysis could not do, in words"),
            (
                "trace.invalid_events",
                "count",
                "events left out of every fact for an unusable time (missing, not a number, NaN, negative, "
                "over 24 h, a start below 0, a GPU event longer than the trace); trace.warnings says which",
            ),
            ("step.ms", "ms", "mean step time (ProfilerStep span) over the traced steps"),
            ("step.ms_list", "ms list", "each traced step's time"),
            ("part.source", "text", "where model parts come from: vlmdoctor ranges, module hierarchy, none"),
        ],
    ),
    Fact(
        "trace.recorded.<option>",
        "bool",
        "the profiler option left its marks (record_shapes, profile_memory, with_stack)",
        ("trace",),
        DRIVER,
        joined=_ALL,
    ),
    Fact(
        "config.<knob>",
        "knob value",
        "the run config vlmdoctor recorded in the trace (rules read it for exceptions, never as the trigger)",
        ("run",),
        DRIVER,
    ),
    # --- run identity ----------------------------------------------------------------------------------------
    *_group(
        f"{_F}.identity",
        ("trace",),
        [
            ("run.stage", "1 or 2", "training stage: --stage, else the run config, else the estimate"),
            ("run.stage_source", "text", "where run.stage came from"),
            ("run.stage_estimate", "1 or 2", "stage 2 when the LLM's linear layers compute weight gradients"),
            ("run.stage_estimate_why", "text", "the evidence for the stage estimate, or why there is none"),
            ("run.model", "text", "model preset: --model, else the run config"),
            ("run.model_source", "text", "where run.model came from"),
            ("run.notes", "list", "where --stage / --model contradict the trace"),
        ],
    ),
    # --- GPU busy and idle -----------------------------------------------------------------------------------
    *_group(
        f"{_F}.busy",
        ("gpu",),
        [
            ("gpu.busy_ms", "ms/step", "union of kernel, memcpy and memset intervals inside the steps"),
            ("gpu.busy_ms_list", "ms list", "each step's GPU busy time"),
            ("gpu.idle_ms", "ms/step", "step time with no GPU work"),
            ("gpu.busy_frac", "fraction", "GPU busy time over the traced step time"),
            (
                "busy.<account>.ms",
                "ms/step",
                "GPU busy time given to one account: each moment to the first class running then (compute, then "
                "copies, then communication); the accounts add up to gpu.busy_ms",
            ),
        ],
    ),
    *_group(
        f"{_F}.idle",
        ("gpu",),
        [
            ("idle.data_loader.ms", "ms/step", "GPU idle while a DataLoader op ran on the host"),
            ("idle.data_loader.share", "fraction", "share of GPU idle time under a DataLoader op"),
            (
                "idle.data_loader.least_ms",
                "ms/step",
                "idle.data_loader.ms of the analyzed step that had least of it: the wait every step paid, "
                "without a stall that some steps had",
            ),
            ("idle.sync.ms", "ms/step", "GPU idle from host syncs (the sync and the relaunch after it)"),
            ("idle.sync.share", "fraction", "share of GPU idle time from host syncs"),
            (
                "idle.sync.loop_ms",
                "ms/step",
                "the part of idle.sync.ms opened by the training loop's own calls (outside the model's forward, "
                "backward, optimizer step and compilation)",
            ),
            (
                "idle.sync.by_code",
                "list",
                "idle.sync.ms told apart by whose code made the syncs (code: loop, model, backward, optimizer; "
                "calls and ms per step); compilation's syncs go to idle.host.compile, a data-parallel wrapper's "
                "waits for the other ranks to idle.host.ranks",
            ),
            ("idle.memcpy.ms", "ms/step", "GPU idle during host cudaMemcpy calls"),
            ("idle.memcpy.share", "fraction", "share of GPU idle time in cudaMemcpy"),
            ("idle.optimizer_host.ms", "ms/step", "GPU idle during the optimizer's host work"),
            ("idle.optimizer_host.share", "fraction", "share of GPU idle time in the optimizer's host work"),
            ("idle.other_host.ms", "ms/step", "GPU idle under other named host work: the sum of idle.host.<cause>.ms"),
            ("idle.other_host.share", "fraction", "share of GPU idle time under other named host work"),
            (
                "idle.host.<cause>.ms",
                "ms/step",
                "GPU idle given to one host cause, in order, from the innermost host event of any thread (a launch, "
                "an allocator call, a torch op, Python inside a step)",
            ),
            ("idle.unattributed.ms", "ms/step", "GPU idle under no host event and outside every step marker"),
            ("idle.unattributed.share", "fraction", "share of GPU idle time no cause covers"),
            ("idle.op.cudnn_attention.ms", "ms/step", "GPU idle under cuDNN attention ops (plans built on host)"),
            ("idle.top_host_ops", "list", "the innermost host ops the GPU waited on most (op, ms, share, cause)"),
        ],
    ),
    *_group(
        f"{_T}.cudnn_plan",
        ("gpu",),
        [
            ("cudnn_plan.calls", "calls/step", "cuDNN attention calls (a wrapper and its inner op counted once)"),
            ("cudnn_plan.long_calls", "calls/step", "those that held the host 1 ms or more (plan builds)"),
            ("cudnn_plan.idle_ms", "ms/step", "GPU idle time while the host was inside cuDNN attention calls"),
            ("cudnn_plan.step_share", "fraction", "that idle time over the step"),
        ],
    ),
    # --- kernel classes, GEMMs -------------------------------------------------------------------------------
    *_group(
        f"{_F}.kernels",
        ("gpu",),
        [
            ("kernels.<class>.ms", "ms/step", "GPU time of one kernel class"),
            ("kernels.<class>.count", "count/step", "kernels of one class"),
            ("kernels.<class>.share", "fraction", "share of all GPU time in one kernel class"),
            ("gemm.ms", "ms/step", "GPU time of all GEMM classes"),
            ("gemm.count", "count/step", "GEMM kernels"),
            ("gemm.fp32_share", "fraction", "share of GEMM time on scalar FP32 units (no tensor cores)"),
            ("gemm.tf32_share", "fraction", "share of GEMM time on TF32 tensor cores"),
            ("gemm.fp32_share_of_gpu", "fraction", "FP32 (non-tensor-core) GEMM time over all GPU time"),
            ("gemm.fp32_top_kernels", "list", "the three FP32 GEMM kernels that ran most often"),
            ("gemm.fp8_share", "fraction", "share of GEMM time already in FP8"),
            ("gemm.fp8_ms", "ms/step", "FP8 GEMM time"),
            ("gemm.bf16_ms", "ms/step", "bf16/fp16 tensor-core GEMM time"),
            ("gemm.bf16_share_of_gpu", "fraction", "bf16/fp16 tensor-core GEMM time over all GPU time"),
            ("gemm.bf16_mean_ms", "ms", "mean bf16/fp16 GEMM kernel time (how wide the GEMMs are)"),
            ("gemm.fp16_share", "fraction", "share of GEMM time in fp16 tensor-core kernels (fp16 autocast)"),
            ("attention.fp32_kernels", "count/step", "attention kernels running in FP32"),
            ("attention.kernel_share", "fraction", "share of GPU time in attention kernels"),
            ("liger.<liger>.launches", "count/step", "launches of one Liger kernel"),
            ("triton_compiled.launches", "count/step", "launches of torch.compile's (Inductor) Triton kernels"),
            ("optimizer.fused", "bool", "the optimizer ran fused kernels (FusedAdam)"),
        ],
    ),
    *_group(
        f"{_F}.launch",
        ("gpu",),
        [
            ("launch.kernels", "count/step", "kernels launched"),
            ("launch.tiny_kernel_frac", "fraction", "share of kernels shorter than 10 us (launch-bound)"),
            ("launch.api_ms", "ms/step", "host time in kernel-launch runtime calls"),
            ("launch.delay_us_median", "us", "median time from launch call to kernel start"),
            ("launch.delay_us_p90", "us", "90th percentile of launch-to-start delay"),
            (
                "launch.starved_ms",
                "ms/step",
                "GPU idle waiting for a kernel's launch: gaps under 1 ms closed by a kernel that started within 30 us "
                "of its launch call, not within 1 ms of a sync's return (the refill of the queue the sync drained)",
            ),
        ],
    ),
    # --- model parts and phases ------------------------------------------------------------------------------
    *_group(
        f"{_F}.parts",
        ("gpu", "stack"),
        [
            ("part.<part>.ms", "ms/step", "GPU time of kernels launched by one model part"),
            ("part.<part>.share", "fraction", "share of GPU time in one model part"),
            ("part.<part>.<phase>_ms", "ms/step", "GPU time of one model part in one phase"),
            ("attention.<part>.<phase>_ms", "ms/step", "attention (and softmax) kernel time of a part in a phase"),
        ],
    ),
    *_group(
        f"{_F}.parts",
        ("gpu",),
        [
            ("part.<slice>.ms", "ms/step", "GPU time outside the model parts (loss, optimizer, other, ...)"),
            ("part.<slice>.share", "fraction", "share of GPU time outside the model parts"),
            ("part.<slice>.<phase>_ms", "ms/step", "GPU time outside the model parts, by phase"),
            ("attention.<slice>.<phase>_ms", "ms/step", "attention kernel time outside the model parts, by phase"),
            ("phase.<phase>.ms", "ms/step", "GPU time of one phase (forward, backward, recompute, optimizer)"),
            ("recompute.ms", "ms/step", "GPU time re-running forward ops under backward (checkpointing)"),
            ("recompute.share", "fraction", "share of GPU time in recompute"),
            ("recompute.kind", "text", "reentrant, non_reentrant or none"),
            ("part.fp32_gemm_parts", "list", "the parts that ran FP32 (non-tensor-core) GEMMs"),
            ("optimizer.kernels", "count/step", "kernels launched under Optimizer.step (any class)"),
            (
                "optimizer.multi_tensor_kernels",
                "count/step",
                "of those, multi-tensor (foreach or fused) kernels; the rest are per-parameter kernels",
            ),
            ("gemm.bf16_llm_ms", "ms/step", "the LLM's bf16 GEMM time (what the fp8 knob converts)"),
        ],
    ),
    *_group(
        f"{_F}.memcpy",
        ("gpu",),
        [
            ("memcpy.<direction>.bytes", "bytes/step", "bytes copied in one direction"),
            ("memcpy.<direction>.ms", "ms/step", "copy time in one direction"),
            ("memcpy.pageable_count", "count/step", "copies from pageable (unpinned) host memory"),
        ],
    ),
    # --- work beside the model's own: evaluation forwards, determinism, the GradScaler, DDP's search ----------
    *_group(
        f"{_F}.side_work",
        ("trace",),
        [
            ("nograd.gemm_calls", "calls/step", "GEMM calls (linear, matmul, mm) from Python outside autograd"),
            ("autograd.gemm_calls", "calls/step", "GEMM calls from Python that autograd records (a training forward)"),
            ("nograd.loss_calls", "calls/step", "loss ops (cross entropy, NLL) computed outside autograd"),
            (
                "nograd.forwards",
                "count/step",
                "forwards under no_grad: runs of torch ops without an autograd sequence number holding a GEMM "
                "and a loss (an evaluation inside the step)",
            ),
            ("nograd.forward_ms", "ms/step", "host wall time of those forwards"),
            ("determinism.empty_fills", "calls/step", "fills of new uninitialized tensors (fill_ under empty)"),
            ("ddp.unused_searches", "calls/step", "DDP's search for unused parameters (find_unused_parameters)"),
            ("ddp.unused_search_ms", "ms/step", "host time of that search"),
            ("amp.scaler_calls", "calls/step", "GradScaler ops: inf check + unscale, scale update"),
        ],
    ),
    *_group(
        f"{_F}.side_work",
        ("gpu",),
        [
            ("nograd.forward_gpu_ms", "ms/step", "GPU time of the kernels those no-grad forwards launched"),
            ("determinism.fill_ms", "ms/step", "GPU time of those fills"),
            ("amp.scaler_gpu_ms", "ms/step", "GPU time of the GradScaler's kernels"),
        ],
    ),
    *_group(
        f"{_F}.moe",
        ("trace",),
        [("moe.grouped_mm_calls", "calls/step", "MoE expert GEMMs (torch._grouped_mm: all experts in one call)")],
    ),
    *_group(
        f"{_F}.moe",
        ("shapes",),
        [
            ("moe.experts", "count", "experts of the MoE layers (the grouped GEMM's weight batch)"),
            ("moe.tokens_per_expert", "rows", "routed token rows per expert in one forward grouped GEMM (mean)"),
        ],
    ),
    # --- host ops --------------------------------------------------------------------------------------------
    *_group(
        f"{_F}.host",
        ("gpu",),
        [
            ("attention.backend.<backend>.calls", "calls/step", "SDPA calls that took one backend"),
            (
                "compile.gpu_ms",
                "ms/step",
                "the model's GPU time launched by torch.compile'd graphs (CompiledFxGraph, CompiledFunction and its "
                "backward); Optimizer.step, copies and collectives left out",
            ),
            (
                "compile.gpu_share",
                "fraction",
                "that over all of the model's GPU time (Optimizer.step, copies and collectives left out): how much of "
                "the step ran compiled",
            ),
            (
                "compile.eager_ms",
                "ms/step",
                "GPU time launched inside compiled regions but outside their graphs: what graph breaks left to eager",
            ),
        ],
    ),
    *_group(
        f"{_F}.host",
        ("trace",),
        [
            ("attention.backends", "list", "the attention backends that ran (SDPA backends, flex)"),
            ("attention.eager_softmax_calls", "calls/step", "aten::_softmax calls (attention as matmul + softmax)"),
            ("attention.sdpa_calls", "calls/step", "scaled_dot_product_attention calls"),
            ("ops.fused_linear_cross_entropy", "bool", "a fused linear cross-entropy op ran (Liger FusedCE)"),
            ("ops.checkpoint_reentrant", "bool", "a reentrant checkpoint (CheckpointFunction) ran"),
            ("host.sync_calls", "calls/step", "runtime calls that made the host wait for the device"),
            ("host.sync_ops", "list", "the aten ops around those syncs (op, calls per step)"),
            ("host.allocator_calls", "calls/step", "cudaMalloc/cudaFree and pinned-memory calls (a warm step: none)"),
            ("compile.regions", "calls/step", "calls of torch.compile'd regions (Torch-Compiled Region ranges)"),
            ("compile.frames", "list", "the compiled frame/version pairs that ran (a version above 0: a recompile)"),
            (
                "compile.compiles",
                "count/step",
                "dynamo compiling a frame inside the traced steps (_compile.compile_inner): compilation or recompiles "
                "during training",
            ),
        ],
    ),
    *_group(
        f"{_F}.batches",
        ("shapes",),
        [
            (
                "shapes.micro_batches_per_step",
                "count/step",
                "micro-batches per step: LLM embedding calls, else "
                "estimated from forward/backward boundaries or loss calls",
            ),
            ("shapes.micro_batches_per_step.source", "text", "measured, or how it was estimated"),
            ("shapes.distinct_token_batches", "count", "distinct token-batch shapes (shape churn)"),
            ("shapes.token_batches", "list", "the token-batch shapes (batch x length)"),
            ("shapes.rows_per_micro_batch", "rows", "mean rows per LLM batch (fewer than samples when packed)"),
        ],
    ),
    *_group(
        f"{_F}.loss",
        ("shapes",),
        [
            ("loss.logits_elements", "elements", "elements of the largest logits tensor"),
            ("loss.logits_gb", "GiB", "size of the largest logits tensor"),
            ("loss.logits_dtype", "text", "dtype of the largest logits tensor"),
            ("loss.head_rows_per_step", "rows/step", "rows the LM head and loss ran on"),
            ("loss.head_rows_frac", "fraction", "those rows over all token positions of the batches"),
            (
                "loss.fce_logits_elements",
                "elements",
                "rows x vocabulary of Liger's fused linear cross entropy: the logits it never materializes",
            ),
        ],
    ),
    *_group(
        f"{_F}.attention",
        ("shapes", "stack"),
        [
            ("attention.<part>.head_dims", "list", "head dims of one part's SDPA calls"),
            ("attention.<part>.head_dim_pow2", "bool", "every head dim of the part is a power of two"),
            ("attention.<part>.fwd_tflop_per_step", "TFLOP/step", "forward attention FLOPs of the part"),
            ("attention.<part>.fwd_tflops", "TFLOP/s", "forward attention throughput of the part"),
            ("attention.<part>.dense_mask_share", "fraction", "share of the part's SDPA calls with a dense mask"),
        ],
    ),
    # --- causes, weighed by time (trace/attention_cause.py, trace/casts.py) ---------------------------------
    *_group(
        f"{_T}.attention_cause",
        ("trace",),
        [
            ("attention.<written>.blocks", "count/step", "attention blocks written out as matmul + softmax"),
            ("attention.<written>.ms", "ms/step", "their time (GPU kernels, or host ops on a CPU trace)"),
            ("attention.<written>.parts", "list", "the model parts they ran in"),
            ("attention.<written>.head_blocks", "count/step", "those in a pooling head (one query)"),
            ("attention.<written>.head_ms", "ms/step", "the pooling heads' time"),
            ("attention.eager.model_ms", "ms/step", "eager attention time less the pooling heads' (what SDPA fuses)"),
            ("attention.written_out.source", "text", "GPU kernels, or host ops (CPU trace)"),
            (
                "gemm.fp32_from_math_attention",
                "bool",
                "the FP32 GEMMs fit in SDPA's math-path attention, bf16 GEMMs elsewhere (GPU): not the weights'",
            ),
        ],
    ),
    *_group(
        f"{_T}.casts",
        ("gpu",),
        [
            ("casts.<cast>.count", "count/step", "cast ops of one kind that launched kernels"),
            ("casts.<cast>.ms", "ms/step", "their time"),
            ("casts.<cast>.share", "fraction", "their share of GPU time"),
            ("casts.classified_by", "text", "shapes (record_shapes), or the parent op"),
        ],
    ),
    # --- memory and the device -------------------------------------------------------------------------------
    *_group(
        f"{_F}.memory",
        ("gpu",),
        [("memory.device_total_gb", "GiB", "the GPU's memory (deviceProperties)")],
        joined=_MAX,
    ),
    *_group(
        f"{_F}.memory",
        ("gpu", "memory"),
        [
            ("memory.peak_allocated_gb", "GiB", "largest allocated total of the CUDA [memory] events"),
            ("memory.peak_reserved_gb", "GiB", "largest reserved total of the CUDA [memory] events"),
            ("memory.peak_allocated_frac", "fraction", "peak allocated memory over the GPU's memory"),
            ("memory.peak_reserved_frac", "fraction", "peak reserved memory over the GPU's memory"),
        ],
        joined=_MAX,
    ),
    *_group(
        f"{_F}.memory_live",
        ("gpu", "memory"),
        [
            ("memory.live.peak_gb", "GiB", "the largest allocated total, where the live blocks are counted"),
            ("memory.live.persistent_gb", "GiB", "of it, allocated before the traced window (weights, grads, state)"),
            ("memory.live.logits_gb", "GiB", "of it, the LM head's logits and the loss (copies, gradients)"),
            ("memory.live.vision_gb", "GiB", "of it, allocated by the vision tower"),
            ("memory.live.projector_gb", "GiB", "of it, allocated by the projector"),
            ("memory.live.activations_gb", "GiB", "of it, the LLM's forward activations"),
            ("memory.live.recompute_gb", "GiB", "of it, allocated while recomputing (gradient checkpointing)"),
            ("memory.live.backward_gb", "GiB", "of it, the LLM's backward buffers"),
            ("memory.live.optimizer_gb", "GiB", "of it, allocated by the optimizer step"),
            ("memory.live.other_gb", "GiB", "of it, allocated outside any op or part"),
            ("memory.live.largest", "text", "what holds the most of the peak, in words"),
            ("memory.live.largest_gb", "GiB", "how much that holds"),
            ("memory.live.logits_frac", "fraction", "the logits' share of the peak"),
            ("memory.live.top", "text", "the three largest holders with their GiB, in words"),
            (
                "memory.live.logits_bytes_per_element",
                "bytes",
                "live logits bytes at the peak per logits element (copies and gradients of one tensor)",
                "a trace with both shapes and memory events of the plain-CE path",
            ),
        ],
        joined=_MAX,
    ),
    *_group(
        f"{_F}.device",
        ("gpu",),
        [
            ("device.name", "text", "the GPU's name (deviceProperties)"),
            ("device.compute_capability", "number", "compute capability (deviceProperties, else the run's env)"),
        ],
    ),
    # --- FLOPs -----------------------------------------------------------------------------------------------
    *_group(
        f"{_F}.flops",
        ("gpu", "shapes"),
        [
            (
                "flops.model_tflop_per_step_upper",
                "TFLOP/step",
                "model FLOPs of the token batches, no padding subtracted (an upper bound)",
            ),
            ("flops.lm_head_tflop_per_step", "TFLOP/step", "LM head FLOPs on every position, fwd + bwd"),
            ("flops.vision_tflop_per_step", "TFLOP/step", "the vision tower's forward FLOPs for the step's images"),
            ("gpu.busy_tflops", "TFLOP/s", "model FLOPs over GPU busy time"),
            ("mfu.upper_bound", "fraction", "model FLOPs over step time and the GPU's peak (an upper bound)"),
        ],
    ),
    # --- CPU-only runs (trace/cpu_facts.py) ------------------------------------------------------------------
    *_group(
        f"{_T}.cpu_facts",
        ("cpu",),
        [
            ("cpu.capability", "text", "the CPU's ISA level vlmdoctor recorded with the run (AVX512, AMX, ...)"),
            ("cpu.probe.<dtype>_gflops", "GFLOP/s", "the CPU's matmul rate in a dtype, probed by the run"),
            ("cpu.cast.count", "count/step", "dtype casts"),
            ("cpu.cast.ms", "ms/step", "time in dtype casts"),
            ("cpu.cast.share", "fraction", "share of the step in dtype casts"),
            ("cpu.matmul.ms", "ms/step", "time in matmuls"),
            ("cpu.matmul.share", "fraction", "share of the step in matmuls"),
            ("cpu.matmul.<dtype>_ms", "ms/step", "matmul time in a dtype"),
            ("cpu.matmul.<dtype>_gflop", "GFLOP/step", "matmul work in a dtype"),
            ("cpu.matmul.<dtype>_gflops", "GFLOP/s", "matmul rate in a dtype"),
            ("cpu.matmul.dtypes", "list", "the dtypes matmuls ran in"),
            ("cpu.bf16_cost.ms", "ms/step", "time in low-precision matmuls and casts"),
            ("cpu.bf16_cost.share", "fraction", "share of the step in low-precision matmuls and casts"),
            ("cpu.lm_head.ms", "ms/step", "time in the LM head matmul"),
            ("cpu.data_loader.ms", "ms/step", "time in DataLoader ops"),
            ("cpu.loss.ms", "ms/step", "time in the loss ops, forward and backward"),
            ("cpu.optimizer.ms", "ms/step", "time in Optimizer.step"),
            ("cpu.data_loader.share", "fraction", "share of the step in DataLoader ops"),
            ("cpu.part.<part>.forward_ms", "ms/step", "a part's forward time"),
            ("cpu.part.<part>.backward_ms", "ms/step", "a part's backward time"),
            ("cpu.part.<part>.ms", "ms/step", "a part's time"),
            ("cpu.part.<part>.share", "fraction", "share of the step in a part"),
        ],
    ),
    Fact(
        "trace.cpu_only", "bool", "the trace ran on the CPU (no GPU kernels)", ("cpu",), f"{_T}.cpu_facts", joined=_ALL
    ),
    # --- training modes (trace/modes.py) ---------------------------------------------------------------------
    *_group(
        f"{_T}.modes",
        ("shapes",),
        [
            ("lora.lowrank_gemm_count", "count/step", "GEMMs with a low-rank (LoRA adapter) dimension"),
            ("lora.gemm_count", "count/step", "GEMMs with recorded shapes"),
            ("lora.lowrank_gemm_ms", "ms/step", "time in low-rank GEMMs"),
            ("lora.lowrank_gemm_share", "fraction", "share of GEMM time in low-rank GEMMs"),
            ("lora.lowrank_flop_share", "fraction", "share of GEMM FLOPs in low-rank GEMMs"),
            ("lora.rank", "rank", "the adapters' rank"),
            ("dpo.reference_fp32_gemm_share", "fraction", "share of the reference forward's GEMM FLOPs in FP32"),
        ],
    ),
    *_group(
        f"{_T}.modes",
        ("trace",),
        [
            ("qlora.dequant_count", "count/step", "4-bit dequantize kernels (GPU) or ops (CPU)"),
            ("qlora.dequant_ms", "ms/step", "time dequantizing"),
            ("qlora.dequant_share", "fraction", "share of GPU (or step) time dequantizing"),
            ("qlora.bf16_extra_gb", "GiB", "extra memory of a bf16 base instead of 4-bit"),
            ("dpo.reference_count", "count/step", "DPO reference forwards"),
            ("dpo.reference_ms", "ms/step", "time in the reference forward"),
            ("dpo.reference_share", "fraction", "share of the step in the reference forward"),
            ("dpo.reference_backward_nodes", "count/step", "backward nodes the reference forward recorded"),
            ("dpo.reference_backward_ms", "ms/step", "backward time spent on the reference"),
            ("dpo.reference_backward_share", "fraction", "share of the step in the reference's backward"),
            ("dpo.reference_weight_casts", "count/step", "weight casts inside the reference forward"),
            ("dpo.reference_cast_ms", "ms/step", "time in those casts"),
            ("dpo.reference_cast_share", "fraction", "share of the reference forward in casts"),
        ],
    ),
    Fact(
        "memory.headroom_gb",
        "GiB",
        "GPU memory free at the peak (total - peak reserved)",
        ("gpu", "memory"),
        f"{_T}.modes",
    ),
    # --- collectives of one rank (trace/comms.py) ------------------------------------------------------------
    *_group(
        f"{_T}.comms",
        ("collectives",),
        [
            ("comm.backend", "text", "nccl or gloo"),
            ("comm.parallel", "text", "ddp, fsdp2 or none"),
            ("comm.world_size", "ranks", "the process group's size"),
            ("comm.ms", "ms/step", "time in collectives"),
            ("comm.exposed_ms", "ms/step", "collective time with no compute alongside"),
            ("comm.hidden_ms", "ms/step", "collective time overlapped with compute"),
            ("comm.overlap_frac", "fraction", "hidden over all collective time"),
            ("comm.exposed_share", "fraction", "exposed collective time over the step"),
            ("comm.count", "count/step", "collectives"),
            ("comm.kinds", "list", "the collectives that ran"),
            ("comm.<kind>.count", "count/step", "collectives of one kind"),
            ("comm.<kind>.ms", "ms/step", "time in one kind of collective"),
            ("comm.<kind>.exposed_ms", "ms/step", "exposed time of one kind"),
            ("comm.<kind>.bytes", "bytes/step", "bytes moved by one kind"),
            ("comm.<kind>.algbw_gbps", "GB/s", "algorithm bandwidth of one kind"),
            ("comm.<kind>.busbw_gbps", "GB/s", "bus bandwidth of one kind (nccl-tests' factors)"),
            ("comm.fsdp.all_gathers", "count/step", "FSDP parameter all-gathers"),
            ("comm.fsdp.prefetched_frac", "fraction", "all-gathers issued before the compute that needs them"),
            ("comm.fsdp.<phase>_prefetched_frac", "fraction", "the same, in forward or backward"),
            ("comm.micro_batches_per_step", "count/step", "micro-batches per step (from the loss calls)"),
            ("comm.synced_micro_batches_per_step", "count/step", "micro-batches followed by a gradient sync"),
            ("comm.grad_sync.extra_ms", "ms/step", "collective time of gradient syncs beyond one per step"),
            ("comm.grad_sync.extra_bytes", "bytes/step", "bytes of gradient syncs beyond one per step"),
        ],
    ),
    # --- the ranks of one job together (trace/ranks.py) ------------------------------------------------------
    *_group(
        f"{_T}.ranks",
        ("ranks",),
        [
            ("dist.ranks", "count", "rank traces read"),
            ("dist.world_size", "ranks", "the job's world size"),
            ("dist.backend", "text", "the ranks' collective backend"),
            ("dist.parallel", "text", "ddp, fsdp2 or none"),
            ("dist.step.ms", "ms", "mean step time over the ranks"),
            ("dist.step_ms_spread", "ms", "slowest minus fastest rank's step time"),
            ("dist.straggler.rank", "rank", "the rank with the most GPU work"),
            ("dist.step_skew_ms", "ms", "the slowest rank's busy time above the median of the other ranks'"),
            ("dist.step_skew_frac", "fraction", "that skew over the step"),
            ("dist.straggler.excess_ms", "ms", "the straggler's busy time above the mean"),
            ("dist.straggler.tokens_excess_frac", "fraction", "the straggler's tokens above the others' mean"),
            ("dist.straggler.loader_excess_ms", "ms", "the straggler's data-loader time above the others'"),
            ("dist.straggler.gap_excess_ms", "ms", "the straggler's host gaps above the others'"),
            (
                "dist.straggler.gemm_excess_frac",
                "fraction",
                "the straggler's GEMM time above the others' mean (its work, where tokens are not recorded)",
            ),
            (
                "dist.straggler.accounts",
                "list",
                "the straggler's step accounts above the others' mean, largest first (account, excess_ms, meaning)",
            ),
            (
                "dist.straggler.cause",
                "text",
                "tokens, gemm_work, data_loader, host_gaps, the account that grew most, balanced or unexplained",
            ),
            ("dist.late_wait_ms", "ms", "mean time ranks wait for the last one at a collective"),
            ("dist.late_wait_ms_max", "ms", "the largest such wait"),
            ("dist.comm.ms", "ms/step", "mean collective time over the ranks"),
            ("dist.comm.exposed_ms", "ms/step", "mean exposed collective time"),
            ("dist.comm.hidden_ms", "ms/step", "mean hidden collective time"),
            ("dist.comm.exposed_own_ms", "ms/step", "exposed time less waiting for late ranks"),
            ("dist.comm.exposed_share", "fraction", "that over the step"),
            ("dist.comm.kinds", "list", "the collectives that ran"),
            ("dist.comm.<kind>.exposed_own_ms", "ms/step", "exposed own time of one kind"),
            ("dist.comm.<kind>.ms", "ms/step", "mean time of one kind"),
            ("dist.comm.<kind>.exposed_ms", "ms/step", "mean exposed time of one kind"),
            ("dist.comm.<kind>.count", "count/step", "mean count of one kind"),
            ("dist.comm.<kind>.bytes", "bytes/step", "mean bytes of one kind"),
            ("dist.comm.<kind>.busbw_gbps", "GB/s", "mean bus bandwidth of one kind"),
            ("dist.fsdp.prefetched_frac", "fraction", "mean FSDP prefetched share"),
            ("dist.fsdp.<phase>_prefetched_frac", "fraction", "mean FSDP prefetched share in a phase"),
            ("dist.micro_batches_per_step", "count/step", "mean micro-batches per step"),
            ("dist.synced_micro_batches_per_step", "count/step", "mean synced micro-batches per step"),
            ("dist.grad_sync.extra_ms", "ms/step", "mean extra gradient-sync time"),
            ("dist.grad_sync.extra_bytes", "bytes/step", "mean extra gradient-sync bytes"),
            ("dist.grad_gb", "GiB", "bytes one gradient sync moves (the trained parameters' gradients)"),
            ("dist.batch_size", "rows", "the smallest micro-batch a rank ran"),
        ],
    ),
    # --- the untraced run (trace/measured.py, from a profile report) -----------------------------------------
    *_group(
        MEASURED,
        ("report",),
        [
            ("data.pad_fraction", "fraction", "padding tokens over all positions of the batches"),
            ("data.real_tokens_per_s", "tokens/s", "non-padding tokens per second (untraced windows)"),
            ("data.loss_token_frac", "fraction", "labeled positions over all positions of the batches"),
            ("mfu", "fraction", "model FLOPs per second over the GPU's peak (untraced windows)"),
            ("measured.gpu.busy_frac", "fraction", "GPU busy time per traced step over the untraced median step"),
            ("measured.memory.peak_allocated_gb", "GiB", "peak allocated memory the run measured"),
            ("measured.memory.peak_reserved_gb", "GiB", "peak reserved memory the run measured"),
            ("measured.memory.device_total_gb", "GiB", "the GPU's memory, as the run measured it"),
            ("measured.memory.peak_allocated_frac", "fraction", "measured peak allocated over the GPU's memory"),
            ("measured.memory.peak_reserved_frac", "fraction", "measured peak reserved over the GPU's memory"),
            (
                "measured.device.compute_capability",
                "number",
                "compute capability the run recorded, for a GPU trace without deviceProperties",
                "a GPU trace without deviceProperties and its report; the "
                "committed GPU traces all carry deviceProperties",
            ),
        ],
    ),
]


def lookup(name: str) -> Fact | None:
    """The catalogue entry a fact name belongs to (a literal entry before a template)."""
    for f in FACTS:
        if f.name == name:  # a literal name, or a template asked for by its own name
            return f
    for f in FACTS:
        if f.is_template and f.pattern.fullmatch(name):
            return f
    return None


def by_producer(producer: str) -> list[Fact]:
    """The facts one module declares it produces."""
    return [f for f in FACTS if f.producer == producer]


def known(name: str) -> bool:
    """A fact vlmdoctor can produce (rules may read only these, and `patch.<knob>`)."""
    return lookup(name) is not None


def missing_hint(name: str, facts: dict[str, Any]) -> str | None:
    """The profiler option that would have recorded a missing fact, when the trace shows it was off."""
    f = lookup(name)
    if f is None:
        return None
    for need in _HINTED:
        if need in f.needs and not _HINTED[need](facts):
            if need == "stack" and not any(f".{p}." in f".{name}." for p in MODEL_PARTS):
                continue
            return NEEDS[need]
    return None


def gpu_only(name: str) -> bool:
    """A fact only GPU kernels give (its entry needs a GPU trace): on a CPU-only trace a rule that reads one does
    not apply, rather than being unmeasured."""
    f = lookup(name)
    return f is not None and "gpu" in f.needs


def is_measured(name: str) -> bool:
    """A fact of the untraced run: a rule reads it where the run measured it, else falls back to the trace's."""
    return name.startswith("measured.")


def suggest(name: str) -> list[str]:
    """Close catalogue names, for "did you mean"."""
    return difflib.get_close_matches(name, [f.name for f in FACTS], n=3, cutoff=0.6)


# --- what `vlmdoctor facts` prints, and the generated tables of the docs ------------------------------------------


def module_path(producer: str) -> str:
    """A producer module as the file a reader opens: vlmdoctor/trace/families/idle.py."""
    return producer.replace(".", "/") + ".py"


def describe(f: Fact) -> dict[str, Any]:
    """One fact as `vlmdoctor facts NAME --json` gives it."""
    return {
        "name": f.name,
        "unit": f.unit,
        "meaning": f.meaning,
        "computed_in": module_path(f.producer),
        "recorded_by": [NEEDS[n] for n in f.needs],
        "template": f.is_template,
        **({"values": {p: PLACEHOLDERS[p][1] for p in re.findall(r"<([a-z]+)>", f.name)}} if f.is_template else {}),
        **({"ranks": f.joined} if f.joined else {}),
        **({"no_fixture": f.unfixtured} if f.unfixtured else {}),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_facts() -> str:
    """The table of every fact, for docs/analysis.md."""
    rows = ["| fact | unit | needs | computed in | meaning |", "|---|---|---|---|---|"]
    for f in FACTS:
        meaning = f.meaning + (f"; {f.joined}" if f.joined else "")
        rows.append(
            f"| `{f.name}` | {_cell(f.unit)} | {', '.join(f.needs)} | `{module_path(f.producer)}` | {_cell(meaning)} |"
        )
    rows += ["", "| needs | what records it |", "|---|---|"]
    rows += [f"| {k} | {_cell(v)} |" for k, v in NEEDS.items()]
    rows += ["", "| placeholder | stands for |", "|---|---|"]
    rows += [f"| `<{k}>` | {_cell(d)} |" for k, (_, d) in PLACEHOLDERS.items()]
    return "\n".join(rows) + "\n"


def markdown_families() -> str:
    """The table of producer modules and the facts each computes, for docs/architecture.md."""
    rows = ["| module | facts it computes |", "|---|---|"]
    for p in dict.fromkeys(f.producer for f in FACTS):
        rows.append(f"| `{module_path(p)}` | {', '.join(f'`{f.name}`' for f in by_producer(p))} |")
    return "\n".join(rows) + "\n"


#: the generated tables of the docs: (file under docs/, table)
GENERATED = {"facts": ("analysis.md", markdown_facts), "families": ("architecture.md", markdown_families)}
_BEGIN = "<!-- {} table: generated from vlmdoctor/trace/catalog.py (python -m vlmdoctor.trace.catalog) -->\n"
_END = "<!-- end of the generated {} table -->\n"


def with_generated(text: str, which: str) -> str:
    """A doc's text with its generated table rewritten from the catalogue."""
    return docgen.with_generated(
        text, _BEGIN.format(which), _END.format(which), GENERATED[which][1](), f"{which} table"
    )


if __name__ == "__main__":  # rewrite the docs' generated tables: python -m vlmdoctor.trace.catalog
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    for which, (name, _) in GENERATED.items():
        path = docs / name
        path.write_text(with_generated(path.read_text(), which))
        print(f"wrote the {which} table of {path}")
