"""Did it take effect? From a trace's facts, which optimizations the traced step actually ran: how much of the model
ran compiled and how often it recompiled, which Liger kernels replaced which modules, which SDPA backend attention
took and why the math fallback ran, whether the fused loss kept the logits unmaterialized, which optimizer
implementation ran, and what precision the GEMMs ran in.

One row (`documents.Effect`) per optimization: `state` is on, off, partial or unknown; `seen` the evidence with its
numbers; `why` the reason it is off or partial (or unknown) when the facts say it, else None. A row reads facts only
(docs/analysis.md, "Did it take effect?"); a fact a row needs that the trace cannot hold (no GPU kernels, no shapes)
makes that part "unknown" and says which profiler option would record it.
"""

from __future__ import annotations

from typing import Any

from vlmdoctor.documents.analysis import Effect
from vlmdoctor.trace.catalog import MODEL_PARTS, NEEDS

STATES = ("on", "off", "partial", "unknown")
#: compile "on": at least this share of the model's GPU time ran in compiled graphs. A whole-model or per-layer
#: compile leaves 0-3% outside its graphs on the H100 fixtures (compile_s2 100%, liger_compile_s2 98%, treated_s2
#: 98%); corpus_h200/deepseekvl_compile_static compiles the LLM alone and runs 89% compiled
COMPILE_ON_SHARE = 0.95
#: precision: the share of GEMM time on scalar FP32 or TF32 units above which bf16 is "partial", and "off"
FP32_PARTIAL_SHARE = 0.05
FP32_OFF_SHARE = 0.95
#: autocast re-casting fp32 weights at every use: at this share of GPU time bf16 is only "partial" (the default
#: config, fp32 weights under bf16 autocast, spends 8.7% of its GPU time on weight casts: traces/default_s2)
WEIGHT_CAST_SHARE = 0.05
#: the model's own attention written out (eager) below this share of the step does not make SDPA "partial"; the
#: rule fusion-eager-attention's threshold
EAGER_STEP_SHARE = 0.01
#: for-loop optimizer: per-parameter kernels under Optimizer.step above this many per step (the rule
#: system-non-fused-optimizer's MIN_LOOP_KERNELS: foreach and fused AdamW launch none)
LOOP_KERNELS = 100
#: fused SDPA kernels take head dims that are multiples of 8, up to 256 (flash, cuDNN)
HEAD_DIM_MULTIPLE, HEAD_DIM_MAX = 8, 256
FUSED_BACKENDS = ("cudnn", "flash", "efficient", "flex", "flash_cpu")
BACKEND_FACTS = {  # the calls of each backend, spelled out (trace/families/host.py)
    "cudnn": "attention.backend.cudnn.calls",
    "flash": "attention.backend.flash.calls",
    "efficient": "attention.backend.efficient.calls",
    "math": "attention.backend.math.calls",
    "flash_cpu": "attention.backend.flash_cpu.calls",
}
#: each Liger kernel's launches (trace/families/kernels.py), the module it stands for, and the run-config knob
#: that asks for it in vlmdoctor's own runs
LIGER = {
    "rms_norm": ("liger.rms_norm.launches", "LigerRMSNorm", "liger_rms_norm"),
    "swiglu": ("liger.swiglu.launches", "LigerSwiGLUMLP", "liger_swiglu"),
    "rope": ("liger.rope.launches", "liger_rotary_pos_emb", "liger_rope"),
    "cross_entropy": ("liger.cross_entropy.launches", "LigerCrossEntropyLoss", "liger_fused_linear_cross_entropy"),
}
GPU_HINT = NEEDS["gpu"]
SHAPES_HINT = "record_shapes=True"


def effects(facts: dict[str, Any]) -> list[Effect]:
    """The rows, in the order the one-line summary says them."""
    return [
        compile_effect(facts),
        liger_effect(facts),
        attention_effect(facts),
        fused_loss_effect(facts),
        optimizer_effect(facts),
        precision_effect(facts),
    ]


