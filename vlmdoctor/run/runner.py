"""Runs real training steps of the VLM described by a run config and measures them.

One configuration per process: Liger patches transformers classes globally and cannot be
undone, so a second configuration in the same process would measure a mix. `run_isolated`
starts a fresh interpreter for each configuration.

Every timed step is a full optimizer step: data fetch, host-to-device copy, forward, backward
and a real AdamW update (the seed's benchmark left the optimizer out), followed by a device
synchronize so that wall time is what the GPU really took.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vlmdoctor import SCHEMA_VERSION, __version__, supervise
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_NAN, EXIT_OK, EXIT_OOM, UsageError, is_out_of_memory
from vlmdoctor.run import distributed, envinfo, flops, fp8, metrics, modes, native, throughput
from vlmdoctor.run.capture import TraceOptions, capture, lost_note, measured_metadata, trace_path
from vlmdoctor.run.compile import compile_vlm, compiled, graphs_compiled, mark_lengths_dynamic
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.data import (
    BatchSampler,
    Collator,
    LlavaFile,
    PairCollator,
    PreferenceFile,
    SyntheticPairs,
    SyntheticVQA,
)
from vlmdoctor.run.model import (
    VLM,
    apply_stage,
    build_model,
    enable_gradient_checkpointing,
    enable_input_require_grads,
    param_counts,
)
from vlmdoctor.run.zoo import ModelSpec, resolve
from vlmdoctor.supervise import scratch_dir

Progress = Callable[[str, int, int], None]

GPU_ONLY_ATTENTION = ("efficient", "cudnn")


def _quiet(*_: Any) -> None:
    pass


def resolve_device(cfg: RunConfig) -> torch.device:
    """auto -> the GPU when there is one; a GPU preset without a GPU is a user error with a hint."""
    has_gpu = torch.cuda.is_available()
    if cfg.device == "cuda" and not has_gpu:
        raise UsageError(
            "--device cuda asked for, but no CUDA GPU is visible; run on CPU with: "
            "vlmdoctor profile --model tiny --device cpu"
        )
    if cfg.device == "auto" and not has_gpu:
        if cfg.model != "tiny" and not cfg.model.startswith("tiny-"):
            raise UsageError(
                f"no CUDA GPU found for the {cfg.model!r} preset; to run on CPU use: "
                "vlmdoctor profile --model tiny --device cpu (or pass --device cpu to force this preset)"
            )
        return torch.device("cpu")
    return torch.device("cuda" if cfg.device in ("auto", "cuda") else "cpu")


def preflight(cfg: RunConfig, spec: ModelSpec | native.NativeSpec, device: torch.device) -> None:
    """Combinations that cannot run here fail before anything is built."""
    if isinstance(spec, native.NativeSpec):
        native.check_native(cfg, spec, device)
    modes.check_mode_device(cfg, device)
    if cfg.fp8 != "off":
        fp8.check_device(cfg, device)
    if cfg.uses_liger:
        if device.type != "cuda":
            raise UsageError(
                "Liger kernels are Triton GPU kernels and cannot run on the CPU; drop the --liger-* flags "
                "or run on a CUDA GPU"
            )
        if isinstance(spec, ModelSpec) and spec.llm["family"] not in ("qwen2", "llama"):
            raise UsageError(f"Liger patches exist for qwen2 and llama LLMs, not {spec.llm['family']}")
        try:
            import liger_kernel.transformers  # noqa: F401
        except Exception as e:
            raise UsageError(
                f"Liger asked for but liger-kernel cannot be imported ({type(e).__name__}: {e}); "
                "install it with: pip install 'vlmdoctor[liger]'"
            ) from None
    if cfg.unsloth:
        check_unsloth(cfg, spec, device)
    if cfg.parallel != "none" and (cfg.train != "full" or cfg.objective != "sft"):
        raise UsageError(
            f"--train {cfg.train} --objective {cfg.objective} runs in one process for now; drop "
            f"--parallel {cfg.parallel} (LoRA, QLoRA and DPO under DDP/FSDP2 are not built yet)"
        )
    if cfg.compile_vision != "model":
        if cfg.parallel != "none":
            raise UsageError(
                f"--compile-vision {cfg.compile_vision} compiles the tower of one unwrapped model; with "
                f"--parallel {cfg.parallel} use --compile (and --compile-regions) instead"
            )
        if isinstance(spec, native.NativeSpec):
            raise UsageError(
                f"--compile-vision {cfg.compile_vision} compiles the composite model's tower on its own; "
                f"the native preset {cfg.model!r} is compiled as one module: drop it"
            )
        if cfg.cache_vision_features:
            raise UsageError(
                f"--compile-vision {cfg.compile_vision} compiles the tower, but --cache-vision-features "
                "takes the tower out of the step; drop one of them"
            )
    if cfg.compile == "reduce-overhead" and device.type != "cuda":
        raise UsageError(
            "--compile reduce-overhead uses CUDA graphs, which exist only on CUDA; use --compile default on CPU"
        )
    if cfg.attention in GPU_ONLY_ATTENTION and device.type != "cuda":
        raise UsageError(f"the {cfg.attention!r} SDPA backend exists only on CUDA; use sdpa, math or eager on CPU")
    if cfg.attention == "flex" and device.type != "cuda":
        raise UsageError(
            f"--attention flex trains only on CUDA: FlexAttention has no backward on {device.type} "
            f"(torch {torch.__version__.split('+')[0]}); use --attention sdpa here"
        )
    if cfg.packing and cfg.attention == "eager":
        raise UsageError(
            "packing runs on SDPA or FlexAttention here, not eager attention (it writes out every "
            "row's full score matrix); use --attention flex (it skips the blocks between samples) or sdpa"
        )
    if cfg.data == "synthetic" and cfg.num_samples < cfg.batch_size * cfg.grad_accum * cfg.nproc_per_node:
        raise UsageError(
            "--num-samples must hold at least one optimizer step of samples"
            + (" on every rank" if cfg.nproc_per_node > 1 else "")
        )
    if distributed.is_distributed(cfg):
        distributed.check_launch(cfg, device)


#: what Unsloth needs importable besides itself (its own imports; docs/unsloth.md lists the full set)
UNSLOTH_NEEDS = ("unsloth", "unsloth_zoo", "bitsandbytes", "trl", "peft", "accelerate")
#: LLM families whose class Unsloth patches, and the Unsloth class that patches it
UNSLOTH_CLASSES = {
    "llama": ("unsloth.models.llama", "FastLlamaModel"),
    "qwen2": ("unsloth.models.qwen2", "FastQwen2Model"),
}


def check_unsloth(cfg: RunConfig, spec: ModelSpec | native.NativeSpec, device: torch.device) -> None:
    """Unsloth's requirements, each refused in one line before anything is built or imported."""
    import importlib.util

    if isinstance(spec, native.NativeSpec):
        raise UsageError(
            f"--unsloth patches the composite model's LLM class; the native preset {cfg.model!r} is not "
            "supported: use a composite preset (0.5b, dino-135m, ...)"
        )
    if spec.llm["family"] not in UNSLOTH_CLASSES:
        raise UsageError(
            f"Unsloth's fast path exists here for {', '.join(UNSLOTH_CLASSES)} LLMs, not {spec.llm['family']}"
        )
    if device.type != "cuda":
        raise UsageError(
            "Unsloth needs a CUDA GPU (its kernels are Triton GPU kernels and its import refuses a "
            "machine without one); drop --unsloth or run on a CUDA GPU"
        )
    if cfg.weight_dtype != "bf16":
        raise UsageError("Unsloth's fast path trains 16-bit weights; add --weight-dtype bf16 with --unsloth")
    missing = [name for name in UNSLOTH_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"--unsloth asked for, but {', '.join(missing)} cannot be imported; install with: "
            "pip install unsloth (it brings unsloth_zoo, bitsandbytes, xformers, trl; docs/unsloth.md)"
        )


