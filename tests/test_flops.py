"""FLOP model of a training step, checked against the built model, and the device peak table."""

from __future__ import annotations

import pytest
from torch import nn

from vlmdoctor.run.flops import FlopModel, describe, peak_flops
from vlmdoctor.run.model import build_model
from vlmdoctor.run.zoo import resolve


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@pytest.fixture(scope="module", params=["0.5b", "1.5b", "llava-1.5-7b", "dino-135m", "dino-1.7b", "tiny-dino"])
def spec_and_model(request):
    spec = resolve(request.param)
    return spec, build_model(spec, device="meta")


def test_llm_linear_params_match_built_model(spec_and_model):
    spec, model = spec_and_model
    fm = FlopModel.from_spec(spec)
    decoder = model.llm.model.layers
    vocab, hidden = spec.llm["config"]["vocab_size"], spec.llm["config"]["hidden_size"]
    expected = _linear_weights(decoder) + vocab * hidden  # + the LM head (tied or not)
    assert fm.llm_linear_params == expected
    # the LM head really is a vocab x hidden linear in the built model
    assert model.llm.lm_head.weight.shape == (vocab, hidden)
    # and it is what every nn.Linear of the LLM adds up to
    assert fm.llm_linear_params == _linear_weights(model.llm)


def test_vision_and_projector_linear_params_match_built_model(spec_and_model):
    spec, model = spec_and_model
    fm = FlopModel.from_spec(spec)
    conv = [m for m in model.vision.modules() if isinstance(m, nn.Conv2d)]
    assert len(conv) == 1  # the patch embedding, counted as a linear map
    encoder_layers = [
        m
        for name, m in model.vision.named_modules()
        if name.endswith("encoder.layers") or name.endswith("encoder.layer")
    ]
    assert len(encoder_layers) == 1
    assert fm.vision_linear_params == _linear_weights(encoder_layers[0]) + conv[0].weight.numel()
    assert fm.projector_params == _linear_weights(model.projector)


def test_vision_patches_count_cls_for_clip_only():
    assert FlopModel.from_spec(resolve("0.5b")).vision_patches == 14 * 14  # SigLIP: no CLS token
    assert FlopModel.from_spec(resolve("llava-1.5-7b")).vision_patches == 24 * 24 + 1  # CLIP: CLS + 576


def test_llm_forward_terms():
    fm = FlopModel.from_spec(resolve("0.5b"))
    lin, att = fm.llm_forward([100, 300])
    assert lin == 2 * fm.llm_linear_params * 400
    # causal attention: QK^T and AV over L(L+1)/2 query-key pairs, 2 FLOPs per MAC, per layer
    d = 14 * 64  # 0.5b: 14 heads x 64
    assert fm.llm_attn_dim == d
    assert att == pytest.approx(2 * 2 * 24 * d * (100 * 101 / 2 + 300 * 301 / 2))


def test_stage2_costs_more_than_stage1():
    fm = FlopModel.from_spec(resolve("0.5b"))
    lengths = [340, 300, 410, 280]
    s1, s2 = fm.step(lengths, stage=1), fm.step(lengths, stage=2)
    assert s2["total"] > s1["total"] > 0
    assert s2["llm"] > s1["llm"] > 0
    assert s1["vision"] == s2["vision"] > 0  # the frozen tower does the same forward in both stages
    assert s1["projector"] == s2["projector"] > 0
    for s in (s1, s2):
        assert s["total"] == pytest.approx(s["llm"] + s["vision"] + s["projector"])


def test_stage_formula_terms():
    fm = FlopModel.from_spec(resolve("0.5b"))
    lengths = [340, 200]
    lin, att = fm.llm_forward(lengths)
    assert fm.step(lengths, stage=2)["llm"] == pytest.approx(3 * (lin + att))  # fwd + act grads + weight grads
    assert fm.step(lengths, stage=1)["llm"] == pytest.approx(2 * lin + 3 * att)  # no weight grads


def test_stage2_llm_is_1_5x_stage1_when_attention_is_negligible():
    fm = FlopModel.from_spec(resolve("0.5b"))
    lengths = [1] * 8  # one-token samples: the attention term is ~1e-5 of the linear term
    lin, att = fm.llm_forward(lengths)
    assert att / lin < 1e-4
    s1, s2 = fm.step(lengths, stage=1)["llm"], fm.step(lengths, stage=2)["llm"]
    assert s1 == pytest.approx(2 * lin, rel=1e-3)
    assert s2 == pytest.approx(1.5 * s1, rel=1e-3)


def test_step_scales_with_samples():
    fm = FlopModel.from_spec(resolve("0.5b"))
    one, two = fm.step([340], stage=2), fm.step([340, 340], stage=2)
    for k in ("llm", "vision", "projector", "total"):
        assert two[k] == pytest.approx(2 * one[k])


def test_projector_flops_per_image():
    spec = resolve("0.5b")
    fm = FlopModel.from_spec(spec)
    # forward + weight grad, 2 FLOPs per MAC, per output token: 4 * weights * tokens
    assert fm.step([340], stage=1)["projector"] == 4 * (768 * 4 * 896) * 49


def test_cached_vision_features_remove_vision_flops():
    fm = FlopModel.from_spec(resolve("0.5b"))
    live, cached = fm.step([340] * 4, stage=2), fm.step([340] * 4, stage=2, vision_cached=True)
    assert cached["vision"] == 0
    assert live["vision"] > 0
    assert cached["llm"] == live["llm"] and cached["projector"] == live["projector"]
    assert cached["total"] == pytest.approx(live["total"] - live["vision"])


def test_describe_mentions_every_part():
    d = describe()
    assert {"llm_stage1", "llm_stage2", "vision", "projector"} <= set(d)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989.4e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L4", 121e12),
    ],
)
def test_peak_flops_known_gpus(name, peak):
    value, source = peak_flops(name)
    assert value == peak
    assert source


@pytest.mark.parametrize("name", ["Quadro RTX 9999", "NVIDIA GeForce GTX 1080", None, ""])
def test_peak_flops_unknown_or_no_gpu_is_none(name):
    value, source = peak_flops(name)
    assert value is None
    assert source  # the report says why MFU is missing


def test_peak_flops_l40_is_not_l4():
    value, _ = peak_flops("NVIDIA L40")
    assert value in (None, 181.05e12)
