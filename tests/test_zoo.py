"""Model zoo: presets built from shipped configs match the public checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from vlmdoctor.errors import UsageError
from vlmdoctor.run.model import build_model, param_counts
from vlmdoctor.run.zoo import llm_specs, presets, resolve, vision_specs

# public parameter counts of the released checkpoints (model cards / safetensors metadata)
PUBLIC_LLM_PARAMS = {
    "0.5b": 494_032_768,  # Qwen2.5-0.5B-Instruct (494.0M)
    "1.5b": 1_543_714_304,  # Qwen2.5-1.5B-Instruct
    "llava-1.5-7b": 6_738_415_616,  # Vicuna-7B v1.5 (Llama-2-7B)
}


@pytest.fixture(scope="module")
def meta_models():
    return {name: build_model(resolve(name), device="meta") for name in PUBLIC_LLM_PARAMS}


@pytest.mark.parametrize("name", list(PUBLIC_LLM_PARAMS))
def test_llm_param_count_matches_public_checkpoint(meta_models, name):
    assert param_counts(meta_models[name])["llm"] == PUBLIC_LLM_PARAMS[name]


@pytest.mark.parametrize("name", list(PUBLIC_LLM_PARAMS))
def test_meta_build_allocates_nothing(meta_models, name):
    assert all(p.device.type == "meta" for p in meta_models[name].parameters())


def test_param_counts_add_up(meta_models):
    for name, m in meta_models.items():
        c = param_counts(m)
        assert c["total"] == c["vision"] + c["projector"] + c["llm"], name
        assert c["trainable"] == c["total"]  # before apply_stage everything requires grad


@pytest.mark.parametrize("name, tokens", [("0.5b", 49), ("1.5b", 81), ("llava-1.5-7b", 576)])
def test_image_tokens(name, tokens):
    assert resolve(name).image_tokens == tokens


@pytest.mark.parametrize("name, head_dim", [("0.5b", 64), ("1.5b", 72), ("llava-1.5-7b", 64)])
def test_vision_head_dim(name, head_dim):
    assert resolve(name).vision_head_dim == head_dim


def test_built_vision_tower_really_has_that_head_dim(meta_models):
    attn = next(m for m in meta_models["1.5b"].vision.modules() if type(m).__name__.endswith("Attention"))
    assert attn.head_dim == 72


def test_projector_output_count_matches_image_tokens():
    spec = resolve("tiny")
    m = build_model(spec, device="meta")
    feats = torch.empty(2, spec.patch_grid**2, spec.vision["config"]["hidden_size"], device="meta")
    out = m.projector(feats)
    assert tuple(out.shape) == (2, spec.image_tokens, spec.llm["config"]["hidden_size"])


def test_compose_other_tower_and_llm():
    spec = resolve(
        "0.5b",
        vision="clip-vit-l-14-336",
        llm="smollm2-360m-instruct",
        projector="mlp2x_gelu",
        pixel_shuffle=2,
    )
    assert spec.image_tokens == 144  # 336/14 = 24 -> 12x12 after a x2 shuffle
    m = build_model(spec, device="meta")
    linears = [mod for mod in m.projector.modules() if isinstance(mod, nn.Linear)]
    assert len(linears) == 2
    assert linears[0].in_features == 1024 * 4  # CLIP-L hidden x shuffle^2
    assert linears[0].out_features == linears[1].in_features == linears[1].out_features == 960  # SmolLM2-360M
    assert type(m.vision).__name__ == "CLIPVisionModel"
    assert type(m.llm).__name__ == "LlamaForCausalLM"
    # the public SmolLM2-360M has 361.8M parameters
    assert param_counts(m)["llm"] == pytest.approx(361.8e6, rel=2e-3)


def test_preset_overrides_fall_back_to_preset():
    spec = resolve("0.5b", llm="smollm2-135m-instruct")
    assert spec.vision["name"] == presets()["0.5b"]["vision"]
    assert spec.llm["name"] == "smollm2-135m-instruct"
    assert spec.pixel_shuffle == presets()["0.5b"]["pixel_shuffle"]


@pytest.mark.parametrize(
    "kwargs, listed",
    [
        ({"model": "nope"}, lambda: presets()),
        ({"model": "0.5b", "vision": "vit-huge"}, lambda: vision_specs()),
        ({"model": "0.5b", "llm": "llama-99b"}, lambda: llm_specs()),
    ],
)
def test_unknown_names_list_valid_ones(kwargs, listed):
    with pytest.raises(UsageError) as ei:
        resolve(**kwargs)
    msg = str(ei.value)
    bad = [v for v in kwargs.values() if v != "0.5b"][0]
    assert bad in msg
    for name in listed():
        assert name in msg


def test_pixel_shuffle_must_divide_grid():
    # 0.5b: 224/16 = 14x14 patch grid; 3 does not divide 14
    with pytest.raises(UsageError) as ei:
        resolve("0.5b", pixel_shuffle=3)
    assert "14" in str(ei.value)
    assert resolve("0.5b", pixel_shuffle=7).image_tokens == 4


def test_models_cli_json_lists_presets_with_params(cli_runner):
    from vlmdoctor.cli import app

    result = cli_runner.invoke(app, ["models", "--json", "-"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    by_name = {r["name"]: r for r in rows if r["kind"] == "preset"}
    assert {"0.5b", "1.5b", "tiny"} <= set(by_name)
    for name in ("0.5b", "1.5b", "tiny"):
        assert isinstance(by_name[name]["params"], int) and by_name[name]["params"] > 0
    assert by_name["0.5b"]["counts"]["llm"] == PUBLIC_LLM_PARAMS["0.5b"]
    assert by_name["1.5b"]["counts"]["llm"] == PUBLIC_LLM_PARAMS["1.5b"]
    assert by_name["0.5b"]["image_tokens"] == 49
    assert by_name["tiny"]["params"] < by_name["0.5b"]["params"] < by_name["1.5b"]["params"]
    llms = {r["name"]: r for r in rows if r["kind"] == "llm"}
    assert llms["qwen2.5-0.5b-instruct"]["params"] == PUBLIC_LLM_PARAMS["0.5b"]