def apply_unsloth(family: str) -> None:
    """Unsloth's fast forwards on the LLM's transformers class, before the LLM is built.

    `FastLanguageModel.from_pretrained` needs a checkpoint and a tokenizer on disk; the composite
    model builds its LLM from a shipped config with random weights, so the same class patches are
    applied directly (`pre_patch`: fast attention with Unsloth's RoPE kernel, decoder layers with its
    RMSNorm kernel, its cross entropy in the causal-LM forward). They are process-wide, so a run with
    --unsloth is one process (profile runs one config; treat runs each trial in its own process).
    """
    import importlib

    module, cls = UNSLOTH_CLASSES[family]
    try:
        import unsloth  # noqa: F401  (its import patches transformers and checks the GPU)

        getattr(importlib.import_module(module), cls).pre_patch()
    except Exception as e:
        raise UsageError(
            f"Unsloth could not be loaded ({type(e).__name__}: {_first_line(e)}); see docs/unsloth.md "
            "for the versions it needs"
        ) from None


def resolve_model(cfg: RunConfig) -> ModelSpec | native.NativeSpec:
    """The composite spec, or a native class's spec for the native presets."""
    if native.is_native(cfg.model):
        return native.resolve_native(cfg.model)
    try:
        return resolve(cfg.model, cfg.vision, cfg.llm, cfg.projector, cfg.pixel_shuffle)
    except UsageError as e:
        if cfg.model in str(e):  # an unknown preset: list the native ones too
            raise UsageError(f"{e}, {', '.join(native.native_presets())}") from None
        raise


def check(cfg: RunConfig) -> tuple[ModelSpec | native.NativeSpec, torch.device]:
    """Everything that can be refused without building anything: names, then hardware, then combinations."""
    spec = resolve_model(cfg)
    device = resolve_device(cfg)
    preflight(cfg, spec, device)
    return spec, device


# ------------------------------------------------------------------------------------------------
@dataclass
class Patient:
    """Everything a timed step needs, built from one run config."""

    cfg: RunConfig
    spec: ModelSpec | native.NativeSpec
    device: torch.device
    model: torch.nn.Module
    vlm: VLM | native.NativeVLM
    optimizer: torch.optim.Optimizer
    batches: Iterator[dict[str, Any]]
    flop_model: flops.FlopModel
    data_info: dict[str, Any] = field(default_factory=dict)
    dist: distributed.Dist | None = None  # this rank's place, in a run under torchrun
    wrap_info: dict[str, Any] | None = None
    flop_mode: flops.Mode = field(default_factory=flops.Mode)
    reference: modes.Reference | None = None
    mode_info: dict[str, Any] = field(default_factory=dict)

    def step_flops(self, counts: dict[str, Any]) -> float:
        head = counts["loss_tokens"] if self.cfg.lm_head_labeled_only else None
        return self.flop_model.step(
            counts["lengths"], self.cfg.stage, self.cfg.cache_vision_features, head, self.flop_mode
        )["total"]


def _attention_context(backend: str):
    """The SDPA backend pinned around the step; sdpa, eager and flex choose their kernels themselves."""
    if backend in ("sdpa", "eager", "flex"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[backend]
    )


def _apply_liger(vlm: VLM, cfg: RunConfig) -> None:
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

    fn = {"qwen2": apply_liger_kernel_to_qwen2, "llama": apply_liger_kernel_to_llama}[vlm.spec.llm["family"]]
    fn(
        rope=cfg.liger_rope,
        rms_norm=cfg.liger_rms_norm,
        swiglu=cfg.liger_swiglu,
        cross_entropy=False,
        fused_linear_cross_entropy=cfg.liger_fused_linear_cross_entropy,
        model=vlm.llm,
    )


def _cycle(loader) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def _batch_sampler(cfg: RunConfig, lengths: list[int], dist: distributed.Dist | None):
    """One process: the sampler itself. Several: global batches of batch_size x ranks, each rank its shard."""
    bucketed = cfg.sampler == "length_bucketed"
    if dist is None:
        return BatchSampler(lengths, cfg.batch_size, bucketed, cfg.seed)
    if len(lengths) < cfg.batch_size * dist.world:
        raise UsageError(
            f"the data holds {len(lengths)} usable samples, fewer than one batch of {cfg.batch_size} "
            f"on each of {dist.world} ranks"
        )
    inner = BatchSampler(lengths, cfg.batch_size * dist.world, bucketed, cfg.seed)
    return distributed.RankBatches(inner, lengths, dist.rank, dist.world, cfg.balance_tokens)


