"""Unsloth as a layer-4 alternative: refused where it cannot run, never stacked with Liger or torch.compile.

Unsloth itself needs a CUDA GPU, so what runs here is everything around it: validation,
preflight, the CLI's one-line errors, and that no rule or treatment composes it with Liger.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vlmdoctor.cli import app
from vlmdoctor.doctor.rule_expr import evaluate, parsed
from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.doctor.treat import compose
from vlmdoctor.errors import UsageError
from vlmdoctor.run import checks
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.zoo import resolve

LIGER_KNOBS = [f.name for f in dataclasses.fields(RunConfig) if f.name.startswith("liger_")]
GPU = torch.device("cuda")  # preflight only reads the type: nothing is put on it


@pytest.mark.parametrize("knob", LIGER_KNOBS)
@pytest.mark.parametrize("source", ["command line", "run.yaml"])
def test_unsloth_with_any_liger_knob_is_a_usage_error_naming_both(knob, source):
    with pytest.raises(UsageError) as e:
        RunConfig(model="0.5b").replace(source=source, unsloth=True, **{knob: True})
    flag = {"liger_fused_linear_cross_entropy": "--liger-fused-ce"}.get(knob, "--" + knob.replace("_", "-"))
    wanted = ("--unsloth", flag) if source == "command line" else ("unsloth", knob)
    assert all(w in e.value.message for w in wanted) and "do not stack" in e.value.message
    RunConfig(model="0.5b").replace(**{knob: True})  # each alone is fine
    RunConfig(model="0.5b").replace(unsloth=True)


@pytest.mark.parametrize(
    "change",
    [
        {"compile": "default"},
        {"compile": "reduce-overhead"},
        {"compile": "max-autotune"},
        {"compile_vision": "fullgraph"},
    ],
)
def test_unsloth_with_torch_compile_is_refused(change):
    with pytest.raises(UsageError, match="Unsloth compiles its own parts"):
        RunConfig().replace(unsloth=True, **change)


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{"model": "dino-135m", "unsloth": True, "weight_dtype": "bf16", **kw})


def test_unsloth_needs_a_gpu():
    with pytest.raises(UsageError, match="needs a CUDA GPU"):
        checks.preflight(_cfg(device="cpu"), resolve("dino-135m"), torch.device("cpu"))


def test_unsloth_not_importable_is_one_clear_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("unsloth", "bitsandbytes") else real(name, *a),
    )
    with pytest.raises(UsageError) as e:
        checks.preflight(_cfg(), resolve("dino-135m"), GPU)
    missing = e.value.message.split("but ")[1].split(" cannot be imported")[0].split(", ")
    assert {"unsloth", "bitsandbytes"} <= set(missing) and "peft" not in missing  # peft is installed here
    assert "pip install unsloth" in e.value.message


@pytest.mark.parametrize("model", ["0.5b", "dino-135m", "tiny", "tiny-dino"])
def test_supported_llm_classes_pass_preflight_when_unsloth_is_there(monkeypatch, model):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    checks.preflight(_cfg(model=model), resolve(model), GPU)


def test_other_llm_families_and_native_presets_are_refused():
    spec = resolve("0.5b")
    other = dataclasses.replace(spec, llm={**spec.llm, "family": "mistral"})
    with pytest.raises(UsageError, match="not mistral"):
        checks.preflight(_cfg(model="0.5b"), other, GPU)
    with pytest.raises(UsageError, match="native preset"):
        checks.check_unsloth(_cfg(model="tiny-llava"), checks.resolve_model(_cfg(model="tiny-llava")), GPU)


def test_unsloth_needs_16_bit_weights(monkeypatch):
    with pytest.raises(UsageError, match="--weight-dtype bf16"):
        checks.preflight(_cfg(weight_dtype="fp32"), resolve("dino-135m"), GPU)


@pytest.mark.parametrize(
    "args",
    [
        ["--unsloth"],
        ["--unsloth", "--liger"],
        ["--unsloth", "--compile", "default"],
        ["--unsloth", "--liger-fused-ce"],
    ],
)
def test_cli_refuses_in_one_line_with_exit_2(cli_runner, args):
    result = cli_runner.invoke(app, ["profile", "--model", "tiny-dino", "--device", "cpu", *args])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) <= 3 and "Traceback" not in result.output  # one message (wrapped at 80 columns)
    assert "nsloth" in result.output


# --- the doctor never composes Unsloth with Liger or torch.compile -------------------------------------


def _fusion_rules():
    """Shipped rules whose patch turns on another fusion system (a Liger kernel or torch.compile)."""
    rules, problems = load_rules()
    assert not problems
    return [
        r
        for r in rules
        if any(k.startswith("liger_") and v is True for k, v in r.patch.items())
        or r.patch.get("compile") not in (None, "off")
    ]


def test_some_rules_prescribe_liger_or_compile():
    ids = {r.id for r in _fusion_rules()}
    assert {"fusion-unfused-norm-activation", "fusion-fusedce-stage1", "fusion-compile-launch-bound"} <= ids


@pytest.mark.parametrize("rule", _fusion_rules(), ids=lambda r: r.id)
def test_every_rule_prescribing_liger_or_compile_stands_down_for_unsloth(rule):
    base = {f"config.{k}": v for k, v in RunConfig().to_dict().items()}
    assert rule.unless and "config.unsloth" in rule.unless
    assert evaluate(parsed(rule.unless), {**base, "config.unsloth": True})
    assert not evaluate(parsed(rule.unless), {**base, "config.unsloth": False})


def _unfused_facts(**extra):
    return {
        "run.stage": 1,
        "liger.rms_norm.launches": 0.0,
        "liger.swiglu.launches": 0.0,
        "triton_compiled.launches": 0.0,
        "kernels.elementwise.share": 0.3,
        "kernels.elementwise.ms": 30.0,
        "kernels.elementwise.count": 900.0,
        "step.ms": 100.0,
        "ops.fused_linear_cross_entropy": False,
        "loss.logits_gb": 3.0,
        "loss.logits_elements": 10**9,
        "loss.logits_dtype": "float32",
        **extra,
    }


def test_a_measured_unsloth_run_gets_no_liger_prescription():
    rules = [r for r in load_rules()[0] if r.id in ("fusion-unfused-norm-activation", "fusion-fusedce-stage1")]
    assert {f["id"] for f in diagnose(_unfused_facts(), rules)["findings"]} == {r.id for r in rules}
    assert diagnose(_unfused_facts(**{"config.unsloth": True}), rules)["findings"] == []


def test_treat_never_composes_unsloth_with_liger():
    """A diagnosis without the run's config (a user's trace) still prescribes Liger: the composition skips it."""
    rules = [r for r in load_rules()[0] if r.id in ("fusion-unfused-norm-activation", "fusion-fusedce-stage1")]
    report = diagnose(_unfused_facts(), rules)
    assert report["findings"]
    cfg = RunConfig(model="0.5b", unsloth=True, weight_dtype="bf16", stage=1)
    skipped: list = []
    compositions = compose(cfg, report, skipped)
    assert all(not c["config"].uses_liger for c in compositions)
    assert {s["rule"] for s in skipped} == {f["id"] for f in report["findings"]}
    assert all("do not stack" in s["why"] for s in skipped)
