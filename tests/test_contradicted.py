"""Titles checked against their own evidence: a rule's `contradicted_by` names the facts that would make its title
false (kernels that queue for a launch-bound title, SDPA's math path for an FP32-weights title, someone else's code
for a loop-sync title, no real wait for a loader title). The engine says so in the finding's evidence; the corpus
count is in docs/rules.md (bench/rule_precision.py) and tests/test_corpus.py holds it at zero there."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from vlmdoctor.doctor.rules import CONTRADICTED, contradictions, diagnose, load_rules
from vlmdoctor.trace.facts import analyze

FIX = Path(__file__).resolve().parents[1] / "fixtures"
RULES = {r.id: r for r in load_rules()[0]}
#: the finding kinds whose titles make a claim a trace can refute, and the rules of each
KINDS = {
    "launch-bound": ("fusion-compile-launch-bound", "batching-host-bound"),
    "precision from the weights or autocast": (
        "precision-fp32-gemms",
        "precision-no-tf32",
        "precision-autocast-casts",
        "precision-fp16-grad-scaler",
    ),
    "a sync in the training loop's code": ("system-sync-calls",),
    "a real wait on the loader": ("system-data-loader", "system-straggler-data-loader"),
}
RULE = """\
id: my-launch
layer: 4
title: Launch-bound
severity: medium
when: launch.kernels > 0
evidence: ["{launch.kernels:.0f} kernels"]
fix: compile
patch: {}
contradicted_by:
  - when: "launch.delay_us_median >= 1000"
    says: "kernels queued {launch.delay_us_median:.0f} us"
"""


@cache
def facts(trace: str) -> dict:
    return analyze(FIX / f"{trace}.pt.trace.json.gz")["files"][0]["facts"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_rule_of_a_refutable_kind_says_what_would_refute_it(kind):
    for rid in KINDS[kind]:
        assert RULES[rid].contradicted_by, rid


def test_a_contradicted_finding_says_so_and_a_check_without_its_facts_is_skipped(tmp_path):
    (tmp_path / "r.yaml").write_text(RULE)
    rules, problems = load_rules(tmp_path)
    assert not problems
    mine = [r for r in rules if r.id == "my-launch"]
    queued = diagnose({"launch.kernels": 2000.0, "launch.delay_us_median": 4700.0}, mine)["findings"][0]
    assert queued["evidence"][-1] == CONTRADICTED + "kernels queued 4700 us"
    fresh = diagnose({"launch.kernels": 2000.0, "launch.delay_us_median": 9.0}, mine)["findings"][0]
    assert not any(e.startswith(CONTRADICTED) for e in fresh["evidence"])
    assert contradictions(mine[0], {"launch.kernels": 2000.0}) == []  # unmeasured: nothing to refute it with


@pytest.mark.parametrize(
    "bad, says",
    [
        ("contradicted_by: [{when: 'launch.nope > 1'}]", "contradicted_by must be a list"),
        ("contradicted_by: [{when: 'launch.nope > 1', says: x}]", "unknown fact(s) or constant(s) launch.nope"),
        ("contradicted_by: [{when: 'launch.kernels > MAX', says: x}]", "unknown fact(s) or constant(s) MAX"),
        ("contradicted_by: [{when: 'import os', says: x}]", "does not parse"),
    ],
)
def test_a_broken_check_is_refused_with_the_file_and_the_problem(tmp_path, bad, says):
    (tmp_path / "r.yaml").write_text(RULE.split("contradicted_by:")[0] + bad + "\n")
    _, problems = load_rules(tmp_path)
    assert any(says in p and "r.yaml" in p for p in problems), problems


@pytest.mark.parametrize(
    "trace",
    ["user_h100/llava_s2_plain", "user_h100/llava_s1_plain", "user_h100/llava_infer", "traces/sync_s2"],
)
def test_traces_whose_titles_were_contradicted_are_not_any_more(trace):
    """The sync finding named syncs of the model's own forward as the loop's (llava: transformers' masked_scatter
    and .item()); now it names the loop's only."""
    for f in diagnose(facts(trace), list(RULES.values()))["findings"]:
        assert not [e for e in f["evidence"] if e.startswith(CONTRADICTED)], (f["id"], f["evidence"])


def test_an_inference_only_trace_is_not_an_evaluation_inside_training():
    """llava_infer runs forwards under no_grad with a loss and nothing else: no training step to evaluate inside."""
    f = facts("user_h100/llava_infer")
    assert f["nograd.forwards"] > 0 and f["autograd.gemm_calls"] == 0
    assert "system-eval-in-step" not in {x["id"] for x in diagnose(f, list(RULES.values()))["findings"]}