def summary(rows: list[Effect]) -> str:
    """`in effect: compile partial (89%), Liger off, SDPA cudnn, fused loss off, optimizer foreach, bf16 on`."""
    return "in effect: " + ", ".join(r.brief or f"{r.name} {r.state}" for r in rows)


def _row(name: str, state: str, brief: str, seen: str, why: str | None = None) -> Effect:
    """One row: the optimization, its state, the words for the summary line, what was seen, and why not (or None)."""
    return Effect(name=name, state=state, brief=brief, seen=seen, why=why)


def _unknown(name: str, brief: str, seen: str, why: str | None) -> Effect:
    """A row the trace cannot settle: what it lacks and what would show it."""
    return _row(name, "unknown", brief, seen, why)


def _num(f: dict[str, Any], name: str) -> float:
    v = f.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def _gpu(f: dict[str, Any]) -> bool:
    return bool(f.get("trace.gpu_kernels"))


def _knob(f: dict[str, Any], knob: str) -> Any:
    return f.get(f"config.{knob}")


# --- torch.compile ---------------------------------------------------------------------------------------------


def _versions(frames: list[Any]) -> tuple[int, int]:
    """(compiled frames, recompiles): each frame's highest version that ran is how often it was recompiled."""
    top: dict[str, int] = {}
    for fv in frames or []:
        frame, _, version = str(fv).partition("/")
        try:
            top[frame] = max(top.get(frame, 0), int(version))
        except ValueError:
            top.setdefault(frame, 0)
    return len(top), sum(top.values())


def compile_effect(f: dict[str, Any]) -> Effect:
    regions = _num(f, "compile.regions")
    asked = _knob(f, "compile")
    if regions <= 0:
        why = (
            f"the run config asks compile={asked}, but no compiled region ran in the traced steps"
            if asked not in (None, "off")
            else None
        )
        return Effect(name="compile", state="off", brief="compile off", seen="no torch.compile'd region ran", why=why)
    frames, recompiles = _versions(f.get("compile.frames") or [])
    compiles = _num(f, "compile.compiles")
    notes = [f"{regions:,.0f} region calls/step, {frames} frame(s), {recompiles} recompile(s)"]
    if compiles:
        notes.append(f"compiling inside the traced steps: {compiles:g}/step")
    if "compile.gpu_share" not in f:  # a CPU trace: the regions ran, their share of the work is not measured
        return _row("compile", "on", "compile on", "; ".join(notes), None)
    share = _num(f, "compile.gpu_share")
    eager = _num(f, "compile.eager_ms")
    seen = [f"{share * 100:.0f}% of the model's GPU time compiled ({_num(f, 'compile.gpu_ms'):,.1f} ms/step)"]
    if eager:
        seen.append(f"graph breaks: {eager:,.2f} ms/step eager inside compiled regions")
    seen += notes
    state = "on" if share >= COMPILE_ON_SHARE else "partial"
    why = None
    if state == "partial":
        why = f"{(1 - share) * 100:.0f}% of the model's GPU time ran eager, outside compiled graphs"
        if eager:
            why += f" ({eager:,.2f} ms/step of it at graph breaks)"
        if compiles:
            why += f"; it recompiled inside the traced steps ({compiles:g}/step)"
    elif compiles:
        why = f"it recompiled inside the traced steps ({compiles:g}/step)"
    return _row("compile", state, f"compile {state} ({share * 100:.0f}%)", "; ".join(seen), why)


# --- Liger -----------------------------------------------------------------------------------------------------


