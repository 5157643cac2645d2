"""Traces of users' own training, recorded on one H100 80GB by a script that is not vlmdoctor's.

`bench/user_style/train_native.py` trains native transformers VLM classes with a plain loop and
profiles the torch.profiler tutorial's way (fixtures/README.md, fixtures/user_traces/manifest.json).
Each trace must give the findings its recorded mistake calls for, and the healthy ones none of
layer 1, with no vlmdoctor markers, shapes or memory events to lean on.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.trace.facts import analyze

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "user_traces"

#: trace -> (rule ids that must fire, rule ids that must not)
EXPECTED = {
    "llava_fp32_autocast_ckpt_s2": (
        {"precision-autocast-casts", "system-checkpoint-recompute"},
        {"fusion-fusedce-stage2"},
    ),
    "llava_fp32_s1": ({"precision-fp32-gemms"}, {"system-checkpoint-recompute"}),
    "llava_fce_s2": ({"fusion-fusedce-stage2"}, {"precision-fp32-gemms", "precision-autocast-casts"}),
    "llava_ckpt_spare_s2": (
        {"system-checkpoint-recompute"},
        {"precision-fp32-gemms", "precision-autocast-casts"},
    ),
    "llava_healthy_s2": (
        set(),
        {"fusion-fusedce-stage2", "system-checkpoint-recompute", "fusion-eager-attention"},
    ),
    "qwen2vl_fp32_autocast_s2": ({"precision-autocast-casts", "system-checkpoint-recompute"}, set()),
    "qwen2vl_fce_s2": ({"fusion-fusedce-stage2"}, {"precision-fp32-gemms", "precision-autocast-casts"}),
    "smolvlm_healthy_s1_loader": (
        set(),
        {"fusion-fusedce-stage2", "system-checkpoint-recompute", "system-data-loader"},
    ),
    # a DataLoader without workers: 20.9 ms a step of batch building against 139.7 ms of GPU work
    "llava_loader_main_s2": ({"system-data-loader"}, {"fusion-fusedce-stage2", "precision-fp32-gemms"}),
}
HEALTHY = {"llava_healthy_s2", "smolvlm_healthy_s1_loader"}


@pytest.fixture(scope="module")
def diagnosed() -> dict[str, tuple[dict, dict]]:
    rules, problems = load_rules()
    out = {}
    for name in EXPECTED:
        facts = analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
        out[name] = (facts, diagnose(facts, rules, problems))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_recorded_mistake_is_found(diagnosed, name):
    facts, diagnosis = diagnosed[name]
    fired = {f["id"] for f in diagnosis["findings"]} | {s["id"] for s in diagnosis["superseded"]}
    must, must_not = EXPECTED[name]
    assert must <= fired, f"{name}: missing {must - fired}; fired {sorted(fired)}"
    assert not (must_not & fired), f"{name}: should not fire {must_not & fired}"
    if name in HEALTHY:
        assert not [f for f in diagnosis["findings"] if f["layer"] == 1], diagnosis["findings"]


def test_the_stage_is_estimated_from_weight_gradients_and_says_so(diagnosed):
    for name in EXPECTED:
        facts, _ = diagnosed[name]
        assert facts["run.stage"] == (1 if "_s1" in name else 2), name
        assert facts["run.stage_source"].startswith("estimated"), facts["run.stage_source"]


def test_windows_come_from_profiler_steps_or_the_whole_trace(diagnosed):
    assert diagnosed["qwen2vl_fp32_autocast_s2"][0]["trace.windows_from"] == "whole trace"  # a bare `with profile()`
    assert diagnosed["llava_fce_s2"][0]["trace.windows_from"] == "ProfilerStep"


def test_recompute_without_memory_events_is_a_finding_with_the_caveat(diagnosed):
    facts, diagnosis = diagnosed["llava_fp32_autocast_ckpt_s2"]
    assert not facts["trace.recorded.memory"]
    (f,) = [f for f in diagnosis["findings"] if f["id"] == "system-checkpoint-recompute"]
    assert any("profile_memory=True" in e for e in f["evidence"]), f["evidence"]


def test_memory_events_when_recorded_show_the_memory_to_spare(diagnosed):
    facts, _ = diagnosed["llava_ckpt_spare_s2"]
    assert facts["trace.recorded.memory"]
    assert facts["memory.peak_allocated_gb"] < 0.5 * 79  # 11.6 GiB allocated at the script's peak


def test_the_fused_ce_finding_reads_the_liger_kernels(diagnosed):
    for name in ("llava_fce_s2", "qwen2vl_fce_s2"):
        facts = diagnosed[name][0]
        assert facts["ops.fused_linear_cross_entropy"] and facts["liger.cross_entropy.launches"] > 0, name
    assert not diagnosed["llava_healthy_s2"][0].get("ops.fused_linear_cross_entropy")
    assert not diagnosed["llava_healthy_s2"][0].get("liger.cross_entropy.launches")


def test_parts_come_from_the_module_hierarchy_of_a_stack_trace(diagnosed):
    facts, _ = diagnosed["smolvlm_healthy_s1_loader"]
    assert facts["part.source"] == "module hierarchy"
    assert facts["part.vision.ms"] > 0 and facts["part.llm.ms"] > facts["part.vision.ms"]
    named = sum(v for k, v in facts.items() if k.startswith("part.") and k.endswith(".ms") and k != "part.other.ms")
    assert named > 0.8 * (named + facts.get("part.other.ms", 0.0))
    hints = {n["id"]: n.get("hint") for n in diagnosed["llava_fce_s2"][1]["not_evaluated"]}
    assert any(h and "with_stack=True" in h for h in hints.values()), hints


def test_analyze_says_the_fix_as_loop_lines_and_no_rule_file_is_broken(tmp_path):
    import json

    from typer.testing import CliRunner

    from vlmdoctor.cli import app

    out = tmp_path / "a.json"
    r = CliRunner().invoke(
        app,
        ["analyze", str(TRACES / "llava_fp32_autocast_ckpt_s2.pt.trace.json.gz"), "--json", str(out)],
        env={"COLUMNS": "80"},
    )
    assert r.exit_code == 0, r.output
    assert "in your loop:" in r.output and "model.to(torch.bfloat16)" in r.output
    assert "vlmdoctor profile --model" not in r.output  # not vlmdoctor's run: no command of vlmdoctor's own
    entry = json.loads(out.read_text())["files"][0]
    assert entry["diagnosis"]["problems"] == []
    assert all(f["advice"]["audience"] == "loop" for f in entry["diagnosis"]["findings"])


def test_autocast_casts_are_found_on_a_small_model_by_casts_per_gemm():
    """A tiny LLaVA casts only ~290 times per step under autocast: below any fixed count, but 2.5 per GEMM."""
    rules, _ = load_rules()
    small = TRACES.parent / "user_h100"
    fired = {}
    for name in ("llava_s2_ckpt_autocast", "llava_s2_plain", "llava_s1_plain"):
        facts = analyze(small / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
        assert facts["kernels.cast.count"] < 1000
        fired[name] = {f["id"] for f in diagnose(facts, rules)["findings"]}
    assert "precision-autocast-casts" in fired["llava_s2_ckpt_autocast"]
    assert "precision-autocast-casts" not in fired["llava_s2_plain"] | fired["llava_s1_plain"]
