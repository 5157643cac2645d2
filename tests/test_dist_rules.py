"""The rules over several ranks, on the cross-rank facts of real 2-rank recordings (fixtures/dist_cpu).

Memory is not in these CPU traces: the memory rules are tested on the same real facts merged with a
real H100 run's measured memory (fixtures/traces/*.report.json), the way `profile` merges a report's
measurements into trace facts. Rules whose trigger the CPU recordings cannot reach (exposed
communication over a tenth of the step) are tested as tests/test_rules.py's VARIATION_CASES are:
the real facts with the named facts changed to what the problem looks like, and not firing on
the unchanged real facts.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.trace.facts import analyze, merge_measured

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "fixtures" / "dist_cpu"
RULES, PROBLEMS = load_rules()
DIST_RULES = [r for r in RULES if r.uses_dist]


@cache
def facts(case: str) -> dict:
    return analyze(DIST / case)["cross_rank"]["facts"]


def with_memory(case: str, report: str) -> dict:
    """A case's facts plus the peak and device memory an H100 run measured (a real report's metrics)."""
    rep = json.loads((ROOT / "fixtures" / "traces" / f"{report}.report.json").read_text())
    return merge_measured(facts(case), rep)


def run(f: dict) -> dict:
    return diagnose(f, DIST_RULES)


def fired(f: dict) -> dict[str, dict]:
    return {x["id"]: x for x in run(f)["findings"]}


def test_the_dist_rules_load_and_are_the_ones_that_read_dist_facts():
    assert PROBLEMS == []
    assert {r.id for r in DIST_RULES} == {
        "system-comm-exposed-fsdp",
        "system-comm-exposed-ddp",
        "batching-rank-token-imbalance",
        "system-fsdp-small-model",
        "system-ddp-near-memory",
        "system-accum-sync",
        "batching-sharded-batch",
        "system-straggler-data-loader",
    }


def test_token_imbalance_fires_on_the_token_straggler_only():
    f = fired(facts("ddp_tokens"))["batching-rank-token-imbalance"]
    assert f["config_patch"] == {"balance_tokens": True}
    assert f["expected_gain"]["saves_ms_per_step"] == pytest.approx(facts("ddp_tokens")["dist.straggler.excess_ms"])
    assert any("rank 1" in e for e in f["evidence"]) and any("700.0% more tokens" in e for e in f["evidence"])
    for case in ("ddp", "ddp_loader", "fsdp2", "ddp_accum"):  # a slow data loader is not a token imbalance
        assert "batching-rank-token-imbalance" not in fired(facts(case)), case
    assert "batching-rank-token-imbalance" not in fired({**facts("ddp_tokens"), "config.balance_tokens": True})


@pytest.mark.parametrize(
    "case, fires",
    [
        ("ddp_accum", True),
        ("fsdp2_accum", True),
        ("ddp_accum_nosync", False),
        ("ddp", False),
        ("fsdp2", False),
    ],
)
def test_accumulation_without_no_sync(case, fires):
    got = fired(facts(case))
    assert ("system-accum-sync" in got) is fires
    if fires:
        f = got["system-accum-sync"]
        assert f["config_patch"] == {"accum_no_sync": True}
        assert f["expected_gain"]["saves_ms_per_step"] == pytest.approx(facts(case)["dist.grad_sync.extra_ms"])
        assert any("2 of 2 micro-batches" in e for e in f["evidence"])


def test_exposed_communication_rules_follow_the_wrapper_and_the_share():
    for case in ("fsdp2", "ddp"):  # measured on 2 CPU ranks: under a tenth of the step
        assert facts(case)["dist.comm.exposed_share"] < 0.1
        got = fired(facts(case))
        assert "system-comm-exposed-fsdp" not in got and "system-comm-exposed-ddp" not in got
    fsdp = {**facts("fsdp2"), "dist.comm.exposed_share": 0.3}
    got = fired(fsdp)
    assert "system-comm-exposed-ddp" not in got
    f = got["system-comm-exposed-fsdp"]
    assert f["config_patch"] == {"fsdp_prefetch": 2}  # no device memory measured: reshard is left as it is
    assert f["expected_gain"]["saves_ms_per_step"] == pytest.approx(0.5 * facts("fsdp2")["dist.comm.exposed_own_ms"])
    assert any("forward 0.0%" in e and "backward 100.0%" in e for e in f["evidence"])
    assert "system-comm-exposed-ddp" not in fired({**facts("ddp"), "dist.comm.exposed_share": 0.3})  # not all-reduce
    ddp = {**facts("ddp"), "dist.comm.all_reduce.exposed_own_ms": 0.3 * facts("ddp")["dist.step.ms"]}
    got = fired(ddp)
    assert "system-comm-exposed-fsdp" not in got
    assert got["system-comm-exposed-ddp"]["config_patch"] == {"ddp_bucket_cap_mb": 100}
    assert "system-comm-exposed-ddp" not in fired({**ddp, "config.ddp_bucket_cap_mb": 200})


def test_fsdp2_on_a_small_model_goes_to_ddp_and_supersedes_prefetching():
    """A 340M model under FSDP2 on two H200s over NCCL (fixtures/dist_gpu/fsdp2_reshard): its exposed all-gathers
    are almost all waiting for the other rank (own exposure 1.7 ms of 236 ms), which once hid the finding; every
    all-gather is a point where the ranks wait, so the exposure counts whole."""
    from vlmdoctor.trace.facts import analyze

    gpu = analyze(ROOT / "fixtures" / "dist_gpu" / "fsdp2_reshard")["cross_rank"]["facts"]
    assert gpu["dist.comm.all_gather.exposed_own_ms"] < 0.01 * gpu["dist.step.ms"]
    assert gpu["dist.comm.all_gather.exposed_ms"] > 0.05 * gpu["dist.step.ms"]
    got = fired(gpu)
    assert got["system-fsdp-small-model"]["config_patch"] == {"parallel": "ddp"}
    assert got["system-fsdp-small-model"]["expected_gain"]["saves_ms_per_step"] == pytest.approx(
        0.5 * gpu["dist.comm.all_gather.exposed_ms"]
    )
    real = with_memory("fsdp2", "default_s2")  # the tiny CPU model on an 80 GB device: a replica fits too
    f = {**real, "dist.comm.all_gather.exposed_ms": 0.4 * real["dist.step.ms"], "dist.comm.exposed_share": 0.3}
    d = run(f)
    # both are layer 5; the one that saves more comes first, and the declared conflict sets the other aside
    assert {s["id"]: s["superseded_by"] for s in d["superseded"]}[
        "system-comm-exposed-fsdp"
    ] == "system-fsdp-small-model"
    assert "system-fsdp-small-model" not in fired(
        {**with_memory("ddp", "default_s2"), "dist.comm.all_gather.exposed_ms": 50.0}
    )
    # a replica that does not fit easily keeps FSDP2
    assert "system-fsdp-small-model" not in fired({**f, "dist.grad_gb": 10.0})
    assert "system-fsdp-small-model" not in fired({**gpu, "dist.grad_gb": 20.0})


def test_ddp_near_the_memory_limit_goes_to_fsdp2():
    near = with_memory("ddp", "bucketed_b32_s2")  # 71.8 of 79.2 GiB reserved on the H100
    assert near["measured.memory.peak_reserved_frac"] > 0.85
    f = fired(near)["system-ddp-near-memory"]
    assert f["config_patch"] == {"parallel": "fsdp2"}
    assert 1.0 <= f["expected_gain"]["throughput_x"] <= 2.0
    assert "system-ddp-near-memory" not in fired(with_memory("ddp", "default_s2"))
    assert "system-ddp-near-memory" not in fired(with_memory("fsdp2", "bucketed_b32_s2"))


def test_sharding_that_frees_memory_gets_a_larger_batch_from_the_measurement():
    f = with_memory("fsdp2", "default_s2")  # 11.9 of 79.2 GiB
    got = fired(f)["batching-sharded-batch"]
    b = facts("fsdp2")["dist.batch_size"]
    assert b == 2  # the recorder's batch, read from the embedded token batch
    frac = f["measured.memory.peak_reserved_frac"]
    assert got["config_patch"]["batch_size"] == min(b * 8, max(b * 2, int(b * 0.7 / frac)))
    assert got["expected_gain"]["throughput_x"] > 1.0
    assert "batching-sharded-batch" not in fired(with_memory("fsdp2", "bucketed_b32_s2"))
    assert "batching-sharded-batch" not in fired(with_memory("ddp", "default_s2"))


def test_memory_rules_on_cpu_traces_are_not_applicable_and_say_why():
    """GPU memory is a fact of GPU runs (the catalogue says so): on a gloo trace the memory rules do not
    apply, and no profiler option would make them (not "not evaluated" with a profile_memory hint)."""
    d = run(facts("fsdp2"))
    na = {n["id"]: n for n in d["not_applicable"]}
    assert "memory.peak_reserved_frac" in na["batching-sharded-batch"]["why"]
    assert "CPU" in na["batching-sharded-batch"]["why"]
    assert "batching-sharded-batch" not in {n["id"] for n in d["not_evaluated"]}


def test_one_trace_alone_makes_the_dist_rules_not_applicable_not_unevaluated():
    single = analyze(DIST / "ddp_tokens" / "trace_rank1.json.gz")["files"][0]["facts"]
    d = diagnose(single, RULES)
    na = {n["id"] for n in d["not_applicable"]}
    assert {r.id for r in DIST_RULES} <= na
    assert not {r.id for r in DIST_RULES} & {n["id"] for n in d["not_evaluated"]}


def test_a_run_report_whose_trace_is_a_rank_folder_gets_the_dist_findings(tmp_path):
    from vlmdoctor.doctor.diagnosis import examine

    folder = tmp_path / "trace"
    shutil.copytree(DIST / "ddp_accum", folder)
    report = {"trace": {"path": str(folder), "kept": True}, "config": {"stage": 2}, "metrics": {}}
    examine(report)
    assert report["facts"]["dist.synced_micro_batches_per_step"] == 2
    assert report["cross_rank"]["facts"]["dist.ranks"] == 2
    assert "system-accum-sync" in {f["id"] for f in report["findings"]}
    assert "system-accum-sync" not in {
        f["id"] for f in diagnose({**report["facts"], "config.accum_no_sync": True}, RULES)["findings"]
    }  # the knob set: not again
