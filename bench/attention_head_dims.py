"""Attention throughput by head dimension and SDPA backend, on the GPU this runs on.

    python bench/attention_head_dims.py [--out results.json]

Why: the 1.5b preset's SigLIP-2 so400m tower has head dim 72 (1152 / 16), not a power of two.
Kernels built for fixed head dims (FlashAttention pads to 32/64/96/128/..., Triton kernels to
the next power of two) may waste work on it. This measures forward and forward+backward
TFLOP/s of torch's SDPA for the shapes of the presets' towers and LLMs, per backend, so that the
rule about head dims rests on a measurement of this GPU rather than on folklore.

FLOPs: forward 4 * B * H * Lq * Lk * D (halved when causal), backward 2.5x the forward.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# (what, batch, heads, length, causal): the presets' attention shapes at batch 16
SHAPES = [
    ("so400m tower (384px, 729 patches)", 16, 16, 729, False),
    ("siglip2-base tower (224px, 196 patches)", 16, 12, 196, False),
    ("qwen2.5 LLM, 512 tokens", 16, 14, 512, True),
]
HEAD_DIMS = [64, 72, 80, 96, 128]


def timed(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for what, b, h, n, causal in SHAPES:
        for d in HEAD_DIMS:
            q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            flop = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
            for name, backend in BACKENDS.items():
                row = {
                    "shape": what,
                    "batch": b,
                    "heads": h,
                    "length": n,
                    "head_dim": d,
                    "causal": causal,
                    "backend": name,
                }
                try:
                    with sdpa_kernel(backend):
                        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))  # noqa: B023 (called here)
                        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        grad = torch.randn_like(out)

                        def step() -> None:  # called at once below, inside this iteration
                            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: B023
                            o.backward(grad)  # noqa: B023

                        both = timed(step)
                    row.update(
                        fwd_ms=fwd * 1e3,
                        fwd_bwd_ms=both * 1e3,
                        fwd_tflops=flop / fwd / 1e12,
                        fwd_bwd_tflops=3.5 * flop / both / 1e12,
                    )
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
                q.grad = k.grad = v.grad = None
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    print("| shape | head dim | " + " | ".join(f"{b} fwd / fwd+bwd TFLOP/s" for b in BACKENDS) + " |")
    for what, *_ in SHAPES:
        for d in HEAD_DIMS:
            cells = []
            for b in BACKENDS:
                r = next(x for x in rows if x["shape"] == what and x["head_dim"] == d and x["backend"] == b)
                cells.append(f"{r['fwd_tflops']:.0f} / {r['fwd_bwd_tflops']:.0f}" if "fwd_tflops" in r else "n/a")
            print(f"| {what} | {d} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