def _finish_model(
    cfg: RunConfig,
    vlm: torch.nn.Module,
    device: torch.device,
    dist: distributed.Dist | None,
    compile_fn: Callable[[torch.nn.Module], torch.nn.Module],
) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any] | None]:
    """Wrap for data parallelism (FSDP2 replaces parameters, so before the optimizer), compile, optimizer."""
    info = None
    model: torch.nn.Module = vlm
    if dist is not None and cfg.parallel == "fsdp2":
        model, info = distributed.wrap(vlm, cfg, dist, device)
    if cfg.compile != "off":
        model = compile_fn(model)
    if dist is not None and cfg.parallel == "ddp":
        model, info = distributed.wrap(model, cfg, dist, device)
    params = [p for p in vlm.parameters() if p.requires_grad]
    optimizer = modes.make_optimizer(params, cfg)
    return model, optimizer, info


def build_patient(
    cfg: RunConfig, device: torch.device, progress: Progress = _quiet, dist: distributed.Dist | None = None
) -> Patient:
    spec = resolve_model(cfg)
    preflight(cfg, spec, device)
    torch.manual_seed(cfg.seed)
    torch.set_float32_matmul_precision("high" if cfg.allow_tf32 else "highest")
    progress("building model", 0, 1)
    if isinstance(spec, native.NativeSpec):
        return _native_patient(cfg, spec, device, dist)
    if cfg.unsloth:
        apply_unsloth(spec.llm["family"])
    vlm = build_model(spec, cfg.weight_dtype, cfg.attention, cfg.weights, device)
    apply_stage(vlm, cfg.stage)
    vlm.vision_no_grad = cfg.vision_no_grad
    vlm.fused_ce = cfg.liger_fused_linear_cross_entropy
    if cfg.uses_liger:
        _apply_liger(vlm, cfg)
    mode_info = _apply_train_mode(vlm.llm, cfg, device)
    if cfg.fp8 != "off":
        mode_info["fp8"] = fp8.convert(vlm.llm, cfg.fp8, pad_inner_dim=not fp8.tokens_aligned(cfg))
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(vlm, cfg.checkpoint_use_reentrant)
    if cfg.input_require_grads:
        enable_input_require_grads(vlm)

    dpo = cfg.objective == "dpo"
    if cfg.data == "synthetic":
        dataset: SyntheticVQA | LlavaFile = (SyntheticPairs if dpo else SyntheticVQA)(spec, cfg.num_samples, cfg.seed)
        pad_id = spec.llm["special_tokens"]["pad"]
        data_info = {"source": "synthetic", "length_model": dataset.lm["name"], "samples": len(dataset)}
    else:
        dataset = (PreferenceFile if dpo else LlavaFile)(cfg.data, cfg.tokenizer, spec, cfg.bad_records)
        pad_id = dataset.ids["pad"]
        vlm.image_pad_id = dataset.ids["image_pad"]
        data_info = {
            "source": cfg.data,
            "records": dataset.stats.records,
            "skipped": dataset.stats.skipped,
            "problems": dataset.stats.problems[:20],
            "samples": len(dataset),
        }
    if len(dataset) < cfg.batch_size:
        raise UsageError(f"the data holds {len(dataset)} usable samples, fewer than one batch of {cfg.batch_size}")

    features = None
    if cfg.cache_vision_features:
        progress("caching vision features", 0, 1)
        features = _cache_features(vlm, dataset, cfg, device)
        dataset.with_pixels = False
    collator = Collator(
        pad_id, cfg.pad_to_multiple_of, cfg.packing, cfg.pack_length, features, cfg.lm_head_labeled_only
    )
    return _assemble(
        cfg,
        spec,
        device,
        vlm,
        vlm.projector,
        dataset,
        collator,
        flops.FlopModel.from_spec(spec),
        data_info,
        mode_info,
        dist,
    )


def _assemble(
    cfg: RunConfig,
    spec: ModelSpec | native.NativeSpec,
    device: torch.device,
    vlm: torch.nn.Module,
    projector: torch.nn.Module,
    dataset: Any,
    collator: Any,
    flop_model: flops.FlopModel,
    data_info: dict[str, Any],
    mode_info: dict[str, Any],
    dist: distributed.Dist | None,
) -> Patient:
    """What the composite model and a native class share once built: the loader, the DPO reference, the
    optimizer and compile, or the DDP/FSDP2 wrapper (which makes its own optimizer)."""
    dpo = cfg.objective == "dpo"
    if dpo:
        collator = PairCollator(collator)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=_batch_sampler(cfg, dataset.lengths, dist),
        collate_fn=collator,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )
    reference = modes.Reference(vlm, cfg, projector) if dpo else None
    if dist is None:
        params = [p for p in vlm.parameters() if p.requires_grad]
        optimizer = modes.make_optimizer(params, cfg)
        model = compile_vlm(vlm, cfg.compile, cfg.compile_vision, cfg.compile_shape_padding, cfg.compile_regions)
        info = None
    else:
        model, optimizer, info = _finish_model(cfg, vlm, device, dist, lambda m: _compile_wrapped(m, cfg))
    patient = Patient(
        cfg,
        spec,
        device,
        model,
        vlm,
        optimizer,
        _cycle(loader),
        flop_model,
        data_info,
        dist,
        info,
        reference=reference,
    )
    return _with_mode(patient, mode_info, dataset, collator)


def _apply_train_mode(llm: torch.nn.Module, cfg: RunConfig, device: torch.device) -> dict[str, Any]:
    """LoRA (on a 4-bit base for QLoRA) on the LLM; nothing for full training."""
    info: dict[str, Any] = {"train": cfg.train, "objective": cfg.objective}
    if cfg.train == "full":
        return info
    if cfg.train == "qlora":
        info["quantized_linear_layers"] = modes.quantize_nf4(llm)
    adapted = modes.apply_lora(llm, cfg)
    info.update(
        lora_rank=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_targets=list(modes.target_names(cfg.lora_targets)),
        adapted_layers=len(adapted),
        adapter_params=modes.adapter_params(llm),
    )
    return info


