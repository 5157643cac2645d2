"""A user's VLM training script with one habit planted, profiled the way the torch.profiler tutorial shows.

A native transformers VLM class built from a config (random weights, no download, see vlms.py), a
plain loop (a DataLoader with workers and pinned memory unless the habit changes that), AdamW, a few
warm steps, then `torch.profiler.profile(schedule=schedule(wait=1, warmup=1, active=2))` over four
more steps; the trace is written with `prof.export_chrome_trace` and gzipped. One JSON line on stdout:
model class, habit, versions, device, step times, trace size. Nothing here imports vlmdoctor.

    python bench/corpus/habits.py --model qwen3_vl --habit healthy --out /tmp/t.pt.trace.json.gz
    python bench/corpus/habits.py --model glm4v --habit empty_cache --tiny --device cpu --out /tmp/x.json.gz
    python bench/corpus/habits.py --list

Each habit is the only sickness planted on top of the healthy setup (bf16 weights, sdpa attention,
fused AdamW, DataLoader(num_workers=2, pin_memory=True), non_blocking copies); see HABITS below.
Habits that need CUDA degrade on --device cpu (said on stderr) so that the script still runs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import zlib

HABITS = {
    "healthy": "control: bf16 weights, sdpa, fused AdamW, DataLoader(num_workers=2, pin_memory=True)",
    "tuned": "tuned control: healthy, and every batch padded to one fixed length (no new shapes, ~5% padding)",
    "empty_cache": "torch.cuda.empty_cache() after every optimizer step",
    "cudnn_benchmark": "torch.backends.cudnn.benchmark=True with native-resolution images: new conv shapes every step",
    "sdpa_math": "flash, memory-efficient and cuDNN SDPA switched off (torch.backends.cuda.enable_*_sdp(False))",
    "compile_static": "the LLM under torch.compile(dynamic=False); each of the two active steps brings a new length",
    "fp16_scaler": "fp32 weights under torch.autocast(float16) with a GradScaler, on a bf16-capable GPU",
    "tokenize_in_loop": "captions tokenized in the training loop by a pure-Python BPE (no cache), every step",
    "pageable_h2d": "DataLoader(pin_memory=False): fp32 pixels (4 padded tiles) copied from pageable memory",
    "eval_in_window": "an evaluation (model.eval(), no_grad, 2 batches, loss.item()) every 4 steps, one in the window",
    "checkpoint_save": "torch.save(model.state_dict()) to /tmp every 4 steps, one in the window",
    "log_tensors": "every step: loss.item(), and per parameter grad norm .item() + a grad histogram .cpu()",
    "launch_blocking": "CUDA_LAUNCH_BLOCKING=1 in the environment",
    "deterministic": "torch.use_deterministic_algorithms(True, warn_only=True), CUBLAS_WORKSPACE_CONFIG=:4096:8",
    "forloop_adamw": "torch.optim.AdamW(foreach=False, fused=False): one parameter at a time",
    "moe_tiny_batch": "an MoE model trained at batch 1 with short texts (few tokens per expert)",
    "fp32_weights": "fp32 weights, no autocast (TF32 left off, the default)",
    "eager_attention": "attn_implementation='eager' in every sub-model",
    "spare_checkpointing": "gradient checkpointing (non-reentrant) on a model using a fraction of the GPU",
    "loader_python": "DataLoader(num_workers=0) whose collate decodes, resizes and normalizes each image in Python",
    "logits_to_cpu": "every step the answer tokens' logits copied to the host (.cpu()) for a token-accuracy metric",
    "tiny_ops": "a per-token loss weight built by a Python loop over positions (thousands of tiny kernels)",
}
SHAPES = {"cudnn_benchmark", "moe_tiny_batch"}  # habits recorded with record_shapes=True (or --record-shapes)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3_vl", help="a key of vlms.MAKERS or its class name (--list)")
    ap.add_argument("--habit", default="healthy", choices=sorted(HABITS))
    ap.add_argument("--out", help="the trace to write (.json.gz)")
    ap.add_argument("--tiny", action="store_true", help="every width cut to 64 (a CPU smoke test)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--llm-layers", type=int, default=0, help="the LLM's depth (0: vlms.py's default, 4)")
    ap.add_argument("--vit-layers", type=int, default=0, help="the vision tower's depth (0: vlms.py's default, 2)")
    ap.add_argument("--warm", type=int, default=3, help="untraced warm steps before the profiler")
    ap.add_argument(
        "--batch-size", type=int, default=0, help="0: the habit's default (8, 2 with --tiny; 1 for moe_tiny_batch)"
    )
    ap.add_argument("--min-text", type=int, default=0, help="shortest text row in tokens (0: default)")
    ap.add_argument("--max-text", type=int, default=0, help="longest text row in tokens, exclusive (0: default)")
    ap.add_argument("--record-shapes", action="store_true", help="record shapes whatever the habit")
    ap.add_argument("--list", action="store_true", help="print the habits and models, then exit")
    args = ap.parse_args(argv)
    if not args.list and not args.out:
        ap.error("--out is required")
    return args


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and not ARGS.list:
    # environment habits must be in place before CUDA is initialized (the driver sets them too)
    if ARGS.habit == "launch_blocking":
        os.environ.setdefault("CUDA_LAUNCH_BLOCKING", "1")
    if ARGS.habit == "deterministic":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, schedule  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vlms  # noqa: E402


def note(msg: str) -> None:
    print(f"[habits] {msg}", file=sys.stderr, flush=True)


# --- a user's pure-Python tokenizer: GPT-2's byte-level BPE algorithm, run without its cache -------------
WORDS = (
    "a photo of the cat dog sitting on table next to red blue green small large window car street "
    "person holding umbrella rain what color is there how many people in this image describe scene "
    "kitchen counter bowl fruit banana apple orange tree sky cloud building road sign stop left right "
    "answer question picture background foreground wearing shirt looking standing walking"
).split()
PAT = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")
BYTES = {b: chr(b) if 33 <= b <= 126 else chr(256 + b) for b in range(256)}
MERGES: dict = {}  # (left, right) -> rank: every known word can be assembled left to right


def _merges() -> dict:
    if not MERGES:
        for w in WORDS:
            w = BYTES[32] + w
            for i in range(1, len(w)):
                MERGES.setdefault((w[:i], w[i]), len(MERGES))
    return MERGES


def bpe(token: str) -> list[str]:
    ranks = _merges()
    word = tuple(token)
    while len(word) > 1:
        pairs = set(zip(word, word[1:]))
        first, second = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if (first, second) not in ranks:
            break
        new, i = [], 0
        while i < len(word):
            if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                new.append(first + second)
                i += 2
            else:
                new.append(word[i])
                i += 1
        word = tuple(new)
    return list(word)


VOCAB: dict = {}


def tokenize(text: str, vocab: int) -> list[int]:
    ids = []
    for tok in PAT.findall(text):
        tok = "".join(BYTES[b] for b in tok.encode("utf-8"))
        for piece in bpe(tok):
            if piece not in VOCAB:
                VOCAB[piece] = 100 + (len(VOCAB) * 7919) % (vocab - 100)
            ids.append(VOCAB[piece])
    return ids


def caption(rng: random.Random, n_tokens: int) -> str:
    """About n_tokens tokens of text: known words, and now and then a rare word (several pieces)."""
    words = []
    for _ in range(max(4, int(n_tokens / 1.5))):
        if rng.random() < 0.08:
            words.append("".join(rng.choice("bcdfghjklmnpqrstvwxz") for _ in range(rng.randint(4, 9))))
        else:
            words.append(rng.choice(WORDS))
        if rng.random() < 0.06:
            words[-1] += rng.choice(",.?")
    return " ".join(words)


# --- data -------------------------------------------------------------------------------------------
class Examples(torch.utils.data.Dataset):
    """Item i: one example of step i // batch; its text length and image side drawn from a seed of i."""

    def __init__(self, spec, args, bsz, lengths, sides=None, raw=False, dtype=None):
        self.spec, self.args, self.bsz, self.lengths, self.sides = spec, args, bsz, lengths, sides
        self.raw, self.dtype = raw, dtype
        self.files = None

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        n = self.lengths(i, g)
        side = self.sides(i) if self.sides else None
        if self.raw == "caption":  # the tokenize habit: the text stays a string until the loop
            toks, px = self.spec.image(g, side or self.spec.side)
            return {"caption": caption(random.Random(i), n), "image_tokens": toks, **px}
        ex = vlms.sample(self.spec, g, n, side)
        if self.raw == "encoded":  # the loader_python habit: the image as compressed bytes, decoded in the collate
            if self.files is None:
                self.files = encoded_images(self.spec.side)
            del ex["pixel_values"]
            ex["encoded"] = self.files[i % len(self.files)]
        elif self.dtype is not None:
            ex = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in ex.items()}
        return ex


