"""Kernel classification by name: what the GPU actually ran.

Patterns, not exact names: other GPUs, drivers and libraries name kernels differently (the
seed saw `cutlass_80_simt_sgemm_*` and `magma_sgemmEx` on Blackwell; the H100 runs
`sm80_xmma_gemm_f32f32_f32f32_f32_*_ffma_*`). The first matching row wins, so specific rows
come before general ones.
"""

from __future__ import annotations

import re
from functools import cache

#: (class, pattern, what it means). Order matters.
KERNEL_CLASSES: list[tuple[str, str, str]] = [
    ("nccl", r"nccl", "collective communication"),
    # FP8 GEMMs (torch._scaled_mm, torchao.float8): cuBLASLt names the operand types (`sm90_xmma_gemm_e4m3bf16_
    # e4m3f32_f32_*`, `..._e5m2e4m3_...`; nvjet: `nvjet_qqtst_*`, q = e4m3), CUTLASS its element types
    # (`cutlass::float_e4m3_t`, `cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_*`, fbgemm-style `f8f8bf16_rowwise`). A
    # GEMM word must be in the name too: eager casts to FP8 are elementwise kernels whose template names
    # `Float8_e4m3fn`, and they are not GEMMs. `_scaled_mm` is FP8-only: Inductor's max-autotune template for it
    # (`triton_tem_fused__scaled_mm_*`) is an FP8 GEMM, not a fused elementwise kernel.
    (
        "gemm_fp8",
        r"nvjet_(sm\d+_)?(q[a-z]|[a-z]q)[a-z]{3}_|f8f8(bf16|f16|f32)|_scaled_mm"
        r"|(gemm|xmma|cutlass|cublas|scaled_mm|nvjet).*(e4m3|e5m2|float8|fp8)"
        r"|(e4m3|e5m2|float8|fp8).*(gemm|xmma|cutlass|cublas|scaled_mm|nvjet)",
        "FP8 GEMM on tensor cores",
    ),
    ("gemm_tf32", r"tf32", "FP32 GEMM on TF32 tensor cores"),
    # a kernel whose template arguments are bf16/fp16 is not an FP32 GEMM whatever its name says
    # (cuDNN's `implicit_convolve_sgemm<__nv_bfloat16, ...>` runs a bf16 patch-embedding convolution)
    (
        "gemm_fp32_simt",
        r"^(?!.*(bfloat16|__half|bf16|f16)).*(ffma|simt_sgemm|magma_sgemm|sgemm|gemm_f32f32_f32f32_f32)",
        "FP32 GEMM on scalar FMA units (no tensor cores)",
    ),
    ("attention_cudnn", r"cudnn.*sdpa|sdpa.*cudnn|fort_native_sdpa", "cuDNN fused attention"),
    ("attention_flash", r"flash_fwd|flash_bwd|pytorch_flash|flash::|flash_attn", "FlashAttention"),
    (
        "attention_mem_efficient",
        r"fmha_cutlass|AttentionKernel|AttentionBackwardKernel|efficient_attention",
        "memory-efficient (cutlass) attention",
    ),
    # FlexAttention compiled by Inductor: template kernels `triton_tem_fused_flex_attention_0` and
    # `..._flex_attention_backward_1`, named after the flex_attention HOP (before the Triton rows below)
    ("attention_flex", r"flex_attention|flex_decoding", "FlexAttention (Inductor Triton template)"),
    (
        "gemm_tensor_core",
        r"nvjet|xmma_gemm|s16816gemm|h16816gemm|bf16.*gemm|gemm.*bf16|hgemm|cutlass.*gemm|gemm_kernel"
        r"|gemmk|gemv|cublasLt|sm90_.*gemm",
        "GEMM on tensor cores (bf16/fp16)",
    ),
    ("liger_rms_norm", r"_rms_norm_(forward|backward)_kernel", "Liger RMSNorm (Triton)"),
    ("liger_swiglu", r"_swiglu_(forward|backward)_kernel", "Liger SwiGLU (Triton)"),
    ("liger_rope", r"_triton_rope", "Liger RoPE (Triton)"),
    (
        "liger_cross_entropy",
        r"liger_cross_entropy_kernel|element_mul_kernel",
        "Liger (fused linear) cross entropy (Triton)",
    ),
    ("triton_compiled", r"^triton_(poi|red|per|tem|for)_", "torch.compile (Inductor) Triton kernel"),
    ("optimizer", r"multi_tensor_apply_kernel|fused_adam|FusedAdam|adamw?_", "optimizer update"),
    ("softmax", r"softmax|SoftMax", "softmax / log-softmax"),
    ("cast", r"bfloat16_copy|float16_copy|direct_copy_kernel|copy_kernel", "copies and dtype casts"),
    ("reduction", r"reduce_kernel|Reduce|reduction", "reductions"),
    (
        "elementwise",
        r"elementwise|CatArrayBatchedCopy|index|gather|scatter|embedding|fill|arange|where|masked",
        "elementwise and indexing",
    ),
]
_COMPILED = [(name, re.compile(pat, re.IGNORECASE)) for name, pat, _ in KERNEL_CLASSES]

GEMM_CLASSES = ("gemm_fp32_simt", "gemm_tf32", "gemm_tensor_core", "gemm_fp8")
ATTENTION_CLASSES = ("attention_cudnn", "attention_flash", "attention_mem_efficient", "attention_flex")
LIGER_CLASSES = ("liger_rms_norm", "liger_swiglu", "liger_rope", "liger_cross_entropy")


@cache
def classify(name: str, category: str = "kernel") -> str:
    """Class of one GPU event; memcpy and memset come from the event category."""
    if category == "gpu_memcpy":
        return "memcpy"
    if category == "gpu_memset":
        return "memset"
    for cls, rx in _COMPILED:
        if rx.search(name):
            return cls
    if "::" not in name and "(" not in name and "<" not in name:
        return "triton_other"  # bare names are what Triton kernels look like; C++ kernels carry signatures
    return "other"


@cache
def is_fp32_attention(name: str) -> bool:
    return bool(re.search(r"fmha_cutlass[FB]_f32|AttentionKernel<float|_f32_", name))


def memcpy_direction(name: str) -> str:
    m = re.search(r"(HtoD|DtoH|DtoD|HtoH|PtoP)", name)
    return m.group(1) if m else "other"
