"""Shared fixtures for the vlmdoctor test suite.

Everything here is CPU-only and small: the `tiny` preset for real runs, the meta device for the
big presets, and a tiny local tokenizer + PNG images for the LLaVA file loader.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.zoo import resolve
from vlmdoctor.trace.worker import cpus

#: torch's intra-op threads, here and in the processes the tests start: the cores shared out over the
#: pytest-xdist workers (`-n`), at most 2. Two workers of two threads each on a 2-core host wait at
#: every parallel region for a thread the scheduler gave to the other (on the shared 2-core machine the
#: whole suite took twice the CPU time on two threads that it took on one).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
THREADS = max(1, min(2, cpus() // WORKERS))
if WORKERS > 1:
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = str(THREADS)

# a suite started in the background (`&` ignores SIGINT, nohup SIGHUP) would pass the ignored signals on to
# the processes the tests start: the tests that send them SIGINT or SIGHUP need what a terminal gives
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
]


@pytest.fixture(scope="session")
def tiny_spec():
    return resolve("tiny")


@pytest.fixture(scope="session")
def spec_05b():
    return resolve("0.5b")


@pytest.fixture
def tiny_cfg():
    """Factory for a fast real CPU run config of the tiny preset (autocast off unless asked)."""

    def make(**changes) -> RunConfig:
        base = dict(model="tiny", device="cpu", steps=2, warmup=1, num_samples=64, autocast="off")
        base.update(changes)
        return RunConfig(**base)

    return make


@pytest.fixture
def cli_runner():
    from typer.testing import CliRunner

    return CliRunner()


# --- LLaVA-format file fixtures -------------------------------------------------------------------

CORPUS = [
    "You are a helpful assistant.",
    "system user assistant",
    "What is in the picture? Describe the image in detail.",
    "A red cat sits on a blue mat next to a small dog.",
    "How many animals are there? There are two animals.",
    "The sky is clear and the grass is green.",
]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny byte-level BPE tokenizer (ids < 300, so within the tiny LLM's 2048 vocab) with the
    Qwen2.5 chat and vision special tokens, saved the way a real checkpoint folder holds one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", additional_special_tokens=SPECIAL_TOKENS[1:]
    )
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    assert len(fast) < 2048
    return out


def write_png(path: Path, seed: int, size: int = 40) -> None:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(arr).save(path)


def good_record(image: str, k: int = 0) -> dict:
    return {
        "id": f"rec{k}",
        "image": image,
        "conversations": [
            {"from": "human", "value": "<image>\nWhat is in the picture?"},
            {"from": "gpt", "value": f"A red cat sits on a blue mat {k}."},
            {"from": "human", "value": "How many animals are there?"},
            {"from": "gpt", "value": "There are two animals."},
        ],
    }


@pytest.fixture
def llava_dir(tmp_path) -> Path:
    """A folder with images/img{0..5}.png (different sizes, as real data has)."""
    img_dir = tmp_path / "images"
    img_dir.mkdir()
    for k in range(6):
        write_png(img_dir / f"img{k}.png", seed=k, size=32 + 8 * k)
    return tmp_path


def write_jsonl(path: Path, lines: list) -> Path:
    """Each entry is a dict (dumped as JSON) or a raw string (written as is)."""
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(scope="session", autouse=True)
def _examples_cache(tmp_path_factory):
    """The example scripts' local checkpoints (examples/train_llava_loop.py) go in the test session's folder."""
    import os

    old = os.environ.get("VLMDOCTOR_EXAMPLES_CACHE")
    os.environ["VLMDOCTOR_EXAMPLES_CACHE"] = str(tmp_path_factory.mktemp("examples-cache"))
    yield
    if old is None:
        os.environ.pop("VLMDOCTOR_EXAMPLES_CACHE", None)
    else:
        os.environ["VLMDOCTOR_EXAMPLES_CACHE"] = old


@pytest.fixture(autouse=True)
def _torch_threads():
    # a test never oversubscribes the machine: at most THREADS intra-op threads (a test may change them)
    prev = torch.get_num_threads()
    torch.set_num_threads(min(prev, THREADS))
    yield
    torch.set_num_threads(prev)
