"""The patient of a profile run: the model, data, optimizer (and DDP/FSDP2 wrapper, DPO reference) that a run
config describes, built once per process, and what a step needs around the model: the autocast, the SDPA backend
pinned, the batch on the device.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from vlmdoctor.errors import UsageError, first_line
from vlmdoctor.run import distributed, flops, fp8, modes, native
from vlmdoctor.run.checks import UNSLOTH_CLASSES, preflight, resolve_model
from vlmdoctor.run.compile import compile_vlm
from vlmdoctor.run.config import RunConfig, target_names
from vlmdoctor.run.data import (
    BatchSampler,
    Collator,
    LlavaFile,
    PairCollator,
    PreferenceFile,
    SyntheticPairs,
    SyntheticVQA,
)
from vlmdoctor.run.model import VLM, apply_stage, build_model, enable_gradient_checkpointing, enable_input_require_grads
from vlmdoctor.run.zoo import ModelSpec

Progress = Callable[[str, int, int], None]


def quiet(*_: Any) -> None:
    pass


def apply_unsloth(family: str) -> None:
    """Unsloth's fast forwards on the LLM's transformers class, before the LLM is built.

    `FastLanguageModel.from_pretrained` needs a checkpoint and a tokenizer on disk; the composite
    model builds its LLM from a shipped config with random weights, so the same class patches are
    applied directly (`pre_patch`: fast attention with Unsloth's RoPE kernel, decoder layers with its
    RMSNorm kernel, its cross entropy in the causal-LM forward). They are process-wide, so a run with
    --unsloth is one process (profile runs one config; treat runs each trial in its own process).
    """

    module, cls = UNSLOTH_CLASSES[family]
    try:
        import unsloth  # noqa: F401  (its import patches transformers and checks the GPU)

        getattr(importlib.import_module(module), cls).pre_patch()
    except Exception as e:
        raise UsageError(
            f"Unsloth could not be loaded ({type(e).__name__}: {first_line(e)}); see docs/unsloth.md "
            "for the versions it needs"
        ) from None


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
    dataset: Any = None  # what the loader reads, and how it collates: an in-process arm's loader (run/switch.py)
    collator: Any = None

    def step_flops(self, counts: dict[str, Any]) -> float:
        head = counts["loss_tokens"] if self.cfg.lm_head_labeled_only else None
        return self.flop_model.step(
            counts["lengths"], self.cfg.stage, self.cfg.cache_vision_features, head, self.flop_mode
        )["total"]


def attention_context(backend: str):
    """The SDPA backend pinned around the step; sdpa, eager and flex choose their kernels themselves."""
    if backend in ("sdpa", "eager", "flex"):
        return contextlib.nullcontext()

    return sdpa_kernel(
        {
            "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION,
            "math": SDPBackend.MATH,
        }[backend]
    )


def _apply_liger(vlm: VLM, cfg: RunConfig) -> None:
    from liger_kernel.transformers import (  # deferred: liger, an optional extra
        apply_liger_kernel_to_llama,
        apply_liger_kernel_to_qwen2,
    )

    fn = {"qwen2": apply_liger_kernel_to_qwen2, "llama": apply_liger_kernel_to_llama}[vlm.spec.llm["family"]]
    fn(
        rope=cfg.liger_rope,
        rms_norm=cfg.liger_rms_norm,
        swiglu=cfg.liger_swiglu,
        cross_entropy=False,
        fused_linear_cross_entropy=cfg.liger_fused_linear_cross_entropy,
        model=vlm.llm,
    )


def cycle(loader: Any) -> Iterator[dict[str, Any]]:
    """Batches without end, epoch after epoch (a patient's `batches`; an in-process arm's: run/switch.py)."""
    while True:
        yield from loader


def make_loader(
    cfg: RunConfig, dataset: Any, collator: Any, device: torch.device, dist: distributed.Dist | None = None
) -> torch.utils.data.DataLoader:
    """The loader a run config describes over a built dataset (a run's own; an in-process arm's: run/switch.py)."""
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=_batch_sampler(cfg, dataset.lengths, dist),
        collate_fn=collator,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        persistent_workers=cfg.num_workers > 0,
    )


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
    cfg: RunConfig, device: torch.device, progress: Progress = quiet, dist: distributed.Dist | None = None
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
    vlm.set_vision_no_grad(cfg.vision_no_grad)
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
    loader = make_loader(cfg, dataset, collator, device, dist)
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
        cycle(loader),
        flop_model,
        data_info,
        dist,
        info,
        reference=reference,
        dataset=dataset,
        collator=collator,
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
        lora_targets=list(target_names(cfg.lora_targets)),
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
    dtype = input_dtype(p)
    ref, b = p.reference, p.cfg.batch_size
    flop_total = 0.0
    for start in range(0, len(dataset), b):
        batch = collator([dataset[i] for i in range(start, min(start + b, len(dataset)))])
        counts, index = batch.pop("counts"), batch.pop("pair_index")
        batch = to_device(batch, p.device, dtype)
        labels = batch.pop("labels")
        with torch.no_grad(), attention_context(p.cfg.attention), autocast(p.cfg, p.device):
            logps = ref.logps(batch, labels).float().cpu()
        n = len(index)
        for k, i in enumerate(index):
            ref.cache[i] = (float(logps[k]), float(logps[n + k]))
        fwd = p.flop_model.step(counts["lengths"], p.cfg.stage, False, None, flops.Mode(objective="dpo"))
        flop_total += fwd["reference"]
    sync(p.device)
    return {"pairs": len(ref.cache), "wall_s": time.perf_counter() - t0, "tflop": flop_total / 1e12}


def input_dtype(p: Patient) -> torch.dtype:
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
    ac = autocast(cfg, device)
    for start in range(0, count, 16):
        pixels = torch.stack([dataset.raw_image(i) for i in range(start, min(start + 16, count))]).to(device)
        with ac:
            out.append(vlm.encode_images(pixels.to(vlm.projector.dtype)).cpu())
    feats = torch.cat(out)
    return feats.pin_memory() if cfg.pin_memory and device.type == "cuda" else feats


def autocast(cfg: RunConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def to_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def release(device: torch.device) -> None:
    """What a failed or finished window held, freed: the tensors collected, the allocator's cache emptied on a GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
