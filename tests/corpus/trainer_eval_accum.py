"""A transformers Trainer with evaluation every 2 steps and gradient accumulation over 2 micro-batches.
CORPUS_WAY=callback adds vlmdoctor's DoctorCallback, as a user would."""

import os

import torch
from _way import WINDOW, save
from torch.utils.data import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM, Trainer, TrainingArguments


class Samples(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 128, (n, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long), "labels": self.ids[i]}


config = Qwen2Config(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    attention_dropout=0.1,
)
args = TrainingArguments(
    output_dir="trainer-out",
    max_steps=10,
    per_device_train_batch_size=2,
    per_device_eval_batch_size=4,
    gradient_accumulation_steps=2,
    eval_strategy="steps",
    eval_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    seed=12,
    dataloader_num_workers=0,
    disable_tqdm=True,
    use_cpu=True,
)
callbacks = []
if os.environ.get("CORPUS_WAY") == "callback":
    from vlmdoctor import DoctorCallback

    callbacks.append(DoctorCallback(out=os.environ["CORPUS_OUT"], quiet=True, **WINDOW))
torch.manual_seed(12)
trainer = Trainer(
    model=Qwen2ForCausalLM(config),
    args=args,
    train_dataset=Samples(64, 0),
    eval_dataset=Samples(8, 1),
    callbacks=callbacks,
)
trainer.train()
history = [{k: v for k, v in e.items() if not k.startswith("vlmdoctor/")} for e in trainer.state.log_history]
save(
    [e["loss"] for e in history if "loss" in e],
    evals=[float(e["eval_loss"]).hex() for e in history if "eval_loss" in e],
)
