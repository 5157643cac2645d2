"""`treat --trial-gpus`: the final ablation's arms on several GPUs at once, one comparison each, every pair on one
GPU; on CPU with the fake runner of test_treat.py (each run of the ablation sleeps, to show the GPUs overlap)."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch
from test_treat import BASE, FakeRunner, run_fake
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.commands.treat import pinned
from vlmdoctor.doctor.treat import TreatOptions, resolve_trial_gpus, treat
from vlmdoctor.documents import TreatResult, as_document

SLEEP_S = 0.2


class DeviceRunner(FakeRunner):
    """The fake world's runs, each recording the GPU it was pinned to; a pinned run takes SLEEP_S."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        self.devices: list[tuple[object, int | None]] = []

    def __call__(self, c, diagnose, timeout, device=None):  # type: ignore[override]
        if device is not None:
            time.sleep(SLEEP_S)
        with self.lock:  # the fake world's noise comes from one generator
            self.devices.append((c, device))
            return super().__call__(c, diagnose, timeout)


def test_one_gpu_runs_the_ablation_as_before():
    """--trial-gpus 1 (the default): the same trials in the same order, no run pinned to a GPU."""
    before = run_fake(FakeRunner())
    runner = DeviceRunner()
    result = run_fake(runner, trial_gpus=1)
    assert all(d is None for _, d in runner.devices)
    keep = ("trial", "kind", "rule", "outcome", "ratios", "pairs")
    assert [{k: t.get(k) for k in keep} for t in result["trials"]] == [
        {k: t.get(k) for k in keep} for t in before["trials"]
    ]
    assert result["final_ablation"] == before["final_ablation"] and result["trial_gpus"] == 1


def test_two_gpus_split_the_arms_each_pair_on_one_gpu_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    runner, said = DeviceRunner(), []
    cfg = dataclasses.replace(BASE, device="cuda")
    opts = TreatOptions(time_budget_s=None, trial_gpus=2)
    result = treat(cfg, runner, opts, said.append, validate=lambda c: None)
    ablated = [t for t in result["trials"] if t["kind"] == "ablation"]
    assert len(ablated) == 4 and all(t["outcome"] != "undecided" and t["pairs"] >= 3 for t in ablated)
    contrib = {c["rule"]: c["contribution"]["outcome"] for c in result["ladder"][1]["changes"]}
    assert contrib == {
        "bf16": "kept",
        "batch": "superseded",
        "pad": "harmful",
        "compile": "kept",
        "fused-adamw": "no_gain",
    }  # as on one GPU (test_treat.py)
    assert result["final_ablation"]["dropped"] == ["pad", "fused-adamw"]
    assert set(result["final_ablation"]) == {"trials", "dropped", "pooled_log_sd", "pooled_df"}
    # every arm ran on one GPU; the final config on each, as each comparison's own reference
    pinned_runs = [(c, d) for c, d in runner.devices if d is not None]
    by_config: dict[str, set[int]] = {}
    for c, d in pinned_runs:
        by_config.setdefault(json.dumps(c.to_dict(), sort_keys=True), set()).add(d)
    shared = [c for c, ds in by_config.items() if len(ds) > 1]
    assert len(shared) == 1 and by_config[shared[0]] == {0, 1}  # the final config only
    assert len(by_config) == 5  # the final config and the four configs without one change
    # the two comparisons overlapped: the ablation took well under the sum of its runs
    ablate_s = sum(v["spent_s"] for v in result["states"] if v["state"] == "ablate")
    assert ablate_s < 0.75 * SLEEP_S * len(pinned_runs)
    assert result["trial_gpus"] == 2
    assert any("on 2 GPUs" in m for m in said) and any(m.endswith("(GPU 1)") for m in said)
    as_document(result, TreatResult, "treat.json")  # the declared result, its new field included


def test_trial_gpus_resolve_to_one_on_a_cpu_and_for_a_distributed_config(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_trial_gpus(0, BASE) == 1  # a CPU config: parallel runs would share the cores they time
    assert resolve_trial_gpus(4, BASE) == 1
    cuda = dataclasses.replace(BASE, device="cuda")
    assert resolve_trial_gpus(0, cuda) == 4 and resolve_trial_gpus(8, cuda) == 4 and resolve_trial_gpus(2, cuda) == 2
    dist = dataclasses.replace(cuda, nproc_per_node=2, parallel="ddp")
    assert resolve_trial_gpus(0, dist) == 1 and resolve_trial_gpus(4, dist) == 1  # its runs use the GPUs


def test_a_pinned_run_sees_one_gpu_of_those_this_process_sees(monkeypatch):
    assert pinned(None) == {}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert pinned(1) == {"CUDA_VISIBLE_DEVICES": "1"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert pinned(1) == {"CUDA_VISIBLE_DEVICES": "3"}


@pytest.mark.parametrize("value", ["-1", "1.5", "65"])
def test_trial_gpus_is_checked_before_any_run(value):
    r = CliRunner().invoke(app, ["treat", "--model", "tiny", "--device", "cpu", "--trial-gpus", value])
    assert r.exit_code != 0 and "--trial-gpus" in r.output
