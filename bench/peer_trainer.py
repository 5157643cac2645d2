"""The peer `vlmdoctor treat` has to beat: a native preset trained by the HF Trainer, tuned by hand.

What a practitioner would run instead of `treat`: the same model class and weights (a native preset,
random init from the shipped config), the same synthetic ShareGPT4V-COCO-shaped samples, trained by
`transformers.Trainer` with the speed flags set by hand. Nothing of vlmdoctor runs in the step: it
only supplies the model, the samples and the collation (vlmdoctor.run.native, vlmdoctor.run.data),
and afterwards the one throughput estimator and the FLOP model (so both sides are counted alike).

    python bench/peer_trainer.py --model llava-siglip2-0.5b --recipe docs --json r.json
    python bench/peer_trainer.py --model llava-siglip2-0.5b --recipe tuned --batch-size 96 \
        --group-by-length --pad-to 64 --workers 8 --json r.json
    python bench/peer_trainer.py --model tiny-llava --device cpu --recipe tuned --batch-size 4 --steps 3

Recipes (flags after --recipe override it):
  docs   what the Trainer docs start with: fp32 weights + `bf16=True` (autocast), batch 8, no workers
  tuned  bf16 weights, `use_liger_kernel=True` (RoPE, RMSNorm, SwiGLU, fused linear cross entropy),
         fused AdamW, pinned memory; add the batch, workers, length grouping and padding by flag

Measured like vlmdoctor's runner: each step's wall time with the device synchronized at its end,
each step's real (non-padding) tokens counted in the collator on the host; real tokens/s is the
median of the per-step rates over the steps after warm-up (vlmdoctor.run.throughput.rate), MFU
from vlmdoctor's FLOP model of the preset over the device's dense bf16 peak. One JSON object is
written to --json (status ok / oom / error), so a driver can run each configuration in a fresh
process and find the largest batch that fits.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not bench/ (its tabulate.py)

from vlmdoctor.run import flops, native  # noqa: E402
from vlmdoctor.run.data import Collator, SyntheticVQA  # noqa: E402
from vlmdoctor.run.native_spec import resolve_native  # noqa: E402
from vlmdoctor.run.throughput import percentile, rate  # noqa: E402

RECIPES: dict[str, dict[str, Any]] = {
    "docs": dict(weights="fp32", liger=False, fused_adamw=False, batch_size=8, workers=0, pad_to=1, group=False),
    "tuned": dict(weights="bf16", liger=True, fused_adamw=True, batch_size=8, workers=0, pad_to=1, group=False),
}


class HFCollator:
    """vlmdoctor's collation, handed over in the inputs the class itself takes (as a processor would make
    them), plus the host-side count of real tokens and the row lengths (popped before the forward)."""

    def __init__(self, spec: Any, pad_to: int) -> None:
        self.spec = spec
        self.base = Collator(spec.llm["special_tokens"]["pad"], pad_to)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        b = self.base(samples)
        out: dict[str, Any] = {
            "input_ids": b["input_ids"],
            "attention_mask": b["attention_mask"],
            "labels": b["labels"],
        }
        name = self.spec.cls_name
        if name.startswith("Qwen2VL"):
            vc = self.spec.vision_config
            px, grid = native.qwen2vl_patches(
                b["pixel_values"], vc["patch_size"], vc["temporal_patch_size"], vc["spatial_merge_size"]
            )
            out["pixel_values"], out["image_grid_thw"] = px.contiguous(), grid.contiguous()  # pinned: no expanded views
            out["mm_token_type_ids"] = (b["input_ids"] == self.spec.config["image_token_id"]).int()
        elif name.startswith("Idefics3"):
            px = b["pixel_values"]
            out["pixel_values"] = px.unsqueeze(1)
            out["pixel_attention_mask"] = torch.ones((px.shape[0], 1, *px.shape[-2:]), dtype=torch.bool)
        else:
            out["pixel_values"] = b["pixel_values"]
        out["_counts"] = torch.tensor([b["counts"]["real_tokens"], *b["counts"]["lengths"]])
        return out


def build(args: argparse.Namespace, device: str) -> tuple[Any, Any, Any]:
    spec = resolve_native(args.model)
    vlm = native.build_native(spec, args.weights, "sdpa", "random", device)
    native.apply_native_stage(vlm, args.stage)  # the frozen tower, the trainable LLM (stage 2) and projector
    if args.grad_ckpt:
        native.enable_native_checkpointing(vlm, False)
    data = SyntheticVQA(spec, args.num_samples, args.seed)  # type: ignore[arg-type]
    return spec, vlm.hf, data


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_pt_utils import LengthGroupedSampler

    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    torch.manual_seed(args.seed)
    spec, model, data = build(args, device)
    steps: list[dict[str, float]] = []

    class Peer(Trainer):
        """The practitioner's two additions: lengths for group_by_length from the data set (the collator
        tokenizes, so the Trainer cannot infer them), and the token count taken off the inputs."""

        def _get_train_sampler(self, train_dataset: Any = None) -> Any:
            if args.group:
                return LengthGroupedSampler(self.args.train_batch_size, lengths=list(data.lengths))
            return super()._get_train_sampler(train_dataset)

        def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
            counts = inputs.pop("_counts").tolist()
            steps.append({"real": counts[0], "lengths": counts[1:]})
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        """Each optimizer step's wall time, the device synchronized at its end."""

        def __init__(self) -> None:
            self.last = 0.0

        def on_step_begin(self, *_: Any, **__: Any) -> None:
            if not self.last:
                self._sync()
                self.last = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self._sync()
            now = time.perf_counter()
            steps[-1]["ms"] = (now - self.last) * 1e3
            self.last = now

        @staticmethod
        def _sync() -> None:
            if device == "cuda":
                torch.cuda.synchronize()

    targs = TrainingArguments(
        output_dir=args.scratch,
        max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-5,
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        optim="adamw_torch_fused" if args.fused_adamw else "adamw_torch",
        use_liger_kernel=args.liger,
        dataloader_num_workers=args.workers,
        dataloader_pin_memory=device == "cuda",
        dataloader_persistent_workers=args.workers > 0,
        remove_unused_columns=False,
        save_strategy="no",
        report_to=[],
        logging_steps=10_000,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = Peer(model=model, args=targs, train_dataset=data, data_collator=HFCollator(spec, args.pad_to))
    trainer.add_callback(Clock())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    timed = [s for s in steps[args.warmup :] if "ms" in s]
    ms = [s["ms"] for s in timed]
    fm = flops.flop_model(args.model)
    step_flops = [fm.step([int(n) for n in s["lengths"]], args.stage)["total"] for s in timed]
    peak, peak_how = flops.peak_flops(torch.cuda.get_device_name() if device == "cuda" else None)
    tok = [s["real"] / (s["ms"] / 1e3) for s in timed]
    out = {
        "status": "ok",
        "real_tokens_per_s": rate([s["real"] for s in timed], ms),
        "p10": percentile(tok, 0.1) if tok else None,
        "p90": percentile(tok, 0.9) if tok else None,
        "step_ms_median": sorted(ms)[len(ms) // 2] if ms else None,
        "mfu": (rate(step_flops, ms) or 0.0) / peak if peak else None,
        "mfu_how": peak_how,
        "timed_steps": len(timed),
        "wall_s": wall,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
    }
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llava-siglip2-0.5b")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2))
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="tuned")
    ap.add_argument("--weights", choices=("fp32", "bf16"))
    ap.add_argument("--liger", action=argparse.BooleanOptionalAction)
    ap.add_argument("--fused-adamw", action=argparse.BooleanOptionalAction)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--pad-to", type=int)
    ap.add_argument("--group-by-length", dest="group", action=argparse.BooleanOptionalAction)
    ap.add_argument("--grad-ckpt", action="store_true")
    ap.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    ap.add_argument("--json", help="write the result here (one JSON object)")
    ap.add_argument("--scratch", default=os.environ.get("TMPDIR", "/tmp") + "/peer-trainer-out")
    args = ap.parse_args(argv)
    for k, v in RECIPES[args.recipe].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    knobs = {k: getattr(args, k) for k in ("model", "stage", "recipe", *RECIPES["docs"], "grad_ckpt", "steps")}
    try:
        out = run(args)
    except torch.OutOfMemoryError as e:
        out = {"status": "oom", "error": str(e).splitlines()[0][:300]}
    except Exception as e:  # a benchmark row, not a crash: the driver tabulates it
        out = {"status": "error", "error": f"{type(e).__name__}: {e}"[:500], "traceback": traceback.format_exc()}
    out = {"config": knobs, **out}
    text = json.dumps(out, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if out["status"] == "ok" else 3 if out["status"] == "oom" else 1


if __name__ == "__main__":
    sys.exit(main())
