"""On a GPU: a Qwen2 of bf16 weights, SDPA attention with dropout, fused AdamW, deterministic kernels (the
reproducible set-up a user who compares runs bit for bit chooses)."""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from _way import save, watch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

torch.use_deterministic_algorithms(True)
torch.manual_seed(20)
config = Qwen2Config(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_dropout=0.1,
)
model = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
losses = []
with watch(model) as step:
    for _ in range(12):
        ids = torch.randint(1, 2048, (8, 256), device="cuda")
        b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
save(losses)