def encoded_images(side: int, n: int = 8) -> list[tuple[bytes, int]]:
    """The "files" of the loader_python habit: photo-like images of 2.25x the model's side, zlib-compressed
    (the stand-in for PNG/JPEG bytes read from disk), made once before training."""
    g = torch.Generator().manual_seed(7)
    big = int(side * 2.25)
    out = []
    for _ in range(n):
        smooth = torch.nn.functional.interpolate(
            torch.rand(1, 3, 16, 16, generator=g), size=(big, big), mode="bilinear"
        )
        img = (smooth[0] * 200 + torch.rand(3, big, big, generator=g) * 24).to(torch.uint8)
        out.append((zlib.compress(img.numpy().tobytes(), 6), big))
    return out


def python_collate(spec, examples, dtype):
    """A user's collate in the main process: per image, decode the bytes, resize to the model's side
    (bicubic, antialiased), random flip, normalize per channel; then pad the text rows."""
    mean, std = [0.481, 0.458, 0.408], [0.269, 0.261, 0.276]
    for e in examples:
        data, big = e.pop("encoded")
        raw = torch.frombuffer(bytearray(zlib.decompress(data)), dtype=torch.uint8).view(1, 3, big, big)
        side = int(e["image_sizes"][0, 0]) if "image_sizes" in e else spec.side
        img = raw.float().div(255.0)
        img = torch.nn.functional.interpolate(img, size=(side, side), mode="bicubic", antialias=True)
        if random.random() < 0.5:
            img = img.flip(-1)
        chans = [(img[:, c] - mean[c]) / std[c] for c in range(3)]
        e["pixel_values"] = torch.stack(chans, dim=1).to(dtype)
    return vlms.collate(spec, examples)


