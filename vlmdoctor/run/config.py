"""The run config: every knob of a training run in one serializable object.

Each knob carries the layer of the five-layer recipe it belongs to (1 precision, 2 batching,
3 data layout, 4 kernel fusion, 5 system tuning; 0 for what defines the experiment itself:
model, stage, measurement window). Rules in later stages patch these knobs by name, so the
names are the public interface of a prescription.

The defaults are what a typical first training script does: weights as loaded (fp32) with
bf16 autocast, batch 4, random order, no packing, default SDPA, no fusion, gradient
checkpointing on, no data-loader workers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from vlmdoctor import SCHEMA_VERSION
from vlmdoctor.errors import UsageError
from vlmdoctor.files import write_text
from vlmdoctor.inputs import MAX_YAML_BYTES, read_json, read_yaml
from vlmdoctor.run.zoo import refuse_composite_only

#: the `--help` panel of the knobs that spread a run over several processes
GPUS = "several GPUs"

#: torchrun's nodes by default: one (its --standalone rendezvous)
NNODES = "1"

LAYER_NAMES = {
    0: "experiment",
    1: "precision",
    2: "batching",
    3: "data layout",
    4: "kernel fusion",
    5: "system tuning",
}


def knob(
    default: Any,
    layer: int,
    help: str,
    choices: tuple | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    above: float | None = None,
    *,
    flag: str | None = None,
    panel: str | None = None,
    qualifies: dict[str, tuple] | None = None,
    alone: str | None = None,
):
    """A config field: the one declaration of a knob, from which its flag, `--help` line and checks come.

    layer: the recipe layer (0-5); help: one line for `--help` and the docs; choices / minimum /
    maximum / above (exclusive): the allowed values; flag: the command-line flag where it is not
    --NAME-WITH-DASHES; panel: the `--help` panel where it is not its layer's; qualifies: the
    knobs this one only says how to run, each with the values that turn them off (this knob then
    means nothing, and a command-line override turning them off drops it from a config file);
    alone: set without them, the knob is refused with this reason instead of being ignored.
    """
    return field(
        default=default,
        metadata={
            "layer": layer,
            "help": help,
            "choices": choices,
            "minimum": minimum,
            "maximum": maximum,
            "above": above,
            "flag": flag,
            "panel": panel,
            "qualifies": qualifies or {},
            "alone": alone,
        },
    )


def _label(name: str, source: str) -> str:
    """How an error names a knob: the flag on the command line, `source: knob` for a file."""
    if source == "command line":
        return flag(name)
    return f"{source}: {name}"


@dataclass
class RunConfig:
    # --- layer 0: what is measured -------------------------------------------------------
    model: str = knob("0.5b", 0, "model preset (see `vlmdoctor models`)")
    vision: str | None = knob(None, 0, "vision tower name, overrides the preset's")
    llm: str | None = knob(None, 0, "LLM name, overrides the preset's")
    projector: str | None = knob(None, 0, "projector type, overrides the preset's", ("linear", "mlp2x_gelu"))
    pixel_shuffle: int | None = knob(
        None, 0, "pixel-shuffle factor, overrides the preset's (1 = none)", minimum=1, maximum=16
    )
    weights: str = knob(
        "random",
        0,
        "random init from shipped configs, or the real checkpoints (the hub or a local cache)",
        ("random", "pretrained"),
    )
    stage: int = knob(2, 0, "1: projector only; 2: LLM + projector", (1, 2))
    device: str = knob("auto", 0, "where to run", ("auto", "cuda", "cpu"))
    steps: int = knob(20, 0, "timed steps per repeat", minimum=1, maximum=100_000)
    warmup: int = knob(5, 0, "warm-up steps before timing", minimum=0, maximum=100_000)
    repeats: int = knob(1, 0, "timed windows; numbers are the median over them", minimum=1, maximum=1000)
    seed: int = knob(0, 0, "random seed for weights and data", minimum=0, maximum=2**32 - 1)
    lr: float = knob(1e-5, 0, "AdamW learning rate", above=0)
    data: str = knob("synthetic", 0, "'synthetic' or a LLaVA-format JSON/JSONL file")
    tokenizer: str | None = knob(None, 0, "local tokenizer folder for --data FILE", qualifies={"data": ("synthetic",)})
    bad_records: str = knob(
        "stop",
        0,
        "malformed records in --data: stop the run or skip them (counted)",
        ("stop", "skip"),
        qualifies={"data": ("synthetic",)},
    )
    num_samples: int = knob(4096, 0, "synthetic samples in the data set", minimum=1, maximum=1_000_000)
    train: str = knob(
        "full",
        0,
        "what trains in the LLM: all weights (full), LoRA adapters on a frozen base (lora), "
        "or LoRA on a 4-bit NF4 base (qlora, GPU + bitsandbytes); docs/modes.md",
        ("full", "lora", "qlora"),
    )
    lora_rank: int = knob(16, 0, "LoRA rank r", minimum=1, maximum=4096, qualifies={"train": ("full",)})
    lora_alpha: float = knob(
        32.0, 0, "LoRA alpha (the adapter output is scaled by alpha / r)", above=0, qualifies={"train": ("full",)}
    )
    lora_dropout: float = knob(
        0.05, 0, "dropout on the LoRA adapter input", minimum=0, maximum=0.9, qualifies={"train": ("full",)}
    )
    lora_targets: str = knob(
        "attention_mlp",
        0,
        "LLM modules that get adapters: attention (q,k,v,o), attention_mlp "
        "(+ gate, up, down) or a comma list of module names",
        qualifies={"train": ("full",)},
    )
    objective: str = knob(
        "sft",
        0,
        "training objective: next-token cross entropy (sft) or DPO on preference pairs",
        ("sft", "dpo"),
    )
    dpo_beta: float = knob(
        0.1, 0, "DPO beta (strength of the implicit KL penalty)", above=0, qualifies={"objective": ("sft",)}
    )
    # --- layer 1: precision --------------------------------------------------------------
    weight_dtype: str = knob("fp32", 1, "dtype the weights are stored in", ("fp32", "bf16"))
    autocast: str = knob("bf16", 1, "autocast around forward and loss", ("bf16", "off"))
    vision_no_grad: bool = knob(False, 1, "run the frozen vision tower under torch.no_grad()")
    allow_tf32: bool = knob(False, 1, "let FP32 matmuls use TF32 tensor cores")
    input_require_grads: bool = knob(
        False,
        1,
        "call transformers' enable_input_require_grads() on the vision tower and "
        "the LLM, as LLaVA-style trainers do with checkpointing: the frozen tower's "
        "activations then require grad",
    )
    dpo_reference_dtype: str = knob(
        "fp32",
        1,
        "dtype of the DPO reference copy's weights (full training; LoRA's reference is the policy's own base)",
        ("fp32", "bf16"),
        qualifies={"objective": ("sft",)},
    )
    dpo_reference_no_grad: bool = knob(
        False,
        1,
        "run the DPO reference forward under torch.no_grad() with frozen "
        "weights (off: a deep-copied reference that still tracks grad)",
        qualifies={"objective": ("sft",)},
    )
    fp8: str = knob(
        "off",
        1,
        "FP8 training of the LLM's decoder linear layers through torchao.float8 (tensorwise "
        "or rowwise scaling; a GPU of compute capability 8.9+ and torchao; pays with --compile on "
        "wide GEMMs; docs/treat.md)",
        ("off", "tensorwise", "rowwise"),
    )
    # --- layer 2: batching ---------------------------------------------------------------
    batch_size: int = knob(4, 2, "samples per micro-batch", minimum=1, maximum=65536)
    grad_accum: int = knob(1, 2, "micro-batches per optimizer step", minimum=1, maximum=65536)
    # --- layer 3: data layout ------------------------------------------------------------
    sampler: str = knob("random", 3, "sample order", ("random", "length_bucketed"))
    pad_to_multiple_of: int = knob(
        1, 3, "pad each batch's length up to a multiple of this (1 = none)", minimum=1, maximum=65536
    )
    packing: bool = knob(False, 3, "pack samples into rows (position ids reset, no cross-sample attention)")
    pack_length: int = knob(
        2048, 3, "tokens per packed row", minimum=16, maximum=1 << 20, qualifies={"packing": (False,)}
    )
    # --- layer 4: kernel fusion ----------------------------------------------------------
    attention: str = knob(
        "sdpa",
        4,
        "attention backend (flex: the LLM on FlexAttention)",
        ("sdpa", "flash", "efficient", "cudnn", "math", "eager", "flex"),
    )
    liger_rope: bool = knob(False, 4, "Liger Triton RoPE")
    liger_rms_norm: bool = knob(False, 4, "Liger Triton RMSNorm")
    liger_swiglu: bool = knob(False, 4, "Liger Triton SwiGLU")
    liger_fused_linear_cross_entropy: bool = knob(
        False, 4, "Liger fused LM head + cross entropy (FusedCE)", flag="--liger-fused-ce"
    )
    lm_head_labeled_only: bool = knob(
        False,
        4,
        "run the LM head and the loss only on positions that carry a label (not on image, prompt and padding tokens)",
    )
    compile: str = knob(
        "off", 4, "torch.compile mode for the model", ("off", "default", "reduce-overhead", "max-autotune")
    )
    compile_vision: str = knob(
        "model",
        4,
        "how the vision tower is compiled: 'model' = with the rest of the model under "
        "--compile; 'fullgraph' = on its own, fullgraph=True and static shapes (the tower's input "
        "is a fixed-size image), in the --compile mode ('default' when --compile is off), the LLM "
        "decoder then compiled on its own",
        ("model", "fullgraph"),
    )
    compile_shape_padding: bool = knob(
        True,
        4,
        "Inductor's shape_padding (pad matmul dims for tensor-core alignment); "
        "torch's default is on, false turns it off for a with/without comparison",
        qualifies={"compile": ("off",), "compile_vision": ("model",)},
        alone="off changes nothing without torch.compile; add --compile or --compile-vision fullgraph",
    )
    compile_regions: bool = knob(
        False,
        4,
        "with --compile: compile each layer of every stack of repeated layers on its "
        "own (regional compilation: one graph serves all decoder layers, a fraction of the "
        "whole model's compile time), and the LM head with the loss on labeled positions as "
        "one more region; the rest stays eager",
        qualifies={"compile": ("off",)},
        alone="says how --compile compiles; add --compile default",
    )
    unsloth: bool = knob(
        False,
        4,
        "load the LLM through Unsloth's fast path (FastLanguageModel, llama and qwen2 "
        "classes; CUDA only); an alternative to Liger and torch.compile, never combined with them",
    )
    # --- layer 5: system tuning ----------------------------------------------------------
    gradient_checkpointing: bool = knob(True, 5, "recompute LLM activations in backward")
    checkpoint_use_reentrant: bool = knob(
        False,
        5,
        "use the reentrant checkpoint implementation",
        flag="--checkpoint-reentrant",
        qualifies={"gradient_checkpointing": (False,)},
    )
    num_workers: int = knob(0, 5, "data-loader worker processes", minimum=0, maximum=256)
    pin_memory: bool = knob(False, 5, "pinned host memory for batches (async H2D copies)")
    cache_vision_features: bool = knob(False, 5, "precompute frozen vision features once, copy them H2D each step")
    fused_optimizer: bool = knob(False, 5, "AdamW(fused=True) instead of the default foreach implementation")
    optimizer: str = knob(
        "adamw",
        5,
        "optimizer: torch AdamW, or bitsandbytes' paged AdamW (32-bit or 8-bit states; GPU + bitsandbytes)",
        ("adamw", "paged_adamw", "paged_adamw_8bit"),
    )
    dpo_precompute_reference: bool = knob(
        False,
        5,
        "compute the DPO reference log-probs once per sample before "
        "training and reuse them (reported, outside the timed window)",
        qualifies={"objective": ("sft",)},
    )
    sync_loss: bool = knob(
        False,
        5,
        "read the loss on the host (.item()) after every micro-batch, as logging loops "
        "often do: a device sync per micro-batch",
    )
    # --- several processes (torchrun) -----------------------------------------------------
    nproc_per_node: int = knob(
        1,
        0,
        "processes (one per GPU) per node, launched through torchrun",
        minimum=1,
        maximum=1024,
        panel=GPUS,
    )
    parallel: str = knob(
        "none",
        5,
        "data parallelism across processes: none (one process), ddp, or fsdp2 "
        "(fully_shard per decoder layer and the root)",
        ("none", "ddp", "fsdp2"),
        panel=GPUS,
    )
    reshard_after_forward: bool = knob(
        True,
        5,
        "FSDP2: free gathered parameters after forward, gather again in backward",
        panel=GPUS,
        qualifies={"parallel": ("none", "ddp")},
    )
    fsdp_prefetch: int = knob(
        0,
        5,
        "FSDP2: decoder layers whose all-gather is issued ahead explicitly (0 = FSDP2's implicit prefetch only)",
        minimum=0,
        maximum=64,
        panel=GPUS,
        qualifies={"parallel": ("none", "ddp")},
    )
    ddp_bucket_cap_mb: int = knob(
        25,
        5,
        "DDP: gradient bucket size in MB",
        minimum=1,
        maximum=4096,
        panel=GPUS,
        qualifies={"parallel": ("none", "fsdp2")},
    )
    accum_no_sync: bool = knob(
        False,
        5,
        "sync gradients only on the last micro-batch of an optimizer step (DDP "
        "no_sync, FSDP2 set_requires_gradient_sync)",
        panel=GPUS,
        qualifies={"parallel": ("none",)},
    )
    balance_tokens: bool = knob(
        False,
        2,
        "give every rank micro-batches of about the same token count (token-budget batching across ranks)",
        panel=GPUS,
        qualifies={"parallel": ("none",)},
    )

    # ------------------------------------------------------------------------------------
    @property
    def uses_liger(self) -> bool:
        return self.liger_rope or self.liger_rms_norm or self.liger_swiglu or self.liger_fused_linear_cross_entropy

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config", combinations: bool = True) -> RunConfig:
        """Build and validate; unknown keys and bad values are user errors naming the valid ones."""
        if not isinstance(data, dict):
            raise UsageError(f"{source}: expected a mapping of knob names to values, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in set(data) - names)
        if unknown:
            raise UsageError(f"{source}: unknown knob(s) {', '.join(unknown)}; valid knobs: {', '.join(sorted(names))}")
        data = dict(data)
        for f in fields(cls):  # YAML 1.1 reads 2e-5 as a string; accept any spelling of a number
            v = data.get(f.name)
            if _base_type(f.type) is float and isinstance(v, str):
                try:
                    data[f.name] = float(v)
                except ValueError:
                    pass
        cfg = cls(**data)
        cfg.validate(source, combinations)
        return cfg

    def replace(self, source: str = "config patch", **changes: Any) -> RunConfig:
        """A validated copy with some knobs changed (the shape of a prescription's config patch)."""
        return RunConfig.from_dict({**self.to_dict(), **changes}, source=source)

    def validate(self, source: str = "config", combinations: bool = True) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            meta = f.metadata
            name = _label(f.name, source)
            if value is None:
                if "None" in str(f.type):
                    continue
                raise UsageError(f"{name} needs a value (default: {f.default!r})")
            expected = _base_type(f.type)
            if expected is bool and not isinstance(value, bool):
                raise UsageError(f"{name} must be true or false, got {value!r}")
            if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise UsageError(f"{name} must be an integer, got {value!r}")
            lo, hi, above = meta.get("minimum"), meta.get("maximum"), meta.get("above")
            bounds = [f"> {_num(above)}"] if above is not None else []
            bounds += [f">= {_num(lo)}"] if lo is not None else []
            bounds += [f"<= {_num(hi)}"] if hi is not None else []
            wanted = (
                ("an integer" if expected is int else "a finite number")
                + "".join(" " + b for b in bounds[:1])
                + "".join(" and " + b for b in bounds[1:])
            )
            if expected is float and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            ):
                raise UsageError(f"{name} must be {wanted}, got {value!r}")
            if expected is str and not isinstance(value, str):
                raise UsageError(f"{name} must be a string, got {value!r}")
            if meta["choices"] is not None and value not in meta["choices"]:
                valid = ", ".join(str(c) for c in meta["choices"])
                raise UsageError(f"{name}={value!r} is not valid; choose one of: {valid}")
            if (
                (lo is not None and value < lo)
                or (hi is not None and value > hi)
                or (above is not None and value <= above)
            ):
                raise UsageError(f"{name} must be {wanted}, got {value!r}")
        if combinations:
            self._check_combinations(source)
        if self.nproc_per_node > 1 and self.parallel == "none":
            raise UsageError(
                f"{_label('nproc_per_node', source)}={self.nproc_per_node} runs several processes; "
                f"choose how they share the work: {_label('parallel', source)} ddp or fsdp2"
            )
        check_mode_knobs(self, source)

        try:
            refuse_composite_only(self.model, self.to_dict())
        except UsageError as e:
            raise UsageError(f"{source}: {e.message}") from None

    def _check_combinations(self, source: str) -> None:
        """Knobs that do not stack: one line naming both (the fusion systems each patch the same modules)."""
        if self.unsloth:
            liger = [f.name for f in fields(self) if f.name.startswith("liger_") and getattr(self, f.name)]
            if liger:
                raise UsageError(
                    f"{_pair('unsloth', liger[0], source)} do not stack: Unsloth and "
                    "Liger patch the same RMSNorm, SwiGLU, RoPE and loss modules; choose one"
                )
            if self.compile != "off" or self.compile_vision != "model":
                knob_name = "compile" if self.compile != "off" else "compile_vision"
                raise UsageError(
                    f"{_pair('unsloth', knob_name, source)} do not stack: Unsloth "
                    "compiles its own parts (unsloth_zoo's compiler) around hand-written Triton kernels; "
                    "measure Unsloth with compile off, or torch.compile without Unsloth"
                )
        if self.fp8 != "off":
            self._check_fp8(source)
        for name in idle_qualifiers(self.to_dict()):
            reason = fields_by_name()[name].metadata["alone"]
            if reason:
                raise UsageError(f"{_label(name, source)} {reason}")
        if self.compile_regions and self.compile == "reduce-overhead":
            # measured on the H100 (dino-135m): "accessing tensor output of CUDAGraphs that has been
            # overwritten by a subsequent run" in the first step, because every layer replays one graph
            raise UsageError(
                f"{_pair('compile_regions', 'compile', source)} reduce-overhead do not stack: every "
                "layer of a stack replays the same CUDA graph, whose output the next layer overwrites; "
                "use --compile default with regions, or reduce-overhead on the whole model"
            )
        if self.compile_regions and self.compile_vision != "model":
            raise UsageError(
                f"{_pair('compile_regions', 'compile_vision', source)} do not stack: regional "
                "compilation already compiles the tower's layers on their own; choose one"
            )

    def _check_fp8(self, source: str) -> None:
        """FP8 converts trained, full-width linear layers: what does not train them is refused (no hardware here)."""
        fp8 = _label("fp8", source)
        if self.train != "full":
            raise UsageError(
                f"{_pair('fp8', 'train', source)} {self.train} do not stack: FP8 training converts the "
                "LLM's trained linear layers; LoRA's base is frozen (an FP8 layer still computes its "
                "weight gradient) and its adapters are too narrow for FP8 GEMMs; use --train full"
            )
        if self.stage == 1:
            raise UsageError(
                f"{fp8} converts the LLM's trained linear layers, but stage 1 freezes the LLM (an FP8 "
                "layer still computes its weight gradient); use --stage 2"
            )
        if self.unsloth:
            raise UsageError(
                f"{_pair('fp8', 'unsloth', source)} do not stack: Unsloth replaces the LLM's forwards "
                "that FP8 training converts; choose one"
            )

    # --- files -----------------------------------------------------------------------------
    @classmethod
    def load(
        cls, path: str | Path, overrides: dict[str, Any] | None = None, notes: list[str] | None = None
    ) -> RunConfig:
        """Read YAML or JSON; a report JSON works too (its `config` section is used).

        `overrides` (the command line's flags) win, and apply before the knobs are checked against
        each other, so a flag can complete a file (`compile_regions: true` in the file, `--compile`
        given) or turn a knob off (`--compile off`: the file's knobs that only qualify it are
        dropped, and `notes` gets one line naming them)."""
        data = cls._read(path)
        if not overrides:
            return cls.from_dict(data, source=str(path))
        cls.from_dict(data, source=str(path), combinations=False)  # each of the file's values is valid on its own
        merged, line = override(data, overrides, str(path))
        if line and notes is not None:
            notes.append(line)
        return cls.from_dict(merged, source="command line")

    @classmethod
    def _read(cls, path: str | Path) -> Any:
        p = Path(path)
        if p.suffix == ".json":  # a config, or a report whose config is reused
            data = read_json(p, "config", max_bytes=64 * 2**20)
        else:
            data = read_yaml(p, "config", max_bytes=MAX_YAML_BYTES)
        if isinstance(data, dict) and "schema_version" in data and "config" in data:
            version = data["schema_version"]
            if isinstance(version, bool) or not isinstance(version, int) or version < 1:
                raise UsageError(f"config {p}: schema_version must be a positive integer, got {version!r}")
            if version > SCHEMA_VERSION:
                raise UsageError(
                    f"config {p}: schema_version {version} was written by a newer vlmdoctor (this one "
                    f"reads up to {SCHEMA_VERSION}); upgrade vlmdoctor"
                )
            data = data["config"]
        return {} if data is None else data  # an empty file: every knob at its default; from_dict checks the rest

    def dump(self, path: str | Path) -> None:
        write_text(path, self.dump_text(path))

    def dump_text(self, path: str | Path = "config.yaml") -> str:
        """The config as JSON (for a .json path) or YAML, as `dump` writes it."""
        data = self.to_dict()
        return (
            json.dumps(data, indent=2) + "\n" if Path(path).suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        )