def _with_mode(p: Patient, info: dict[str, Any], dataset: Any, collator: Any) -> Patient:
    """The mode's FLOP terms and report section; the reference pass over the data when precomputing."""
    if p.reference is not None:
        info["reference"] = (
            "adapters disabled + projector snapshot"
            if p.reference.shared
            else f"deep copy ({p.cfg.dpo_reference_dtype})"
        )
        info["reference_mb"] = p.reference.params_bytes() / 2**20
        info["reference_no_grad"] = p.cfg.dpo_reference_no_grad
    p.flop_mode = flops.Mode(
        p.cfg.train, int(info.get("adapter_params", 0)), p.cfg.objective, not p.cfg.dpo_precompute_reference
    )
    p.mode_info = info
    if p.reference is not None and p.cfg.dpo_precompute_reference:
        info["precompute"] = _precompute_reference(p, dataset, collator)
    return p


def _precompute_reference(p: Patient, dataset: Any, collator: Any) -> dict[str, Any]:
    """Reference log-probs of every pair, once, before warm-up (not timed; its wall time is reported)."""
    t0 = time.perf_counter()
    dtype = _input_dtype(p)
    ref, b = p.reference, p.cfg.batch_size
    flop_total = 0.0
    for start in range(0, len(dataset), b):
        batch = collator([dataset[i] for i in range(start, min(start + b, len(dataset)))])
        counts, index = batch.pop("counts"), batch.pop("pair_index")
        batch = _to_device(batch, p.device, dtype)
        labels = batch.pop("labels")
        with torch.no_grad(), _attention_context(p.cfg.attention), _autocast(p.cfg, p.device):
            logps = ref.logps(batch, labels).float().cpu()
        n = len(index)
        for k, i in enumerate(index):
            ref.cache[i] = (float(logps[k]), float(logps[n + k]))
        fwd = p.flop_model.step(counts["lengths"], p.cfg.stage, False, None, flops.Mode(objective="dpo"))
        flop_total += fwd["reference"]
    _sync(p.device)
    return {"pairs": len(ref.cache), "wall_s": time.perf_counter() - t0, "tflop": flop_total / 1e12}


def _input_dtype(p: Patient) -> torch.dtype:
    return p.vlm.input_dtype if isinstance(p.vlm, native.NativeVLM) else p.vlm.projector.dtype


def _native_patient(
    cfg: RunConfig, spec: native.NativeSpec, device: torch.device, dist: distributed.Dist | None = None
) -> Patient:
    """A native transformers class on the same synthetic data, collation and optimizer as the composite model."""
    vlm = native.build_native(spec, cfg.weight_dtype, cfg.attention, cfg.weights, device)
    native.configure(vlm, cfg, lambda: _apply_train_mode(vlm.parts["llm"], cfg, device))
    if cfg.fp8 != "off":  # the LLM part of a native class holds the decoder layers (its LM head sits outside)
        vlm.mode_info = {
            **getattr(vlm, "mode_info", {"train": cfg.train, "objective": cfg.objective}),
            "fp8": fp8.convert(vlm.parts["llm"], cfg.fp8, pad_inner_dim=not fp8.tokens_aligned(cfg)),
        }
    dpo = cfg.objective == "dpo"
    dataset = (SyntheticPairs if dpo else SyntheticVQA)(spec, cfg.num_samples, cfg.seed)  # type: ignore[arg-type]
    data_info = {"source": "synthetic", "length_model": dataset.lm["name"], "samples": len(dataset)}
    if len(dataset) < cfg.batch_size:
        raise UsageError(f"the data holds {len(dataset)} usable samples, fewer than one batch of {cfg.batch_size}")
    collator = Collator(
        spec.llm["special_tokens"]["pad"], cfg.pad_to_multiple_of, labeled_only=cfg.lm_head_labeled_only
    )
    # preflight refused --compile-vision on native classes, so compile_vlm compiles the whole model here
    return _assemble(
        cfg,
        spec,
        device,
        vlm,
        vlm.parts["projector"],
        dataset,
        collator,
        flops.FlopModel.from_native(spec),
        data_info,
        getattr(vlm, "mode_info", {"train": cfg.train, "objective": cfg.objective}),
        dist,
    )


def _compile_wrapped(model: torch.nn.Module, cfg: RunConfig) -> torch.nn.Module:
    """--compile on a DDP- or FSDP2-wrapped model: the whole wrapper, or its repeated layers (--compile-regions)."""
    return compile_vlm(model, cfg.compile, "model", cfg.compile_shape_padding, cfg.compile_regions)


@torch.no_grad()
def _cache_features(vlm: VLM, dataset, cfg: RunConfig, device: torch.device) -> torch.Tensor:
    """Frozen-tower features for every distinct image, kept in host memory (pinned if asked)."""
    n = getattr(dataset, "images", None)
    count = len(n) if n is not None else len(dataset)
    out = []
    ac = _autocast(cfg, device)
    for start in range(0, count, 16):
        pixels = torch.stack([dataset.raw_image(i) for i in range(start, min(start + 16, count))]).to(device)
        with ac:
            out.append(vlm.encode_images(pixels.to(vlm.projector.dtype)).cpu())
    feats = torch.cat(out)
    return feats.pin_memory() if cfg.pin_memory and device.type == "cuda" else feats


