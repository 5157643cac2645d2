"""What a run config asks that cannot run here, refused before anything is built: names (the preset, its
parts), then the hardware (the device), then combinations of knobs, each in one line that says what to do instead.
"""

from __future__ import annotations

import importlib.util

import torch

from vlmdoctor.errors import UsageError
from vlmdoctor.run import distributed, fp8, modes, native
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.zoo import ModelSpec, resolve

GPU_ONLY_ATTENTION = ("efficient", "cudnn")


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