def liger_effect(f: dict[str, Any]) -> Effect:
    if not _gpu(f) or not any(fact in f for fact, _, _ in LIGER.values()):
        return _unknown("liger", "Liger unknown", "Liger's Triton kernels are GPU kernels", f"needs {GPU_HINT}")
    fce = bool(f.get("ops.fused_linear_cross_entropy"))
    ran = {k: _num(f, fact) for k, (fact, _, _) in LIGER.items() if _num(f, fact) > 0}
    asked = [k for k, (_, _, knob) in LIGER.items() if _knob(f, knob) is True]
    missing = [k for k in asked if k not in ran]
    if not ran:
        why = (
            "the run config asks for " + ", ".join(LIGER[k][2] for k in asked) + ", but no Liger kernel launched"
            if asked
            else None
        )
        return Effect(name="liger", state="off", brief="Liger off", seen="no Liger kernel launched", why=why)

    def module(k: str) -> str:
        return "LigerFusedLinearCrossEntropy" if k == "cross_entropy" and fce else LIGER[k][1]

    seen = ", ".join(f"{module(k)} {v:,.0f}" for k, v in ran.items()) + " launches/step"
    state = "partial" if missing else "on"
    why = (
        "the run config asks for " + ", ".join(LIGER[k][2] for k in missing) + ", but none of its kernels launched"
        if missing
        else None
    )
    short = "+".join("ce" if k == "cross_entropy" else k for k in ran)
    return Effect(name="liger", state=state, brief=f"Liger {state} ({short})", seen=seen, why=why)


# --- attention -------------------------------------------------------------------------------------------------


def _head_dims(f: dict[str, Any]) -> dict[str, list[int]]:
    out = {}
    for part in (*MODEL_PARTS, "other"):
        dims = f.get(f"attention.{part}.head_dims")
        if dims:
            out[part] = [int(d) for d in dims if isinstance(d, (int, float))]
    return out


def _math_why(f: dict[str, Any], fused: list[str]) -> str:
    """Why SDPA's math fallback ran, as far as the facts say."""
    reasons = []
    for part, dims in _head_dims(f).items():
        bad = [d for d in dims if d % HEAD_DIM_MULTIPLE or d > HEAD_DIM_MAX]
        if bad:
            reasons.append(
                f"head dim {', '.join(map(str, bad))} in {part} (fused kernels take multiples of "
                f"{HEAD_DIM_MULTIPLE} up to {HEAD_DIM_MAX})"
            )
    if _num(f, "gemm.fp32_share") >= FP32_OFF_SHARE and not f.get("gemm.fp32_from_math_attention"):
        reasons.append("FP32 inputs (flash and cuDNN take bf16/fp16 only)")
    masked = {
        p: _num(f, f"attention.{p}.dense_mask_share")
        for p in (*MODEL_PARTS, "other")
        if _num(f, f"attention.{p}.dense_mask_share") > 0
    }
    if masked:
        reasons.append(
            "a dense attention mask on "
            + ", ".join(f"{v * 100:.0f}% of {p}'s calls" for p, v in masked.items())
            + " (flash takes none)"
        )
    if not fused and _gpu(f) and not reasons:
        reasons.append(
            "no fused backend took any call on a GPU: switched off (sdpa_kernel(MATH), "
            "enable_flash_sdp(False), ...) or every call refused"
        )
    parts = [str(p) for p in f.get("attention.math.parts") or [] if p in MODEL_PARTS]
    where = f"in {', '.join(parts)}: " if parts else ""
    if not f.get("trace.recorded.shapes"):
        reasons.append(f"{SHAPES_HINT} shows head dims and masks")
    return where + "; ".join(reasons)