def _autocast(cfg: RunConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def _to_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def train_step(p: Patient) -> tuple[torch.Tensor, dict[str, Any]]:
    """One optimizer step over grad_accum micro-batches; returns the (device) loss and host counts."""
    cfg = p.cfg
    dtype = _input_dtype(p)
    total = {
        "real_tokens": 0,
        "loss_tokens": 0,
        "padded_tokens": 0,
        "samples": 0,
        "lengths": [],
        "host_losses": [],
    }
    loss_sum = None
    for micro in range(cfg.grad_accum):
        batch = next(p.batches)
        counts = batch.pop("counts")
        index = batch.pop("pair_index", None)
        for k in ("real_tokens", "loss_tokens", "padded_tokens", "samples"):
            total[k] += counts[k]
        total["lengths"] += counts["lengths"]
        batch = _to_device(batch, p.device, dtype)
        if cfg.compile != "off":
            mark_lengths_dynamic(batch)  # one graph for every length, no recompile per new length
        sync = (
            distributed.micro_batch(p.model, p.vlm, cfg, micro == cfg.grad_accum - 1)
            if p.dist
            else contextlib.nullcontext()
        )
        with _attention_context(cfg.attention), sync:
            with _autocast(cfg, p.device):
                loss = (
                    _dpo_loss(p, batch, index) if p.reference is not None else p.model(**batch).loss
                ) / cfg.grad_accum
            loss.backward()
        if cfg.sync_loss:  # what a logging loop does: the host waits for the device every micro-batch
            total["host_losses"].append(loss.item())
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    p.optimizer.step()
    p.optimizer.zero_grad(set_to_none=True)
    return loss_sum, total


def _dpo_loss(p: Patient, batch: dict[str, Any], index: list[int]) -> torch.Tensor:
    """The policy on all 2B rows, the reference on the same rows (or its precomputed log-probs), the DPO loss."""
    labels = batch.pop("labels")
    n = len(index)
    policy = modes.sequence_logps(p.model(**batch, labels=None).logits, labels)
    ref = p.reference
    if p.cfg.dpo_precompute_reference:
        pairs = [ref.cache[i] for i in index]
        ref_logps = torch.tensor([c for c, _ in pairs] + [r for _, r in pairs], device=policy.device)
    else:
        ref_logps = ref.logps(batch, labels)
    loss, _ = modes.dpo_loss(policy[:n], policy[n:], ref_logps[:n], ref_logps[n:], p.cfg.dpo_beta)
    return loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
def _window(p: Patient, steps: int, peak: float | None, progress: Progress, label: str) -> dict[str, Any]:
    """Timed steps; every step ends with a device synchronize."""
    if p.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(p.device)
    step_s, step_tokens, step_loss, step_padded, step_flops, losses = [], [], [], [], [], []
    step_cpu: list[float] = []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, c = train_step(p)
        _sync(p.device)
        step_s.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        losses.append(loss)
        step_tokens.append(c["real_tokens"])  # every micro-batch of the optimizer step
        step_loss.append(c["loss_tokens"])
        step_padded.append(c["padded_tokens"])
        step_flops.append(p.step_flops(c))
        progress(label, i + 1, steps)
    wall = sum(step_s)
    loss_values = torch.stack(losses).float().cpu().tolist()
    step_ms = [s * 1e3 for s in step_s]
    w = {
        "steps": steps,
        "wall_s": wall,
        **metrics.window_numbers(step_ms, step_tokens, step_loss, step_padded, step_flops, peak),
        "step_ms": step_ms,
        "step_real_tokens": step_tokens,  # with step_ms: a throughput sample per step (the estimator, the gate)
        "step_loss_tokens": step_loss,
        "step_flops": step_flops,
        # CPU time of the process per step: on a shared CPU host the work of a single-threaded step,
        # which a neighbour's load does not stretch the way it stretches the wall time (the CPU gate)
        "step_cpu_ms": [s * 1e3 for s in step_cpu],
        "losses": loss_values,
    }
    if p.device.type == "cuda":
        w["peak_mem_gb"] = torch.cuda.max_memory_allocated(p.device) / 2**30
        w["peak_mem_reserved_gb"] = torch.cuda.max_memory_reserved(p.device) / 2**30
    return w


def summarize(
    windows: list[dict[str, Any]],
    device_total_gb: float | None,
    peak: float | None = None,
    warmup: dict[str, Any] | None = None,
    mfu_reason: str | None = None,
) -> metrics.Blocks:
    """The timed windows -> the report's metrics, stats and throughput, by the one writer (run/metrics.py): the
    estimator over every step of the `repeats` windows, each window's numbers spread over the windows."""
    return metrics.write(
        windows,
        peak=peak,
        device_total_gb=device_total_gb,
        spread_of=metrics.SPREAD_OWN,
        warmup=warmup,
        mfu_reason=mfu_reason,
    )


def _traced_window(
    step: Callable[[], None],
    trace: TraceOptions,
    cfg: RunConfig,
    dist: Any,
    device: torch.device,
    meta: dict[str, Any],
    progress: Progress,
) -> dict[str, Any]:
    """The traced window, into --trace-dir or a temporary folder. A trace that cannot be written (a full or
    read-only folder, no temp folder) is reported as lost and never costs the measurement."""
    import shutil

    try:
        where = (
            trace
            if trace.keep
            else replace(trace, trace_dir=str(supervise.temp_folder("vlmdoctor-trace-", dir=scratch_dir())))
        )
    except OSError as e:
        info = {"path": None, "lost": f"no temporary folder for it: {e.strerror or e}", "traced_step_ms": []}
    else:
        path = (
            trace_path(where, cfg.model, cfg.stage)
            if dist is None  # ranks: one folder, rank in the name
            else Path(where.trace_dir) / f"vlmdoctor_{cfg.model}_s{cfg.stage}_rank{dist.rank}.pt.trace.json.gz"
        )
        try:
            info = capture(step, where, device, path, meta, progress)
        except BaseException:  # a temporary trace folder never outlives a failed or interrupted capture
            if not trace.keep:
                shutil.rmtree(where.trace_dir, ignore_errors=True)
            raise
        if info.get("lost") and not trace.keep:
            shutil.rmtree(where.trace_dir, ignore_errors=True)
    info["kept"] = trace.keep
    return info


def run_profile(cfg: RunConfig, progress: Progress = _quiet, trace: TraceOptions | None = None) -> dict[str, Any]:
    """Build, warm up, time, then (if asked) trace a separate window.

    Returns the report, also on OOM, NaN loss or a crash in a step.
    """
    spec, device = check(cfg)
    dist = None
    if distributed.is_distributed(cfg):  # one rank of a torchrun job: join the group, take this rank's GPU
        dist, device = distributed.setup(cfg, device)
        if not dist.is_main:
            progress = _quiet
    env = envinfo.collect(device)
    peak, peak_source = flops.peak_flops(env.get("gpu"))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vlmdoctor", "version": __version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "ok",
        "config": cfg.to_dict(),
        "model": spec.describe(),
        "env": env,
        "flops": {"formula": flops.describe(), "peak_flops": peak, "peak_source": peak_source},
    }
    interrupted: KeyboardInterrupt | None = None
    try:
        patient = build_patient(cfg, device, progress, dist)
        report["model"]["params"] = (
            native.native_param_counts(patient.vlm)
            if isinstance(patient.vlm, native.NativeVLM)
            else param_counts(patient.vlm)
        )
        report["data"] = patient.data_info
        report["mode"] = patient.mode_info
        warm_s: list[float] = []
        per_token: list[float] = []
        settle = settle_budget(cfg)
        while len(warm_s) < cfg.warmup or (settle and _unsettled(per_token)):
            if len(warm_s) >= cfg.warmup:
                settle -= 1
            t0 = time.perf_counter()
            _, counts = train_step(patient)
            _sync(device)
            warm_s.append(time.perf_counter() - t0)
            per_token.append(warm_s[-1] / max(1, counts["padded_tokens"] or counts["real_tokens"]))
            progress("warm-up", len(warm_s), max(cfg.warmup, len(warm_s)))
        graphs = graphs_compiled() if compiled(cfg) else 0
        windows = [
            _window(patient, cfg.steps, peak, progress, f"timed {r + 1}/{cfg.repeats}") for r in range(cfg.repeats)
        ]
        report["warmup"] = _warmup_times(warm_s)
        report["warmup"]["settle_steps"] = len(warm_s) - cfg.warmup
        report["warmup"]["settled"] = None if not settle_budget(cfg) else not _unsettled(per_token)
        if compiled(cfg):
            report["warmup"]["graphs_compiled"] = graphs
            new = graphs_compiled() - graphs
            report["warmup"]["graphs_compiled_in_timed_windows"] = new
            if new:
                report.setdefault("warnings", []).append(
                    f"torch.compile compiled {new} new graph(s) during the timed windows: their compile time counts "
                    f"as step time; raise --warmup or pad to fewer lengths (pad_to_multiple_of)"
                )
        if trace is not None:

            def step() -> None:
                train_step(patient)
                _sync(device)

            meta = {
                "schema_version": SCHEMA_VERSION,
                "tool_version": __version__,
                "config": cfg.to_dict(),
                "model": report["model"],
                "env": {
                    k: env[k]
                    for k in ("device_type", "cpu_count", "cpu_capability", "cpu_matmul_gflops", "compute_capability")
                    if k in env
                },
                # the timed windows' measurements: `analyze` of this trace merges them as profile does
                "metrics": measured_metadata(summarize(windows, metrics.device_total_gb(device), peak).metrics),
            }
            try:
                report["trace"] = _traced_window(step, trace, cfg, dist, device, meta, progress)
            except KeyboardInterrupt as e:
                if dist is not None:
                    raise
                interrupted = e  # Ctrl-C / SIGTERM after the timed windows: what they measured is kept
            else:
                if report["trace"].get("lost"):  # a trace that could not be written never costs the measurement
                    report.setdefault("warnings", []).append(lost_note(report["trace"]["lost"]))
    except UsageError:
        raise
    except Exception as e:  # a crash inside a step (illegal memory access, no SDPA kernel, compile failure)
        _release(device)
        if is_out_of_memory(e):  # the GPU's or the host's (MemoryError, torch's CPU allocator): exit 3 either way
            report.update(status="oom", error=_oom_details(e, device))
            return report
        report.update(
            status="error",
            error={
                "type": type(e).__name__,
                "message": _first_line(e),
                "traceback": traceback.format_exc(limit=8)[-4000:],
            },
        )
        return report
    from vlmdoctor.run.flopcount import device_name

    warm = report.get("warmup", {})
    blocks = summarize(
        windows,
        metrics.device_total_gb(device),
        peak,
        warmup={"warmup_s": warm.get("warmup_s"), "compile_s": warm.get("compile_s") if compiled(cfg) else None},
        mfu_reason=f"no peak known for {device_name(env)}",
    )
    report["metrics"], report["stats"], report["throughput"] = blocks
    if "trace" in report:  # profiler overhead, visible next to the untraced numbers it stayed out of
        report["trace"]["untraced_step_ms_median"] = blocks.metrics["step_ms"]
    report["repeats"] = [
        {k: v for k, v in w.items() if k != "losses"} | {"final_loss": w["losses"][-1]} for w in windows
    ]
    warning = recompile_warning(cfg, windows)
    if warning and not (report.get("warmup") or {}).get("graphs_compiled_in_timed_windows"):
        # step times show compilation in the window that dynamo's graph count did not already report
        report.setdefault("warnings", []).append(warning)
    if dist is not None:
        _merge_ranks(report, dist, patient, windows, peak)
    if not report["metrics"]["loss_finite"]:
        report["status"] = "nan_loss"
        report["error"] = {"type": "NonFiniteLoss", "message": "the loss was NaN or inf in a timed step"}
    if interrupted is not None:  # the caller keeps the measured report and ends as interrupted
        report["interrupted"] = supervise.describe_interruption(interrupted) + " in the traced window: not traced"
        interrupted.report = report  # type: ignore[attr-defined]
        raise interrupted
    return report


