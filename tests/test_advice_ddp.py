"""Advice that runs where it is pasted, under DDP: the fixes that read the model's attributes, pasted into
examples/train_ddp.py (`model = DistributedDataParallel(model)`), run on 2 ranks over gloo on the CPU, tiny.
Pasted code that reached past the wrapper (`model.model(...)`) raised AttributeError there, and adapted as
`model.module.model(...)` it skipped DDP's forward, so the ranks' gradients were never averaged: the check
is that after a few steps both ranks hold the same weights, and that the same check catches the bypass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from _paste import paste

from vlmdoctor.doctor.advice import advise

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DDP = "train_ddp.py"
ANCHOR = "loader = DataLoader("
#: what a DDP run of the example showed (own/model.py describe_model: the parts' paths; config: the wrapper)
CONTEXT = {"parallel": "ddp", "world_size": 2, "device": "cpu", "batch_size": 4, "paths": {}}
#: each rank saves its trainable weights after the last step (the test's own line, not the advice)
SAVE = (
    "    torch.save({k: v.detach() for k, v in model.module.named_parameters() if v.requires_grad},\n"
    "               os.path.join(os.environ['WEIGHTS_OUT'], f'rank{rank}.pt'))\n"
)


def _run_two_ranks(tmp_path: Path, source: str, steps: int = 3) -> dict[int, dict[str, torch.Tensor]]:
    """The (pasted) script on 2 gloo ranks (torchrun), each rank's trainable weights after `steps` steps."""
    shutil.copy(EXAMPLES / "train_llava_loop.py", tmp_path / "train_llava_loop.py")
    marker = '    if rank == 0:\n        print("training done"'
    assert source.count(marker) == 1
    (tmp_path / DDP).write_text(source.replace(marker, SAVE + marker))
    env = {**os.environ, "WEIGHTS_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(tmp_path / DDP), "--steps", str(steps), "--batch-size", "2"]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "training done" in r.stdout
    return {k: torch.load(tmp_path / f"rank{k}.pt") for k in (0, 1)}


def _same(weights: dict[int, dict[str, torch.Tensor]]) -> bool:
    a, b = weights[0], weights[1]
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fixes_pasted_into_ddp_keep_the_ranks_in_sync(tmp_path):
    """The LM head on the labeled rows (through the wrapped forward), the frozen tower reached through the
    wrapper, and the length-grouped sampler that keeps a shard per rank, pasted together: one 2-rank run."""
    lines = []
    for patch in ({"lm_head_labeled_only": True}, {"vision_no_grad": True}, {"sampler": "length_bucketed"}):
        lines += advise(patch, "loop", CONTEXT)
    assert not any(".model(**" in x for x in lines)  # never a call past the wrapper's forward
    assert all("model.model." not in x for x in lines)  # attributes read through the wrapper
    assert any("DistributedLengthGroupedSampler" in x for x in lines)  # not a sampler that drops the sharding
    source = paste((EXAMPLES / DDP).read_text(), lines, ANCHOR)
    assert "logits_to_keep=1" in source and "loss = model(**batch).loss" not in source
    assert "sampler=sampler" in source and "DistributedSampler(ds" not in source
    assert _same(_run_two_ranks(tmp_path, source))


def test_the_check_catches_a_fix_that_bypasses_the_gradient_sync(tmp_path):
    """The adaptation users wrote from the one-process advice: `model.module.model(...)`. Each rank then keeps
    its own gradients; the weights part after one step."""
    lines = advise({"lm_head_labeled_only": True}, "loop", {"device": "cpu", "paths": {}})
    bypass = [
        x.replace("model.model(", "model.module.model(").replace("model.lm_head(", "model.module.lm_head(")
        for x in lines
    ]
    source = paste((EXAMPLES / DDP).read_text(), bypass, ANCHOR)
    assert not _same(_run_two_ranks(tmp_path, source))
