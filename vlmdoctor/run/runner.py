"""Runs real training steps of the VLM described by a run config and measures them.

One configuration per process: Liger patches transformers classes globally and cannot be
undone, so a second configuration in the same process would measure a mix. `run_isolated`
starts a fresh interpreter for each configuration.

Every timed step is a full optimizer step: data fetch, host-to-device copy, forward, backward
and a real AdamW update (the seed's benchmark left the optimizer out), followed by a device
synchronize so that wall time is what the GPU really took.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from vlmdoctor import SCHEMA_VERSION, __version__
from vlmdoctor.run import envinfo, flops
from vlmdoctor.run.capture import TraceOptions, capture, trace_path
from vlmdoctor.run.compile import compile_model, graphs_compiled, mark_lengths_dynamic
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.data import BatchSampler, Collator, LlavaFile, SyntheticVQA
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_NAN, EXIT_OK, EXIT_OOM, UsageError
from vlmdoctor.run import native
from vlmdoctor.run.model import VLM, apply_stage, build_model, enable_gradient_checkpointing, enable_input_require_grads, param_counts
from vlmdoctor.run.zoo import ModelSpec, resolve

Progress = Callable[[str, int, int], None]

GPU_ONLY_ATTENTION = ("efficient", "cudnn")


def _quiet(*_: Any) -> None:
    pass


def resolve_device(cfg: RunConfig) -> torch.device:
    """auto -> the GPU when there is one; a GPU preset without a GPU is a user error with a hint."""
    has_gpu = torch.cuda.is_available()
    if cfg.device == "cuda" and not has_gpu:
        raise UsageError("--device cuda asked for, but no CUDA GPU is visible; run on CPU with: "
                         "vlmdoctor profile --model tiny --device cpu")
    if cfg.device == "auto" and not has_gpu:
        if cfg.model != "tiny" and not cfg.model.startswith("tiny-"):
            raise UsageError(f"no CUDA GPU found for the {cfg.model!r} preset; to run on CPU use: "
                             "vlmdoctor profile --model tiny --device cpu (or pass --device cpu to force this preset)")
        return torch.device("cpu")
    return torch.device("cuda" if cfg.device in ("auto", "cuda") else "cpu")


def preflight(cfg: RunConfig, spec: ModelSpec | native.NativeSpec, device: torch.device) -> None:
    """Combinations that cannot run here fail before anything is built."""
    if isinstance(spec, native.NativeSpec):
        native.check_native(cfg, spec, device)
    if cfg.uses_liger:
        if device.type != "cuda":
            raise UsageError("Liger kernels are Triton GPU kernels and cannot run on the CPU; drop the --liger-* flags "
                             "or run on a CUDA GPU")
        if isinstance(spec, ModelSpec) and spec.llm["family"] not in ("qwen2", "llama"):
            raise UsageError(f"Liger patches exist for qwen2 and llama LLMs, not {spec.llm['family']}")
        try:
            import liger_kernel.transformers  # noqa: F401
        except Exception as e:
            raise UsageError(f"Liger asked for but liger-kernel cannot be imported ({type(e).__name__}: {e}); "
                             "install it with: pip install liger-kernel") from None
    if cfg.compile == "reduce-overhead" and device.type != "cuda":
        raise UsageError("--compile reduce-overhead uses CUDA graphs, which exist only on CUDA; use --compile default "
                         "on CPU")
    if cfg.attention in GPU_ONLY_ATTENTION and device.type != "cuda":
        raise UsageError(f"the {cfg.attention!r} SDPA backend exists only on CUDA; use sdpa, math or eager on CPU")
    if cfg.packing and cfg.attention == "eager":
        raise UsageError("packing needs an SDPA attention backend (the packed block mask is built for SDPA); "
                         "use --attention sdpa")
    if cfg.data == "synthetic" and cfg.num_samples < cfg.batch_size * cfg.grad_accum:
        raise UsageError("--num-samples must hold at least one optimizer step of samples")


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


# ------------------------------------------------------------------------------------------------
@dataclass
class Patient:
    """Everything a timed step needs, built from one run config."""

    cfg: RunConfig
    spec: ModelSpec | native.NativeSpec
    device: torch.device
    model: torch.nn.Module
    vlm: VLM | native.NativeVLM
    optimizer: torch.optim.Optimizer
    batches: Iterator[dict[str, Any]]
    flop_model: flops.FlopModel
    data_info: dict[str, Any] = field(default_factory=dict)


def _attention_context(backend: str):
    if backend in ("sdpa", "eager"):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
         "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[backend]
    )


def _apply_liger(vlm: VLM, cfg: RunConfig) -> None:
    from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

    fn = {"qwen2": apply_liger_kernel_to_qwen2, "llama": apply_liger_kernel_to_llama}[vlm.spec.llm["family"]]
    fn(rope=cfg.liger_rope, rms_norm=cfg.liger_rms_norm, swiglu=cfg.liger_swiglu, cross_entropy=False,
       fused_linear_cross_entropy=cfg.liger_fused_linear_cross_entropy, model=vlm.llm)


def _cycle(loader) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def build_patient(cfg: RunConfig, device: torch.device, progress: Progress = _quiet) -> Patient:
    spec = resolve_model(cfg)
    preflight(cfg, spec, device)
    torch.manual_seed(cfg.seed)
    torch.set_float32_matmul_precision("high" if cfg.allow_tf32 else "highest")
    progress("building model", 0, 1)
    if isinstance(spec, native.NativeSpec):
        return _native_patient(cfg, spec, device)
    vlm = build_model(spec, cfg.weight_dtype, cfg.attention, cfg.weights, device)
    apply_stage(vlm, cfg.stage)
    vlm.vision_no_grad = cfg.vision_no_grad
    vlm.fused_ce = cfg.liger_fused_linear_cross_entropy
    if cfg.uses_liger:
        _apply_liger(vlm, cfg)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(vlm, cfg.checkpoint_use_reentrant)
    if cfg.input_require_grads:
        enable_input_require_grads(vlm)

    if cfg.data == "synthetic":
        dataset: SyntheticVQA | LlavaFile = SyntheticVQA(spec, cfg.num_samples, cfg.seed)
        pad_id = spec.llm["special_tokens"]["pad"]
        data_info = {"source": "synthetic", "length_model": dataset.lm["name"], "samples": len(dataset)}
    else:
        dataset = LlavaFile(cfg.data, cfg.tokenizer, spec, cfg.bad_records)
        pad_id = dataset.ids["pad"]
        vlm.image_pad_id = dataset.ids["image_pad"]
        data_info = {"source": cfg.data, "records": dataset.stats.records, "skipped": dataset.stats.skipped,
                     "problems": dataset.stats.problems[:20], "samples": len(dataset)}
    if len(dataset) < cfg.batch_size:
        raise UsageError(f"the data holds {len(dataset)} usable samples, fewer than one batch of {cfg.batch_size}")

    features = None
    if cfg.cache_vision_features:
        progress("caching vision features", 0, 1)
        features = _cache_features(vlm, dataset, cfg, device)
        dataset.with_pixels = False
    collator = Collator(pad_id, cfg.pad_to_multiple_of, cfg.packing, cfg.pack_length, features, cfg.lm_head_labeled_only)
    sampler = BatchSampler(dataset.lengths, cfg.batch_size, cfg.sampler == "length_bucketed", cfg.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda", persistent_workers=cfg.num_workers > 0,
    )
    params = [p for p in vlm.parameters() if p.requires_grad]
    opt_kwargs = {"fused": True} if cfg.fused_optimizer else {}
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, **opt_kwargs)
    model: torch.nn.Module = vlm
    if cfg.compile != "off":
        model = compile_model(vlm, cfg.compile)
    return Patient(cfg, spec, device, model, vlm, optimizer, _cycle(loader), flops.FlopModel.from_spec(spec), data_info)


def _native_patient(cfg: RunConfig, spec: native.NativeSpec, device: torch.device) -> Patient:
    """A native transformers class on the same synthetic data, collation and optimizer as the composite model."""
    vlm = native.build_native(spec, cfg.weight_dtype, cfg.attention, cfg.weights, device)
    native.configure(vlm, cfg)
    dataset = SyntheticVQA(spec, cfg.num_samples, cfg.seed)  # type: ignore[arg-type]
    data_info = {"source": "synthetic", "length_model": dataset.lm["name"], "samples": len(dataset)}
    if len(dataset) < cfg.batch_size:
        raise UsageError(f"the data holds {len(dataset)} usable samples, fewer than one batch of {cfg.batch_size}")
    collator = Collator(spec.llm["special_tokens"]["pad"], cfg.pad_to_multiple_of)
    sampler = BatchSampler(dataset.lengths, cfg.batch_size, cfg.sampler == "length_bucketed", cfg.seed)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collator, num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda", persistent_workers=cfg.num_workers > 0,
    )
    params = [p for p in vlm.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, **({"fused": True} if cfg.fused_optimizer else {}))
    model: torch.nn.Module = vlm
    if cfg.compile != "off":
        model = torch.compile(vlm, mode=None if cfg.compile == "default" else cfg.compile)
    return Patient(cfg, spec, device, model, vlm, optimizer, _cycle(loader), flops.FlopModel.from_native(spec), data_info)


@torch.no_grad()
def _cache_features(vlm: VLM, dataset, cfg: RunConfig, device: torch.device) -> torch.Tensor:
    """Frozen-tower features for every distinct image, kept in host memory (pinned if asked)."""
    n = getattr(dataset, "images", None)
    count = len(n) if n is not None else len(dataset)
    out = []
    ac = _autocast(cfg, device)
    for start in range(0, count, 16):
        pixels = torch.stack([dataset.raw_image(i) for i in range(start, min(start + 16, count))]).to(device)
        with ac:
            out.append(vlm.encode_images(pixels.to(vlm.projector.dtype)).cpu())
    feats = torch.cat(out)
    return feats.pin_memory() if cfg.pin_memory and device.type == "cuda" else feats


def _autocast(cfg: RunConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast == "bf16")


def _to_device(batch: dict[str, Any], device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            v = v.to(device, non_blocking=True)
            if v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def train_step(p: Patient) -> tuple[torch.Tensor, dict[str, Any]]:
    """One optimizer step over grad_accum micro-batches; returns the (device) loss and host counts."""
    cfg = p.cfg
    dtype = p.vlm.input_dtype if isinstance(p.vlm, native.NativeVLM) else p.vlm.projector.dtype
    total = {"real_tokens": 0, "loss_tokens": 0, "padded_tokens": 0, "samples": 0, "lengths": [], "host_losses": []}
    loss_sum = None
    for _ in range(cfg.grad_accum):
        batch = next(p.batches)
        counts = batch.pop("counts")
        for k in ("real_tokens", "loss_tokens", "padded_tokens", "samples"):
            total[k] += counts[k]
        total["lengths"] += counts["lengths"]
        batch = _to_device(batch, p.device, dtype)
        if cfg.compile != "off":
            mark_lengths_dynamic(batch)  # one graph for every length, no recompile per new length
        with _attention_context(cfg.attention):
            with _autocast(cfg, p.device):
                loss = p.model(**batch).loss / cfg.grad_accum
            loss.backward()
        if cfg.sync_loss:  # what a logging loop does: the host waits for the device every micro-batch
            total["host_losses"].append(loss.item())
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    p.optimizer.step()
    p.optimizer.zero_grad(set_to_none=True)
    return loss_sum, total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------
def _window(p: Patient, steps: int, peak: float | None, progress: Progress, label: str) -> dict[str, Any]:
    """Timed steps; every step ends with a device synchronize."""
    if p.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(p.device)
    step_s, step_tokens, losses, real, loss_tok, padded, model_flops = [], [], [], 0, 0, 0, 0.0
    step_cpu: list[float] = []
    for i in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, c = train_step(p)
        _sync(p.device)
        step_s.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
        losses.append(loss)
        real += c["real_tokens"]
        step_tokens.append(c["real_tokens"])
        loss_tok += c["loss_tokens"]
        padded += c["padded_tokens"]
        head = c["loss_tokens"] if p.cfg.lm_head_labeled_only else None
        model_flops += p.flop_model.step(c["lengths"], p.cfg.stage, p.cfg.cache_vision_features, head)["total"]
        progress(label, i + 1, steps)
    wall = sum(step_s)
    loss_values = torch.stack(losses).float().cpu().tolist()
    w = {
        "steps": steps,
        "wall_s": wall,
        "real_tokens_per_s": real / wall,
        "loss_tokens_per_s": loss_tok / wall,
        "pad_fraction": 1.0 - real / padded,
        "step_ms": [s * 1e3 for s in step_s],
        "step_real_tokens": step_tokens,  # with step_ms: a throughput sample per step, for significance tests
        # CPU time of the process per step: on a shared CPU host the work of a single-threaded step,
        # which a neighbour's load does not stretch the way it stretches the wall time (the CPU gate)
        "step_cpu_ms": [s * 1e3 for s in step_cpu],
        "model_tflops_per_s": model_flops / wall / 1e12,
        "mfu": (model_flops / wall / peak) if peak else None,
        "losses": loss_values,
    }
    if p.device.type == "cuda":
        w["peak_mem_gb"] = torch.cuda.max_memory_allocated(p.device) / 2**30
        w["peak_mem_reserved_gb"] = torch.cuda.max_memory_reserved(p.device) / 2**30
    return w


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(windows: list[dict[str, Any]], device_total_gb: float | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per-window numbers -> metrics (medians over repeats) and their spread."""
    keys = ["real_tokens_per_s", "loss_tokens_per_s", "pad_fraction", "model_tflops_per_s"]
    if windows[0]["mfu"] is not None:
        keys.append("mfu")
    stats = {k: _spread([w[k] for w in windows]) for k in keys}
    all_steps = [s for w in windows for s in w["step_ms"]]
    stats["step_ms"] = {**_spread(all_steps), "p10": _percentile(all_steps, 0.1), "p90": _percentile(all_steps, 0.9),
                        "n_repeats": len(windows)}
    final_losses = [w["losses"][-1] for w in windows]
    metrics: dict[str, Any] = {k: stats[k]["median"] for k in keys}
    metrics.setdefault("mfu", None)
    metrics["step_ms"] = stats["step_ms"]["median"]
    metrics["step_ms_p10"] = stats["step_ms"]["p10"]
    metrics["step_ms_p90"] = stats["step_ms"]["p90"]
    if "peak_mem_gb" in windows[0]:
        metrics["peak_mem_gb"] = max(w["peak_mem_gb"] for w in windows)
        metrics["peak_mem_reserved_gb"] = max(w["peak_mem_reserved_gb"] for w in windows)
    else:
        metrics["peak_mem_gb"] = None
        metrics["peak_mem_reserved_gb"] = None
    metrics["device_mem_total_gb"] = device_total_gb
    metrics["host_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    metrics["final_loss"] = final_losses[-1]
    metrics["loss_finite"] = all(math.isfinite(x) for w in windows for x in w["losses"])
    metrics["repeats"] = len(windows)
    metrics["steps_per_repeat"] = windows[0]["steps"]
    return metrics, stats


def run_profile(cfg: RunConfig, progress: Progress = _quiet, trace: TraceOptions | None = None) -> dict[str, Any]:
    """Build, warm up, time, then (if asked) trace a separate window.

    Returns the report, also on OOM, NaN loss or a crash in a step.
    """
    spec, device = check(cfg)
    env = envinfo.collect(device)
    peak, peak_source = flops.peak_flops(env.get("gpu"))
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "vlmdoctor", "version": __version__},
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "status": "ok",
        "config": cfg.to_dict(),
        "model": spec.describe(),
        "env": env,
        "flops": {"formula": flops.describe(), "peak_flops": peak, "peak_source": peak_source},
    }
    try:
        patient = build_patient(cfg, device, progress)
        report["model"]["params"] = (native.native_param_counts(patient.vlm) if isinstance(patient.vlm, native.NativeVLM)
                                     else param_counts(patient.vlm))
        report["data"] = patient.data_info
        warm_s = []
        for i in range(cfg.warmup):
            t0 = time.perf_counter()
            train_step(patient)
            _sync(device)
            warm_s.append(time.perf_counter() - t0)
            progress("warm-up", i + 1, cfg.warmup)
        graphs = graphs_compiled() if cfg.compile != "off" else 0
        windows = [_window(patient, cfg.steps, peak, progress, f"timed {r + 1}/{cfg.repeats}") for r in range(cfg.repeats)]
        report["warmup"] = _warmup_times(warm_s)
        if cfg.compile != "off":
            report["warmup"]["graphs_compiled"] = graphs
            new = graphs_compiled() - graphs
            report["warmup"]["graphs_compiled_in_timed_windows"] = new
            if new:
                report.setdefault("warnings", []).append(
                    f"torch.compile compiled {new} new graph(s) during the timed windows: their compile time counts "
                    f"as step time; raise --warmup or pad to fewer lengths (pad_to_multiple_of)")
        if trace is not None:
            def step() -> None:
                train_step(patient)
                _sync(device)

            meta = {"schema_version": SCHEMA_VERSION, "tool_version": __version__, "config": cfg.to_dict(),
                    "model": report["model"],
                    "env": {k: env[k] for k in ("device_type", "cpu_count", "cpu_capability", "cpu_matmul_gflops") if k in env}}
            where = trace if trace.keep else replace(trace, trace_dir=tempfile.mkdtemp(prefix="vlmdoctor-trace-"))
            try:
                report["trace"] = capture(step, where, device, trace_path(where, cfg.model, cfg.stage), meta, progress)
            except BaseException:  # a temporary trace folder never outlives a failed or interrupted capture
                if not trace.keep:
                    import shutil

                    shutil.rmtree(where.trace_dir, ignore_errors=True)
                raise
            report["trace"]["kept"] = trace.keep
    except torch.OutOfMemoryError as e:
        _release(device)
        report.update(status="oom", error=_oom_details(e, device))
        return report
    except UsageError:
        raise
    except Exception as e:  # a crash inside a step (illegal memory access, no SDPA kernel, compile failure)
        _release(device)
        report.update(status="error", error={"type": type(e).__name__, "message": _first_line(e),
                                             "traceback": traceback.format_exc(limit=8)[-4000:]})
        return report
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    metrics, stats = summarize(windows, total)
    metrics["warmup_s"] = report.get("warmup", {}).get("warmup_s")
    metrics["compile_s"] = report.get("warmup", {}).get("compile_s") if cfg.compile != "off" else None
    report["metrics"] = metrics
    report["stats"] = stats
    if "trace" in report:  # profiler overhead, visible next to the untraced numbers it stayed out of
        report["trace"]["untraced_step_ms_median"] = metrics["step_ms"]
    report["repeats"] = [{k: v for k, v in w.items() if k != "losses"} | {"final_loss": w["losses"][-1]} for w in windows]
    warning = recompile_warning(cfg, windows)
    if warning and not (report.get("warmup") or {}).get("graphs_compiled_in_timed_windows"):
        # step times show compilation in the window that dynamo's graph count did not already report
        report.setdefault("warnings", []).append(warning)
    if not metrics["loss_finite"]:
        report["status"] = "nan_loss"
        report["error"] = {"type": "NonFiniteLoss", "message": "the loss was NaN or inf in a timed step"}
    return report