#: a compiled run warms up past --warmup, by at most this many steps, until its steps settle
SETTLE_MAX_STEPS = 20
SETTLE_RATIO = throughput.SETTLE_RATIO
_unsettled = throughput.unsettled


def settle_budget(cfg: RunConfig) -> int:
    """How many steps the warm-up may grow by until its last steps agree (throughput.unsettled).

    Compiled runs: up to SETTLE_MAX_STEPS (compilation and autotuning take a while to settle); others, with
    a warm-up of at least throughput.SETTLE_STEPS steps asked for, up to as many again as were asked
    (allocator growth, cuDNN/cuBLAS autotuning, a first-epoch cache); none when the warm-up asked is shorter.
    """
    if cfg.warmup <= 0:
        return 0
    if compiled(cfg):
        return SETTLE_MAX_STEPS
    return min(SETTLE_MAX_STEPS, cfg.warmup) if cfg.warmup >= throughput.SETTLE_STEPS else 0


def _merge_ranks(
    report: dict[str, Any],
    dist: distributed.Dist,
    patient: Patient,
    windows: list[dict[str, Any]],
    peak: float | None,
) -> None:
    """Every rank's numbers to every rank; the report's metrics become the job's.

    metrics.real_tokens_per_s, model_tflops_per_s and mfu are global (all ranks' tokens over the
    slowest rank's time, run/metrics.py), step_ms is the slowest rank's median step, peak_mem_gb the largest;
    `repeats` holds global per-step samples (tokens summed over ranks, the longest rank's step
    time), so that the gate's significance test judges the job. Each rank's own numbers are kept
    under distributed.ranks.
    """
    import platform

    own = distributed.rank_summary(dist.rank, windows, report["metrics"], platform.node())
    own["trace"] = (report.get("trace") or {}).get("path")
    own["loss_finite"] = report["metrics"]["loss_finite"]
    own["param_digest"] = distributed.param_digest(patient.vlm)
    ranks = distributed.gather(own)
    # the job's steps, window by window: per step the slowest rank's time and all ranks' tokens
    job = [metrics.joined([r["windows"][w] for r in ranks]) for w in range(len(windows))]
    job_blocks = metrics.write(job, peak=None, device_total_gb=None, spread_of=("real_tokens_per_s",))
    # the job's headline by the one estimator over them; loss tokens and FLOPs follow it (metrics.job_by_totals)
    numbers = metrics.job_by_totals(ranks, job_blocks.throughput["real_tokens_per_s"], peak)
    whole = {k: numbers[k] for k in metrics.RATES} | distributed.combine(ranks)
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
        "world_size": dist.world,
        "nproc_per_node": patient.cfg.nproc_per_node,
        "nnodes": max(1, dist.world // patient.cfg.nproc_per_node),
        "parallel": patient.cfg.parallel,
        "backend": dist.backend,
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


def _warmup_times(warm_s: list[float]) -> dict[str, Any]:
    """Warm-up wall time, and the part of it beyond steady steps: compilation, autotuning, first-call setup.

    A steady step is the last warm-up step; what the earlier steps took beyond it is `compile_s`.
    """
    if not warm_s:
        return {"warmup_s": 0.0, "compile_s": 0.0, "steps": 0}
    steady = warm_s[-1]
    return {
        "warmup_s": sum(warm_s),
        "compile_s": sum(max(0.0, s - steady) for s in warm_s[:-1]),
        "steps": len(warm_s),
        "step_s": warm_s,
    }


#: a first timed step this many times the median of the others means compilation ran inside the timed window
RECOMPILE_RATIO = 5.0


def recompile_warning(cfg: RunConfig, windows: list[dict[str, Any]]) -> str | None:
    """torch.compile that (re)compiles inside a timed window makes its throughput meaningless; say so."""
    if not compiled(cfg):
        return None
    for r, w in enumerate(windows):
        steps = w["step_ms"]
        if len(steps) < 2:
            continue
        worst = max(range(len(steps)), key=steps.__getitem__)
        rest = statistics.median(steps[:worst] + steps[worst + 1 :])
        if rest > 0 and steps[worst] > RECOMPILE_RATIO * rest:
            what = (
                f"--compile {cfg.compile}"
                if cfg.compile != "off"
                else f"--compile-vision {cfg.compile_vision}"
                if cfg.compile_vision != "model"
                else "--attention flex"
            )
            return (
                f"{what}: timed step {worst + 1} of window {r + 1} took {steps[worst]:.0f} ms, "
                f"{steps[worst] / rest:.0f}x the median of {rest:.0f} ms: compilation ran inside the timed "
                "window, so tokens/s is too low; use more --warmup steps"
            )
    return None


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__


def _oom_details(e: BaseException, device: torch.device) -> dict[str, Any]:
    msg = str(e)
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)", msg)
    requested = None
    if m:
        requested = float(m.group(1)) * {"GiB": 1, "MiB": 1 / 1024, "KiB": 1 / 2**20}[m.group(2)]
    m = re.search(r"tried to allocate (\d+) bytes", msg)  # torch's CPU allocator
    if m:
        requested = int(m.group(1)) / 2**30
    info = {
        "type": "OutOfMemoryError",
        "message": _first_line(e),
        "requested_gb": requested,
        "where": "gpu" if isinstance(e, torch.OutOfMemoryError) else "host",
    }
    if device.type == "cuda":
        info["peak_mem_gb_before_failure"] = torch.cuda.max_memory_allocated(device) / 2**30
        info["device_mem_total_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def exit_code(report: dict[str, Any]) -> int:
    return {"ok": EXIT_OK, "oom": EXIT_OOM, "nan_loss": EXIT_NAN}.get(report["status"], EXIT_FAILED_RUN)


def run_isolated(
    cfg: RunConfig,
    timeout: float | None = None,
    diagnose: bool = True,
    rules_dirs: list[str] | None = None,
    env: dict[str, str] | None = None,
    python: str | None = None,
    own_cwd: bool = False,
) -> dict[str, Any]:
    """Run one configuration in a fresh Python process and return its report (diagnosed unless asked not to).

    `env` adds to the child's environment (compile cache folders shared by a treatment's trials);
    `python` is another interpreter (the gate's baseline: another vlmdoctor or torch install).
    `own_cwd` starts the child in its own empty folder: `python -m` imports from the working
    folder first, so in a checkout the child would run that checkout's vlmdoctor whatever
    `env`'s PYTHONPATH or `python` say (the gate's baseline side needs its own code).
    """
    with supervise.scratch("vlmdoctor-") as folder:
        tmp = str(folder)
        cfg_path, out_path = folder / "config.json", folder / "report.json"
        cfg.dump(cfg_path)
        cmd = [
            python or sys.executable,
            "-m",
            "vlmdoctor",
            "profile",
            "--config",
            str(cfg_path),
            "--json",
            str(out_path),
            "--quiet",
        ]
        cmd += [] if diagnose else ["--no-diagnose"]
        for d in rules_dirs or []:
            cmd += ["--rules", str(d)]
        (folder / "scratch").mkdir()
        # the child's own temporary folders (a trace, torchrun's rank folder) go inside this one: removed with it
        child_env = {**os.environ, **(env or {}), supervise.SCRATCH_ENV: str(folder / "scratch")}
        log = folder / "child.log"
        with open(log, "wb") as f:
            # its own process group: a timeout, Ctrl-C or SIGTERM stops it and all it started (torchrun, its ranks)
            outcome = supervise.run(cmd, env=child_env, cwd=tmp if own_cwd else None, timeout=timeout, log=f)
        if outcome.returncode in (130, 143, -2, -15) and not outcome.timed_out:  # the child was interrupted
            raise KeyboardInterrupt
        if outcome.timed_out:
            kept = _read_json(out_path)
            if kept and kept.get("metrics"):  # stopped in its traced window: the timed numbers are kept
                kept.setdefault("warnings", []).append(
                    f"the run hit its time limit ({timeout:.0f} s) in the traced window: timed numbers only"
                )
                return kept
            return {
                "schema_version": SCHEMA_VERSION,
                "status": "timeout",
                "config": cfg.to_dict(),
                "error": {"type": "Timeout", "message": f"the run took longer than {timeout:.0f} s"},
            }
        if out_path.exists():
            try:
                return json.loads(out_path.read_text())
            except (OSError, ValueError) as e:
                return {
                    "schema_version": SCHEMA_VERSION,
                    "status": "error",
                    "config": cfg.to_dict(),
                    "error": {
                        "type": "ProcessFailed",
                        "message": f"the run's report is unreadable ({e})",
                        "exit_code": outcome.returncode,
                    },
                }
        tail = log.read_bytes()[-8000:].decode("utf-8", errors="replace")
        return {
            "schema_version": SCHEMA_VERSION,
            "status": "error",
            "config": cfg.to_dict(),
            "error": {
                "type": "ProcessFailed",
                "message": tail.strip()[-2000:] or f"the run exited with code {outcome.returncode} and said nothing",
                "exit_code": outcome.returncode,
            },
        }


# ------------------------------------------------------------------------------------------------
def run_distributed(
    cfg: RunConfig,
    trace: TraceOptions | None = None,
    rdzv: distributed.Rendezvous | None = None,
    progress: Progress = _quiet,
    python: str | None = None,
) -> dict[str, Any]:
    """Launch the config through torchrun, one process per GPU, and return rank 0's report of the job.

    Every rank writes its own trace into one folder (the layout Holistic Trace Analysis reads):
    under --trace-dir a new folder per run, else a temporary one the caller removes. On a GPU the
    ranks get NVLink multicast switched off (distributed.NVLINK_MULTICAST_OFF) unless already set.
    """
    import shlex
    import shutil
    from dataclasses import asdict

    _, device = check(cfg)
    rdzv = rdzv or distributed.Rendezvous()
    rdzv.check()
    temp_trace: Path | None = None
    with supervise.scratch("vlmdoctor-ranks-", dir=scratch_dir()) as tmp:
        cfg.dump(tmp / "config.json")
        args = ["--config", str(tmp / "config.json"), "--out", str(tmp)]
        if trace is not None:
            if trace.keep:
                stem = f"vlmdoctor_{cfg.model}_s{cfg.stage}_{time.strftime('%Y%m%d-%H%M%S')}_{cfg.parallel}"
                folder = Path(trace.trace_dir) / stem
                n = 1
                while folder.exists():
                    n += 1
                    folder = Path(trace.trace_dir) / f"{stem}-{n}"
                folder.mkdir(parents=True)
            else:
                folder = temp_trace = supervise.temp_folder("vlmdoctor-trace-", dir=scratch_dir())
            args += ["--trace", json.dumps({**asdict(trace), "trace_dir": str(folder), "keep": True})]
        cmd = distributed.torchrun_command(cfg, args, rdzv, python, log_dir=str(tmp / "torchrun-logs"))
        env = distributed.child_env(device.type == "cuda")
        progress(f"{cfg.nproc_per_node} ranks through torchrun", 0, 1)
        try:
            with open(tmp / "torchrun.log", "wb") as log:  # torchrun and its ranks: one owned group
                proc = supervise.run(cmd, env=env, log=log)
        except BaseException:
            if temp_trace is not None:
                shutil.rmtree(temp_trace, ignore_errors=True)
            raise
        progress(f"{cfg.nproc_per_node} ranks through torchrun", 1, 1)
        try:
            report = _rank_report(tmp, cfg, proc.returncode)
        except BaseException:  # a usage error found on a rank: no temporary trace outlives it
            if temp_trace is not None:
                shutil.rmtree(temp_trace, ignore_errors=True)
            raise
    if temp_trace is not None:
        if report.get("trace"):
            report["trace"]["kept"] = False  # remove_temporary_trace removes the folder after the diagnosis
        else:
            shutil.rmtree(temp_trace, ignore_errors=True)
    report["launch"] = {
        "launcher": "torch.distributed.run",
        "command": shlex.join(cmd),
        "env": {k: env[k] for k in distributed.NVLINK_MULTICAST_OFF if k in env},
    }
    return report


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rank_report(folder: Path, cfg: RunConfig, returncode: int) -> dict[str, Any]:
    """Rank 0's report of the job; else the first failed rank's; else why torchrun failed."""
    path = folder / "report.json"
    if path.exists():
        return json.loads(path.read_text())
    failed = sorted(folder.glob("report_rank*.json"), key=lambda p: int(p.stem.removeprefix("report_rank")))
    if failed:
        report = json.loads(failed[0].read_text())
        if report.get("status") == "usage_error":
            raise UsageError(f"rank {report['rank']}: {report['error']['message']}")
        return report
    log = (folder / "torchrun.log").read_text(errors="replace") if (folder / "torchrun.log").exists() else ""
    lines = [ln for ln in log.splitlines() if ln.strip()]
    why = next((ln for ln in reversed(lines) if "Error" in ln and not ln.lstrip().startswith("File")), None)
    return {
        "schema_version": SCHEMA_VERSION,
        "status": "error",
        "config": cfg.to_dict(),
        "error": {
            "type": "ProcessFailed",
            "exit_code": returncode,
            "message": (why or f"torchrun exited with code {returncode}").strip()[:500],
            "log_tail": "\n".join(lines[-40:])[-4000:],
        },
    }
