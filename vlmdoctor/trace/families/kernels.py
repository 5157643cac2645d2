"""Kernel classes: GPU time by class (trace/kernels.py), the GEMMs' precision, Liger and compiled launches."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.kernels import ATTENTION_CLASSES, GEMM_CLASSES, LIGER_CLASSES, is_fp32_attention

PRODUCES = by_producer(__name__)
#: tensor-core GEMMs on fp16 operands: cuBLASLt's nvjet `hsh`/`hss` (bf16 is `tst`), cuBLAS/CUTLASS `f16`, `fp16`,
#: `__half` (never `bf16`)
FP16_GEMM = re.compile(r"^nvjet_sm\d+_hs[hs]_|(?<![bB])fp?16|__half|hgemm|_h\d+gemm")
#: (ms, count, share) of each kernel class, spelled out so that a search for a fact finds where it is computed
CLASS_FACTS = {
    "nccl": ("kernels.nccl.ms", "kernels.nccl.count", "kernels.nccl.share"),
    "gemm_fp8": ("kernels.gemm_fp8.ms", "kernels.gemm_fp8.count", "kernels.gemm_fp8.share"),
    "gemm_tf32": ("kernels.gemm_tf32.ms", "kernels.gemm_tf32.count", "kernels.gemm_tf32.share"),
    "gemm_fp32_simt": ("kernels.gemm_fp32_simt.ms", "kernels.gemm_fp32_simt.count", "kernels.gemm_fp32_simt.share"),
    "attention_cudnn": ("kernels.attention_cudnn.ms", "kernels.attention_cudnn.count", "kernels.attention_cudnn.share"),
    "attention_flash": ("kernels.attention_flash.ms", "kernels.attention_flash.count", "kernels.attention_flash.share"),
    "attention_mem_efficient": (
        "kernels.attention_mem_efficient.ms",
        "kernels.attention_mem_efficient.count",
        "kernels.attention_mem_efficient.share",
    ),
    "attention_flex": ("kernels.attention_flex.ms", "kernels.attention_flex.count", "kernels.attention_flex.share"),
    "gemm_tensor_core": (
        "kernels.gemm_tensor_core.ms",
        "kernels.gemm_tensor_core.count",
        "kernels.gemm_tensor_core.share",
    ),
    "liger_rms_norm": ("kernels.liger_rms_norm.ms", "kernels.liger_rms_norm.count", "kernels.liger_rms_norm.share"),
    "liger_swiglu": ("kernels.liger_swiglu.ms", "kernels.liger_swiglu.count", "kernels.liger_swiglu.share"),
    "liger_rope": ("kernels.liger_rope.ms", "kernels.liger_rope.count", "kernels.liger_rope.share"),
    "liger_cross_entropy": (
        "kernels.liger_cross_entropy.ms",
        "kernels.liger_cross_entropy.count",
        "kernels.liger_cross_entropy.share",
    ),
    "triton_compiled": ("kernels.triton_compiled.ms", "kernels.triton_compiled.count", "kernels.triton_compiled.share"),
    "optimizer": ("kernels.optimizer.ms", "kernels.optimizer.count", "kernels.optimizer.share"),
    "softmax": ("kernels.softmax.ms", "kernels.softmax.count", "kernels.softmax.share"),
    "cast": ("kernels.cast.ms", "kernels.cast.count", "kernels.cast.share"),
    "reduction": ("kernels.reduction.ms", "kernels.reduction.count", "kernels.reduction.share"),
    "elementwise": ("kernels.elementwise.ms", "kernels.elementwise.count", "kernels.elementwise.share"),
    "memcpy": ("kernels.memcpy.ms", "kernels.memcpy.count", "kernels.memcpy.share"),
    "memset": ("kernels.memset.ms", "kernels.memset.count", "kernels.memset.share"),
    "triton_other": ("kernels.triton_other.ms", "kernels.triton_other.count", "kernels.triton_other.share"),
    "other": ("kernels.other.ms", "kernels.other.count", "kernels.other.share"),
}
LIGER_FACTS = {
    "liger_rms_norm": "liger.rms_norm.launches",
    "liger_swiglu": "liger.swiglu.launches",
    "liger_rope": "liger.rope.launches",
    "liger_cross_entropy": "liger.cross_entropy.launches",
}


def produce(r: Reading, facts: dict[str, Any]) -> None:
    g, n = r.t.gpu, r.n
    gpu_time = r.gpu_time
    by_cls = g.groupby("cls")["dur"].agg(["sum", "count"])
    for cls, row in by_cls.iterrows():
        ms, count, share = CLASS_FACTS.get(cls) or (f"kernels.{cls}.ms", f"kernels.{cls}.count", f"kernels.{cls}.share")
        facts[ms] = row["sum"] / 1e3 / n
        facts[count] = row["count"] / n
        facts[share] = row["sum"] / gpu_time
    gemm = by_cls.reindex(list(GEMM_CLASSES))["sum"].fillna(0.0)
    facts["gemm.ms"] = float(gemm.sum()) / 1e3 / n
    facts["gemm.count"] = float(by_cls.reindex(list(GEMM_CLASSES))["count"].fillna(0.0).sum()) / n
    facts["gemm.fp32_share"] = float(gemm["gemm_fp32_simt"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.tf32_share"] = float(gemm["gemm_tf32"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.fp32_share_of_gpu"] = float(gemm["gemm_fp32_simt"]) / gpu_time
    # FP8 (torchao.float8): the share of GEMM time already in FP8, and the bf16/fp16 tensor-core GEMM time it could take
    facts["gemm.fp8_share"] = float(gemm["gemm_fp8"] / gemm.sum()) if gemm.sum() else 0.0
    facts["gemm.fp8_ms"] = float(gemm["gemm_fp8"]) / 1e3 / n
    tc = g[g["cls"] == "gemm_tensor_core"]
    fp16 = float(tc.loc[tc["name"].astype(str).str.contains(FP16_GEMM), "dur"].sum())
    facts["gemm.fp16_share"] = fp16 / float(gemm.sum()) if gemm.sum() else 0.0  # fp16 autocast, not bf16
    facts["gemm.bf16_ms"] = float(gemm["gemm_tensor_core"]) / 1e3 / n
    facts["gemm.bf16_share_of_gpu"] = float(gemm["gemm_tensor_core"]) / gpu_time
    # how wide the GEMMs are, from the trace alone: FP8's casts grow with a GEMM's inputs, its saving with the FLOPs
    bf16_count = float(by_cls["count"].get("gemm_tensor_core", 0))
    facts["gemm.bf16_mean_ms"] = float(gemm["gemm_tensor_core"]) / 1e3 / bf16_count if bf16_count else 0.0
    fp32_names = Counter(g.loc[g["cls"] == "gemm_fp32_simt", "name"])
    facts["gemm.fp32_top_kernels"] = [k for k, _ in fp32_names.most_common(3)]
    att = g[g["cls"].isin(ATTENTION_CLASSES)]
    facts["attention.fp32_kernels"] = int(sum(is_fp32_attention(x) for x in att["name"])) / n
    facts["attention.kernel_share"] = float(att["dur"].sum()) / gpu_time if gpu_time else 0.0
    for cls in LIGER_CLASSES:
        facts[LIGER_FACTS.get(cls) or f"liger.{cls.removeprefix('liger_')}.launches"] = (
            float(by_cls["count"].get(cls, 0)) / n
        )
    facts["triton_compiled.launches"] = float(by_cls["count"].get("triton_compiled", 0)) / n
    opt_names = g.loc[g["cls"] == "optimizer", "name"].astype(str)
    facts["optimizer.fused"] = bool(opt_names.str.contains("FusedOptimizer|FusedAdam", regex=True).any())
