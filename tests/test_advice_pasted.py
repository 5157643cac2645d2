"""Advice that works when pasted: each fix a rule gives a user's run, in the user's terms, pasted into the
example scripts (a plain loop, a Trainer whose collator tokenizes) the way its lines say (tests/_paste.py),
and the scripts run on CPU, tiny. Where a fix must not change the loss, the loss is compared."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import re
import runpy
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from _paste import paste

from vlmdoctor.doctor.advice import advise
from vlmdoctor.doctor.rules import load_rules

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
LOOP, TRAINER = "train_llava_loop.py", "train_llava_trainer.py"
ANCHOR = {LOOP: "loader = DataLoader(", TRAINER: "targs = TrainingArguments("}
AUDIENCE = {LOOP: "loop", TRAINER: "trainer"}

#: what each rule's `=` expression gives on a small run, where the patch computes a value
COMPUTED = {"batch_size": 8, "warmup": 10}
#: fixes not pasted here, and why (every rule is either pasted below or listed here)
NOT_HERE = {
    "batching-rank-token-imbalance": "several ranks: prose (deal batches by tokens)",
    "batching-sharded-batch": "FSDP2 several ranks",
    "data-packing": "packing is the collator's (prose) or TRL's SFTConfig, not in these examples",
    "fusion-head-dim": "cuDNN attention: a GPU backend",
    "fusion-fusedce-stage1": "Liger: Triton kernels, a GPU",
    "fusion-fusedce-stage2": "Liger: Triton kernels, a GPU",
    "fusion-liger-with-compile": "Liger: Triton kernels, a GPU",
    "fusion-unfused-norm-activation": "Liger: Triton kernels, a GPU",
    "batching-memory-wall-logits": "Liger's FusedCE: Triton kernels, a GPU",
    "precision-dpo-reference-fp32": "a DPO run",
    "precision-dpo-reference-grad": "a DPO run",
    "system-dpo-reference-every-step": "a DPO run",
    "precision-fp8-gemm": "torchao FP8: a GPU of compute capability 8.9+",
    "precision-qlora-dequant": "QLoRA: bitsandbytes on a GPU",
    "system-accum-sync": "several ranks",
    "system-comm-exposed-ddp": "several ranks",
    "system-comm-exposed-fsdp": "several ranks",
    "system-ddp-near-memory": "several ranks",
    "system-fsdp-small-model": "several ranks",
    "system-vision-cache-h2d": "vlmdoctor's own feature cache: prose for a user's run",
}
#: a fix that this CPU refuses: (rule, script) -> why
GPU_ONLY = {("precision-no-tf32", TRAINER): "TrainingArguments(tf32=True) is refused without an Ampere GPU"}
#: torch.compile on a CPU takes minutes on 2 cores: these run in the slow suite
COMPILES = {"batching-host-bound", "fusion-compile-launch-bound", "fusion-lora-tiny-gemms"}
#: in the default run: the fixes the tiny examples get on a CPU (the Trainer's length grouping has its own test)
FAST = {("data-padding-waste", LOOP), ("fusion-lm-head-unlabeled", LOOP), ("fusion-lm-head-unlabeled", TRAINER)}
#: fixes that must leave the loss as it was (same data, same seed)
SAME_LOSS = {"fusion-lm-head-unlabeled", "precision-frozen-tower-graph", "system-non-fused-optimizer"}


def _patch(rule) -> dict:
    return {k: COMPUTED.get(k, v) if isinstance(v, str) and v.startswith("=") else v for k, v in rule.patch.items()}


@functools.cache
def _rules() -> dict:
    return {r.id: r for r in load_rules()[0]}


@functools.cache
def _context(script: str) -> dict:
    """What a run of the example showed (own/model.py describe_model, trainer_args.sample_lengths): its context."""
    sys.path.insert(0, str(EXAMPLES))
    from train_llava_loop import build_model
    from train_llava_trainer import RawSamples

    from vlmdoctor.own.model import describe_model
    from vlmdoctor.run.trainer_args import sample_lengths

    ctx = {"batch_size": 4, "device": "cpu", "paths": describe_model(build_model())["paths"]}
    if script == TRAINER:
        fake = SimpleNamespace(train_dataset=RawSamples(2), args=SimpleNamespace(length_column_name="length"))
        ctx["sample_lengths"] = sample_lengths(fake)
    return ctx


@functools.cache
def _fields() -> set[str]:
    from transformers import TrainingArguments

    return {f.name for f in dataclasses.fields(TrainingArguments)}


def _run(folder: Path, script: str, source: str, steps: int = 3) -> str:
    """The (pasted) script, run in this process with --steps; what it printed."""
    for name in (LOOP, TRAINER):
        shutil.copy(EXAMPLES / name, folder / name)
    (folder / script).write_text(source)
    argv, out = sys.argv, io.StringIO()
    sys.argv = [str(folder / script), "--steps", str(steps), "--out", str(folder / "doc")]
    if script == TRAINER:
        sys.argv.append("--no-doctor")
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(folder / script), run_name="__main__")
    finally:
        sys.argv = argv
        for name in ("train_llava_loop", "train_llava_trainer"):
            sys.modules.pop(name, None)
    return out.getvalue()


def _loss(printed: str, script: str) -> float:
    if script == LOOP:
        return float(re.search(r"step 0 loss ([\d.]+)", printed).group(1))
    return float(re.search(r"'train_loss': '([\d.]+)'", printed).group(1))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    """Each example's loss, unchanged."""
    return {s: _loss(_run(tmp_path_factory.mktemp(s[:-3]), s, (EXAMPLES / s).read_text()), s) for s in (LOOP, TRAINER)}


