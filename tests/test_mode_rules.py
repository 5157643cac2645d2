"""The doctor on the training modes: facts of trace/modes.py and the mode rules, on traces recorded here.

Every trace is recorded by torch.profiler in the test from real tiny-preset steps on the CPU
(the runner's traced window), so the facts are measured, never written by hand. QLoRA's
dequantization kernels exist only on a GPU with bitsandbytes; its fact code is checked on a real
QLoRA step on the CPU (bitsandbytes 0.50 has CPU kernels; the trace is a committed fixture with
the script that recorded it), and the GPU input is recorded by bench/modes15/record.sh on the H100.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.run import runner
from vlmdoctor.run.capture import TraceOptions
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace.facts import analyze

LAYERS = 2  # tiny preset: LLM layers


def _record(tmp: Path, **kw) -> dict:
    base = dict(
        model="tiny",
        device="cpu",
        steps=1,
        warmup=0,
        num_samples=2,
        batch_size=1,
        gradient_checkpointing=False,
    )
    base.update(kw)
    report = runner.run_profile(RunConfig(**base), trace=TraceOptions(str(tmp), steps=1))
    assert report["status"] == "ok", report.get("error")
    facts = analyze(report["trace"]["path"])["files"][0]["facts"]
    rules, problems = load_rules()
    assert not problems
    return {
        "facts": facts,
        "fired": {f["id"]: f for f in diagnose(facts, rules)["findings"]},
        "report": report,
    }


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("mode-traces")
    return {  # four recordings cover every rule both ways
        "lora": _record(
            tmp / "lora",
            train="lora",
            lora_rank=4,
            objective="dpo",
            dpo_reference_no_grad=True,
            dpo_precompute_reference=True,
        ),
        "lora_ckpt_dpo": _record(
            tmp / "lora_dpo", train="lora", lora_rank=4, objective="dpo", gradient_checkpointing=True
        ),
        "dpo": _record(tmp / "dpo", objective="dpo"),
        "dpo_fixed": _record(
            tmp / "dpo_fixed", objective="dpo", dpo_reference_no_grad=True, dpo_reference_dtype="bf16"
        ),
    }


def test_lora_gemms_counted_from_shapes(traces):
    """6 rank-r GEMMs per adapted layer per step (A and B forward; their input and weight grads)."""
    f = traces["lora"]["facts"]
    assert f["lora.rank"] == 4
    assert f["lora.lowrank_gemm_count"] == 6 * 7 * LAYERS
    assert 0 < f["lora.lowrank_flop_share"] < 1 and 0 < f["lora.lowrank_gemm_share"] < 1
    assert f["lora.lowrank_gemm_ms"] > 0


def test_lora_with_checkpointing_recomputes_the_adapters_too(traces):
    """DPO doubles the rows, not the GEMM count; checkpointing re-runs the two forward GEMMs per layer."""
    f = traces["lora_ckpt_dpo"]["facts"]
    assert f["lora.rank"] == 4 and f["lora.lowrank_gemm_count"] == 8 * 7 * LAYERS


def test_no_adapters_no_lora_finding(traces):
    f = traces["dpo_fixed"]["facts"]  # full training: the only skinny GEMMs are the tiny LM head's
    assert f.get("lora.lowrank_gemm_count", 0) < 50
    assert "fusion-lora-tiny-gemms" not in traces["dpo_fixed"]["fired"]


def test_lora_rule_follows_the_measured_shares(traces):
    f = traces["lora"]["facts"]
    over = f["lora.lowrank_gemm_share"] > 0.1 and f["lora.lowrank_gemm_share"] > 3 * f["lora.lowrank_flop_share"]
    assert ("fusion-lora-tiny-gemms" in traces["lora"]["fired"]) == over
    compiled = dict(f, **{"config.compile": "default"})
    rules, _ = load_rules()
    assert "fusion-lora-tiny-gemms" not in {x["id"] for x in diagnose(compiled, rules)["findings"]}


def test_reference_with_grad_tracking_gets_a_backward(traces):
    f = traces["dpo"]["facts"]
    assert f["dpo.reference_count"] == 1 and f["dpo.reference_ms"] > 0
    assert f["dpo.reference_backward_nodes"] > 10 and f["dpo.reference_backward_ms"] > 0
    finding = traces["dpo"]["fired"]["precision-dpo-reference-grad"]
    assert finding["config_patch"] == {"dpo_reference_no_grad": True}


def test_shared_lora_reference_with_hooked_embeddings_gets_a_backward_too(traces):
    """peft + checkpointing hook the input embeddings to require grad: the shared base then builds a graph."""
    assert traces["lora_ckpt_dpo"]["facts"]["dpo.reference_backward_nodes"] > 0


def test_fp32_reference_casts_its_weights_every_step(traces):
    """Every linear weight of an fp32 reference is cast under autocast (the tiny LLM: 14 projections,
    the tower's and projector's too); a bf16 reference casts none. The tiny weights are too small for
    the time share to matter on CPU, so the rule is checked on the measured facts with that share at
    what the H100 traces will show (bench/modes15/record.sh), and on the real ones as measured."""
    bad, good = traces["dpo"]["facts"], traces["dpo_fixed"]["facts"]
    assert bad["dpo.reference_weight_casts"] >= 14 and good["dpo.reference_weight_casts"] == 0
    assert bad["dpo.reference_cast_ms"] > 0 == good["dpo.reference_cast_ms"]
    rules, _ = load_rules()
    ids = lambda f: {x["id"]: x for x in diagnose(f, rules)["findings"]}
    assert ("precision-dpo-reference-fp32" in traces["dpo"]["fired"]) == (bad["dpo.reference_cast_share"] > 0.05)
    heavy = ids({**bad, "dpo.reference_cast_share": 0.2})
    assert heavy["precision-dpo-reference-fp32"]["config_patch"] == {"dpo_reference_dtype": "bf16"}
    assert "precision-dpo-reference-fp32" not in traces["dpo_fixed"]["fired"]
    lora = traces["lora_ckpt_dpo"]["facts"]  # LoRA: no copy to cast; the rule is hidden
    assert "precision-dpo-reference-fp32" not in ids({**lora, "dpo.reference_cast_share": 0.2})


def test_no_grad_reference_gets_no_backward(traces):
    f = traces["dpo_fixed"]["facts"]
    assert f["dpo.reference_count"] == 1 and f["dpo.reference_backward_nodes"] == 0
    assert "precision-dpo-reference-grad" not in traces["dpo_fixed"]["fired"]


def test_precomputed_reference_leaves_the_step(traces):
    f = traces["lora"]["facts"]
    assert f["dpo.reference_count"] == 0 and f["dpo.reference_ms"] == 0 and f["dpo.reference_backward_nodes"] == 0
    assert not {k for k in traces["lora"]["fired"] if "dpo" in k}
    assert traces["lora"]["report"]["mode"]["precompute"]["pairs"] == 2
    for name in ("dpo", "dpo_fixed"):
        share = traces[name]["facts"]["dpo.reference_share"]
        assert share > 0 and ("system-dpo-reference-every-step" in traces[name]["fired"]) == (share > 0.15)


def test_treat_applies_every_mode_patch(traces):
    from vlmdoctor.doctor.treat_compose import _change, apply

    cfg = RunConfig(**traces["dpo"]["report"]["config"])
    found = [f for name in ("dpo", "lora") for f in traces[name]["fired"].values()]
    changes = [c for c in (_change(f, cfg) for f in found) if c]
    treated = apply(
        cfg,
        changes
        + [
            _change(
                {
                    "id": "precision-dpo-reference-fp32",
                    "layer": 1,
                    "title": "",
                    "config_patch": {"dpo_reference_dtype": "bf16"},
                },
                cfg,
            )
        ],
    )
    assert treated.dpo_reference_no_grad and treated.dpo_reference_dtype == "bf16"
    assert treated.dpo_precompute_reference == ("system-dpo-reference-every-step" in traces["dpo"]["fired"])


# --- QLoRA: a real QLoRA step on the CPU (bitsandbytes 0.50 has CPU 4-bit kernels) -----------------
QLORA_CPU = Path(__file__).resolve().parents[1] / "fixtures" / "mode_traces" / "qlora_tiny_cpu.pt.trace.json.gz"


def test_qlora_dequantization_measured_on_a_recorded_qlora_step():
    """fixtures/mode_traces/qlora_tiny_cpu: tiny preset, NF4 base + LoRA r=4, recorded by
    bench/modes15/record_qlora_cpu.py (bitsandbytes::dequantize_4bit / dequantize_blockwise ops)."""
    f = analyze(QLORA_CPU)["files"][0]["facts"]
    assert f["config.train"] == "qlora"
    # 14 NF4 layers, each dequantizing its weight (dequantize_4bit) and its double-quantized
    # statistics (dequantize_blockwise) once in the forward and once for the backward's input grad
    assert f["qlora.dequant_count"] == 56 and 0.05 < f["qlora.dequant_share"] < 1
    assert f["lora.rank"] == 4 and f["lora.lowrank_gemm_count"] == 6 * 7 * LAYERS
    rules, _ = load_rules()
    fired = {x["id"]: x for x in diagnose(f, rules)["findings"]}
    assert fired["precision-qlora-dequant"]["config_patch"] == {"train": "lora", "weight_dtype": "bf16"}


def test_no_dequantization_without_a_4bit_base(traces):
    for name in ("lora", "dpo"):
        assert traces[name]["facts"]["qlora.dequant_count"] == 0
        assert "precision-qlora-dequant" not in traces[name]["fired"]


def test_qlora_rule_held_back_without_memory_headroom():
    rules, _ = load_rules()
    facts = {
        "qlora.dequant_share": 0.2,
        "qlora.dequant_ms": 10.0,
        "qlora.dequant_count": 400.0,
        "memory.headroom_gb": 2.0,
        "qlora.bf16_extra_gb": 5.0,
        "trace.gpu_kernels": True,
    }
    ids = lambda fs: {x["id"] for x in diagnose(fs, rules)["findings"]}
    assert "precision-qlora-dequant" not in ids(facts)
    assert "precision-qlora-dequant" in ids({**facts, "memory.headroom_gb": 40.0})


# --- H100 recordings (fixtures/mode_traces/h100_*: 0.5b stage 2, bf16 weights, recorded by -------------
# bench/modes15/record.sh on one H100 80GB; the user trace by bench/modes15/train_modes.py)
MODE_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "mode_traces"


@cache
def _h100(name: str) -> tuple[dict, dict]:
    facts = analyze(MODE_DIR / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
    rules, _ = load_rules()
    d = diagnose(facts, rules)
    return facts, {
        "fired": {x["id"] for x in d["findings"]},
        "superseded": {x["id"] for x in d["superseded"]},
        "not_applicable": {x["id"]: x["why"] for x in d["not_applicable"]},
    }


def test_h100_qlora_dequantization_and_adapters():
    """NF4 base + LoRA r=16 on the 0.5b LLM (24 layers x 7 projections = 168 adapted NF4 layers),
    checkpointing on: each layer dequantizes (weight + double-quantized statistics) in the forward,
    the recompute and the backward; each runs 8 rank-16 GEMMs with the recompute."""
    f, d = _h100("h100_qlora_r16_s2")
    assert f["qlora.dequant_count"] == 168 * 6
    assert 0.03 < f["qlora.dequant_share"] < 0.2
    assert f["lora.rank"] == 16 and f["lora.lowrank_gemm_count"] == 168 * 8
    # the adapters take far more of the GEMM time than of the GEMM FLOPs: launch-bound
    assert f["lora.lowrank_gemm_share"] > 10 * f["lora.lowrank_flop_share"]
    assert "precision-qlora-dequant" in d["fired"]
    # the tiny-GEMM rule holds on this trace, but the host-bound step (layer 2) covers it
    assert "fusion-lora-tiny-gemms" in d["superseded"]
    assert not [k for k in f if k.startswith("dpo.") and f[k]]


def test_h100_dpo_reference_as_a_first_script_writes_it_then_fixed():
    """A deep-copied fp32 reference with grad tracking, then the fixed one (no_grad, bf16 copy)."""
    bad, d_bad = _h100("h100_dpo_full_s2")
    ok, d_ok = _h100("h100_dpo_fixed_s2")
    assert bad["dpo.reference_count"] == ok["dpo.reference_count"] == 1
    assert bad["dpo.reference_backward_nodes"] > 1000 and bad["dpo.reference_backward_share"] > 0.1
    assert ok["dpo.reference_backward_nodes"] == 0
    # the fp32 copy under autocast casts its weight matrices in every forward; the bf16 one does not
    assert bad["dpo.reference_weight_casts"] > 100 and ok["dpo.reference_weight_casts"] == 0
    assert {"precision-dpo-reference-grad", "precision-dpo-reference-fp32"} <= d_bad["fired"]
    assert not {"precision-dpo-reference-grad", "precision-dpo-reference-fp32"} & d_ok["fired"]
    # the reference still runs every step in both: precomputing it is the next fix
    assert "system-dpo-reference-every-step" in d_bad["fired"] & d_ok["fired"]


def test_h100_user_dpo_reference_found_by_the_users_range_name():
    """train_modes.py names the reference forward as TRL's method does (compute_ref_log_probs)."""
    f, d = _h100("h100_user_dpo")
    assert f["trace.written_by_vlmdoctor"] is False
    assert f["dpo.reference_count"] == 1 and f["dpo.reference_backward_share"] > 0.1
    assert "precision-dpo-reference-grad" in d["fired"]


