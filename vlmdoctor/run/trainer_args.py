"""The run-config knobs <-> transformers `TrainingArguments` fields: one entry per knob, read both ways.

`read` turns a Trainer run's arguments into the knob's value, so the rules see what is already set
(`DoctorCallback`, `vlmdoctor run --`); `write` turns a prescribed value into the fields a Trainer user
sets (the advice). A test checks that `read(write(v)) == v` for every value of every knob here.
Knobs without a `TrainingArguments` field (weight dtype, the LM head on labeled positions, ...) are
not here; their advice is code (`doctor/advice.py`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

#: a reader of one TrainingArguments field (None when the arguments do not have it)
Get = Callable[[str], Any]


@dataclass(frozen=True)
class TrainerField:
    """How one knob is spelled in TrainingArguments."""

    fields: tuple[str, ...]  # the fields `read` looks at (kept raw in the report's `trainer_args`)
    read: Callable[[Get], Any]  # the knob's value, or None where the arguments do not say
    write: Callable[[Any], dict[str, Any]]  # the fields that set the knob to a value


def same(name: str, kind: type = bool) -> TrainerField:
    """A field that holds the knob's value itself."""
    return TrainerField((name,), lambda g: None if g(name) is None else kind(g(name)), lambda v: {name: kind(v)})


def _sampling_field() -> str:
    """How this transformers spells length grouping: `group_by_length` (4.x) or `train_sampling_strategy` (5.x)."""
    try:
        from transformers import TrainingArguments  # deferred: transformers

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
    except Exception:
        return "group_by_length"
    if "group_by_length" not in names and "train_sampling_strategy" in names:
        return "train_sampling_strategy"
    return "group_by_length"


def _ckpt(name: str) -> str:
    """`gradient_checkpointing[_kwargs]`, or `activation_checkpointing[_kwargs]` where this transformers renamed it."""
    try:
        from transformers import TrainingArguments  # deferred: transformers

        new = name.replace("gradient_", "activation_")
        return new if new in {f.name for f in dataclasses.fields(TrainingArguments)} else name
    except Exception:
        return name


def _write_sampler(value: str) -> dict[str, Any]:
    grouped = value == "length_bucketed"
    if _sampling_field() == "group_by_length":
        return {"group_by_length": grouped}
    return {"train_sampling_strategy": "group_by_length" if grouped else "random"}


def _read_sampler(g: Get) -> str:
    grouped = g("group_by_length") or g("train_sampling_strategy") == "group_by_length"
    return "length_bucketed" if grouped else "random"


#: optimizer knob value <-> TrainingArguments `optim`
OPTIM = {"adamw": "adamw_torch", "paged_adamw": "paged_adamw_32bit", "paged_adamw_8bit": "paged_adamw_8bit"}


#: each Liger knob's kernel, as `liger_kernel_config` and liger-kernel's `apply_liger_kernel_to_*` name it
LIGER = {
    "liger_rope": "rope",
    "liger_rms_norm": "rms_norm",
    "liger_swiglu": "swiglu",
    "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy",
}


def _liger(key: str) -> TrainerField:
    """One Liger kernel: `use_liger_kernel` and its entry in `liger_kernel_config` (absent: on)."""
    return TrainerField(
        ("use_liger_kernel", "liger_kernel_config"),
        lambda g: bool(g("use_liger_kernel")) and bool((g("liger_kernel_config") or {}).get(key, True)),
        lambda v: {"use_liger_kernel": bool(v), "liger_kernel_config": {key: bool(v)}},
    )