def test_every_rule_is_pasted_or_said_why_not():
    assert set(_rules()) == set(NOT_HERE) | {r for r in _rules() if r not in NOT_HERE}
    assert not set(NOT_HERE) - set(_rules())  # no stale entry


def _cases():
    for rid in sorted(set(_rules()) - set(NOT_HERE)):
        for script in (LOOP, TRAINER):
            marks = [pytest.mark.slow] if (rid, script) not in FAST else []
            yield pytest.param(rid, script, marks=marks, id=f"{rid}-{AUDIENCE[script]}")


@pytest.mark.parametrize("rid,script", list(_cases()))
def test_the_fix_runs_when_pasted(rid, script, tmp_path, baseline):
    if (rid, script) in GPU_ONLY:
        pytest.skip(GPU_ONLY[rid, script])
    rule = _rules()[rid]
    lines = advise(_patch(rule), AUDIENCE[script], _context(script))
    assert lines, rid
    code = [x for x in lines if not x.lstrip().startswith("#")]
    if not code:
        pytest.skip(f"{rid}: said as prose for a {AUDIENCE[script]} ({lines[0]})")
    source = paste((EXAMPLES / script).read_text(), lines, ANCHOR[script], _fields())
    assert source != (EXAMPLES / script).read_text()
    printed = _run(tmp_path, script, source)
    if rid in SAME_LOSS:
        assert _loss(printed, script) == pytest.approx(baseline[script], rel=1e-4)


def test_group_by_length_needs_the_lengths_the_advice_gives(tmp_path):
    """The known failure: with only `train_sampling_strategy="group_by_length"` a Trainer whose collator
    tokenizes raises; with the advice's lengths it trains, batches grouped by length."""
    lines = advise({"sampler": "length_bucketed"}, "trainer", _context(TRAINER))
    assert lines[0] == 'train_sampling_strategy="group_by_length"' and len(lines) > 3
    only_field = paste((EXAMPLES / TRAINER).read_text(), lines[:1], ANCHOR[TRAINER], _fields())
    with pytest.raises(ValueError, match="Can only automatically infer lengths"):
        _run(tmp_path, TRAINER, only_field)
    whole = paste((EXAMPLES / TRAINER).read_text(), lines, ANCHOR[TRAINER], _fields())
    assert "class LengthGroupedTrainer(Trainer)" in whole and "trainer = LengthGroupedTrainer(" in whole
    _run(tmp_path, TRAINER, whole)
    # a Trainer that can read the lengths (items holding input_ids) is told the one line only
    assert advise({"sampler": "length_bucketed"}, "trainer", {"sample_lengths": "input_ids"}) == lines[:1]
