"""Training data: synthetic ShareGPT4V-COCO-shaped samples or a user's LLaVA-format file.

Every sample uses the SiQ-VL chat format on the Qwen2.5 template
    <|im_start|>system\\n SYS <|im_end|>\\n
    <|im_start|>user\\n <|vision_start|> IMG*n <|vision_end|>\\n QUESTION <|im_end|>\\n
    <|im_start|>assistant\\n ANSWER <|im_end|>\\n
with labels -100 everywhere but the answer (its closing <|im_end|> included).
Lengths vary from sample to sample, so padding in unbucketed batches is real.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import decode, path_problem, read_bytes
from vlmdoctor.run.zoo import ModelSpec

IGNORE = -100
SYSTEM_PROMPT = "You are a helpful assistant."
IMAGE_POOL = 64  # distinct synthetic images; samples cycle through them like epochs over a small set


def length_model(name: str = "sharegpt4v_coco") -> dict[str, Any]:
    """The shipped length distribution (also under fixtures/lengths/)."""
    return json.loads((resources.files("vlmdoctor.run") / "configs" / "lengths" / f"{name}.json").read_text())


def sample_text_lengths(lm: dict[str, Any], n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Question and answer token counts for n samples."""
    rng = np.random.default_rng(seed)
    q = lm["question_tokens"]
    a = lm["answer_tokens"]
    questions = rng.integers(q["low"], q["high"] + 1, n)
    answers = np.round(a["low"] + (a["high"] - a["low"]) * rng.beta(a["alpha"], a["beta"], n)).astype(np.int64)
    return questions, answers


@dataclass
class Template:
    """Token ids of the chat template for one LLM."""

    ids: dict[str, int]
    role_system: int
    role_user: int
    role_assistant: int
    newline: int

    @classmethod
    def for_llm(cls, llm_spec: dict[str, Any]) -> Template:
        lo, _ = llm_spec["text_token_range"]
        # fixed stand-ins for the role words and newline inside the text range
        return cls(
            ids=llm_spec["special_tokens"],
            role_system=lo,
            role_user=lo + 1,
            role_assistant=lo + 2,
            newline=lo + 3,
        )

    def build(
        self, system: list[int], n_image: int, question: list[int], answer: list[int]
    ) -> tuple[list[int], list[int]]:
        t = self.ids
        prompt = (
            [t["im_start"], self.role_system, self.newline, *system, t["im_end"], self.newline]
            + [t["im_start"], self.role_user, self.newline, t["vision_start"], *([t["image_pad"]] * n_image)]
            + [t["vision_end"], self.newline, *question, t["im_end"], self.newline]
            + [t["im_start"], self.role_assistant, self.newline]
        )
        reply = [*answer, t["im_end"]]
        ids = prompt + reply + [self.newline]
        labels = [IGNORE] * len(prompt) + reply + [IGNORE]
        return ids, labels


def normalize_image(img: np.ndarray) -> torch.Tensor:
    """uint8 CHW -> float CHW in [-1, 1], what the SigLIP processor does after resizing."""
    return torch.from_numpy(img).to(torch.float32).mul_(1 / 127.5).sub_(1.0)


class SyntheticVQA(Dataset):
    """ShareGPT4V-COCO-shaped VQA samples with random token ids and random images."""

    def __init__(self, spec: ModelSpec, num_samples: int, seed: int = 0) -> None:
        self.spec = spec
        self.template = Template.for_llm(spec.llm)
        self.lm = length_model()
        self.questions, self.answers = sample_text_lengths(self.lm, num_samples, seed)
        self.seed = seed
        lo, hi = spec.llm["text_token_range"]
        self.text_range = (lo + 4, hi)  # the first four ids are the template stand-ins
        rng = np.random.default_rng(seed + 1)
        self.system = rng.integers(*self.text_range, self.lm["system_prompt_tokens"]).tolist()
        s = spec.vision["input_size"]
        self.images = rng.integers(0, 256, (IMAGE_POOL, 3, s, s), dtype=np.uint8)  # decoded, resized, CHW
        fixed = self.lm["template_tokens"] + self.lm["system_prompt_tokens"] + spec.image_tokens + 2
        self.lengths = (fixed + self.questions + self.answers).tolist()
        self.with_pixels = True  # False when vision features are cached

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        rng = np.random.default_rng((self.seed, i))
        question = rng.integers(*self.text_range, int(self.questions[i])).tolist()
        answer = rng.integers(*self.text_range, int(self.answers[i]) - 1).tolist()
        ids, labels = self.template.build(self.system, self.spec.image_tokens, question, answer)
        sample = {"input_ids": ids, "labels": labels, "image_id": i % IMAGE_POOL}
        if self.with_pixels:
            sample["pixel_values"] = self.raw_image(sample["image_id"])
        return sample

    def raw_image(self, image_id: int) -> torch.Tensor:
        return normalize_image(self.images[image_id])


