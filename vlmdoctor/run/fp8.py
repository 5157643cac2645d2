"""FP8 training of the LLM's linear layers through torchao.float8 (the `fp8` knob).

Why only the LLM's decoder projections: they are the wide GEMMs of a stage-2 step (q/k/v/o and
gate/up/down at hidden 1536 and MLP 8960 in the 1.5b preset), where an FP8 tensor-core GEMM
(twice bf16's peak on an H100) can pay for the extra work around it: every converted layer
computes an amax and casts its input, weight and output gradient to FP8 in each step. What
stays in bf16, and why:
- the LM head: its output is the logits, whose precision the loss is sensitive to (torchtitan's
  float8 converter leaves the output projection out too); and Liger's fused linear cross
  entropy works on its weight directly, so the two never touch the same layer;
- the vision tower: frozen in both stages, so an FP8 layer there would compute weight gradients
  that nobody needs, and its GEMMs (hidden 1152, head dim 72) are narrow;
- the projector: two layers, a small share of the step; leaving it out keeps the conversion to one
  submodule whatever the preset.

FP8 GEMMs (`torch._scaled_mm`) need both dimensions of the weight divisible by 16, so a layer
whose in or out features are not is skipped (`fp8_filter`, testable without torchao). The
token count of a batch is an inner dimension in backward (the weight gradient's GEMM); when the
collation does not make it a multiple of 16 (`--pad-to-multiple-of` not a multiple of 16),
torchao pads it (`pad_inner_dim`, at some memory cost).

It can pay only under torch.compile, which fuses the amax and cast kernels into the surrounding
ones, and only where GEMMs are large: at the 1.5b preset (hidden 1536, batch 16, compiled by
region) it measured 0.81x of bf16 on the H100, the FP8 GEMMs 1.07x faster and the casts 16.5 ms
a step more (docs/treat.md). The rule `precision-fp8-gemm` prescribes it only for GEMMs four
times wider than that.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from vlmdoctor.errors import UsageError

#: _scaled_mm's alignment: both dims of the weight (and the inner dim of every GEMM) a multiple of this
ALIGN = 16
#: FP8 tensor cores: Ada (8.9) and Hopper (9.0) onwards
MIN_CAPABILITY = (8, 9)
#: module names never converted (the output projection; see the module docstring)
SKIP_NAMES = ("lm_head",)


def fp8_filter(module: nn.Module, fqn: str) -> bool:
    """Whether one linear layer is converted: aligned dims and not the LM head (torchao's module_filter_fn)."""
    if not isinstance(module, nn.Linear):
        return False
    if fqn.rsplit(".", 1)[-1] in SKIP_NAMES:
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def tokens_aligned(cfg: Any) -> bool:
    """Whether every batch's token count is a multiple of ALIGN by construction (else torchao pads it)."""
    if cfg.packing:
        return cfg.pack_length % ALIGN == 0
    return cfg.pad_to_multiple_of % ALIGN == 0


def check_device(cfg: Any, device: torch.device) -> None:
    """FP8 GEMMs need a CUDA GPU of compute capability 8.9+ and torchao: refused in one line before building."""
    flag = f"--fp8 {cfg.fp8}"
    if device.type != "cuda":
        raise UsageError(
            f"{flag}: FP8 GEMMs need a CUDA GPU of compute capability 8.9+ (H100, H200, L40S, "
            f"RTX 4090...); this device is the CPU; drop {flag} (or use --fp8 off)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise UsageError(
            f"{flag}: FP8 GEMMs need compute capability 8.9+ (H100, H200, L40S, RTX 4090...); this "
            f"device is {name} ({major}.{minor}); use --fp8 off"
        )
    import_torchao(flag)


def import_torchao(flag: str = "--fp8") -> Any:
    """torchao.float8, or a one-line usage error saying how to install it."""
    try:
        import torchao.float8 as float8  # deferred: torchao, optional
    except Exception as e:
        raise UsageError(
            f"{flag} needs torchao, which cannot be imported ({type(e).__name__}); install it with: pip install torchao"
        ) from None
    return float8


def linear_config(recipe: str, pad_inner_dim: bool = False, emulate: bool = False) -> Any:
    """torchao's Float8LinearConfig for a recipe name; `emulate` computes in high precision (CPU tests)."""

    float8 = import_torchao(f"--fp8 {recipe}")
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(cfg, pad_inner_dim=pad_inner_dim, emulate=emulate)


def convert(llm: nn.Module, recipe: str, pad_inner_dim: bool = False, emulate: bool = False) -> dict[str, Any]:
    """Swap the LLM's aligned linear layers for torchao's Float8Linear in place; what was converted and skipped.

    Called after the model is built and before torch.compile and the optimizer (the weights stay the
    same Parameters, so nothing else changes)."""
    float8 = import_torchao(f"--fp8 {recipe}")
    linears = {name: m for name, m in llm.named_modules() if isinstance(m, nn.Linear)}
    skipped = sorted(name for name, m in linears.items() if not fp8_filter(m, name))
    float8.convert_to_float8_training(
        llm, module_filter_fn=fp8_filter, config=linear_config(recipe, pad_inner_dim, emulate)
    )
    converted = sum(1 for m in llm.modules() if type(m).__name__ == "Float8Linear")
    return {
        "recipe": recipe,
        "converted_linear_layers": converted,
        "skipped_linear_layers": skipped[:20],
        "skipped_count": len(skipped),
        "pad_inner_dim": pad_inner_dim,
    }
