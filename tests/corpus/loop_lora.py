"""A LoRA model (peft) of a tiny Qwen2, trained in a plain loop with dropout in the adapters."""

import torch
from _way import save, watch
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(13)
config = Qwen2Config(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
model = get_peft_model(
    Qwen2ForCausalLM(config), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
model.train()
losses = []
with watch(model) as step:
    for _ in range(10):
        ids = torch.randint(1, 128, (2, 16))
        b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        step(b)
save(losses)
