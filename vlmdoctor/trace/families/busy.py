"""GPU busy and idle time: the union of every kernel, copy and memset inside the steps, and the busy time given
to one account per moment.

Where streams overlap, the moment goes to the first account below that runs then: compute before
copies, copies before communication. So `busy.communication` is the communication no compute hid
(the exposed part, waiting for late ranks included), and the busy accounts add up to GPU busy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vlmdoctor.trace.catalog import by_producer
from vlmdoctor.trace.context import Reading
from vlmdoctor.trace.intervals import intersect, per_window, subtract, total, union
from vlmdoctor.trace.kernels import LIGER_CLASSES

PRODUCES = by_producer(__name__)

#: the busy accounts, in the order a moment is given: account -> (its fact, kernel classes of trace/kernels.py,
#: what it means)
BUSY_ACCOUNTS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "gemm_bf16": ("busy.gemm_bf16.ms", ("gemm_tensor_core",), "GEMMs on tensor cores (bf16/fp16)"),
    "gemm_fp8": ("busy.gemm_fp8.ms", ("gemm_fp8",), "FP8 GEMMs"),
    "gemm_tf32": ("busy.gemm_tf32.ms", ("gemm_tf32",), "FP32 GEMMs on TF32 tensor cores"),
    "gemm_fp32": ("busy.gemm_fp32.ms", ("gemm_fp32_simt",), "FP32 GEMMs on FMA units (no tensor cores)"),
    "attention_cudnn": ("busy.attention_cudnn.ms", ("attention_cudnn",), "cuDNN fused attention"),
    "attention_flash": ("busy.attention_flash.ms", ("attention_flash",), "FlashAttention"),
    "attention_mem_efficient": (
        "busy.attention_mem_efficient.ms",
        ("attention_mem_efficient",),
        "memory-efficient attention",
    ),
    "attention_flex": ("busy.attention_flex.ms", ("attention_flex",), "FlexAttention"),
    "liger": ("busy.liger.ms", LIGER_CLASSES, "Liger fused kernels"),
    "compiled": ("busy.compiled.ms", ("triton_compiled",), "torch.compile (Inductor) kernels"),
    "triton": ("busy.triton.ms", ("triton_other",), "other Triton kernels"),
    "optimizer": ("busy.optimizer.ms", ("optimizer",), "optimizer update kernels"),
    "softmax": ("busy.softmax.ms", ("softmax",), "softmax and log-softmax"),
    "elementwise": ("busy.elementwise.ms", ("elementwise", "reduction"), "elementwise, indexing and reduction kernels"),
    "cast": ("busy.cast.ms", ("cast",), "dtype casts and copy kernels"),
    "other_kernels": ("busy.other_kernels.ms", ("other",), "kernels of no known class"),
    "copy": ("busy.copy.ms", ("memcpy", "memset"), "memory copies and sets"),
    "communication": (
        "busy.communication.ms",
        ("nccl",),
        "communication no compute hid (waiting for late ranks included)",
    ),
}
#: the accounts that are the training's own work done the fast way: no prescription is missing when they lead
WORK_ACCOUNTS = frozenset(
    {"gemm_bf16", "gemm_fp8", "attention_cudnn", "attention_flash", "attention_flex", "liger", "compiled"}
)


def produce(r: Reading, facts: dict[str, Any]) -> None:
    busy, n = r.busy, r.n
    facts["gpu.busy_ms"] = total(busy) / 1e3 / n
    facts["gpu.busy_ms_list"] = [round(x, 3) for x in (per_window(busy, r.windows) / 1e3).tolist()]
    facts["gpu.idle_ms"] = total(r.idle) / 1e3 / n
    facts["gpu.busy_frac"] = total(busy) / max(total(r.span), 1e-9)
    g = r.t.gpu
    cls = g["cls"].astype(str).to_numpy()
    left = busy
    for fact, classes, _ in BUSY_ACCOUNTS.values():
        m = np.isin(cls, classes)
        hit = intersect(left, union(g["ts"].to_numpy()[m], g["end"].to_numpy()[m]))
        facts[fact] = total(hit) / 1e3 / n
        left = subtract(left, hit)