TABLE: dict[str, TrainerField] = {
    "autocast": TrainerField(
        ("bf16", "fp16"),
        lambda g: "bf16" if g("bf16") else ("fp16" if g("fp16") else "off"),
        lambda v: {"bf16": True} if v == "bf16" else {"bf16": False, "fp16": False},
    ),
    "allow_tf32": same("tf32"),
    "batch_size": same("per_device_train_batch_size", int),
    "grad_accum": same("gradient_accumulation_steps", int),
    "sampler": TrainerField(("group_by_length", "train_sampling_strategy"), _read_sampler, _write_sampler),
    "compile": TrainerField(
        ("torch_compile", "torch_compile_mode"),
        lambda g: (g("torch_compile_mode") or "default") if g("torch_compile") else "off",
        lambda v: {"torch_compile": v != "off", **({"torch_compile_mode": v} if v not in ("off", "default") else {})},
    ),
    **{knob: _liger(key) for knob, key in LIGER.items()},
    "gradient_checkpointing": TrainerField(
        ("gradient_checkpointing", "activation_checkpointing"),
        lambda g: bool(g("gradient_checkpointing") or g("activation_checkpointing")),
        lambda v: {_ckpt("gradient_checkpointing"): v},
    ),
    "checkpoint_use_reentrant": TrainerField(
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        lambda g: (g("gradient_checkpointing_kwargs") or g("activation_checkpointing_kwargs") or {}).get(
            "use_reentrant"
        ),
        lambda v: {_ckpt("gradient_checkpointing_kwargs"): {"use_reentrant": bool(v)}},
    ),
    "num_workers": TrainerField(
        ("dataloader_num_workers",),
        lambda g: int(g("dataloader_num_workers") or 0),
        lambda v: {"dataloader_num_workers": v, **({"dataloader_persistent_workers": True} if v else {})},
    ),
    "pin_memory": TrainerField(
        ("dataloader_pin_memory",), lambda g: bool(g("dataloader_pin_memory")), lambda v: {"dataloader_pin_memory": v}
    ),
    "fused_optimizer": TrainerField(
        ("optim",),
        lambda g: "fused" in str(g("optim") or ""),
        lambda v: {"optim": "adamw_torch_fused" if v else "adamw_torch"},
    ),
    "optimizer": TrainerField(
        ("optim",),
        lambda g: {"adamw_torch_fused": "adamw", **{o: k for k, o in OPTIM.items()}}.get(str(g("optim") or "")),
        lambda v: {"optim": OPTIM[v]},
    ),
}

#: fields kept raw in a Trainer report beside the ones the table reads
RAW_EXTRA = ("logging_steps", "max_steps")


def getter(args: Any) -> Get:
    """Read a TrainingArguments field; an enum (`optim`) as its value."""

    def get(name: str) -> Any:
        value = getattr(args, name, None)
        return getattr(value, "value", value)

    return get


def training_args_config(args: Any) -> dict[str, Any]:
    """TrainingArguments -> run-config knobs (what the rules read), plus the raw fields under `trainer_args`."""
    g = getter(args)
    cfg: dict[str, Any] = {}
    for knob, entry in TABLE.items():
        value = entry.read(g)
        if value is not None:
            cfg[knob] = value
    names = dict.fromkeys(f for entry in TABLE.values() for f in entry.fields)
    raw = {name: g(name) for name in [*names, *RAW_EXTRA]}
    cfg["trainer_args"] = {
        k: (v if isinstance(v, (bool, int, float, str, dict, type(None))) else str(v)) for k, v in raw.items()
    }
    return cfg


def sample_lengths(trainer: Any) -> str | None:
    """Where `group_by_length` would find each sample's length in this Trainer's data: 'length_column'
    (a datasets.Dataset column), 'input_ids' (items that hold them), 'none' (the collator tokenizes: the
    Trainer raises), or None when the data cannot be looked at."""

    try:
        ds, args = trainer.train_dataset, trainer.args
        if args.length_column_name in (getattr(ds, "column_names", None) or []):
            return "length_column"
        names = getattr(getattr(trainer, "processing_class", None), "model_input_names", None) or ["input_ids"]
        item = ds[0]
        return "input_ids" if isinstance(item, Mapping) and names[0] in item else "none"
    except Exception:
        return None


def fields_for(patch: dict[str, Any]) -> dict[str, Any]:
    """The TrainingArguments fields that apply a config patch's knobs (those with a field), merged.

    Knobs writing one field agree or merge (Liger's kernels: one `liger_kernel_config`, and
    `use_liger_kernel` on when any kernel is); a config of kernels is left out when Liger is off."""
    out: dict[str, Any] = {}
    for knob, value in patch.items():
        if knob not in TABLE:
            continue
        for name, v in TABLE[knob].write(value).items():
            if isinstance(v, dict) and isinstance(out.get(name), dict):
                out[name] = {**out[name], **v}
            elif isinstance(v, bool) and isinstance(out.get(name), bool):
                out[name] = out[name] or v
            else:
                out[name] = v
    if out.get("use_liger_kernel") is False:
        out.pop("liger_kernel_config", None)
    return out


def spelled(name: str, value: Any) -> str:
    """`name=value` as Python source: strings in double quotes, the rest as repr."""
    return f"{name}={json.dumps(value) if isinstance(value, str) else repr(value)}"
