"""What the user's model is: its class and parts, parameter counts and weight dtype, the training stage they
imply, the device it is on, its padding token id, and the wrappers around it (DDP, FSDP, torch.compile)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmdoctor.run.parts import find_parts


def pad_id(model: nn.Module | None) -> int | None:
    """The padding token id of the model's config (or its text config), if it says one."""
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        pid = getattr(c, "pad_token_id", None) if c is not None else None
        if isinstance(pid, int):
            return pid
    return None


def describe_model(model: nn.Module | None) -> dict[str, Any]:
    """Class names of the model and its parts, parameter counts and the dtype the weights are in."""
    if model is None:
        return {"class": None, "parts": {}}
    parts = find_parts(model)
    params = list(model.parameters())
    dtypes: dict[str, int] = {}
    for p in params:
        dtypes[str(p.dtype).replace("torch.", "")] = dtypes.get(str(p.dtype).replace("torch.", ""), 0) + p.numel()
    out: dict[str, Any] = {
        "class": type(model).__name__,
        "parts": {k: type(m).__name__ for k, m in parts.items()},
        "params": {
            "total": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "by_part": {
                k: {
                    "total": sum(p.numel() for p in m.parameters()),
                    "trainable": sum(p.numel() for p in m.parameters() if p.requires_grad),
                }
                for k, m in parts.items()
            },
        },
        "param_dtypes": dtypes,
    }
    names = {id(m): name for name, m in model.named_modules()}
    out["paths"] = {k: names[id(m)] for k, m in parts.items() if names.get(id(m))}  # model.<path>, for the advice
    for k in ("vision", "projector", "llm"):
        out[k] = out["parts"].get(k)
    return out


def estimate_stage(desc: dict[str, Any]) -> int | None:
    """1 when only the projector trains, 2 when the LLM trains; None when the parts are not known."""
    by = (desc.get("params") or {}).get("by_part") or {}
    llm = by.get("llm")
    if llm is None:
        return None
    if llm["trainable"] > 0:
        return 2
    proj = by.get("projector")
    return 1 if proj and proj["trainable"] > 0 else None


def weight_dtype(desc: dict[str, Any]) -> str | None:
    """The dtype most of the weights are in, under the run config's names (fp32, bf16, fp16)."""
    d = desc.get("param_dtypes") or {}
    if not d:
        return None
    main = max(d, key=d.get)
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(main, main)


def device_of(model: nn.Module | None) -> torch.device:
    """Where the model's first parameter is; the CPU for no model (or one without parameters)."""
    if model is not None:
        for p in model.parameters():
            return p.device
    return torch.device("cpu")


def unwrap(model: nn.Module | None) -> tuple[nn.Module | None, str]:
    """The user's model inside DDP / FSDP (`.module`) and torch.compile (`._orig_mod`) wrappers, and how it
    is run in parallel: 'ddp', 'fsdp', 'fsdp2' (fully_shard keeps the module, with FSDP's class mixed in) or
    'none'."""
    parallel = "none"
    try:
        from torch.distributed.fsdp import FSDPModule  # deferred: torch.distributed.fsdp, not loaded by torch

        if isinstance(model, FSDPModule):
            parallel = "fsdp2"
    except ImportError:
        pass
    while model is not None:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            break
        name = type(model).__name__
        if name == "DistributedDataParallel":
            parallel = "ddp"
        elif name == "FullyShardedDataParallel":
            parallel = "fsdp"
        model = inner
    return model, parallel