def attention_effect(f: dict[str, Any]) -> Effect:
    backends = [str(b) for b in f.get("attention.backends") or []]
    fused = [b for b in backends if b in FUSED_BACKENDS]
    math = _num(f, "attention.backend.math.calls")
    eager_ms = _num(f, "attention.eager.model_ms")
    eager = eager_ms > EAGER_STEP_SHARE * _num(f, "step.ms") and eager_ms > 0

    def calls(b: str) -> str:
        if b == "flex":
            return f"flex {_num(f, 'kernels.attention_flex.count'):,.0f} kernels"
        return f"{b} {_num(f, BACKEND_FACTS.get(b) or f'attention.backend.{b}.calls'):,.0f}"

    seen = []
    if backends:
        seen.append(", ".join(calls(b) for b in backends) + " calls/step")
    if math:
        seen.append(f"math path's matmul + softmax {_num(f, 'attention.math.ms'):,.1f} ms/step")
    if eager:
        parts = ", ".join(map(str, f.get("attention.eager.parts") or [])) or "the model"
        seen.append(
            f"eager matmul + softmax in {parts}: {_num(f, 'attention.eager.blocks'):,.0f} blocks/step, "
            f"{eager_ms:,.1f} ms/step"
        )
    fp32 = _num(f, "attention.fp32_kernels")
    if fp32:
        seen.append(f"{fp32:,.0f} FP32 attention kernels/step")
    if not backends and not eager:
        return _unknown(
            "attention", "attention unknown", "no SDPA call and no written-out attention in the traced steps", None
        )
    if not fused:
        if math:
            return _row("attention", "off", "SDPA math", "; ".join(seen), _math_why(f, fused))
        return _row(
            "attention",
            "off",
            "attention eager",
            "; ".join(seen),
            "the model's own attention code (attn_implementation='eager'), not scaled_dot_product_attention",
        )
    name = "SDPA " + "+".join(fused)
    if math:
        return _row(
            "attention",
            "partial",
            f"{name}+math",
            "; ".join(seen),
            f"{math:,.0f} calls/step fell back to the math path: {_math_why(f, fused)}",
        )
    if eager:
        return _row(
            "attention",
            "partial",
            f"{name}+eager",
            "; ".join(seen),
            "part of the model's attention is its own eager code, not scaled_dot_product_attention",
        )
    if fp32:
        return _row(
            "attention",
            "partial",
            f"{name} (fp32)",
            "; ".join(seen),
            "attention inputs are FP32: flash and cuDNN take bf16/fp16 only, so SDPA ran FP32 kernels",
        )
    return Effect(name="attention", state="on", brief=name, seen="; ".join(seen), why=None)


# --- the fused loss --------------------------------------------------------------------------------------------


def fused_loss_effect(f: dict[str, Any]) -> Effect:
    if f.get("ops.fused_linear_cross_entropy"):
        elements = _num(f, "loss.fce_logits_elements")
        seen = "Liger's fused linear cross entropy: logits never materialized"
        if elements:
            seen += f" ({elements / 1e6:,.0f}M elements, {elements * 2 / 2**30:,.2f} GiB in bf16)"
        return Effect(name="fused_loss", state="on", brief="fused loss on", seen=seen, why=None)
    if "loss.logits_gb" in f:
        dtype = str(f.get("loss.logits_dtype") or "?")
        return _row(
            "fused_loss",
            "off",
            "fused loss off",
            f"logits materialized: {_num(f, 'loss.logits_gb'):,.2f} GiB ({dtype})",
            "no fused linear cross-entropy op ran: plain cross entropy over the full logits",
        )
    loss_seen = _num(f, "part.loss.ms") > 0 or _num(f, "cpu.loss.ms") > 0
    if not loss_seen:
        return _unknown(
            "fused_loss",
            "fused loss unknown",
            "no cross-entropy op and no fused linear cross entropy in the traced steps",
            "a loss compiled into a graph runs inside it (its ops are not in the trace); inference has none",
        )
    size = "" if f.get("trace.recorded.shapes") else f" (their size: {SHAPES_HINT})"
    return _row(
        "fused_loss",
        "off",
        "fused loss off",
        f"logits materialized{size}",
        "no fused linear cross-entropy op ran: plain cross entropy over the full logits",
    )


# --- the optimizer ---------------------------------------------------------------------------------------------


