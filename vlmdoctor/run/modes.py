"""Training modes: LoRA and QLoRA on the LLM, and the DPO objective with its frozen reference.

What each mode runs (docs/modes.md has the FLOP counts and the rules that read them):

  full   every LLM weight trains (stage 2) or none (stage 1), as before.
  lora   peft `LoraConfig` adapters on the LLM's attention (and MLP) projections; the base LLM is
         frozen, the vision tower stays frozen, the projector trains fully (not LoRA-adapted). Only
         stage 2 has a meaning: stage 1 trains the projector alone, so LoRA there is a usage error.
  qlora  as lora, on a base whose LLM linear layers are bitsandbytes 4-bit NF4 (double
         quantization, bf16 compute). GPU and bitsandbytes only.

  sft    next-token cross entropy on the answer tokens.
  dpo    per sample a shared prompt + image and two answers (chosen, rejected). The policy runs on
         both rows; a frozen reference runs on both too, and the loss is
             L = -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))
         with pi_* / ref_* the summed log-probabilities of the answer tokens under the policy and
         the reference (Rafailov et al. 2023; seed 003). The reference is:
           full:       a deep copy of the policy made before training, stored in
                       `dpo_reference_dtype` (fp32 by default, as a second `from_pretrained` loads it);
           lora/qlora: the policy itself with its adapters disabled (what peft's `disable_adapter()`
                       does) plus a frozen snapshot of the projector's starting weights, so no
                       second copy of the base is kept (the memory the seed's stage-3 note warns of).
         `dpo_reference_no_grad` off (the default) is what a script that deep-copies the policy and
         forgets `torch.no_grad()` does: the copy's weights still require grad, so the reference
         builds a graph, keeps its activations, and the loss's backward runs through it.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import target_names

REFERENCE_RANGE = "vlmdoctor::reference"


def check_mode_device(cfg: Any, device: torch.device) -> None:
    """QLoRA and the paged optimizers need a CUDA GPU and bitsandbytes; peft for any LoRA."""
    needs_bnb = [f"--train {cfg.train}"] if cfg.train == "qlora" else []
    needs_bnb += [f"--optimizer {cfg.optimizer}"] if cfg.optimizer != "adamw" else []
    if needs_bnb and device.type != "cuda":
        raise UsageError(
            f"{' and '.join(needs_bnb)}: bitsandbytes' CUDA kernels, which run on a CUDA GPU only; "
            "on CPU use --train lora and --optimizer adamw"
        )
    if needs_bnb:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:
            raise UsageError(
                f"{' and '.join(needs_bnb)} need bitsandbytes, which cannot be imported "
                f"({type(e).__name__}); install it with: pip install bitsandbytes"
            ) from None
    if cfg.train != "full":
        try:
            import peft  # noqa: F401
        except Exception as e:
            raise UsageError(
                f"--train {cfg.train} needs peft, which cannot be imported ({type(e).__name__}); "
                "install it with: pip install 'vlmdoctor[lora]' (or pip install peft)"
            ) from None


# --- LoRA / QLoRA ------------------------------------------------------------------------------------
def _linear_names(llm: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in llm.named_modules() if isinstance(m, nn.Linear)}


def quantize_nf4(llm: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace the LLM's linear layers by bitsandbytes Linear4bit (NF4, double quantization, bf16 compute).

    What `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16)` does at load time, done on an already built module (random or
    pretrained weights alike). The LM head stays as it is, as transformers leaves it. Returns the count.
    """
    import bitsandbytes as bnb  # deferred: bitsandbytes, optional

    count = 0
    for module in list(llm.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or child_name in skip:
                continue
            q = bnb.nn.Linear4bit(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                compute_dtype=torch.bfloat16,
                compress_statistics=True,
                quant_type="nf4",
                device="cpu",
            )
            w = child.weight.detach().to("cpu", torch.float16)
            q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=True, quant_type="nf4")
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.detach().to("cpu", torch.bfloat16), requires_grad=False)
            device = child.weight.device
            setattr(module, child_name, q.to(device))  # moving to the GPU quantizes
            count += 1
    return count


def apply_lora(llm: nn.Module, cfg: Any) -> list[str]:
    """peft LoRA adapters on the named projections of the LLM (only the LLM: the tower and projector get none).

    Freezes the LLM's base weights; the adapters are the LLM's only trainable parameters. Returns the
    adapted module paths (inside `llm`).
    """
    from peft import LoraConfig, inject_adapter_in_model  # deferred: peft, an optional extra

    names = target_names(cfg.lora_targets)
    have = _linear_names(llm) | _bnb_linear_names(llm)
    missing = [n for n in names if n not in have]
    if missing:
        raise UsageError(
            f"--lora-targets: the LLM has no linear layer named {', '.join(missing)}; its linear "
            f"layers: {', '.join(sorted(have))}"
        )
    llm.requires_grad_(False)
    lcfg = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=list(names),
        bias="none",
    )
    inject_adapter_in_model(lcfg, llm)
    adapted = [n for n, m in llm.named_modules() if _is_lora_layer(m)]
    for n, p in llm.named_parameters():
        p.requires_grad_("lora_" in n)
    return adapted