def _warmup_times(warm_s: list[float]) -> dict[str, Any]:
    """Warm-up wall time, and the part of it beyond steady steps: compilation, autotuning, first-call setup.

    A steady step is the last warm-up step; what the earlier steps took beyond it is `compile_s`.
    """
    if not warm_s:
        return {"warmup_s": 0.0, "compile_s": 0.0, "steps": 0}
    steady = warm_s[-1]
    return {"warmup_s": sum(warm_s), "compile_s": sum(max(0.0, s - steady) for s in warm_s[:-1]),
            "steps": len(warm_s), "step_s": warm_s}


#: a first timed step this many times the median of the others means compilation ran inside the timed window
RECOMPILE_RATIO = 5.0


def recompile_warning(cfg: RunConfig, windows: list[dict[str, Any]]) -> str | None:
    """torch.compile that (re)compiles inside a timed window makes its throughput meaningless; say so."""
    if cfg.compile == "off":
        return None
    for r, w in enumerate(windows):
        steps = w["step_ms"]
        if len(steps) < 2:
            continue
        worst = max(range(len(steps)), key=steps.__getitem__)
        rest = statistics.median(steps[:worst] + steps[worst + 1:])
        if rest > 0 and steps[worst] > RECOMPILE_RATIO * rest:
            return (f"--compile {cfg.compile}: timed step {worst + 1} of window {r + 1} took {steps[worst]:.0f} ms, "
                    f"{steps[worst] / rest:.0f}x the median of {rest:.0f} ms: compilation ran inside the timed "
                    "window, so tokens/s is too low; use more --warmup steps")
    return None


