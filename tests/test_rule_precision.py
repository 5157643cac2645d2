"""The rules against the labelled corpus (fixtures/labels.yaml): precision, recall and the named misses.

By default a representative subset runs (the issue's false positives and their true positives, on the
smaller traces); the whole corpus runs under the `slow` marker, as bench/rule_precision.py does to
write docs/rules.md. Facts are computed once per trace per session.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from vlmdoctor.doctor.rules import load_rules

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("rule_precision", ROOT / "bench" / "rule_precision.py")
rp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rp)

LABELS = rp.load_labels()
RULES = {r.id: r for r in load_rules()[0]}
KNOWN = LABELS.get("known_misses") or {}
#: one of each: the pooling head (Gemma3 and LLaVA, loop and Trainer) and fp32 islands in a bf16 model, the
#: model's own eager attention (Gemma3 on the H100, the 0.5b preset), SDPA's math backend
#: beside the head (the tiny LLaVA), eager attention, autocast over fp32 weights (a user's and vlmdoctor's),
#: a knob already set (compile_s2: the compile prescriptions), a rank folder.
SUBSET = [
    "user_traces/gemma3_healthy_s2",
    "user_traces/gemma3_eager_s2",
    "user_traces/gemma3_trainer_healthy_s2",
    "user_traces/llava_healthy_s2",
    "user_h100/llava_s2_modules",
    "user_h100/llava_s2_plain",
    "user_cpu/llava_s2_plain",
    "user_h100/llava_s2_ckpt_autocast",
    "traces/eager_s2",
    "traces/default_s2",
    "traces/compile_s2",
    "mode_traces/qlora_tiny_cpu",
    "dist_cpu/ddp_accum",
    "mem_h100/wall_plain_ce_b40",
    "mem_h100/spare_fce_b16",
]
#: the folders whose jobs hold one trace per rank: each job is one labelled entry (its folder)
RANK_FOLDERS = ("dist_cpu", "dist_gpu", "dist_gpu4")
#: layer-1 rules whose fix is a dtype: none may fire on a run whose weights are all bf16
DTYPE_KNOBS = {"weight_dtype", "autocast", "allow_tf32", "dpo_reference_dtype"}


def test_labels_name_real_traces_and_rules():
    """Every label names a recorded trace and a shipped rule, with a reason; every trace under fixtures/ is labelled."""
    for key, lab in LABELS["traces"].items():
        assert rp.trace_path(key).exists(), key
        assert lab["habit"] in ("runner", "loop", "trainer") and lab["device"] in ("gpu", "cpu"), key
        assert isinstance(lab["bf16"], bool) and lab["class"], key
        for table in ("fire", "silent"):
            for rule, why in (lab.get(table) or {}).items():
                assert rule in RULES, (key, rule)
                assert isinstance(why, str) and len(why) >= 12, (key, rule)
        assert not set(lab.get("fire") or {}) & set(lab.get("silent") or {}), key
    recorded = {
        str(p.relative_to(rp.FIXTURES)).removesuffix(".pt.trace.json.gz")
        for p in rp.FIXTURES.rglob("*.pt.trace.json.gz")
        if not set(RANK_FOLDERS) & set(p.parts)
    } | {f"{top}/{d.name}" for top in RANK_FOLDERS for d in (rp.FIXTURES / top).iterdir() if d.is_dir()}
    assert recorded <= set(LABELS["traces"]), sorted(recorded - set(LABELS["traces"]))
    for key, rules in KNOWN.items():
        assert key in LABELS["traces"] and all(r in RULES for r in rules), key


def _check(keys: list[str]) -> None:
    per, misses = rp.confusion(LABELS, keys)
    found = {(m["trace"], m["rule"]) for m in misses}
    listed = {(k, r) for k, rules in KNOWN.items() if k in keys for r in rules}
    assert not found - listed, f"misses without a documented cause: {sorted(found - listed)}"
    assert not listed - found, f"documented misses that no longer miss (remove them): {sorted(listed - found)}"
    rows = rp.rule_table(per)
    for r in rows:
        if r["severity"] == "high" and r["precision"] is not None and r["precision"] < rp.TARGET_PRECISION_HIGH:
            fps = [m for m in misses if m["rule"] == r["id"] and m["kind"] == "FP"]
            assert fps and all((m["trace"], m["rule"]) in listed for m in fps), r
        if r["recall"] is not None and r["recall"] < rp.TARGET_RECALL:
            fns = [m for m in misses if m["rule"] == r["id"] and m["kind"] == "FN"]
            assert fns and all((m["trace"], m["rule"]) in listed for m in fns), r
    for key in keys:  # no dtype prescription on a run already all bf16
        if LABELS["traces"][key]["bf16"]:
            wrong = [rid for rid in rp.fired(key) if RULES[rid].layer == 1 and set(RULES[rid].patch) & DTYPE_KNOBS]
            assert not wrong, (key, wrong)


def test_subset_meets_targets_or_names_its_misses():
    _check(SUBSET)


@pytest.mark.slow
def test_corpus_meets_targets_or_names_its_misses():
    _check(list(LABELS["traces"]))


def test_pooling_head_is_not_eager_attention():
    """SigLIP's pooling head (Gemma3, LLaVA: computed, then discarded) beside SDPA: no 'set sdpa' prescription."""
    from vlmdoctor.trace.facts import analyze

    g3 = analyze(rp.trace_path("user_traces/gemma3_healthy_s2"))["files"][0]["facts"]
    assert g3["attention.eager_softmax_calls"] == 1 and g3["attention.sdpa_calls"] > 1  # the count share
    assert g3["attention.mha.head_blocks"] == 1 and g3["attention.eager.model_ms"] == 0  # query length 1
    assert "fusion-eager-attention" not in rp.fired("user_traces/gemma3_healthy_s2")
    assert "fusion-eager-attention" in rp.fired("user_traces/gemma3_eager_s2")  # the LLM's own eager layers
    facts = analyze(rp.trace_path("user_traces/llava_healthy_s2"))["files"][0]["facts"]
    assert facts["attention.sdpa_calls"] > 30 and facts["attention.eager_softmax_calls"] == 1
    assert facts["attention.mha.blocks"] == 1 and facts["attention.mha.head_blocks"] == 1  # query length 1
    assert facts["attention.eager.model_ms"] == 0
    assert "fusion-eager-attention" not in rp.fired("user_traces/llava_healthy_s2")
    # the tiny LLaVA: the head (by module name) and SDPA's own math backend in the LLM, both left out
    tiny = analyze(rp.trace_path("user_h100/llava_s2_modules"))["files"][0]["facts"]
    assert tiny["attention.mha.head_blocks"] == 1 and tiny["attention.mha.parts"] == ["vision"]
    assert tiny["attention.math.blocks"] == 2 and tiny["attention.math.parts"] == ["llm"]
    assert "fusion-eager-attention" not in rp.fired("user_h100/llava_s2_modules")
    # the same model on the CPU (docs/own-training.md's example): SDPA's CPU kernel, and the head written out
    cpu = analyze(rp.trace_path("user_cpu/llava_s2_plain"))["files"][0]["facts"]
    assert cpu["attention.sdpa_calls"] == 4 and cpu["attention.mha.blocks"] == 1 and cpu["attention.eager.blocks"] == 0
    assert "fusion-eager-attention" not in rp.fired("user_cpu/llava_s2_plain")