FLAGS = {f.name: f.metadata["flag"] for f in fields(RunConfig) if f.metadata["flag"]}


def fields_by_name() -> dict[str, Any]:
    """The knobs' declarations (dataclass fields) by name."""
    return RunConfig.__dataclass_fields__


def flag(name: str) -> str:
    """A knob's command-line flag: --NAME-WITH-DASHES unless its declaration names another."""
    return fields_by_name()[name].metadata["flag"] or "--" + name.replace("_", "-")


def panel(name: str) -> str:
    """A knob's `--help` panel: its layer ('1 precision'), or the panel its declaration names."""
    meta = fields_by_name()[name].metadata
    layer = meta["layer"]
    return meta["panel"] or (LAYER_NAMES[layer] if layer == 0 else f"{layer} {LAYER_NAMES[layer]}")


#: the LLM's projection names per `lora_targets` shorthand (Qwen2 and Llama names)
TARGETS = {
    "attention": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "attention_mlp": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}


def target_names(spec: str) -> tuple[str, ...]:
    """The module names a `lora_targets` value names (a shorthand or a comma list)."""
    if spec in TARGETS:
        return TARGETS[spec]
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    return names


def check_mode_knobs(cfg: Any, source: str = "config") -> None:
    """Combinations of mode knobs that mean nothing, refused with one line (no hardware checks here)."""
    where = "" if source == "command line" else f"{source}: "
    if cfg.train != "full" and cfg.stage == 1:
        raise UsageError(
            f"{where}--train {cfg.train} adapts the LLM, but stage 1 trains the projector only; use "
            "--stage 2 (LoRA on the LLM + a fully trainable projector)"
        )
    names = target_names(cfg.lora_targets)
    if not names or any(not n.replace("_", "").replace(".", "").isalnum() for n in names):
        raise UsageError(
            f"{where}lora_targets={cfg.lora_targets!r}: give attention, attention_mlp or a comma list "
            "of module names (q_proj,v_proj)"
        )
    if cfg.optimizer != "adamw" and cfg.fused_optimizer:
        raise UsageError(
            f"{where}--fused-optimizer is torch's fused AdamW; it does not combine with --optimizer {cfg.optimizer}"
        )
    if cfg.objective == "dpo":
        for knob in ("packing", "lm_head_labeled_only", "liger_fused_linear_cross_entropy", "cache_vision_features"):
            if getattr(cfg, knob):
                raise UsageError(
                    f"{where}{flag(knob)} is for the SFT loss; --objective dpo needs per-row log-probs of "
                    "full logits (drop the flag)"
                )


