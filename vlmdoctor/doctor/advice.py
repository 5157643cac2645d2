"""A prescription in the user's terms: run-config knobs -> TrainingArguments fields or loop lines.

vlmdoctor's rules patch its own run-config knobs (`weight_dtype=bf16`). For vlmdoctor's runs that
is the fix; for the user's own training vlmdoctor does not own the config, so the same patch is
said as what to write: `TrainingArguments(bf16=True)` for a `Trainer` user, `model.to(torch.bfloat16)`
for a plain loop.

Every line is Python, meant to be pasted (tests/test_advice_pasted.py pastes them into the example
scripts and runs them): a `TrainingArguments` field (`name=value`); a call with `...` (`DataLoader(...,
batch_size=24)`: add these arguments to that call); statements (a `class ...(Trainer)` to use in place
of Trainer, `loss = ...` lines in place of the loss line, other lines after the model and the data are
made); or a comment, for what is not code. What the run showed (the batch size, the device, where the
model keeps its parts, whether the Trainer can read each sample's length) fills the lines in.
"""

from __future__ import annotations

import sys
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
    """The LLM's attention implementation, or the SDPA backend (forward and backward under the context)."""
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
        f"with sdpa_kernel(SDPBackend.{backend}):  # forward and backward",
        "    loss = model(**batch).loss",
        "    loss.backward()",
    ]


def _lm_head(v: Any, trainer: bool, ctx: dict[str, Any]) -> list[str]:
    """The LM head and the loss on the labeled positions only: the same loss, fewer rows through the head.

    One process: the model without its head (`model.model`), then the head on the kept rows. Under DDP the
    model's attributes are on `model.module`, and calling `model.module.model` would skip DDP's forward, which
    is what synchronizes the gradients: there the wrapped model runs whole, with one logit row
    (`logits_to_keep=1`), and the head reads the final hidden states (the Trainer passes the wrapped model
    to compute_loss too)."""
    if not v:
        return ["loss = model(**batch).loss  # the LM head over every position"]
    body = ['labels = batch["labels"]', 'x = {k: v for k, v in batch.items() if k != "labels"}']
    if _wrapped(ctx):
        body += [
            f"inner = {UNWRAP}  # the model inside DDP",
            "out = model(**x, logits_to_keep=1, output_hidden_states=True)",
            "keep = labels[:, 1:] != -100  # the next token is a label",
            "h = out.hidden_states[-1][:, :-1][keep]  # after the final norm",
            "logits = inner.lm_head(h).float()",
        ]
    else:
        body += [
            "out = model.model(**x)  # the model without its LM head",
            "keep = labels[:, 1:] != -100  # the next token is a label",
            "h = out.last_hidden_state[:, :-1][keep]",
            "logits = model.lm_head(h).float()",
        ]
    body.append("loss = F.cross_entropy(logits, labels[:, 1:][keep])")
    if not trainer:
        return ["import torch.nn.functional as F", "# in place of loss = model(**batch).loss:", *body]
    return [
        "import torch.nn.functional as F",
        "class LabeledHeadTrainer(Trainer):  # use it in place of Trainer",
        "    def compute_loss(self, model, batch, return_outputs=False, **kw):",
        *(f"        {line}" for line in body),
        "        return (loss, out) if return_outputs else loss",
    ]


def _fp8(v: Any, ctx: dict[str, Any]) -> list[str]:
    if v == "off":
        return ["# train the linear layers in bf16 (no convert_to_float8_training)"]
    llm = (ctx.get("paths") or {}).get("llm") or "model.language_model"
    return [
        "from torchao.float8 import convert_to_float8_training, Float8LinearConfig",
        "# before torch.compile and the optimizer; not the LM head:",
        *([f"inner = {UNWRAP}  # the model inside DDP"] if _wrapped(ctx) else []),
        f"convert_to_float8_training({'inner' if _wrapped(ctx) else 'model'}.{llm},",
        "    module_filter_fn=lambda m, fqn: m.in_features % 16 == 0",
        "    and m.out_features % 16 == 0,",
        f"    config=Float8LinearConfig.from_recipe_name({v!r}))",
    ]


def _train(v: Any) -> list[str]:
    if v == "lora":
        return [
            "# load the base in bf16 without quantization_config (no BitsAndBytesConfig)",
            "model = get_peft_model(model, LoraConfig(r=16, target_modules=[...]))  # peft",
        ]
    if v == "full":
        return ["# train the LLM's own weights (no get_peft_model)"]
    return [
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'))"
    ]


def _dpo_reference_no_grad(v: Any, trainer: bool) -> list[str]:
    if not v:
        return ["# run the reference forward with autograd (drop its torch.no_grad())"]
    lines = [
        "ref_model.requires_grad_(False); ref_model.eval()",
        "with torch.no_grad():",
        "    ref_logps = logps(ref_model, batch)  # detached",
    ]
    return (
        ["# DPOConfig: pass ref_model=None with peft (adapters off), or a frozen ref_model"] + lines
        if trainer
        else lines
    )