def optimizer_effect(f: dict[str, Any]) -> Effect:
    if "optimizer.kernels" not in f:
        return _unknown(
            "optimizer", "optimizer unknown", "the optimizer's kernels are GPU kernels", f"needs {GPU_HINT}"
        )
    kernels = _num(f, "optimizer.kernels")
    if kernels <= 0:
        return _unknown(
            "optimizer",
            "optimizer unknown",
            "no kernels under Optimizer.step",
            "no torch.optim step in the traced steps (inference, or an optimizer without Optimizer.step ranges)",
        )
    multi = _num(f, "optimizer.multi_tensor_kernels")
    loop = kernels - multi
    ms = f", {_num(f, 'part.optimizer.ms'):,.1f} ms/step" if "part.optimizer.ms" in f else ""
    if f.get("optimizer.fused"):
        return _row("optimizer", "on", "optimizer fused", f"fused: {kernels:,.0f} kernels/step{ms}", None)
    if loop > LOOP_KERNELS and loop >= multi:
        return _row(
            "optimizer",
            "off",
            "optimizer for-loop",
            f"for-loop: {loop:,.0f} per-parameter kernels/step{ms}",
            "foreach=False: the update runs parameter by parameter, a launch per kernel",
        )
    return _row(
        "optimizer",
        "partial",
        "optimizer foreach",
        f"foreach: {multi:,.0f} multi-tensor kernels/step{ms}",
        "foreach (torch.optim's default): multi-tensor kernels per operation, not fused=True's one kernel",
    )


# --- precision -------------------------------------------------------------------------------------------------


def precision_effect(f: dict[str, Any]) -> Effect:
    if not _gpu(f) or "gemm.fp32_share" not in f:
        return _unknown(
            "precision", "precision unknown", "GEMM precision is read from GPU kernels", f"needs {GPU_HINT}"
        )
    if _num(f, "gemm.ms") <= 0:
        return _unknown("precision", "precision unknown", "no GEMM ran", None)
    fp32, tf32 = _num(f, "gemm.fp32_share"), _num(f, "gemm.tf32_share")
    fp16, fp8 = _num(f, "gemm.fp16_share"), _num(f, "gemm.fp8_share")
    low = max(0.0, 1 - fp32 - tf32)
    dtype = "fp16" if fp16 > low / 2 else "bf16"
    seen = [f"{dtype} tensor cores: {low * 100:.0f}% of GEMM time"] if low >= 0.001 else []
    if fp8:
        seen.append(f"FP8 {fp8 * 100:.0f}%")
    if fp32 >= 0.001:
        seen.append(f"FP32 (no tensor cores) {fp32 * 100:.0f}%")
    if tf32 >= 0.001:
        seen.append(f"TF32 {tf32 * 100:.0f}%")
    casts = _num(f, "casts.weight.share")
    if casts:
        seen.append(f"{_num(f, 'casts.weight.count'):,.0f} weight casts/step ({casts * 100:.1f}% of GPU time)")
    parts = ", ".join(map(str, f.get("part.fp32_gemm_parts") or [])) or "the model"
    if fp32 + tf32 >= FP32_OFF_SHARE:
        kind = "TF32" if tf32 > fp32 else "FP32"
        return Effect(
            name="precision",
            state="off",
            brief=f"{kind} GEMMs",
            seen="; ".join(seen),
            why=f"{kind} GEMMs in {parts}"
            + ("" if casts else " and no autocast casts: fp32 weights and inputs, no bf16 autocast"),
        )
    if fp32 + tf32 >= FP32_PARTIAL_SHARE and not f.get("gemm.fp32_from_math_attention"):
        return _row(
            "precision",
            "partial",
            f"{dtype} partial (FP32 {(fp32 + tf32) * 100:.0f}%)",
            "; ".join(seen),
            f"FP32 GEMMs in {parts}: those layers' weights or inputs stay fp32 outside autocast",
        )
    if fp32 >= FP32_PARTIAL_SHARE:  # the FP32 GEMMs are SDPA math attention's, not the weights' (attention row)
        seen.append("the FP32 is SDPA math attention's, not the weights'")
    if casts >= WEIGHT_CAST_SHARE:
        return _row(
            "precision",
            "partial",
            f"{dtype} partial (autocast casts)",
            "; ".join(seen),
            "autocast over fp32 weights: every use re-casts a weight; weights loaded in bf16 need no casts",
        )
    return Effect(name="precision", state="on", brief=f"{dtype} GEMMs", seen="; ".join(seen), why=None)
