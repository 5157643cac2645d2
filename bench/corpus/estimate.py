"""Estimate each one-GPU run's GPU time per step on an H100 from its work sizes (no GPU needed).

    python bench/corpus/estimate.py            # every run of record.sh's two lanes

Counts, from the model built on the meta device: the LLM's linear parameters (embeddings and lm_head
apart), the vision tower's, the tokens of a mean batch; then FLOPs = 6 x params x tokens (forward and
backward) + the lm_head + causal attention, at an assumed sustained rate (bf16: 350 TFLOP/s of the
H100's 989; fp32 without TF32: 45 of 67), plus the memory-bound loss (fp32 logits, ~20 bytes an element)
and fused AdamW (~16 bytes a parameter) at 2.5 TB/s. Host time (Python, launches, habit work) is not in
it: the step is GPU-bound only where these numbers stay above the host's ~30-60 ms of eager launches.
"""

from __future__ import annotations

import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vlms  # noqa: E402

BF16, FP32, BW = 350e12, 45e12, 2.5e12


def runs():
    text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "record.sh")).read()
    for m in re.finditer(r'^\s+"(\w+)\s+(\w+)\s+(\w+)([^"]*)"$', text, re.M):
        yield m.group(1), m.group(2), m.group(3), m.group(4).split()


def estimate(model, habit, flags):
    layers = int(next((f.split("=")[1] for f in flags if f.startswith("--llm-layers=")), 0))
    max_text = int(next((f.split("=")[1] for f in flags if f.startswith("--max-text=")), 0))
    batch = int(next((f.split("=")[1] for f in flags if f.startswith("--batch-size=")), 0))
    s = vlms.spec(model, False, layers)
    m = vlms.build(s, "meta", torch.bfloat16)
    tc = getattr(s.config, "text_config", s.config)
    d, V = tc.hidden_size, tc.vocab_size
    n_layers = tc.num_hidden_layers
    emb = {id(p) for mod in (m.get_input_embeddings(), m.get_output_embeddings()) for p in mod.parameters()}
    total = sum(p.numel() for p in m.parameters())
    lm_names = ("language_model", "text_model")
    llm = sum(p.numel() for n, p in m.named_parameters() if any(k in n for k in lm_names) and id(p) not in emb)
    if model == "qwen3_vl_moe":  # only the routed experts' share of the expert weights works per token
        e = tc.num_experts_per_tok / tc.num_experts
        experts = sum(p.numel() for n, p in m.named_parameters() if "experts" in n)
        llm = llm - experts + experts * e
    vit = sum(p.numel() for n, p in m.named_parameters() if not any(k in n for k in lm_names) and id(p) not in emb)
    bsz = batch or (1 if habit == "moe_tiny_batch" else 8)
    lo, hi = (32, 64) if habit == "moe_tiny_batch" else (512, max_text or 1024)
    text = 0.95 * (lo + hi) / 2
    toks, px = s.image(torch.Generator().manual_seed(0), s.side)
    seq = text + len(toks)
    T = bsz * seq
    patches = {
        "mllama": 4 * ((448 // 14) ** 2 + 1),
        "qwen3_vl": 784,
        "qwen3_vl_moe": 784,
        "glm4v": 1024,
        "idefics2": 729,
        "mistral3": 784,
        "aya_vision": 676,
        "janus": 576,
        "deepseek_vl": 576,
        "blip2": 676,
    }[model]
    flops = 6 * llm * T + 6 * d * V * T + 12 * n_layers * d * seq * seq / 2 * bsz + 6 * vit * bsz * patches
    rate = FP32 if habit == "fp32_weights" else BF16  # fp16_scaler's GEMMs run in fp16 under autocast
    gemm_ms = flops / rate * 1e3
    loss_ms = T * V * 20 / BW * 1e3
    opt_ms = total * (32 if habit in ("fp32_weights", "fp16_scaler") else 16) / BW * 1e3
    if habit == "spare_checkpointing":
        gemm_ms *= 4 / 3
    return dict(
        params_m=total / 1e6,
        llm_m=llm / 1e6,
        vit_m=vit / 1e6,
        tokens=int(T),
        gemm_ms=gemm_ms,
        loss_ms=loss_ms,
        opt_ms=opt_ms,
        total_ms=gemm_ms + loss_ms + opt_ms,
    )


def main():
    print(f"{'run':28s} {'params':>7s} {'tokens':>7s} {'gemm':>6s} {'loss':>5s} {'opt':>5s} {'GPU ms':>7s}")
    for name, model, habit, flags in runs():
        e = estimate(model, habit, flags)
        print(
            f"{name:28s} {e['params_m']:6.0f}M {e['tokens']:7d} {e['gemm_ms']:6.1f} {e['loss_ms']:5.1f} "
            f"{e['opt_ms']:5.1f} {e['total_ms']:7.1f}"
        )


if __name__ == "__main__":
    main()