@dataclass
class FileStats:
    records: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


class LlavaFile(Dataset):
    """LLaVA-format JSON or JSONL (`image` path + `conversations`), local images, local tokenizer.

    Malformed records are reported with their line (JSONL) or index (JSON list); `bad_records`
    decides whether the run stops or skips them. Skips are counted in the report, so the
    numbers never change silently.
    """

    def __init__(self, path: str, tokenizer_dir: str | None, spec: ModelSpec, bad_records: str = "stop") -> None:
        self.spec = spec
        self.path = Path(path)

        problem = path_problem(self.path)
        if problem:
            raise UsageError(f"--data {str(path)[:120]}: {problem}")
        if self.path.is_dir():
            raise UsageError(f"--data {path}: is a folder; give a LLaVA-format .json or .jsonl file")
        if not self.path.is_file():
            raise UsageError(
                f"--data {path}: no such file" if not self.path.exists() else f"--data {path}: not a regular file"
            )
        if tokenizer_dir is None:
            raise UsageError("--data FILE needs --tokenizer DIR (a local tokenizer folder); nothing is downloaded")
        self.tokenizer = _load_tokenizer(tokenizer_dir)
        self.ids = _tokenizer_special_ids(self.tokenizer, tokenizer_dir)
        self.stats = FileStats()
        self.samples: list[dict[str, Any]] = []
        for where, record, parse_error in _read_records(self.path):
            self.stats.records += 1
            try:
                if parse_error:
                    raise ValueError(parse_error)
                self.samples.append(self._encode(record))
            except ValueError as e:
                msg = f"{self.path}:{where}: {e}"
                if bad_records == "stop":
                    raise UsageError(f"{msg} (use --bad-records skip to skip such records)") from None
                self.stats.skipped += 1
                self.stats.problems.append(msg)
        if not self.samples:
            raise UsageError(f"--data {path}: no usable records ({self.stats.skipped} skipped)")
        self.lengths = [self._length(s) for s in self.samples]
        self.with_pixels = True  # False when vision features are cached

    def _length(self, sample: dict[str, Any]) -> int:
        return len(sample["input_ids"])

    def _encode(self, record: Any) -> dict[str, Any]:
        if not isinstance(record, dict):
            raise ValueError("record is not an object")
        image, convs = record.get("image"), record.get("conversations")
        if not isinstance(image, str) or not image:
            raise ValueError("missing 'image' path")
        img_path = Path(image) if Path(image).is_absolute() else self.path.parent / image
        if not img_path.is_file():
            raise ValueError(f"image not found: {img_path}")
        _check_image(img_path)  # an undecodable image is a bad record (skippable), not a crash mid-run
        if not isinstance(convs, list) or len(convs) < 2:
            raise ValueError("'conversations' must be a list of at least two turns")
        t, tok = self.ids, self.tokenizer
        ids = _encode_text(tok, f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n")
        labels = [IGNORE] * len(ids)
        for k, turn in enumerate(convs):
            if (
                not isinstance(turn, dict)
                or turn.get("from") not in ("human", "gpt")
                or not isinstance(turn.get("value"), str)
            ):
                raise ValueError(f"turn {k} needs 'from' (human|gpt) and a string 'value'")
            text = turn["value"]
            if turn["from"] == "human":
                part = _encode_text(tok, "<|im_start|>user\n")
                if "<image>" in text:
                    part += [t["vision_start"]] + [t["image_pad"]] * self.spec.image_tokens + [t["vision_end"]]
                    text = text.replace("<image>", "").lstrip("\n")
                part += _encode_text(tok, f"{text}<|im_end|>\n<|im_start|>assistant\n")
                ids += part
                labels += [IGNORE] * len(part)
            else:
                reply = _encode_text(tok, f"{text}<|im_end|>")
                ids += reply + _encode_text(tok, "\n")
                labels += reply + [IGNORE] * (len(ids) - len(labels) - len(reply))
        n_img = sum(1 for x in ids if x == t["image_pad"])
        if n_img != self.spec.image_tokens:
            raise ValueError(
                f"expected one <image> in the human turns, found {n_img // max(1, self.spec.image_tokens)}"
            )
        return {"input_ids": ids, "labels": labels, "image_path": str(img_path)}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = {**self.samples[i], "image_id": i}
        if self.with_pixels:
            sample["pixel_values"] = self.raw_image(i)
        return sample

    def raw_image(self, image_id: int) -> torch.Tensor:
        size = self.spec.vision["input_size"]
        path = self.samples[image_id]["image_path"]
        try:
            with Image.open(path) as im:
                arr = np.asarray(im.convert("RGB").resize((size, size), Image.BICUBIC)).transpose(2, 0, 1)
        except OSError as e:
            raise UsageError(f"cannot decode image {path}: {e}") from None
        return normalize_image(np.ascontiguousarray(arr))


def _check_image(path: Path) -> None:
    try:
        with Image.open(path) as im:
            im.verify()
    except Exception as e:  # PIL raises many kinds for a broken file
        raise ValueError(f"cannot decode image {path} ({type(e).__name__})") from None


def _read_records(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, record, parse error) for each record; JSONL lines that do not parse (or are not UTF-8)
    are records too, so --bad-records skip applies to them."""

    raw = read_bytes(path, "--data")
    if path.suffix == ".jsonl":
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield (
                    f"line {n}",
                    None,
                    f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})",
                )
                continue
            try:
                yield f"line {n}", json.loads(text), None
            except (json.JSONDecodeError, RecursionError) as e:
                yield f"line {n}", None, f"not valid JSON ({getattr(e, 'msg', type(e).__name__)})"
        return
    try:
        text = decode(raw, path, "--data")
    except UsageError:  # bad bytes inside a record's strings make that record bad, not the whole file
        text = raw.decode("utf-8", errors="surrogateescape")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: not valid JSON at line {e.lineno}: {e.msg}") from None
    except RecursionError:
        raise UsageError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, list):
        raise UsageError(f"{path}: expected a JSON list of LLaVA records (or a .jsonl file)")
    for n, rec in enumerate(data):
        if _has_undecodable(rec):
            yield f"record {n}", None, "not UTF-8 text"
        else:
            yield f"record {n}", rec, None


def _has_undecodable(value: Any) -> bool:
    """A string holding bytes that were not UTF-8 (kept as lone surrogates by surrogateescape)."""
    if isinstance(value, str):
        return any("\udc80" <= ch <= "\udcff" for ch in value)
    if isinstance(value, dict):
        return any(_has_undecodable(k) or _has_undecodable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_undecodable(v) for v in value)
    return False


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer  # deferred: transformers

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise UsageError(f"--tokenizer {path}: cannot load a local tokenizer ({type(e).__name__})") from None


def _tokenizer_special_ids(tok, where: str) -> dict[str, int]:
    ids = {}
    for key, token in [
        ("im_start", "<|im_start|>"),
        ("im_end", "<|im_end|>"),
        ("vision_start", "<|vision_start|>"),
        ("vision_end", "<|vision_end|>"),
        ("image_pad", "<|image_pad|>"),
    ]:
        i = tok.convert_tokens_to_ids(token)
        if i is None or i == tok.unk_token_id:
            raise UsageError(
                f"--tokenizer {where}: the tokenizer has no {token} token (a Qwen2.5-style tokenizer is expected)"
            )
        ids[key] = i
    ids["pad"] = tok.pad_token_id if tok.pad_token_id is not None else ids["im_end"]
    return ids


def _encode_text(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


# --- samplers --------------------------------------------------------------------------------------


class BatchSampler(Sampler[list[int]]):
    """Random order, or length-bucketed: sort within mega-batches of 50 batches, shuffle the batches.

    The mega-batch scheme is the one HF's `group_by_length` uses; it keeps randomness across
    the epoch while batches hold samples of similar length.
    """

    MEGA = 50

    def __init__(self, lengths: list[int], batch_size: int, bucketed: bool, seed: int = 0) -> None:
        self.lengths = lengths
        self.batch_size = batch_size
        self.bucketed = bucketed
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.lengths) // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        self.epoch += 1
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        b = self.batch_size
        if self.bucketed:
            mega = b * self.MEGA
            chunks = [sorted(order[i : i + mega], key=lambda j: -self.lengths[j]) for i in range(0, len(order), mega)]
            order = [j for c in chunks for j in c]
        batches = [order[i : i + b] for i in range(0, len(order) - b + 1, b)]
        if self.bucketed:
            rng.shuffle(batches)
        return iter(batches)


# --- collation -------------------------------------------------------------------------------------


class Collator:
    """Pads (optionally to a multiple) or packs a list of samples into one micro-batch.

    Token counts are computed here on the host, so counting them costs no device sync.
    """

    def __init__(
        self,
        pad_id: int,
        pad_to_multiple_of: int = 1,
        packing: bool = False,
        pack_length: int = 2048,
        vision_features: torch.Tensor | None = None,
        labeled_only: bool = False,
    ) -> None:
        self.pad_id = pad_id
        self.multiple = pad_to_multiple_of
        self.packing = packing
        self.pack_length = pack_length
        self.vision_features = vision_features
        self.labeled_only = labeled_only

    def _round(self, n: int) -> int:
        return int(math.ceil(n / self.multiple) * self.multiple)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        rows = self._pack(samples) if self.packing else [[s] for s in samples]
        width = self._round(max(sum(len(s["input_ids"]) for s in row) for row in rows))
        n = len(rows)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        labels = torch.full((n, width), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        position_ids = torch.zeros((n, width), dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for s in row:
                k = len(s["input_ids"])
                input_ids[r, at : at + k] = torch.tensor(s["input_ids"])
                labels[r, at : at + k] = torch.tensor(s["labels"])
                attention_mask[r, at : at + k] = 1
                position_ids[r, at : at + k] = torch.arange(k)
                at += k
            position_ids[r, at:] = torch.arange(width - at)  # padding forms its own "sequence"
        real = int(attention_mask.sum())
        batch: dict[str, Any] = {
            "input_ids": input_ids,
            "labels": labels,
            "position_ids": position_ids,
            # packing: no 2D mask, so transformers builds the block-diagonal causal mask from position ids
            # (dense for SDPA, a document BlockMask for --attention flex)
            "attention_mask": None if self.packing else attention_mask,
        }
        if self.labeled_only:  # positions whose next token is a label, flat over (rows, width - 1)
            nxt = labels[:, 1:].reshape(-1)
            batch["loss_index"] = torch.nonzero(nxt != IGNORE).squeeze(1)
            batch["loss_targets"] = nxt[batch["loss_index"]]
        ordered = [s for row in rows for s in row]  # image order must match <|image_pad|> order
        if self.vision_features is not None:
            batch["vision_features"] = self.vision_features[[s["image_id"] for s in ordered]]
        else:
            batch["pixel_values"] = torch.stack([s["pixel_values"] for s in ordered])
        batch["counts"] = {
            "real_tokens": real,
            "loss_tokens": int((labels != IGNORE).sum()),
            "padded_tokens": n * width,
            "samples": len(samples),
            "lengths": [len(s["input_ids"]) for s in samples],
            "rows": n,
            "width": width,
        }
        return batch

    def _pack(self, samples: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
        """Fewest rows of at most pack_length tokens, balanced so the longest row (the padded width) is short.

        Longest-first into the least-filled row; a sample longer than pack_length gets a row of its own.
        """
        lengths = [len(s["input_ids"]) for s in samples]
        order = sorted(range(len(samples)), key=lambda i: -lengths[i])
        k = max(1, math.ceil(sum(lengths) / self.pack_length))
        while True:
            rows: list[list[int]] = [[] for _ in range(k)]
            load = [0] * k
            for i in order:
                r = min(range(k), key=load.__getitem__)
                rows[r].append(i)
                load[r] += lengths[i]
            if max(load) <= max(self.pack_length, max(lengths)) or k >= len(samples):
                return [[samples[i] for i in row] for row in rows if row]
            k += 1


# --- preference pairs (DPO) ------------------------------------------------------------------------


class SyntheticPairs(SyntheticVQA):
    """Preference pairs: each sample's prompt + image is shared by a chosen and a rejected answer.

    The chosen answer is the SFT sample's; the rejected answer draws its own length from the same
    length model (another seed), so the two rows of a pair differ in length as real pairs do.
    A pair's length for bucketing is its longer row.
    """

    def __init__(self, spec: ModelSpec, num_samples: int, seed: int = 0) -> None:
        super().__init__(spec, num_samples, seed)
        _, self.rejected_answers = sample_text_lengths(self.lm, num_samples, seed + 2)
        fixed = self.lm["template_tokens"] + self.lm["system_prompt_tokens"] + spec.image_tokens + 2
        self.row_lengths = [
            (c, fixed + int(q) + int(r)) for c, q, r in zip(self.lengths, self.questions, self.rejected_answers)
        ]
        self.lengths = [max(c, r) for c, r in self.row_lengths]

    def __getitem__(self, i: int) -> dict[str, Any]:
        chosen = super().__getitem__(i)
        rng = np.random.default_rng((self.seed, i, 1))
        q_rng = np.random.default_rng((self.seed, i))  # the chosen sample's question, drawn again
        question = q_rng.integers(*self.text_range, int(self.questions[i])).tolist()
        answer = rng.integers(*self.text_range, int(self.rejected_answers[i]) - 1).tolist()
        ids, labels = self.template.build(self.system, self.spec.image_tokens, question, answer)
        pair = {
            "chosen": {"input_ids": chosen["input_ids"], "labels": chosen["labels"]},
            "rejected": {"input_ids": ids, "labels": labels},
            "image_id": chosen["image_id"],
            "index": i,
        }
        if self.with_pixels:
            pair["pixel_values"] = chosen["pixel_values"]
        return pair


class PreferenceFile(LlavaFile):
    """TRL-style preference JSONL/JSON: `prompt`, `images` (one local path; `image` works too), `chosen`, `rejected`.

    `prompt` is a string (an `<image>` in it marks where the image goes, else the image leads the
    prompt) or TRL's conversational form, a list of {"role": "user", "content": str}; `chosen` and
    `rejected` are strings or one-message lists ({"role": "assistant", "content": str}). The
    LLaVA reader's conventions hold: --tokenizer DIR is needed, image paths are relative to the
    file, and a malformed record stops the run with its line, or is skipped and counted with
    --bad-records skip.
    """

    def _length(self, sample: dict[str, Any]) -> int:
        return max(len(sample["chosen"]["input_ids"]), len(sample["rejected"]["input_ids"]))

    def _encode(self, record: Any) -> dict[str, Any]:
        if not isinstance(record, dict):
            raise ValueError("record is not an object")
        images = record.get("images", record.get("image"))
        if isinstance(images, str):
            images = [images]
        if not isinstance(images, list) or len(images) != 1 or not isinstance(images[0], str) or not images[0]:
            raise ValueError("'images' must hold exactly one image path")
        image = images[0]
        img_path = Path(image) if Path(image).is_absolute() else self.path.parent / image
        if not img_path.is_file():
            raise ValueError(f"image not found: {img_path}")
        _check_image(img_path)
        prompt = _text_of(record.get("prompt"), "prompt", "user")
        t, tok = self.ids, self.tokenizer
        before, _, after = prompt.partition("<image>") if "<image>" in prompt else ("", "", prompt)
        if "<image>" in after:
            raise ValueError("the prompt holds more than one <image>")
        head = _encode_text(tok, f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{before}")
        head += [t["vision_start"]] + [t["image_pad"]] * self.spec.image_tokens + [t["vision_end"]]
        head += _encode_text(tok, f"{after.lstrip(chr(10))}<|im_end|>\n<|im_start|>assistant\n")
        rows = {}
        for key in ("chosen", "rejected"):
            reply = _encode_text(tok, f"{_text_of(record.get(key), key, 'assistant')}<|im_end|>")
            tail = _encode_text(tok, "\n")
            rows[key] = {
                "input_ids": head + reply + tail,
                "labels": [IGNORE] * len(head) + reply + [IGNORE] * len(tail),
            }
        return {**rows, "image_path": str(img_path)}

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = self.samples[i]
        pair = {"chosen": s["chosen"], "rejected": s["rejected"], "image_id": i, "index": i}
        if self.with_pixels:
            pair["pixel_values"] = self.raw_image(i)
        return pair


def _text_of(value: Any, key: str, role: str) -> str:
    """A string, or TRL's conversational list of messages of one role, as one string."""
    if isinstance(value, str) and value.strip():
        return value
    if (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and m.get("role") == role and isinstance(m.get("content"), str) for m in value)
    ):
        return "\n".join(m["content"] for m in value)
    raise ValueError(f"'{key}' must be a non-empty string or a list of {{role: {role}, content: str}} messages")


class PairCollator:
    """A batch of B pairs as 2B rows (chosen rows first, then rejected), as TRL's concatenated forward does."""

    def __init__(self, base: Collator) -> None:
        self.base = base

    def __call__(self, pairs: list[dict[str, Any]]) -> dict[str, Any]:
        rows = []
        for key in ("chosen", "rejected"):
            for p in pairs:
                row = {**p[key], "image_id": p["image_id"]}
                if "pixel_values" in p:
                    row["pixel_values"] = p["pixel_values"]
                rows.append(row)
        batch = self.base(rows)
        batch["counts"]["pairs"] = len(pairs)
        batch["pair_index"] = [p["index"] for p in pairs]
        return batch