def text_range(args, habit):
    lo, hi = (32, 64) if habit == "moe_tiny_batch" else (512, 1024)
    if args.tiny:
        lo, hi = (8, 24) if habit == "moe_tiny_batch" else (16, 48)
    return args.min_text or lo, args.max_text or hi


def make_loader(spec, args, habit, bsz, dtype, device):
    lo, hi = text_range(args, habit)
    warm = args.warm

    # rows of a batch within 10% of the batch's longest (a length-grouped sampler: little padding);
    # the longest row drawn per step, or, for compile_static, one length before the window and a new
    # one at each active step
    def longest(step):
        if habit == "tuned":  # one padded length for every batch: a tuned user's fixed-shape collate
            return hi - 1
        if habit == "compile_static":
            drop = max(1, (hi - lo) // 8)
            return max(lo + 1, hi - 1 - max(0, step - (warm + 1)) * drop)
        return int(torch.randint(lo, hi, (1,), generator=torch.Generator().manual_seed(500 + step)))

    def lengths(i, g):
        step, row = divmod(i, bsz)
        top = longest(step)
        return top if row == 0 else int(torch.randint(int(top * 0.9), top + 1, (1,), generator=g))

    def per_batch(i):  # loader_python: a resize target per batch (the rows of a batch are stacked)
        return spec.sides[(i // bsz) % len(spec.sides)]

    def per_image(i):  # cudnn_benchmark: native resolution, each image its own size
        return spec.sides[int(torch.randint(len(spec.sides), (1,), generator=torch.Generator().manual_seed(i)))]

    sides = {"loader_python": per_batch, "cudnn_benchmark": per_image}.get(habit) if spec.sides else None

    cuda = device.type == "cuda"
    if habit == "loader_python":
        ds = Examples(spec, args, bsz, lengths, sides, raw="encoded")
        return torch.utils.data.DataLoader(
            ds, batch_size=bsz, num_workers=0, pin_memory=cuda, collate_fn=lambda ex: python_collate(spec, ex, dtype)
        )
    if habit == "tokenize_in_loop":
        ds = Examples(spec, args, bsz, lengths, sides, raw="caption", dtype=dtype)
        return torch.utils.data.DataLoader(ds, batch_size=bsz, num_workers=2, collate_fn=list, persistent_workers=True)
    if habit == "pageable_h2d":  # fp32 pixels as the processor returns them, no pinning
        ds = Examples(spec, args, bsz, lengths, sides)
        return torch.utils.data.DataLoader(
            ds,
            batch_size=bsz,
            num_workers=2,
            pin_memory=False,
            persistent_workers=True,
            collate_fn=lambda ex: vlms.collate(spec, ex),
        )
    ds = Examples(spec, args, bsz, lengths, sides, dtype=dtype)
    return torch.utils.data.DataLoader(
        ds,
        batch_size=bsz,
        num_workers=2,
        pin_memory=cuda,
        persistent_workers=True,
        collate_fn=lambda ex: vlms.collate(spec, ex),
    )


def tokenize_batch(spec, examples, vocab):
    """The tokenize habit's loop work, as users write it: the prompt tokenized alone (to find where the
    answer starts) and the whole conversation tokenized again, per example, in pure Python; then the batch."""
    out = []
    for e in examples:
        words = e["caption"].split(" ")
        prompt = " ".join(words[: len(words) // 2])
        n_prompt = len(tokenize(prompt, vocab))
        ids = tokenize(e["caption"], vocab)
        text = torch.tensor(ids, dtype=torch.long)
        row = torch.cat([text[:8], torch.tensor(e["image_tokens"]), text[8:]])
        labels = torch.full_like(row, -100)
        start = len(e["image_tokens"]) + max(n_prompt, 8)
        labels[start:] = row[start:]
        px = {k: v for k, v in e.items() if k not in ("caption", "image_tokens")}
        out.append({"input_ids": row, "labels": labels, **px})
    return vlms.collate(spec, out)


# --- the run ----------------------------------------------------------------------------------------
def set_switches(habit: str, cuda: bool) -> None:
    """The process-wide switches some habits flip before the model is built."""
    if habit == "fp16_scaler" and not cuda:
        note("fp16_scaler on CPU: autocast(float16) on CPU, GradScaler('cpu')")
    if habit in ("empty_cache", "launch_blocking", "pageable_h2d") and not cuda:
        note(f"{habit} has no effect on CPU; the run goes on as a smoke test")
    if habit == "cudnn_benchmark":
        torch.backends.cudnn.benchmark = True
    if habit == "sdpa_math":
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
    if habit == "deterministic":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic = True


class Training:
    """The user's model, optimizer, data and step, with the habit planted."""

    def __init__(self, args, device):
        self.args, self.habit, self.device = args, args.habit, device
        habit, cuda = self.habit, device.type == "cuda"
        self.cuda = cuda
        self.weights = torch.float32 if habit in ("fp32_weights", "fp16_scaler") else torch.bfloat16
        self.attn = "eager" if habit == "eager_attention" else "sdpa"
        self.bsz = args.batch_size or (1 if habit == "moe_tiny_batch" else 2 if args.tiny else 8)
        self.spec = vlms.spec(args.model, args.tiny, args.llm_layers, args.vit_layers)
        model = vlms.build(self.spec, device, self.weights, self.attn)
        if habit == "spare_checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if habit == "compile_static":  # the LLM compiled (the vision tower left eager), static shapes
            inner = model.model
            (inner.language_model if hasattr(inner, "language_model") else inner.text_model).compile(dynamic=False)
        model.train()
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        if habit == "forloop_adamw":
            self.opt = torch.optim.AdamW(self.params, lr=1e-5, foreach=False, fused=False)
        elif cuda or self.weights == torch.float32:
            self.opt = torch.optim.AdamW(self.params, lr=1e-5, fused=True)
        else:  # fused AdamW on CPU wants fp32 parameters
            self.opt = torch.optim.AdamW(self.params, lr=1e-5)
        self.scaler = torch.amp.GradScaler(device.type) if habit == "fp16_scaler" else None
        self.batches = iter(make_loader(self.spec, args, habit, self.bsz, self.weights, device))
        self.eval_batches = self._eval_batches() if habit == "eval_in_window" else None
        self.ckpt_path = os.path.join(tempfile.gettempdir(), f"habits_{os.getpid()}_ckpt.pt")

    def _eval_batches(self):
        lo, hi = text_range(self.args, self.habit)

        def lengths(i, g):
            return int(torch.randint(lo, hi, (1,), generator=g))

        ev = Examples(self.spec, self.args, 4, lengths, dtype=self.weights)
        return [
            vlms.to_device(
                vlms.collate(self.spec, [ev[10_000 + 4 * j + r] for r in range(4)]), self.device, self.weights
            )
            for j in range(2)
        ]

    def next_batch(self) -> dict:
        b = next(self.batches)
        if self.habit == "tokenize_in_loop":
            b = tokenize_batch(self.spec, b, self.spec.vocab)
            return vlms.to_device(b, self.device, self.weights, non_blocking=False)
        if self.habit == "pageable_h2d":  # copied as they come (fp32, pageable), cast on the GPU
            b = {k: v.to(self.device, non_blocking=True) for k, v in b.items()}
            return {k: v.to(self.weights) if v.is_floating_point() else v for k, v in b.items()}
        return vlms.to_device(b, self.device, self.weights, non_blocking=self.cuda)

    def forward_loss(self, batch: dict):
        if self.habit == "fp16_scaler":
            with torch.autocast(self.device.type, dtype=torch.float16):
                return self.model(**batch).loss, None
        if self.habit == "tiny_ops":
            labels = batch.pop("labels")
            logits = self.model(**batch).logits
            ce = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="none", ignore_index=-100
            ).view(labels.shape[0], -1)
            # the user's per-token weight: answer tokens count more the later they come, written token by token
            answer = (labels[:, 1:] != -100).float()
            w = torch.zeros_like(ce)
            for t in range(ce.shape[1]):
                w[:, t] = answer[:, t] * (1.0 + t / ce.shape[1])
            return (ce * w).sum() / w.sum().clamp(min=1), None
        out = self.model(**batch)
        return out.loss, out.logits

    def backward_and_step(self, loss) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            if self.habit == "log_tensors":  # a tracker's per-parameter gradient logging, every step
                logged = {"loss": loss.item()}
                for name, p in self.model.named_parameters():
                    if p.grad is not None:
                        logged[f"grad_norm/{name}"] = p.grad.norm().item()
                        logged[f"grad_hist/{name}"] = torch.histc(p.grad.float(), bins=64).cpu()
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self, i: int):
        """One training step (the i-th); returns its token count (a device tensor: no sync)."""
        batch = self.next_batch()
        n_tokens = batch["attention_mask"].sum()
        loss, logits = self.forward_loss(batch)
        if self.habit == "logits_to_cpu":  # the answer tokens' logits to the host for a token-accuracy metric
            answer = batch["labels"][:, 1:] != -100
            host = logits[:, :-1][answer].detach().cpu()  # (answer tokens, V)
            acc = (host.argmax(-1) == batch["labels"][:, 1:][answer].cpu()).float().mean()  # noqa: F841
        self.backward_and_step(loss)
        if self.habit == "empty_cache":
            torch.cuda.empty_cache()
        if self.habit == "eval_in_window" and i % 4 == 2:
            self.model.eval()
            with torch.no_grad():
                ev_loss = sum(self.model(**b).loss for b in self.eval_batches) / len(self.eval_batches)
            print(f"step {i} eval loss {ev_loss.item():.3f}", file=sys.stderr)
            self.model.train()
        if self.habit == "checkpoint_save" and i % 4 == 2:
            torch.save(self.model.state_dict(), self.ckpt_path)
        return n_tokens


def profile_window(run: Training, args, sync) -> tuple[list, list, float]:
    """Four steps under schedule(wait=1, warmup=1, active=2); the trace exported, then gzipped."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    tmp_json = args.out[: -len(".gz")] if args.out.endswith(".gz") else args.out + ".json"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)

    def on_ready(p):
        p.export_chrome_trace(tmp_json)

    host_s, tokens = [], []
    sync()
    t_win = time.perf_counter()
    with profile(
        activities=acts,
        schedule=schedule(wait=1, warmup=1, active=2),
        on_trace_ready=on_ready,
        record_shapes=args.habit in SHAPES or args.record_shapes,
    ) as prof:
        for i in range(args.warm, args.warm + 4):
            t0 = time.perf_counter()
            tokens.append(run.step(i))
            host_s.append(round(time.perf_counter() - t0, 4))  # the host's time in the step (unsynced)
            prof.step()  # after the last active step: the export
    sync()
    window_s = time.perf_counter() - t_win
    if tmp_json != args.out:
        with open(tmp_json, "rb") as f, gzip.open(args.out, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
        os.remove(tmp_json)
    return host_s, tokens, window_s


def main(args) -> None:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device; use --device cpu")
    torch.manual_seed(0)
    random.seed(0)
    t_start = time.perf_counter()
    set_switches(args.habit, cuda)
    run = Training(args, device)
    t_built = time.perf_counter() - t_start

    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm_s, tokens = [], []
    for i in range(args.warm):
        t0 = time.perf_counter()
        tokens.append(run.step(i))
        sync()
        warm_s.append(round(time.perf_counter() - t0, 4))
    window_host_s, window_tokens, window_s = profile_window(run, args, sync)
    if os.path.exists(run.ckpt_path):
        os.remove(run.ckpt_path)

    import transformers

    model = run.model
    text_cfg = getattr(model.config, "text_config", model.config)
    timed = warm_s[1:] or warm_s
    line = {
        "out": args.out,
        "model": vlms.resolve(args.model),
        "class": type(model).__name__,
        "habit": args.habit,
        "habit_says": HABITS[args.habit],
        "tiny": args.tiny,
        "batch_size": run.bsz,
        "text_tokens": list(text_range(args, args.habit)),
        "weights": str(run.weights).replace("torch.", ""),
        "attn": run.attn,
        "warm_step_s": warm_s,
        "s_per_step": round(sum(timed) / len(timed), 4),
        "window_host_step_s": window_host_s,
        "window_s": round(window_s, 3),
        "tokens_per_step": [int(t) for t in tokens + window_tokens],
        "build_s": round(t_built, 1),
        "run_s": round(time.perf_counter() - t_start, 1),
        "n_params": sum(p.numel() for p in model.parameters()),
        "experts_implementation": getattr(text_cfg, "_experts_implementation", None),
        "peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "device_mem_gb": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2) if cuda else None,
        "device_name": torch.cuda.get_device_name(0) if cuda else "cpu",
        "env": {
            k: os.environ[k]
            for k in ("CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG", "CUDA_VISIBLE_DEVICES")
            if k in os.environ
        },
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "size_bytes": os.path.getsize(args.out) if os.path.exists(args.out) else None,
        "command": " ".join(["python", *sys.argv]),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if ARGS.list:
        print("habits:")
        for k, v in HABITS.items():
            print(f"  {k:20s} {v}")
        print("models:")
        for k, v in vlms.CLASSES.items():
            print(f"  {k:20s} {v}")
        raise SystemExit(0)
    main(ARGS)
