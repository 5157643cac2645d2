"""The foveated-VLM presets (DINOv2 + SmolLM2) and the roadmap's compile knobs, on CPU.

Architectures are checked against the published checkpoints' numbers, FLOPs against
torch.utils.flop_counter on the tiny DINOv2 + Llama model, and a real training step runs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vlmdoctor.run.compile as compile_mod
from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.flops import FlopModel, flop_model
from vlmdoctor.run.model import apply_stage, build_model, param_counts
from vlmdoctor.run.parts import find_parts
from vlmdoctor.run.runner import build_patient, run_profile, train_step
from vlmdoctor.run.zoo import presets, resolve

CPU = torch.device("cpu")
DINO_PRESETS = [name for name, p in presets().items() if p["vision"].startswith("dinov2")]


def test_the_roadmap_presets_exist_with_the_published_architectures():
    assert {"dino-135m", "dino-1.7b", "tiny-dino"} <= set(DINO_PRESETS)
    small, big = resolve("dino-135m"), resolve("dino-1.7b")
    # facebook/dinov2-small: ViT-S/14, 384 wide, 12 layers, 6 heads; dinov2-base: 768, 12, 12
    assert [
        small.vision["config"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "patch_size")
    ] == [384, 12, 6, 14]
    assert [big.vision["config"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads")] == [
        768,
        12,
        12,
    ]
    # SmolLM2-135M: 576 wide, 30 layers, 9 heads / 3 KV heads; SmolLM2-1.7B: 2048, 24 layers, 32/32 heads
    c = small.llm["config"]
    assert [
        c[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    ] == [576, 1536, 30, 9, 3, 49152]
    c = big.llm["config"]
    assert [
        c[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
    ] == [2048, 8192, 24, 32, 32]


def test_parameter_counts_match_the_checkpoints():
    small = param_counts(build_model(resolve("dino-135m"), device="meta"))
    assert small["llm"] == 134_515_008  # SmolLM2-135M, tied embeddings (its model card's count)
    assert small["vision"] == pytest.approx(22.06e6, rel=0.01)  # DINOv2-S/14: 22M (the DINOv2 paper's table)
    c = resolve("dino-1.7b").llm["config"]  # SmolLM2-1.7B: 1.71B (tied head; MHA, 4 h^2 attention weights)
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    llm = c["vocab_size"] * h + layers * (4 * h * h + 3 * h * c["intermediate_size"] + 2 * h) + h
    assert llm == pytest.approx(1.711e9, rel=0.01)


@pytest.mark.parametrize("name", DINO_PRESETS)
def test_patch_tokens_go_to_the_projector_and_cls_does_not(name):
    spec = resolve(name)
    grid = spec.vision["input_size"] // spec.vision["config"]["patch_size"]
    assert spec.patch_grid == grid and spec.image_tokens == (grid // spec.pixel_shuffle) ** 2
    assert FlopModel.from_spec(spec).vision_patches == grid * grid + 1  # the tower still computes CLS


@pytest.fixture(scope="module")
def tiny_dino():
    """Eager attention: the flop counter sees its matmuls (CPU SDPA kernels are not counted)."""
    torch.manual_seed(0)
    spec = resolve("tiny-dino")
    vlm = build_model(spec, attention="eager")
    apply_stage(vlm, 2)
    return spec, vlm


def test_the_tower_output_drops_cls_and_fills_every_image_token(tiny_dino):
    spec, vlm = tiny_dino
    size = spec.vision["input_size"]
    pixels = torch.randn(3, 3, size, size)
    full = vlm.vision(pixel_values=pixels).last_hidden_state
    feats = vlm.encode_images(pixels)
    assert full.shape[1] == spec.patch_grid**2 + 1
    assert torch.equal(feats, full[:, 1:])  # CLS is token 0 of Dinov2Model's output
    assert vlm.projector(feats).shape == (3, spec.image_tokens, spec.projector_out)


def test_parts_are_found(tiny_dino):
    _, vlm = tiny_dino
    parts = find_parts(vlm)
    assert type(parts["vision"]).__name__ == "Dinov2Model"
    assert parts["projector"] is vlm.projector
    assert type(parts["llm"]).__name__ == "LlamaForCausalLM"


def _counted(fn) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


@pytest.mark.parametrize("images", [1, 3])
def test_vision_flops_match_the_flop_counter(tiny_dino, images):
    spec, vlm = tiny_dino
    size = spec.vision["input_size"]
    with torch.no_grad():
        counted = _counted(lambda: vlm.vision(pixel_values=torch.randn(images, 3, size, size)))
    assert FlopModel.from_spec(spec).vision_forward(images) == counted


@pytest.mark.parametrize("length", [24, 57])
def test_llm_and_projector_flops_match_the_flop_counter(tiny_dino, length):
    spec, vlm = tiny_dino
    fm = FlopModel.from_spec(spec)
    ids = torch.randint(10, 2000, (1, length))
    with torch.no_grad():
        counted = _counted(lambda: vlm.llm(input_ids=ids, use_cache=False))
        feats = torch.randn(1, spec.patch_grid**2, spec.vision["config"]["hidden_size"])
        counted_proj = _counted(lambda: vlm.projector(feats))
    lin, att = fm.llm_forward([length])
    c = spec.llm["config"]
    square = (
        4.0 * c["num_hidden_layers"] * fm.llm_attn_dim * length * length
    )  # eager attention computes the masked half too
    assert lin + square == counted
    assert att == pytest.approx(square * (length + 1) / (2 * length))  # the model counts the causal half only
    assert 2 * fm.projector_params * spec.image_tokens == counted_proj


def test_a_training_step_runs_and_the_llama_llm_trains():
    cfg = RunConfig(model="tiny-dino", device="cpu", steps=1, warmup=0, num_samples=16, autocast="off")
    p = build_patient(cfg, CPU)
    before = p.vlm.llm.model.layers[0].mlp.up_proj.weight.detach().clone()
    loss, counts = train_step(p)
    assert torch.isfinite(loss) and counts["samples"] == cfg.batch_size
    assert not torch.equal(before, p.vlm.llm.model.layers[0].mlp.up_proj.weight)
    assert p.flop_model == flop_model("tiny-dino")


@pytest.fixture
def llama_module_restored():
    """Liger also swaps classes in transformers' llama module: put them back for the tests after this one."""
    from transformers.models.llama import modeling_llama

    saved = dict(vars(modeling_llama))
    yield
    for k, v in saved.items():
        setattr(modeling_llama, k, v)