def _compile(v: Any) -> list[str]:
    if v == "off":
        return ["# drop model = torch.compile(model)"]
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
        else ["# train in one process"]
    ),
    "reshard_after_forward": lambda v: [f"fully_shard(layer, reshard_after_forward={bool(v)})"],
    "fsdp_prefetch": lambda v: (
        [
            f"layers[i].set_modules_to_forward_prefetch(layers[i + 1:i + 1 + {v}])",
            f"layers[i].set_modules_to_backward_prefetch(layers[max(i - {v}, 0):i][::-1])",
        ]
        if v
        else ["# leave FSDP2's implicit prefetch"]
    ),
    "ddp_bucket_cap_mb": lambda v: [f"DistributedDataParallel(model, bucket_cap_mb={v})"],
    "accum_no_sync": lambda v: (
        [
            "# DDP: every micro-batch but the last under no_sync()",
            "with model.no_sync():",
            "    loss.backward()",
            "# FSDP2: model.set_requires_gradient_sync(is_last_micro_batch)",
        ]
        if v
        else ["# sync gradients in every micro-batch"]
    ),
    "balance_tokens": lambda v: (
        [
            "# give each rank batches of about the same token count:",
            "# sort samples by length, deal batches round-robin to ranks",
        ]
        if v
        else ["# batches of a fixed sample count per rank"]
    ),
    "nproc_per_node": lambda v: [f"# torchrun --nproc-per-node {v} train.py"],
}


@dataclass(frozen=True)
class Say:
    """How one knob's value is said in the user's code.

    loop: the lines of a plain training loop; trainer: a Trainer user's lines, where they are not
    the `TrainingArguments` fields of `run/trainer_args.TABLE` (nor, without either, the loop's).
    With `context`, both are called with (value, what the run showed)."""

    loop: Callable[..., list[str]]
    trainer: Callable[..., list[str]] | None = None
    context: bool = False


def _both(fn: Callable[[Any, bool], list[str]]) -> Say:
    """One function for both audiences."""
    return Say(lambda v: fn(v, False), lambda v: fn(v, True))


_DTYPE = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}


