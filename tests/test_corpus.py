"""The labelled corpus recorded on two H200s (fixtures/corpus_h200, fixtures/dist_gpu; bench/corpus/): plain
user scripts of ten transformers VLM classes not in the other fixtures, one habit planted each. Every planted cause
the rules know is named, the new rules stay silent where their cause is absent, no precision (layer 1) finding where
the weights are bf16, and every millisecond of each step sits in a named account."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from vlmdoctor.doctor.rules import MIN_ACCOUNT_SHARE, diagnose, load_rules
from vlmdoctor.trace.accounts import MAX_UNATTRIBUTED
from vlmdoctor.trace.facts import analyze

FIX = Path(__file__).resolve().parents[1] / "fixtures"
ONE = FIX / "corpus_h200"
DIST = FIX / "dist_gpu"
RULES, _ = load_rules()

#: run -> the findings that name its planted cause (fixtures/corpus_h200/labels.yaml says what each run plants)
NAMED = {
    "glm4v_empty_cache": {"system-allocator-churn"},
    "aya_sdpa_math": {"fusion-sdpa-math-fallback"},
    "deepseekvl_compile_static": {"system-compile-host"},
    "mllama_pageable_h2d": {"system-pageable-h2d"},
    "mistral3_checkpoint_save": {"system-dtoh-copies"},
    "idefics2_logits_to_cpu": {"system-dtoh-copies", "system-sync-calls"},
    "idefics2_log_tensors": {"system-sync-calls"},
    "deepseekvl_launch_blocking": {"system-launch-blocking"},
    "aya_forloop_adamw": {"system-non-fused-optimizer"},
    "janus_fp32_weights": {"precision-fp32-gemms"},
    "blip2_eager_attention": {"fusion-eager-attention"},
    "idefics2_spare_ckpt": {"system-checkpoint-recompute"},
    "mistral3_loader_python": {"system-data-loader"},
    "deepseekvl_tokenize": {"batching-host-bound"},
    "qwen3vl_tiny_ops": {"fusion-compile-launch-bound"},
    "glm4v_cudnn_benchmark": {"data-shape-churn"},
    "dist:ddp_long_rank1": {"batching-rank-token-imbalance"},
    "dist:ddp_accum_sync": {"system-accum-sync"},
    "dist:fsdp2_reshard": {"system-fsdp-small-model"},
    "dist:fsdp2_noreshard": {"system-fsdp-small-model"},
}
#: the rules written for this corpus's classes of cost, silent on every run that does not plant theirs
NEW_RULES = {
    "system-allocator-churn": {"glm4v_empty_cache"},
    "fusion-sdpa-math-fallback": {"aya_sdpa_math"},
    "system-compile-host": {"deepseekvl_compile_static"},
    "system-pageable-h2d": {"mllama_pageable_h2d"},
    "system-dtoh-copies": {"mistral3_checkpoint_save", "idefics2_logits_to_cpu"},
    "system-launch-blocking": {"deepseekvl_launch_blocking"},
}
#: runs whose weights or autocast are the planted cause: the only ones a precision finding may name
PRECISION_PLANTED = {"janus_fp32_weights", "blip2_fp16_scaler"}
RUNS = sorted(p.name.removesuffix(".pt.trace.json.gz") for p in ONE.glob("*.pt.trace.json.gz"))


@cache
def dist_facts(job: str) -> dict[str, Any]:
    """A job's ranks joined (its cross-rank facts)."""
    return analyze(DIST / job)["cross_rank"]["facts"]


@cache
def entry(run: str) -> dict[str, Any]:
    """One run's analysis and diagnosis (a folder of rank traces: the first rank's facts and the ranks joined)."""
    doc = analyze(DIST / run.split(":", 1)[1] if run.startswith("dist:") else ONE / f"{run}.pt.trace.json.gz")
    facts = dict(doc["files"][0]["facts"])
    facts.update((doc.get("cross_rank") or {}).get("facts", {}))
    d = diagnose(facts, RULES)
    fired = {f["id"]: f for f in d["findings"] + d["superseded"]}
    return {"accounts": doc["files"][0]["accounts"], "diagnosis": d, "fired": fired}


def test_the_corpus_is_the_recorded_one():
    assert len(RUNS) == 24 and len([p for p in DIST.iterdir() if p.is_dir()]) == 11


@pytest.mark.parametrize("run", sorted(NAMED))
def test_the_planted_cause_is_named(run):
    assert NAMED[run] <= set(entry(run)["fired"]), sorted(entry(run)["fired"])


@pytest.mark.parametrize("rule", sorted(NEW_RULES))
def test_the_new_rules_stay_silent_where_their_cause_is_absent(rule):
    fired_on = {run for run in RUNS if rule in entry(run)["fired"]}
    assert fired_on == NEW_RULES[rule]


@pytest.mark.parametrize("run", RUNS)
def test_no_precision_finding_where_the_weights_are_bf16(run):
    layer1 = {f for f, x in entry(run)["fired"].items() if x["layer"] == 1}
    assert not layer1 or run in PRECISION_PLANTED, layer1


@pytest.mark.parametrize("run", RUNS + [f"dist:{p.name}" for p in sorted(DIST.iterdir()) if p.is_dir()])
def test_every_millisecond_is_in_an_account_and_every_large_one_is_named(run):
    e = entry(run)
    acc = e["accounts"]
    assert acc["unattributed_share"] <= MAX_UNATTRIBUTED
    assert abs(acc["residual_ms"]) < 1e-3 * acc["step_ms"]
    said = {a["account"]: a["verdict"] for a in e["diagnosis"]["accounts"]}
    for row in acc["rows"]:
        if row["share"] >= MIN_ACCOUNT_SHARE:
            assert said[row["account"]] in ("prescribed", "work", "no prescription known")


def test_the_slower_rank_is_explained_by_the_work_it_was_given():
    """Rank 1 got texts twice as long; shapes were not recorded, so its GEMM time (+32%) measures its work."""
    f = dist_facts("ddp_long_rank1")
    assert f["dist.straggler.rank"] == 1 and f["dist.straggler.cause"] == "gemm_work"
    assert f["dist.straggler.gemm_excess_frac"] > 0.2
    slow = dist_facts("ddp_slow_loader_rank1")
    assert slow["dist.straggler.rank"] == 1 and slow["dist.straggler.cause"] == "data_loader"