def test_liger_patches_the_llama_llm(tiny_dino, llama_module_restored):
    pytest.importorskip("liger_kernel.transformers")
    from vlmdoctor.run.patient import _apply_liger

    _, vlm = tiny_dino
    llm = build_model(resolve("tiny-dino")).llm
    vlm2 = type(vlm)(vlm.spec, vlm.vision, vlm.projector, llm)
    _apply_liger(vlm2, RunConfig(model="tiny-dino", liger_rms_norm=True, liger_swiglu=True))
    # Liger patches the instances' forwards (the classes keep their names)
    assert llm.model.norm.forward.__func__.__module__.startswith("liger_kernel")
    assert llm.model.layers[0].mlp.forward.__func__.__module__.startswith("liger_kernel")


# --- roadmap item 5: the encoder compiled with fullgraph=True -------------------------------------------


def test_the_dinov2_tower_traces_as_one_graph(tiny_dino):
    """What fullgraph=True needs: dynamo sees the whole tower without a graph break."""
    spec, vlm = tiny_dino
    torch._dynamo.reset()
    size = spec.vision["input_size"]
    out = torch._dynamo.explain(vlm.vision)(pixel_values=torch.randn(2, 3, size, size))
    assert out.graph_break_count == 0 and out.graph_count == 1


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def __call__(self, module, **kwargs):
        self.calls.append((type(module).__name__, kwargs))
        return module


@pytest.mark.parametrize("mode", ["off", "default", "max-autotune"])
def test_fullgraph_compiles_the_tower_alone(monkeypatch, mode):
    rec = _Recorder()
    monkeypatch.setattr(compile_mod.torch, "compile", rec)
    vlm = build_model(resolve("tiny-dino"), device="meta")
    assert compile_mod.compile_vlm(vlm, mode, "fullgraph") is vlm
    tower = rec.calls[0]
    assert tower[0] == "Dinov2Model" and tower[1]["fullgraph"] is True and tower[1]["dynamic"] is False
    assert tower[1]["mode"] == (None if mode in ("off", "default") else mode)
    names = [c[0] for c in rec.calls]
    assert names == (["Dinov2Model"] if mode == "off" else ["Dinov2Model", "LlamaModel"])


def test_model_mode_compiles_the_whole_model_once(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(compile_mod.torch, "compile", rec)
    vlm = build_model(resolve("tiny-dino"), device="meta")
    compile_mod.compile_vlm(vlm, "default", "model")
    assert [c[0] for c in rec.calls] == ["VLM"]
    rec.calls.clear()
    compile_mod.compile_vlm(vlm, "off", "model")
    assert rec.calls == []


# --- roadmap item 6: Inductor shape padding ------------------------------------------------------------


@pytest.mark.parametrize("on", [False, True])
def test_shape_padding_is_set_before_compiling(monkeypatch, on):
    import torch._inductor.config as inductor_config

    seen = []
    monkeypatch.setattr(compile_mod.torch, "compile", lambda m, **kw: seen.append(inductor_config.shape_padding) or m)
    before = inductor_config.shape_padding
    inductor_config.shape_padding = not on
    try:
        compile_mod.compile_vlm(build_model(resolve("tiny-dino"), device="meta"), "default", "model", shape_padding=on)
    finally:
        inductor_config.shape_padding = before
    assert seen == [on]


def test_compile_knobs_are_validated():
    with pytest.raises(UsageError, match="changes nothing without torch.compile"):
        RunConfig(model="tiny-dino").replace(source="command line", compile_shape_padding=False)
    RunConfig().replace(compile_shape_padding=False, compile="default")
    RunConfig().replace(compile_shape_padding=False, compile_vision="fullgraph")
    with pytest.raises(UsageError, match="choose one of: model, fullgraph"):
        RunConfig().replace(compile_vision="yes")


@pytest.mark.parametrize("model", ["tiny-llava", "tiny-qwen2-vl"])
def test_fullgraph_tower_is_refused_for_native_presets(model):
    from vlmdoctor.run.runner import check

    with pytest.raises(UsageError, match="native preset"):
        check(RunConfig(model=model, device="cpu", compile_vision="fullgraph"))


def test_fullgraph_tower_is_refused_with_cached_features():
    from vlmdoctor.run.runner import check

    with pytest.raises(UsageError, match="cache-vision-features"):
        check(RunConfig(model="tiny-dino", device="cpu", compile_vision="fullgraph", cache_vision_features=True))


def test_the_profile_command_runs_the_tiny_dino_preset(tmp_path):
    r = run_profile(RunConfig(model="tiny-dino", device="cpu", steps=2, warmup=1, num_samples=16, autocast="off"))
    assert r["status"] == "ok"
    assert r["model"]["vision"] == "dinov2-tiny" and r["model"]["llm"] == "llama-tiny"
    assert r["metrics"]["model_tflops_per_s"] > 0