def _release(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:500] if text else type(e).__name__


def _oom_details(e: BaseException, device: torch.device) -> dict[str, Any]:
    msg = str(e)
    m = re.search(r"Tried to allocate ([\d.]+) (GiB|MiB|KiB)", msg)
    requested = None
    if m:
        requested = float(m.group(1)) * {"GiB": 1, "MiB": 1 / 1024, "KiB": 1 / 2**20}[m.group(2)]
    info = {"type": "OutOfMemoryError", "message": _first_line(e), "requested_gb": requested}
    if device.type == "cuda":
        info["peak_mem_gb_before_failure"] = torch.cuda.max_memory_allocated(device) / 2**30
        info["device_mem_total_gb"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return info


def exit_code(report: dict[str, Any]) -> int:
    return {"ok": EXIT_OK, "oom": EXIT_OOM, "nan_loss": EXIT_NAN}.get(report["status"], EXIT_FAILED_RUN)


def run_isolated(cfg: RunConfig, timeout: float | None = None, diagnose: bool = True,
                 rules_dirs: list[str] | None = None, env: dict[str, str] | None = None,
                 python: str | None = None, own_cwd: bool = False) -> dict[str, Any]:
    """Run one configuration in a fresh Python process and return its report (diagnosed unless asked not to).

    `env` adds to the child's environment (compile cache folders shared by a treatment's trials);
    `python` is another interpreter (the gate's baseline: another vlmdoctor or torch install).
    `own_cwd` starts the child in its own empty folder: `python -m` imports from the working
    folder first, so in a checkout the child would run that checkout's vlmdoctor whatever
    `env`'s PYTHONPATH or `python` say (the gate's baseline side needs its own code).
    """
    with tempfile.TemporaryDirectory(prefix="vlmdoctor-") as tmp:
        cfg_path, out_path = Path(tmp) / "config.json", Path(tmp) / "report.json"
        cfg.dump(cfg_path)
        cmd = [python or sys.executable, "-m", "vlmdoctor", "profile", "--config", str(cfg_path), "--json", str(out_path), "--quiet"]
        cmd += [] if diagnose else ["--no-diagnose"]
        for d in rules_dirs or []:
            cmd += ["--rules", str(d)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, **env} if env else None, cwd=tmp if own_cwd else None)
            if proc.returncode in (130, -2):  # the child was interrupted (Ctrl-C reaches the whole group)
                raise KeyboardInterrupt
        except subprocess.TimeoutExpired:
            return {"schema_version": SCHEMA_VERSION, "status": "timeout", "config": cfg.to_dict(),
                    "error": {"type": "Timeout", "message": f"the run took longer than {timeout:.0f} s"}}
        if out_path.exists():
            try:
                return json.loads(out_path.read_text())
            except (OSError, ValueError) as e:
                return {"schema_version": SCHEMA_VERSION, "status": "error", "config": cfg.to_dict(),
                        "error": {"type": "ProcessFailed", "message": f"the run's report is unreadable ({e})",
                                  "exit_code": proc.returncode}}
        return {"schema_version": SCHEMA_VERSION, "status": "error", "config": cfg.to_dict(),
                "error": {"type": "ProcessFailed", "message": (proc.stderr or proc.stdout).strip()[-2000:],
                          "exit_code": proc.returncode}}
