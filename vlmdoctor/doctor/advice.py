"""A prescription in the user's terms: run-config knobs -> TrainingArguments fields or loop lines.

vlmdoctor's rules patch its own run-config knobs (`weight_dtype=bf16`). For vlmdoctor's runs that
is the fix; for the user's own training vlmdoctor does not own the config, so the same patch is
said as what to write: `TrainingArguments(bf16=True)` for a `Trainer` user, `model.to(torch.bfloat16)`
for a plain loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vlmdoctor.run.trainer_args import LIGER, TABLE, fields_for, spelled

AUDIENCES = ("trainer", "loop")

LIGER_KNOBS = LIGER


def _liger_family(context: dict[str, Any]) -> str:
    llm = str(context.get("llm") or context.get("model") or "").lower()
    for fam in (
        "qwen2_5_vl",
        "qwen2_vl",
        "qwen3",
        "qwen2",
        "llama",
        "mistral",
        "gemma3",
        "gemma2",
        "gemma",
        "phi3",
        "mllama",
        "paligemma",
        "olmo2",
        "granite",
    ):
        if fam.replace("_", "") in llm.replace("_", ""):
            return fam
    return "<your_llm_family>"


def _lines(on: list[str], off: list[str]) -> Callable[[Any], list[str]]:
    """Advice for a switch: these lines to turn it on, those to turn it off."""
    return lambda v: on if v else off


def _weight_dtype(v: Any, trainer: bool) -> list[str]:
    if v == "bf16":
        if trainer:
            return ["from_pretrained(..., dtype=torch.bfloat16)  # weights in bf16, not fp32", "bf16=True"]
        return ["model.to(torch.bfloat16)  # or from_pretrained(..., dtype=torch.bfloat16)"]
    return ["from_pretrained(..., dtype=torch.float32)"] if trainer else ["model.to(torch.float32)"]


def _attention(v: Any) -> list[str]:
    if v == "flex":  # the LLM only: packed position ids become a document BlockMask
        return [
            'from_pretrained(..., attn_implementation="flex_attention")  # the LLM',
            '# a VLM class: attn_implementation={"text_config": "flex_attention"}',
            "# packed rows: position_ids restart per sample, attention_mask=None",
        ]
    if v in ("sdpa", "eager", "flash"):
        impl = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}[v]
        return [f'from_pretrained(..., attn_implementation="{impl}")']
    backend = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}.get(v, v)
    return [
        "from torch.nn.attention import sdpa_kernel, SDPBackend",
        f"with sdpa_kernel(SDPBackend.{backend}):  # forward + backward",
    ]


def _lm_head(v: Any, trainer: bool) -> list[str]:
    head = ["in Trainer.compute_loss (a subclass):"] if trainer else []
    if not v:
        return head + ["loss = model(**batch).loss  # the LM head over every position"]
    return head + [
        "out = model.model(**inputs)  # no LM head over every position",
        "keep = labels[:, 1:] != -100  # next token is a label",
        "h = out.last_hidden_state[:, :-1][keep]",
        "loss = F.cross_entropy(model.lm_head(h), labels[:, 1:][keep])",
    ]


def _fp8(v: Any) -> list[str]:
    if v == "off":
        return ["train the linear layers in bf16 (no convert_to_float8_training)"]
    return [
        "from torchao.float8 import convert_to_float8_training, Float8LinearConfig",
        "# before torch.compile and the optimizer; not the LM head:",
        "convert_to_float8_training(model.model.language_model,",
        "    module_filter_fn=lambda m, fqn: m.in_features % 16 == 0",
        "    and m.out_features % 16 == 0,",
        f"    config=Float8LinearConfig.from_recipe_name({v!r}))",
    ]


def _train(v: Any) -> list[str]:
    if v == "lora":
        return [
            "load the base in bf16 without quantization_config (no BitsAndBytesConfig)",
            "model = get_peft_model(model, LoraConfig(r=16, target_modules=[...]))  # peft",
        ]
    if v == "full":
        return ["train the LLM's own weights (no get_peft_model)"]
    return [
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"
    ]


def _dpo_reference_no_grad(v: Any, trainer: bool) -> list[str]:
    if not v:
        return ["run the reference forward with autograd (drop its torch.no_grad())"]
    lines = [
        "ref_model.requires_grad_(False); ref_model.eval()",
        "with torch.no_grad():",
        "    ref_logps = logps(ref_model, batch)  # detached",
    ]
    return (
        ["DPOConfig: pass ref_model=None with peft (adapters off), or a frozen ref_model"] + lines if trainer else lines
    )


def _compile(v: Any) -> list[str]:
    if v == "off":
        return ["drop model = torch.compile(model)"]
    return [f"model = torch.compile(model{'' if v == 'default' else f', mode={v!r}'})"]


DIST_ADVICE = {
    "parallel": lambda v: (
        ["model = DistributedDataParallel(model, device_ids=[local_rank])"]
        if v == "ddp"
        else [
            "from torch.distributed.fsdp import fully_shard",
            "for layer in model.model.layers: fully_shard(layer)",
            "fully_shard(model)",
        ]
        if v == "fsdp2"
        else ["train in one process"]
    ),
    "reshard_after_forward": lambda v: [f"fully_shard(layer, reshard_after_forward={bool(v)})"],
    "fsdp_prefetch": lambda v: (
        [
            f"layers[i].set_modules_to_forward_prefetch(layers[i + 1:i + 1 + {v}])",
            f"layers[i].set_modules_to_backward_prefetch(layers[max(i - {v}, 0):i][::-1])",
        ]
        if v
        else ["leave FSDP2's implicit prefetch"]
    ),
    "ddp_bucket_cap_mb": lambda v: [f"DistributedDataParallel(model, bucket_cap_mb={v})"],
    "accum_no_sync": lambda v: (
        [
            "with model.no_sync():  # DDP, all micro-batches but the last",
            "model.set_requires_gradient_sync(is_last_micro_batch)  # FSDP2",
        ]
        if v
        else ["sync gradients in every micro-batch"]
    ),
    "balance_tokens": lambda v: (
        [
            "# give each rank batches of about the same token count:",
            "# sort samples by length, deal batches round-robin to ranks",
        ]
        if v
        else ["# batches of a fixed sample count per rank"]
    ),
    "nproc_per_node": lambda v: [f"torchrun --nproc-per-node {v} train.py"],
}


@dataclass(frozen=True)
class Say:
    """How one knob's value is said in the user's code.

    loop: the lines of a plain training loop; trainer: a Trainer user's lines, where they are not
    the `TrainingArguments` fields of `run/trainer_args.TABLE` (nor, without either, the loop's)."""

    loop: Callable[[Any], list[str]]
    trainer: Callable[[Any], list[str]] | None = None


def _both(fn: Callable[[Any, bool], list[str]]) -> Say:
    """One function for both audiences."""
    return Say(lambda v: fn(v, False), lambda v: fn(v, True))


_DTYPE = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
_LORA_FIELDS = {
    "lora_rank": "r",
    "lora_alpha": "lora_alpha",
    "lora_dropout": "lora_dropout",
    "lora_targets": "target_modules",
}
_OPTIM_CLASS = {
    "adamw": "torch.optim.AdamW",
    "paged_adamw": "bnb.optim.PagedAdamW",
    "paged_adamw_8bit": "bnb.optim.PagedAdamW8bit",
}

#: every knob a user's own training can change, said as code (Liger's kernels: together, in advise)
ADVICE: dict[str, Say] = {
    # layer 0 (what trains, and how): peft, TRL
    "train": Say(_train),
    **{k: Say(lambda v, f=f: [f"LoraConfig({f}={v!r})  # peft"]) for k, f in _LORA_FIELDS.items()},
    "dpo_beta": Say(lambda v: [f"beta = {v}  # in the DPO loss"], lambda v: [f"DPOConfig(beta={v})"]),
    "warmup": Say(lambda v: []),  # vlmdoctor's own measuring window, not the user's training
    "steps": Say(lambda v: []),
    "repeats": Say(lambda v: []),
    # layer 1: precision
    "weight_dtype": _both(_weight_dtype),
    "autocast": Say(
        lambda v: (
            ["with torch.autocast('cuda', dtype=torch.bfloat16):", "    loss = model(**batch).loss"]
            if v == "bf16"
            else ["drop the torch.autocast(...) around the forward"]
        )
    ),
    "vision_no_grad": Say(
        _lines(
            [
                "model.vision_tower.requires_grad_(False)  # frozen tower",
                "with torch.no_grad():",
                "    image_features = model.get_image_features(pixel_values=pixel_values)",
            ],
            ["run the vision tower with autograd (drop its torch.no_grad())"],
        )
    ),
    "allow_tf32": Say(lambda v: [f"torch.backends.cuda.matmul.allow_tf32 = {bool(v)}"]),
    "input_require_grads": Say(
        _lines(["model.enable_input_require_grads()"], ["drop model.enable_input_require_grads()"])
    ),
    "dpo_reference_dtype": Say(lambda v: [f"ref_model.to({_DTYPE[v]})  # or load it with dtype={_DTYPE[v]}"]),
    "dpo_reference_no_grad": _both(_dpo_reference_no_grad),
    "fp8": Say(_fp8),
    # layer 2: batching
    "batch_size": Say(lambda v: [f"DataLoader(..., batch_size={v})"]),
    "grad_accum": Say(lambda v: [f"accumulate {v} micro-batches per optimizer step"]),
    # layer 3: data layout
    "sampler": Say(
        lambda v: (
            [
                "from transformers.trainer_pt_utils import LengthGroupedSampler",
                "sampler = LengthGroupedSampler(B, lengths=lengths)",
                "DataLoader(ds, batch_size=B, sampler=sampler)",
            ]
            if v == "length_bucketed"
            else ["DataLoader(ds, batch_size=B, shuffle=True)"]
        )
    ),
    "pad_to_multiple_of": Say(lambda v: [f"processor(..., padding=True, pad_to_multiple_of={v})  # or the collator's"]),
    "packing": Say(
        lambda v: [f"{'pack samples into rows' if v else 'stop packing samples'} in the collator"],
        lambda v: ["SFTConfig(packing=True)  # TRL"] if v else ["stop packing samples in the collator"],
    ),
    "pack_length": Say(
        lambda v: [f"pack samples into rows of {v} tokens in the collator"],
        lambda v: [f"SFTConfig(packing=True, max_length={v})  # TRL"],
    ),
    # layer 4: kernel fusion
    "attention": Say(_attention),
    "lm_head_labeled_only": _both(_lm_head),
    "compile": Say(_compile),
    "compile_regions": Say(lambda v: ["compile the whole model: model = torch.compile(model)"]),  # on: in advise()
    "compile_vision": Say(
        lambda v: (
            ["model.vision_tower = torch.compile(", "    model.vision_tower, fullgraph=True, dynamic=False)"]
            if v == "fullgraph"
            else ["compile the vision tower with the model (no separate torch.compile)"]
        )
    ),
    "compile_shape_padding": Say(
        lambda v: [
            "import torch._inductor.config as inductor_config",
            f"inductor_config.shape_padding = {bool(v)}  # before torch.compile",
        ]
    ),
    "unsloth": Say(
        _lines(
            [
                "from unsloth import FastLanguageModel  # before transformers",
                "model, tok = FastLanguageModel.from_pretrained(NAME,",
                "    load_in_4bit=False, full_finetuning=True)",
            ],
            ["load the model with transformers, not Unsloth's FastLanguageModel"],
        )
    ),
    # layer 5: system tuning
    "gradient_checkpointing": Say(
        _lines(["model.gradient_checkpointing_enable()"], ["model.gradient_checkpointing_disable()"])
    ),
    "checkpoint_use_reentrant": Say(
        lambda v: [
            "model.gradient_checkpointing_enable(",
            f"    gradient_checkpointing_kwargs={{'use_reentrant': {bool(v)}}})",
        ]
    ),
    "num_workers": Say(lambda v: [f"DataLoader(..., num_workers={v}, persistent_workers=True)"]),
    "pin_memory": Say(
        lambda v: (
            [f"DataLoader(..., pin_memory={bool(v)})"]
            + (["batch = {k: v.to('cuda', non_blocking=True) for k, v in batch.items()}"] if v else [])
        )
    ),
    "cache_vision_features": Say(
        _lines(
            ["precompute the frozen tower's image features once and load them with the batch"],
            ["compute image features in the step instead of caching them"],
        )
    ),
    "fused_optimizer": Say(lambda v: [f"torch.optim.AdamW(params, lr=..., fused={bool(v)})"]),
    "optimizer": Say(lambda v: [f"{_OPTIM_CLASS[v]}(params, lr=...)"]),
    "dpo_precompute_reference": Say(
        _lines(
            [
                "compute the reference log-probs of every pair once, before training, and read",
                "them with the batch (the reference then leaves the step and the GPU)",
            ],
            ["compute the reference log-probs in each step"],
        ),
        lambda v: [f"DPOConfig(precompute_ref_log_probs={bool(v)})  # TRL"],
    ),
    "sync_loss": Say(
        lambda v: ["call loss.item() every N steps, not every step (it waits for the GPU)"],
        lambda v: ["logging_steps=50  # each log syncs the device"],
    ),
    # several processes (the same lines for Trainer users, through accelerate / FSDP config)
    **{k: Say(fn) for k, fn in DIST_ADVICE.items()},
}


def _one(knob: str, value: Any, trainer: bool, fields: dict[str, Any]) -> list[str]:
    """One knob's lines: its TrainingArguments fields for a Trainer user, else its entry in ADVICE."""
    if trainer and knob in TABLE:
        return [spelled(name, fields[name]) for name in TABLE[knob].write(value) if name in fields]
    say = ADVICE.get(knob)
    if say is None:
        return [f"{knob}={value!r} (no {'TrainingArguments' if trainer else 'loop'} equivalent known)"]
    return (say.trainer if trainer and say.trainer else say.loop)(value)


def _regional(mode: str, trainer: bool) -> list[str]:
    """Regional compilation in the user's code: each block of a stack compiled in place, one compile for all."""
    arg = "" if mode == "default" else f"mode={mode!r}"
    lines = [
        "# compile each repeated block in place: one compile serves every",
        "# block of a stack (the LLM's decoder layers, the tower's layers)",
        "for block in model.model.language_model.layers:",
        f"    block.compile({arg})",
    ]
    return lines + (["torch_compile=False  # the blocks are compiled already"] if trainer else [])


def advise(patch: dict[str, Any], audience: str, context: dict[str, Any] | None = None) -> list[str]:
    """Lines the user writes to apply a finding's config patch: TrainingArguments fields or loop code."""
    if audience not in AUDIENCES:
        raise ValueError(f"audience must be one of {AUDIENCES}, not {audience!r}")
    ctx = context or {}
    trainer = audience == "trainer"
    fields = fields_for(patch) if trainer else {}
    lines: list[str] = []
    regional = bool(patch.get("compile_regions"))
    for knob, value in patch.items():
        if regional and knob == "compile":  # said once, with compile_regions
            continue
        if regional and knob == "compile_regions":
            value_lines = _regional(str(patch.get("compile", "default")), trainer)
        elif knob in LIGER_KNOBS and not trainer:
            value_lines = []  # said once for all Liger knobs, below
        else:
            value_lines = _one(knob, value, trainer, fields)
        for line in value_lines:
            if line not in lines:
                lines.append(line)
    liger = {LIGER_KNOBS[k]: bool(v) for k, v in patch.items() if k in LIGER_KNOBS}
    if liger and not trainer:
        lines += _liger_loop(liger, _liger_family(ctx))
    return lines


def _liger_loop(liger: dict[str, bool], fam: str) -> list[str]:
    """Liger's kernels in a plain loop: one patching call for all of them, before the model is built."""
    if not any(liger.values()):  # the fix turns Liger off (compile fuses the same operations)
        return [f"# and drop apply_liger_kernel_to_{fam}(...) if you call it"]
    return [
        f"from liger_kernel.transformers import apply_liger_kernel_to_{fam}",
        "# before the model is built:",
        f"apply_liger_kernel_to_{fam}(",
        *[f"    {k}={v}," for k, v in liger.items()],
        ")",
    ]


def add_advice(report: dict[str, Any], audience: str) -> dict[str, Any]:
    """Put `advice` on every finding of a report of the user's own training (in place)."""
    ctx = report.get("config") or {}
    diagnosis = report.get("diagnosis") or {}
    for f in list(diagnosis.get("findings") or []) + list(diagnosis.get("superseded") or []):
        f["advice"] = {"audience": audience, "lines": advise(f.get("config_patch") or {}, audience, ctx)}
    return report