def _bnb_linear_names(llm: nn.Module) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, m in llm.named_modules() if type(m).__name__ == "Linear4bit"}


def _is_lora_layer(m: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer  # deferred: peft, an optional extra
    except Exception:
        return False
    return isinstance(m, LoraLayer)


def lora_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if _is_lora_layer(m)]


def adapter_params(model: nn.Module) -> int:
    """Parameters of the LoRA adapters: sum of r * (d_in + d_out) over adapted layers."""
    return sum(p.numel() for n, p in model.named_parameters() if "lora_A" in n or "lora_B" in n)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer's adapters off (peft's `disable_adapter()` for an injected model)."""
    layers = lora_layers(model)
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)


def expected_adapter_params(llm_config: dict[str, Any], head_dim: int, targets: str, rank: int) -> int | None:
    """r * (d_in + d_out) summed over the adapted projections, from the LLM config; None for unknown names."""
    h, inter, n = llm_config["hidden_size"], llm_config["intermediate_size"], llm_config["num_hidden_layers"]
    q, kv = llm_config["num_attention_heads"] * head_dim, llm_config["num_key_value_heads"] * head_dim
    dims = {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
    }
    names = target_names(targets)
    if any(x not in dims for x in names):
        return None
    return n * sum(rank * sum(dims[x]) for x in names)


def make_optimizer(params: list[nn.Parameter], cfg: Any) -> torch.optim.Optimizer:
    """torch AdamW (foreach or fused), or bitsandbytes' paged AdamW (32-bit or 8-bit states)."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, **({"fused": True} if cfg.fused_optimizer else {}))
    import bitsandbytes as bnb  # deferred: bitsandbytes, optional

    cls = {"paged_adamw": bnb.optim.PagedAdamW, "paged_adamw_8bit": bnb.optim.PagedAdamW8bit}[cfg.optimizer]
    return cls(params, lr=cfg.lr)


# --- DPO -----------------------------------------------------------------------------------------
def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's labeled tokens (labels -100 elsewhere), next-token shifted."""
    logits = logits[:, :-1].float()
    targets = labels[:, 1:]
    mask = targets != -100
    logp = torch.log_softmax(logits, dim=-1).gather(2, targets.clamp(min=0).unsqueeze(2)).squeeze(2)
    return (logp * mask).sum(dim=1)


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), averaged over pairs; metrics stay on the device."""
    margin = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)
    logits = beta * margin
    loss = -F.logsigmoid(logits).mean()
    return loss, {
        "reward_margin": beta * margin.detach().mean(),
        "accuracy": (logits.detach() > 0).float().mean(),
    }


class Reference:
    """The DPO reference: log-probs of the chosen and rejected rows under the frozen starting model."""

    def __init__(self, vlm: nn.Module, cfg: Any, projector: nn.Module | None) -> None:
        self.cfg = cfg
        self.shared = cfg.train != "full"
        if self.shared:  # the policy's own base, adapters off; the projector from a frozen snapshot
            self.model = vlm
            prefix = _module_prefix(vlm, projector) if projector is not None else None
            self.snapshot = (
                {} if prefix is None else {f"{prefix}{n}": p.detach().clone() for n, p in projector.named_parameters()}
            )
        else:
            self.model = copy.deepcopy(vlm)
            self.model.to({"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dpo_reference_dtype])
            if cfg.dpo_reference_no_grad:
                self.model.requires_grad_(False)
            self.snapshot = {}
        self.cache: dict[int, tuple[float, float]] = {}

    def params_bytes(self) -> int:
        """Memory the reference adds: a full copy, or only the projector snapshot."""
        if self.shared:
            return sum(t.numel() * t.element_size() for t in self.snapshot.values())
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def logps(self, batch: dict[str, Any], labels: torch.Tensor) -> torch.Tensor:
        """Per-row summed log-probs; under no_grad when the config asks for it."""
        grad = contextlib.nullcontext() if not self.cfg.dpo_reference_no_grad else torch.no_grad()
        off = adapters_disabled(self.model) if self.shared else contextlib.nullcontext()
        with torch.profiler.record_function(REFERENCE_RANGE), grad, off, _eval(self.model):
            if self.snapshot:
                out = torch.func.functional_call(self.model, self.snapshot, (), {**batch, "labels": None}, strict=False)
            else:
                out = self.model(**batch, labels=None)
            return sequence_logps(out.logits, labels)


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[None]:
    """Eval mode for the reference forward (no dropout, no checkpointing), every module's own flag restored after.

    The shared (LoRA) reference must not checkpoint: its recompute in backward would run with the
    adapters enabled again and differ from its forward.
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, on in flags:
            m.training = on


def _module_prefix(root: nn.Module, sub: nn.Module) -> str | None:
    for name, m in root.named_modules():
        if m is sub:
            return f"{name}." if name else ""
    return None