def _off(values: dict[str, Any], qualifies: dict[str, tuple]) -> bool:
    """Every knob a qualifier qualifies is at a value that turns it off."""
    defaults = fields_by_name()
    return all(values.get(k, defaults[k].default) in off for k, off in qualifies.items())


def idle_qualifiers(values: dict[str, Any]) -> list[str]:
    """Knobs set away from their default that only qualify knobs which are off: they change nothing."""
    found = []
    for f in fields(RunConfig):
        q = f.metadata["qualifies"]
        if q and values.get(f.name, f.default) != f.default and _off(values, q):
            found.append(f.name)
    return found


def override(data: dict[str, Any], overrides: dict[str, Any], source: str) -> tuple[dict[str, Any], str | None]:
    """A config file's knobs with the command line's on top: the command line wins.

    A knob of the file that only qualifies knobs the command line turns off (`compile_regions`
    under `--compile off`) is dropped back to its default rather than refused; the second value is
    one line naming what was dropped (None when nothing was)."""
    merged = {**data, **overrides}
    dropped, given, qualified = [], [], []
    for name in idle_qualifiers(merged):
        by_flag = [k for k in fields_by_name()[name].metadata["qualifies"] if k in overrides]
        if name in data and name not in overrides and by_flag:
            del merged[name]
            dropped.append(name)
            given += [_spelled(k, overrides[k]) for k in by_flag]
            qualified += [flag(k) for k in by_flag]
    if not dropped:
        return merged, None
    they = "it only qualifies" if len(dropped) == 1 else "they only qualify"
    return merged, (
        f"{', '.join(dict.fromkeys(given))}: dropped {', '.join(dropped)} from {source} "
        f"({they} {', '.join(dict.fromkeys(qualified))})"
    )


def _spelled(name: str, value: Any) -> str:
    """A knob's value as the command line spells it: `--compile off`, `--no-packing`."""
    if isinstance(value, bool):
        return flag(name) if value else "--no-" + flag(name)[2:]
    return f"{flag(name)} {value}"


def _pair(a: str, b: str, source: str) -> str:
    """Two knobs named in one error: both flags, or the file once and both knob names."""
    if source == "command line":
        return f"{_label(a, source)} and {_label(b, source)}"
    return f"{source}: {a} and {b}"


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _base_type(annotation: Any) -> type:
    text = str(annotation)
    for t in (bool, int, float, str):
        if text.startswith(t.__name__):
            return t
    return object


def knob_table() -> list[dict[str, Any]]:
    """Every knob with its layer, default, choices and help (for docs and `--help`)."""
    rows = []
    for f in fields(RunConfig):
        m = f.metadata
        rows.append(
            {
                "name": f.name,
                "layer": m["layer"],
                "layer_name": LAYER_NAMES[m["layer"]],
                "default": f.default,
                "choices": list(m["choices"]) if m["choices"] else None,
                "help": m["help"],
            }
        )
    return rows