def _ckpt_name() -> str:
    """transformers 5 renames gradient checkpointing to activation checkpointing: the name the user's one has.

    Read off the transformers already imported (the user's process); without one (`analyze` imports none),
    the old name, which transformers 5 still takes."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    return (
        "activation_checkpointing"
        if hasattr(pretrained, "activation_checkpointing_enable")
        else "gradient_checkpointing"
    )


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
        lambda v, ctx: (
            [f"with torch.autocast({_device(ctx)!r}, dtype=torch.bfloat16):", "    loss = model(**batch).loss"]
            if v == "bf16"
            else ["loss = model(**batch).loss  # no torch.autocast(...) around it"]
        ),
        context=True,
    ),
    "vision_no_grad": Say(lambda v, ctx: _vision_no_grad(v, ctx), context=True),
    "allow_tf32": Say(lambda v: [f"torch.backends.cuda.matmul.allow_tf32 = {bool(v)}"]),
    "input_require_grads": Say(
        lambda v, ctx: (
            [f"{_root(ctx)}.enable_input_require_grads()"] if v else ["# drop model.enable_input_require_grads()"]
        ),
        context=True,
    ),
    "dpo_reference_dtype": Say(lambda v: [f"ref_model.to({_DTYPE[v]})  # or load it with dtype={_DTYPE[v]}"]),
    "dpo_reference_no_grad": _both(_dpo_reference_no_grad),
    "fp8": Say(lambda v, ctx: _fp8(v, ctx), context=True),
    # layer 2: batching
    "batch_size": Say(lambda v: [f"DataLoader(..., batch_size={v})"]),
    "grad_accum": Say(lambda v: [f"# accumulate {v} micro-batches per optimizer step"]),
    # layer 3: data layout
    "sampler": Say(lambda v, ctx: _sampler_loop(v, ctx), context=True),
    "pad_to_multiple_of": Say(lambda v: [f"processor(..., padding=True, pad_to_multiple_of={v})  # or the collator's"]),
    "packing": Say(
        lambda v: [f"# {'pack samples into rows' if v else 'stop packing samples'} in the collator"],
        lambda v: ["SFTConfig(packing=True)  # TRL"] if v else ["# stop packing samples in the collator"],
    ),
    "pack_length": Say(
        lambda v: [f"# pack samples into rows of {v} tokens in the collator"],
        lambda v: [f"SFTConfig(packing=True, max_length={v})  # TRL"],
    ),
    # layer 4: kernel fusion
    "attention": Say(_attention),
    "lm_head_labeled_only": Say(lambda v, ctx: _lm_head(v, False, ctx), lambda v, ctx: _lm_head(v, True, ctx), True),
    "compile": Say(_compile),
    "compile_regions": Say(lambda v: ["model = torch.compile(model)  # the whole model"]),  # on: in advise()
    "compile_vision": Say(
        lambda v: (
            ["model.vision_tower = torch.compile(", "    model.vision_tower, fullgraph=True, dynamic=False)"]
            if v == "fullgraph"
            else ["# compile the vision tower with the model (no separate torch.compile)"]
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
            ["# load the model with transformers, not Unsloth's FastLanguageModel"],
        )
    ),
    # layer 5: system tuning
    "gradient_checkpointing": Say(
        lambda v, ctx: [f"{_root(ctx)}.{_ckpt_name()}_{'enable' if v else 'disable'}()"], context=True
    ),
    "checkpoint_use_reentrant": Say(
        lambda v, ctx: [
            f"{_root(ctx)}.{_ckpt_name()}_enable(",
            f"    {_ckpt_name()}_kwargs={{'use_reentrant': {bool(v)}}})",
        ],
        context=True,
    ),
    "num_workers": Say(
        lambda v: [
            f"DataLoader(..., num_workers={v}, persistent_workers=True)" if v else "DataLoader(..., num_workers=0)"
        ]
    ),
    "pin_memory": Say(
        lambda v, ctx: (
            [f"DataLoader(..., pin_memory={bool(v)})"]
            + ([f"batch = {{k: v.to({_device(ctx)!r}, non_blocking=True) for k, v in batch.items()}}"] if v else [])
        ),
        context=True,
    ),
    "cache_vision_features": Say(
        _lines(
            ["# precompute the frozen tower's image features once and load them with the batch"],
            ["# compute image features in the step instead of caching them"],
        )
    ),
    "fused_optimizer": Say(lambda v: [f"torch.optim.AdamW(params, lr=..., fused={bool(v)})"]),
    "optimizer": Say(lambda v: [f"{_OPTIM_CLASS[v]}(params, lr=...)"]),
    "dpo_precompute_reference": Say(
        _lines(
            [
                "# compute the reference log-probs of every pair once, before training, and read",
                "# them with the batch (the reference then leaves the step and the GPU)",
            ],
            ["# compute the reference log-probs in each step"],
        ),
        lambda v: [f"DPOConfig(precompute_ref_log_probs={bool(v)})  # TRL"],
    ),
    "sync_loss": Say(
        lambda v: ["# call loss.item() every N steps, not every step (it waits for the GPU)"],
        lambda v: ["logging_steps=50  # each log syncs the device"],
    ),
    # several processes (the same lines for Trainer users, through accelerate / FSDP config)
    **{k: Say(fn) for k, fn in DIST_ADVICE.items()},
}


def _device(ctx: dict[str, Any]) -> str:
    return str(ctx.get("device") or "cuda")


#: the model inside DDP (`model.module`) or FSDP1's wrapper; the model itself in one process and under FSDP2
UNWRAP = 'getattr(model, "module", model)'


def _wrapped(ctx: dict[str, Any]) -> bool:
    """Is the user's `model` possibly a DDP/FSDP wrapper? Said so by the run (its `parallel`, its ranks), or not
    known (`analyze` of a trace: no run to ask), where the lines must work both ways."""
    parallel = ctx.get("parallel")
    return parallel not in (None, "none") or (ctx.get("world_size") or 1) > 1 or "device" not in ctx


def _root(ctx: dict[str, Any]) -> str:
    """How the user's code reaches the model's own attributes: `model`, or through a DDP wrapper."""
    return UNWRAP if _wrapped(ctx) else "model"


def _path(ctx: dict[str, Any], part: str, default: str) -> str:
    """`model.<where the model keeps this part>`, as the run found it (own.model.describe_model), through a wrapper."""
    return _root(ctx) + "." + str((ctx.get("paths") or {}).get(part) or default)


def _sampler_loop(v: Any, ctx: dict[str, Any]) -> list[str]:
    if v != "length_bucketed":
        return ["DataLoader(..., shuffle=True)"]
    b = ctx.get("batch_size") or "batch_size"
    if _wrapped(ctx):  # each rank keeps its own shard, as DistributedSampler gave it, with lengths grouped
        return [
            "from transformers.trainer_pt_utils import DistributedLengthGroupedSampler",
            "# each sample's length; a collator that tokenizes: collate([x])",
            'lengths = [len(x["input_ids"]) for x in ds]  # ds: your dataset',
            "# in place of DistributedSampler: still a shard per rank, lengths grouped",
            f"sampler = DistributedLengthGroupedSampler({b}, lengths=lengths)",
            "DataLoader(..., sampler=sampler, shuffle=False)  # set_epoch() each epoch",
        ]
    return [
        "from transformers.trainer_pt_utils import LengthGroupedSampler",
        "# each sample's length; a collator that tokenizes: collate([x])",
        'lengths = [len(x["input_ids"]) for x in ds]  # ds: your dataset',
        f"sampler = LengthGroupedSampler({b}, lengths=lengths)",
        "DataLoader(..., sampler=sampler, shuffle=False)  # the sampler shuffles",
    ]


#: group_by_length when the Trainer cannot read the lengths from the samples (the collator tokenizes)
LENGTHS_TRAINER = [
    "class LengthGroupedTrainer(Trainer):  # use it in place of Trainer",
    "    def _get_train_sampler(self, *args, **kwargs):",
    "        from transformers.trainer_pt_utils import LengthGroupedSampler",
    "        # each sample's length, from your collator, once before training",
    "        collate, ds, a = self.data_collator, self.train_dataset, self.args",
    '        lengths = [len(collate([x])["input_ids"][0]) for x in ds]',
    "        size = a.train_batch_size * a.gradient_accumulation_steps",
    "        return LengthGroupedSampler(size, lengths=lengths)",
]


def _sampler_trainer_extra(value: Any, ctx: dict[str, Any]) -> list[str]:
    """The lengths group_by_length needs when the samples do not hold them (the known ValueError)."""
    if value != "length_bucketed" or ctx.get("sample_lengths") in ("input_ids", "length_column"):
        return []
    why = (
        "# your samples hold no input_ids (the collator tokenizes): give the lengths"
        if ctx.get("sample_lengths") == "none"
        else "# samples without input_ids (the collator tokenizes): give the lengths"
    )
    return [why, "# (or a datasets.Dataset with a length_column_name column)", *LENGTHS_TRAINER]


def _vision_no_grad(v: Any, ctx: dict[str, Any]) -> list[str]:
    """The frozen tower's forward under no_grad: no graph is built through it. A projector kept inside
    the tower (Qwen2-VL's merger) still trains: then every other child of the tower is wrapped."""
    if not v:
        return ["# run the vision tower with autograd (drop its torch.no_grad())"]
    tower = _path(ctx, "vision", "model.vision_tower")
    proj = _path(ctx, "projector", "model.multi_modal_projector")
    lines = [f"tower = {tower}", "tower.requires_grad_(False)  # frozen"]
    if proj.startswith(tower + "."):
        inner = proj[len(tower) + 1 :].split(".")[0]
        return lines + [
            f"for name, m in tower.named_children():  # not {inner}, which trains",
            f"    if name != {inner!r}:",
            "        m.forward = torch.no_grad()(m.forward)",
        ]
    return lines + ["tower.forward = torch.no_grad()(tower.forward)  # no graph"]


def _one(knob: str, value: Any, trainer: bool, fields: dict[str, Any], ctx: dict[str, Any]) -> list[str]:
    """One knob's lines: its TrainingArguments fields for a Trainer user, else its entry in ADVICE."""
    if trainer and knob in TABLE:
        lines = [spelled(name, fields[name]) for name in TABLE[knob].write(value) if name in fields]
        return lines + (_sampler_trainer_extra(value, ctx) if knob == "sampler" else [])
    say = ADVICE.get(knob)
    if say is None:
        return [f"# {knob}={value!r}: no {'TrainingArguments' if trainer else 'loop'} equivalent known"]
    fn = say.trainer if trainer and say.trainer else say.loop
    return fn(value, ctx) if say.context else fn(value)


def _regional(mode: str, trainer: bool, ctx: dict[str, Any]) -> list[str]:
    """Regional compilation in the user's code: each block of a stack compiled in place, one compile for all."""
    arg = "" if mode == "default" else f"mode={mode!r}"
    lines = [
        "# compile each repeated block in place: one compile serves every",
        "# block of a stack (the LLM's decoder layers, the tower's layers)",
        f"for block in {_path(ctx, 'llm', 'model.language_model')}.layers:",
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
            value_lines = _regional(str(patch.get("compile", "default")), trainer, ctx)
        elif knob in LIGER_KNOBS and not trainer:
            value_lines = []  # said once for all Liger knobs, below
        else:
            value_lines = _one(knob, value, trainer, fields, ctx)
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
    ctx = (report.get("config") or {}) | {"paths": (report.get("model") or {}).get("paths") or {}}
    diagnosis = report.get("diagnosis") or {}
    for f in list(diagnosis.get("findings") or []) + list(diagnosis.get("superseded") or []):
        f["advice"] = {"audience": audience, "lines": advise(f.get("config_patch") or {}, audience, ctx)}
    return report