def test_user_trace_without_a_reference_range_leaves_dpo_rules_not_applicable():
    """A user's trace with no range named after the reference: no dpo.* fact at all (not 'none measured')."""
    trace = Path(__file__).resolve().parents[1] / "fixtures" / "user_traces" / "llava_healthy_s2.pt.trace.json.gz"
    facts = analyze(trace)["files"][0]["facts"]
    assert not [k for k in facts if k.startswith("dpo.")]
    rules, _ = load_rules()
    na = {x["id"]: x["why"] for x in diagnose(facts, rules)["not_applicable"]}
    assert "record_function('ref_forward')" in na["precision-dpo-reference-grad"]


@pytest.mark.parametrize(
    "name,hit",
    [
        ("compute_ref_log_probs", True),
        ("ref_forward", True),
        ("reference", True),
        ("dpo/ref_model", True),
        ("Reference model forward", True),
        ("ref", True),
        ("prefetch", False),
        ("refine_masks", False),
        ("preference_loss", False),
        ("aten::ref_thing", False),
        ("ProfilerStep#3", False),
    ],
)
def test_reference_range_names(name, hit):
    import numpy as np

    from vlmdoctor.trace.modes import _reference_ranges

    assert bool(_reference_ranges(np.array([name, "aten::mm"])).any()) is hit