def test_eager_attention_gain_comes_from_its_measured_time():
    from vlmdoctor.doctor.rules import diagnose
    from vlmdoctor.trace.facts import analyze

    facts = analyze(rp.trace_path("traces/eager_s2"))["files"][0]["facts"]
    assert facts["attention.eager.blocks"] == 36 and facts["attention.eager.parts"] == ["llm", "vision"]
    f = next(x for x in diagnose(facts, list(RULES.values()))["findings"] if x["id"] == "fusion-eager-attention")
    saved = f["expected_gain"]["saves_ms_per_step"]
    assert saved == pytest.approx(facts["attention.eager.model_ms"] * 0.54)
    assert f["expected_gain"]["throughput_x"] < 2.0  # not the constant x2.00 of a count share
    assert re.search(r"36 attention blocks .* ms of the", f["evidence"][0])


def test_casts_of_fp32_islands_are_not_weight_casts():
    """A bf16 model's own fp32 upcasts (norms, rotary) stay islands; autocast over fp32 weights casts weights."""
    from vlmdoctor.trace.facts import analyze

    bf16 = analyze(rp.trace_path("user_traces/llava_healthy_s2"))["files"][0]["facts"]
    assert bf16["casts.classified_by"] == "shapes"
    assert bf16["casts.island.count"] > 100 and bf16["casts.weight.count"] == 0
    assert "precision-autocast-casts" not in rp.fired("user_traces/llava_healthy_s2")
    fp32 = analyze(rp.trace_path("user_h100/llava_s2_ckpt_autocast"))["files"][0]["facts"]
    assert fp32["casts.classified_by"] == "parent op"  # no shapes: the cast inside aten::linear tells
    assert fp32["casts.weight.count"] > 5 * fp32["casts.island.count"]
    assert "precision-autocast-casts" in rp.fired("user_h100/llava_s2_ckpt_autocast")


def test_a_knob_already_set_is_not_prescribed():
    """compile_s2 is host-bound but compiled: the compile prescriptions stay silent; the config says so."""
    from vlmdoctor.doctor.rule_expr import evaluate, parsed
    from vlmdoctor.doctor.rules import diagnose
    from vlmdoctor.trace.facts import analyze

    facts = analyze(rp.trace_path("traces/compile_s2"))["files"][0]["facts"]
    assert facts["config.compile"] == "default" and facts["triton_compiled.launches"] > 0
    rule = RULES["fusion-compile-launch-bound"]
    env = {**facts, **{k: c["value"] for k, c in rule.constants.items()}}
    assert evaluate(parsed(rule.when), env)  # thousands of launches: only the knob already set keeps it silent
    got = rp.fired("traces/compile_s2")
    assert not {"batching-host-bound", "fusion-compile-launch-bound"} & got
    # the same trace read as a user's (no run config): Inductor's kernels in the trace say compile is on
    user = {k: v for k, v in facts.items() if not k.startswith("config.")}
    ids = {f["id"] for f in diagnose(user, list(RULES.values()))["findings"]}
    assert not {"batching-host-bound", "fusion-compile-launch-bound"} & ids
