"""A prescription in the user's terms: run-config knobs -> TrainingArguments fields or loop lines.

vlmdoctor's rules patch its own run-config knobs (`weight_dtype=bf16`). For vlmdoctor's runs that
is the fix; for the user's own training vlmdoctor does not own the config, so the same patch is
said as what to write: `TrainingArguments(bf16=True)` for a `Trainer` user, `model.to(torch.bfloat16)`
for a plain loop.
"""

from __future__ import annotations

from typing import Any

AUDIENCES = ("trainer", "loop")

LIGER_KNOBS = {
    "liger_rope": "rope",
    "liger_rms_norm": "rms_norm",
    "liger_swiglu": "swiglu",
    "liger_fused_linear_cross_entropy": "fused_linear_cross_entropy",
}


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


def _sampling_field() -> str:
    """How this transformers spells length grouping: `group_by_length=True` (4.x) or the sampling strategy (5.x)."""
    try:
        import dataclasses

        from transformers import TrainingArguments

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
    except Exception:
        return "group_by_length=True"
    if "group_by_length" not in names and "train_sampling_strategy" in names:
        return 'train_sampling_strategy="group_by_length"'
    return "group_by_length=True"


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


def _one(knob: str, value: Any, audience: str, ctx: dict[str, Any]) -> list[str]:
    trainer = audience == "trainer"
    if knob == "weight_dtype":
        if value == "bf16":
            return (
                ["from_pretrained(..., dtype=torch.bfloat16)  # weights in bf16, not fp32", "bf16=True"]
                if trainer
                else ["model.to(torch.bfloat16)  # or from_pretrained(..., dtype=torch.bfloat16)"]
            )
        return ["from_pretrained(..., dtype=torch.float32)"] if trainer else ["model.to(torch.float32)"]
    if knob == "autocast":
        if value == "bf16":
            return (
                ["bf16=True"]
                if trainer
                else ["with torch.autocast('cuda', dtype=torch.bfloat16):", "    loss = model(**batch).loss"]
            )
        return ["bf16=False, fp16=False"] if trainer else ["drop the torch.autocast(...) around the forward"]
    if knob == "gradient_checkpointing":
        if trainer:
            return [f"gradient_checkpointing={bool(value)}"]
        return ["model.gradient_checkpointing_enable()" if value else "model.gradient_checkpointing_disable()"]
    if knob == "checkpoint_use_reentrant":
        kw = f"gradient_checkpointing_kwargs={{'use_reentrant': {bool(value)}}}"
        return [kw] if trainer else ["model.gradient_checkpointing_enable(", f"    {kw})"]
    if knob == "sampler":
        if value == "length_bucketed":
            return (
                [_sampling_field()]
                if trainer
                else [
                    "from transformers.trainer_pt_utils import LengthGroupedSampler",
                    "sampler = LengthGroupedSampler(B, lengths=lengths)",
                    "DataLoader(ds, batch_size=B, sampler=sampler)",
                ]
            )
        off = "group_by_length=False" if _sampling_field().startswith("group") else 'train_sampling_strategy="random"'
        return [off] if trainer else ["DataLoader(ds, batch_size=B, shuffle=True)"]
    if knob in LIGER_KNOBS:
        return []  # said once for all Liger knobs, below
    if knob == "compile":
        if value == "off":
            return ["torch_compile=False"] if trainer else ["drop model = torch.compile(model)"]
        mode = "" if value == "default" else f", mode={value!r}"
        if trainer:
            return ["torch_compile=True"] + ([f"torch_compile_mode={value!r}"] if mode else [])
        return [f"model = torch.compile(model{mode})"]
    if knob == "compile_regions":  # on: said with the compile mode, in advise()
        return ["compile the whole model: model = torch.compile(model)"]
    if knob == "compile_vision":
        if value == "fullgraph":
            return [
                "model.vision_tower = torch.compile(",
                "    model.vision_tower, fullgraph=True, dynamic=False)",
            ]
        return ["compile the vision tower with the model (no separate torch.compile)"]
    if knob == "compile_shape_padding":
        return [
            "import torch._inductor.config as inductor_config",
            f"inductor_config.shape_padding = {bool(value)}  # before torch.compile",
        ]
    if knob == "unsloth":
        if value:
            return [
                "from unsloth import FastLanguageModel  # before transformers",
                "model, tok = FastLanguageModel.from_pretrained(NAME,",
                "    load_in_4bit=False, full_finetuning=True)",
            ]
        return ["load the model with transformers, not Unsloth's FastLanguageModel"]
    if knob == "num_workers":
        return (
            [f"dataloader_num_workers={value}", "dataloader_persistent_workers=True"]
            if trainer
            else [f"DataLoader(..., num_workers={value}, persistent_workers=True)"]
        )
    if knob == "pin_memory":
        return (
            [f"dataloader_pin_memory={bool(value)}"]
            if trainer
            else [f"DataLoader(..., pin_memory={bool(value)})"]
            + (["batch = {k: v.to('cuda', non_blocking=True) for k, v in batch.items()}"] if value else [])
        )
    if knob == "batch_size":
        return [f"per_device_train_batch_size={value}"] if trainer else [f"DataLoader(..., batch_size={value})"]
    if knob == "grad_accum":
        return (
            [f"gradient_accumulation_steps={value}"]
            if trainer
            else [f"accumulate {value} micro-batches per optimizer step"]
        )
    if knob == "fused_optimizer":
        if trainer:
            return ['optim="adamw_torch_fused"' if value else 'optim="adamw_torch"']
        return [f"torch.optim.AdamW(params, lr=..., fused={bool(value)})"]
    if knob == "vision_no_grad":
        if value:
            return [
                "model.vision_tower.requires_grad_(False)  # frozen tower",
                "with torch.no_grad():",
                "    image_features = model.get_image_features(pixel_values=pixel_values)",
            ]
        return ["run the vision tower with autograd (drop its torch.no_grad())"]
    if knob == "allow_tf32":
        return ["tf32=True"] if trainer and value else [f"torch.backends.cuda.matmul.allow_tf32 = {bool(value)}"]
    if knob == "attention":
        if value == "flex":  # the LLM only: packed position ids become a document BlockMask
            return [
                'from_pretrained(..., attn_implementation="flex_attention")  # the LLM',
                '# a VLM class: attn_implementation={"text_config": "flex_attention"}',
                "# packed rows: position_ids restart per sample, attention_mask=None",
            ]
        if value in ("sdpa", "eager", "flash"):
            impl = {"sdpa": "sdpa", "eager": "eager", "flash": "flash_attention_2"}[value]
            return [f'from_pretrained(..., attn_implementation="{impl}")']
        backend = {"cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}.get(value, value)
        return [
            "from torch.nn.attention import sdpa_kernel, SDPBackend",
            f"with sdpa_kernel(SDPBackend.{backend}):  # forward + backward",
        ]
    if knob == "pad_to_multiple_of":
        return [f"processor(..., padding=True, pad_to_multiple_of={value})  # or the collator's"]
    if knob == "packing":
        return (
            ["SFTConfig(packing=True)  # TRL"]
            if trainer and value
            else [f"{'pack samples into rows' if value else 'stop packing samples'} in the collator"]
        )
    if knob == "lm_head_labeled_only":
        head = ["in Trainer.compute_loss (a subclass):"] if trainer else []
        if not value:
            return head + ["loss = model(**batch).loss  # the LM head over every position"]
        return head + [
            "out = model.model(**inputs)  # no LM head over every position",
            "keep = labels[:, 1:] != -100  # next token is a label",
            "h = out.last_hidden_state[:, :-1][keep]",
            "loss = F.cross_entropy(model.lm_head(h), labels[:, 1:][keep])",
        ]
    if knob == "cache_vision_features":
        return [
            "compute image features in the step instead of caching them"
            if not value
            else "precompute the frozen tower's image features once and load them with the batch"
        ]
    if knob == "fp8":
        if value == "off":
            return ["train the linear layers in bf16 (no convert_to_float8_training)"]
        return [
            "from torchao.float8 import convert_to_float8_training, Float8LinearConfig",
            "# before torch.compile and the optimizer; not the LM head:",
            "convert_to_float8_training(model.model.language_model,",
            "    module_filter_fn=lambda m, fqn: m.in_features % 16 == 0",
            "    and m.out_features % 16 == 0,",
            f"    config=Float8LinearConfig.from_recipe_name({value!r}))",
        ]
    if knob == "input_require_grads":
        return ["model.enable_input_require_grads()" if value else "drop model.enable_input_require_grads()"]
    if knob == "sync_loss":
        return (
            ["logging_steps=50  # each log syncs the device"]
            if trainer
            else ["call loss.item() every N steps, not every step (it waits for the GPU)"]
        )
    if (
        knob in DIST_ADVICE
    ):  # issue 13: several processes (same lines for Trainer users, through accelerate/FSDP config)
        return DIST_ADVICE[knob](value)
    if knob == "train":
        if value == "lora":
            return [
                "load the base in bf16 without quantization_config (no BitsAndBytesConfig)",
                "model = get_peft_model(model, LoraConfig(r=16, target_modules=[...]))  # peft",
            ]
        if value == "full":
            return ["train the LLM's own weights (no get_peft_model)"]
        return [
            "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"
        ]
    if knob == "dpo_reference_no_grad":
        if not value:
            return ["run the reference forward with autograd (drop its torch.no_grad())"]
        lines = [
            "ref_model.requires_grad_(False); ref_model.eval()",
            "with torch.no_grad():",
            "    ref_logps = logps(ref_model, batch)  # detached",
        ]
        return (
            ["DPOConfig: pass ref_model=None with peft (adapters off), or a frozen ref_model"] + lines
            if trainer
            else lines
        )
    if knob == "dpo_reference_dtype":
        dtype = "torch.bfloat16" if value == "bf16" else "torch.float32"
        return [f"ref_model.to({dtype})  # or load it with dtype={dtype}"]
    if knob == "dpo_precompute_reference":
        if trainer:
            return [f"DPOConfig(precompute_ref_log_probs={bool(value)})  # TRL"]
        return (
            [
                "compute the reference log-probs of every pair once, before training, and read",
                "them with the batch (the reference then leaves the step and the GPU)",
            ]
            if value
            else ["compute the reference log-probs in each step"]
        )
    if knob == "optimizer":
        name = {
            "adamw": "adamw_torch",
            "paged_adamw": "paged_adamw_32bit",
            "paged_adamw_8bit": "paged_adamw_8bit",
        }[value]
        cls = {
            "adamw": "torch.optim.AdamW",
            "paged_adamw": "bnb.optim.PagedAdamW",
            "paged_adamw_8bit": "bnb.optim.PagedAdamW8bit",
        }[value]
        return [f'optim="{name}"'] if trainer else [f"{cls}(params, lr=...)"]
    if knob in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets"):
        peft_name = {
            "lora_rank": "r",
            "lora_alpha": "lora_alpha",
            "lora_dropout": "lora_dropout",
            "lora_targets": "target_modules",
        }[knob]
        return [f"LoraConfig({peft_name}={value!r})  # peft"]
    if knob == "dpo_beta":
        return [f"DPOConfig(beta={value})" if trainer else f"beta = {value}  # in the DPO loss"]
    if knob in ("warmup", "steps", "repeats"):
        return []  # vlmdoctor's own measuring window, not the user's training
    return [f"{knob}={value!r} (no {'TrainingArguments' if trainer else 'loop'} equivalent known)"]


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
    lines: list[str] = []
    regional = bool(patch.get("compile_regions"))
    for knob, value in patch.items():
        if regional and knob == "compile":  # said once, with compile_regions
            continue
        if regional and knob == "compile_regions":
            value_lines = _regional(str(patch.get("compile", "default")), audience == "trainer")
        else:
            value_lines = _one(knob, value, audience, ctx)
        for line in value_lines:
            if line not in lines:
                lines.append(line)
    liger = {LIGER_KNOBS[k]: bool(v) for k, v in patch.items() if k in LIGER_KNOBS}
    if liger:
        if audience == "trainer":
            on = any(liger.values())
            lines.append(f"use_liger_kernel={on}")
            if on:
                lines.append(f"liger_kernel_config={liger!r}")
        elif not any(liger.values()):  # the fix turns Liger off (compile fuses the same operations)
            lines.append(f"# and drop apply_liger_kernel_to_{_liger_family(ctx)}(...) if you call it")
        else:
            fam = _liger_family(ctx)
            lines += [
                f"from liger_kernel.transformers import apply_liger_kernel_to_{fam}",
                "# before the model is built:",
                f"apply_liger_kernel_to_{fam}(",
            ]
            lines += [f"    {k}={v}," for k, v in liger.items()] + [")"]
    return lines


def add_advice(report: dict[str, Any], audience: str) -> dict[str, Any]:
    """Put `advice` on every finding of a report of the user's own training (in place)."""
    ctx = report.get("config") or {}
    diagnosis = report.get("diagnosis") or {}
    for f in list(diagnosis.get("findings") or []) + list(diagnosis.get("superseded") or []):
        f["advice"] = {"audience": audience, "lines": advise(f.get("config_patch") or {}, audience, ctx)}
    return report
