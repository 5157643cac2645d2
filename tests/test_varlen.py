"""Padding-free packing through FlexAttention: no cross-sample attention, same numbers as SDPA.

Real forwards of the tiny preset on CPU. FlexAttention runs here as transformers runs it
(`integrations/flex_attention.py` compiles `flex_attention` itself, and `masking_utils` builds
a BlockMask with `create_block_mask(_compile=True)`), so each new mask or shape costs an
Inductor compile of some seconds: the checks that run by default share one packed batch shape
(two masks, about 25 s cold on 2 cores); the padded-batch and compile checks are `slow`.
FlexAttention has no backward on CPU (torch 2.13), so these are forwards; training on flex is
refused on CPU by the runner's preflight (tested below).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import cross_entropy

from vlmdoctor.errors import UsageError
from vlmdoctor.run.data import IGNORE, Collator, SyntheticVQA
from vlmdoctor.run.model import build_model, llm_attn_implementation, vision_attn_implementation

pytest.importorskip("torch.nn.attention.flex_attention")


@pytest.fixture(scope="module")
def models(tiny_spec):
    """The tiny VLM twice, same weights: LLM on SDPA and LLM on FlexAttention."""
    torch.manual_seed(0)
    sdpa = build_model(tiny_spec, attention="sdpa").eval()
    flex = build_model(tiny_spec, attention="flex").eval()
    flex.load_state_dict(sdpa.state_dict())
    return {"sdpa": sdpa, "flex": flex}


@pytest.fixture(scope="module")
def samples(tiny_spec):
    ds = SyntheticVQA(tiny_spec, 16)
    return [ds[i] for i in range(4)]


@pytest.fixture(scope="module")
def pad_id(tiny_spec):
    return tiny_spec.llm["special_tokens"]["pad"]


def _forward(model, batch, **override):
    b = {k: v for k, v in batch.items() if k != "counts"}
    b.update(override)
    with torch.no_grad():
        out = model(**b)
    return out.logits, out.loss


def _sample_loss(logits: torch.Tensor, labels: list[int]) -> tuple[torch.Tensor, int]:
    """Summed next-token loss of one sample's logits, and how many labels it has."""
    target = torch.tensor(labels[1:])
    keep = target != IGNORE
    return cross_entropy(logits[:-1][keep], target[keep], reduction="sum"), int(keep.sum())


@pytest.fixture(scope="module")
def alone(models, samples, pad_id):
    """Each sample run alone, unpacked and unpadded, on SDPA: the reference."""
    return [_forward(models["sdpa"], Collator(pad_id)([s]))[0][0] for s in samples]


@pytest.fixture(scope="module")
def packed(pad_id, samples):
    """All samples in one packed row (position ids restart per sample, no 2-D mask)."""
    batch = Collator(pad_id, packing=True, pack_length=4096)(samples)
    assert batch["input_ids"].shape[0] == 1 and batch["attention_mask"] is None
    return batch


def _segments(samples):
    """(index into samples, start, length) of each sample in the packed row (packing puts longest first)."""
    at, out = 0, []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i]["input_ids"])):
        k = len(samples[i]["input_ids"])
        out.append((i, at, k))
        at += k
    return out


def test_attn_implementation_per_part():
    assert llm_attn_implementation("flex") == "flex_attention"
    assert vision_attn_implementation("flex") == "sdpa"  # fixed-length, unmasked tower: fused SDPA already
    for backend in ("sdpa", "flash", "efficient", "cudnn", "math"):
        assert llm_attn_implementation(backend) == vision_attn_implementation(backend) == "sdpa"
    assert llm_attn_implementation("eager") == vision_attn_implementation("eager") == "eager"


def test_flex_model_is_built_on_flex_for_the_llm_only(models):
    assert models["flex"].llm.config._attn_implementation == "flex_attention"
    assert models["flex"].vision.config._attn_implementation == "sdpa"
    assert models["sdpa"].llm.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_row_equals_each_sample_alone(models, samples, alone, packed, attention):
    """Each sample's logits in the packed row equal its logits alone: no cross-sample attention.

    sdpa gets there through transformers' dense block-diagonal mask, flex through a BlockMask
    whose mask_mod is the packed-sequence (document) mask; both are detected from the position ids.
    """
    logits, loss = _forward(models[attention], packed)
    total, count = torch.zeros(()), 0
    for i, at, k in _segments(samples):
        torch.testing.assert_close(logits[0, at : at + k], alone[i], atol=1e-4, rtol=1e-4)
        s, n = _sample_loss(alone[i], samples[i]["labels"])
        total, count = total + s, count + n
    # the row's loss is the label-weighted mean of the samples' losses alone
    torch.testing.assert_close(loss, total / count, atol=1e-5, rtol=1e-5)


def test_flex_without_position_restarts_matches_sdpa_and_leaks(models, samples, alone, packed):
    """One running position sequence over the packed row: plain causal attention on both paths.

    flex and sdpa agree (same loss, same logits), and the samples now do attend to each other,
    which is what the packed-row test above rules out: that test has teeth.
    """
    width = packed["input_ids"].shape[1]
    running = torch.arange(width)[None]
    flex_logits, flex_loss = _forward(models["flex"], packed, position_ids=running)
    sdpa_logits, sdpa_loss = _forward(models["sdpa"], packed, position_ids=running)
    torch.testing.assert_close(flex_loss, sdpa_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flex_logits, sdpa_logits, atol=1e-4, rtol=1e-4)
    i, at, k = _segments(samples)[1]
    assert (flex_logits[0, at : at + k] - alone[i]).abs().max() > 1e-2


@pytest.mark.slow  # a second shape recompiles flex (~20 s); the running-position test covers flex == sdpa
def test_flex_padded_batch_matches_sdpa(models, samples, pad_id):
    """Packing off: a padded batch with a 2-D mask gives flex the same loss and real-token logits as sdpa."""
    batch = Collator(pad_id, pad_to_multiple_of=64)(samples)
    assert int((batch["attention_mask"] == 0).sum()) > 0  # there is padding to mask
    flex_logits, flex_loss = _forward(models["flex"], batch)
    sdpa_logits, sdpa_loss = _forward(models["sdpa"], batch)
    torch.testing.assert_close(flex_loss, sdpa_loss, atol=1e-5, rtol=1e-5)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(flex_logits[real], sdpa_logits[real], atol=1e-4, rtol=1e-4)


def test_flex_training_refused_on_cpu_in_one_line(tiny_cfg):
    from vlmdoctor.run.runner import check

    with pytest.raises(UsageError, match="FlexAttention") as e:
        check(tiny_cfg(packing=True, attention="flex"))
    assert "\n" not in str(e.value)


def test_eager_packing_still_refused(tiny_cfg):
    from vlmdoctor.run.runner import check

    with pytest.raises(UsageError, match="--attention flex"):
        check(tiny_cfg(packing=True, attention="eager"))


# --- the trace side: FlexAttention's kernels are attention ------------------------------------------

#: names as the H100 and Inductor write them; the flex ones are Inductor template kernels named after
#: the flex_attention HOP (torch/_inductor/kernel/flex/flex_attention.py: TritonTemplate(name="flex_attention"))
ATTENTION_NAMES = {
    "attention_flex": [
        "triton_tem_fused_flex_attention_0",
        "triton_tem_fused_flex_attention_backward_1",
        "triton_tem_fused__to_copy_flex_attention_3",
        "triton_per_fused_flex_attention_backward_zeros_2",
    ],
    "attention_flash": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true>(Params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Traits, true>(Params)",
        "flash_fwd_splitkv_kernel",
    ],
    "attention_mem_efficient": [
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<"
        "cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackward"
        "Kernel<cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, false, 64, 64, 64>"
        "::Params)",
        "efficient_attention_forward",
    ],
    "attention_cudnn": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64",
    ],
}
#: names that must not become attention: other compiled kernels (the block-mask build among them), GEMMs
OTHER_NAMES = {
    "triton_compiled": [
        "triton_poi_fused_add_mul_0",
        "triton_red_fused__to_copy_mean_pow_1",
        "triton_tem_fused_mm_4",
        "triton_poi_fused_eq_index_lt_sum_2",
    ],
    "gemm_tensor_core": ["nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT"],
    "softmax": ["void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*)"],
}


@pytest.mark.parametrize("expected, names", [*ATTENTION_NAMES.items(), *OTHER_NAMES.items()])
def test_kernel_classes_with_flex(expected, names):
    from vlmdoctor.trace.kernels import ATTENTION_CLASSES, classify

    for name in names:
        assert classify(name) == expected, name
    assert (expected in ATTENTION_CLASSES) == (expected in ATTENTION_NAMES)


def test_flex_advice_names_the_llm_only():
    from vlmdoctor.doctor.advice import advise

    lines = advise({"attention": "flex"}, "loop")
    assert any('attn_implementation="flex_attention"' in x for x in lines)
    assert not any("SDPBackend" in x for x in lines)


# --- native transformers classes: FlexAttention for the language model only -----------------------


@pytest.mark.parametrize("preset", ["tiny-llava", "tiny-smolvlm"])
def test_native_flex_sets_the_text_model_only(preset):
    """transformers takes a per-sub-config attn_implementation dict: text on flex, tower on SDPA."""
    from vlmdoctor.run import native

    vlm = native.build_native(native.resolve_native(preset), attention="flex")
    impl = {
        type(m).__name__: m.config._attn_implementation
        for m in vlm.hf.modules()
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")
    }
    text = vlm.hf.config.text_config._attn_implementation
    vision = vlm.hf.config.vision_config._attn_implementation
    assert (text, vision) == ("flex_attention", "sdpa"), impl


def test_native_class_without_flex_support_is_one_line():
    """Qwen2-VL's text model declares no FlexAttention support in transformers 5.23: refused cleanly."""
    from vlmdoctor.run import native

    spec = native.resolve_native("tiny-qwen2-vl")
    try:
        native.build_native(spec, attention="flex")
    except UsageError as e:
        assert "FlexAttention" in str(e) and "\n" not in str(e)
    # a later transformers that supports it builds the model: nothing to refuse then


@pytest.mark.slow  # 15-30 s of Inductor compile on 2 cores
@pytest.mark.parametrize("regions", [True, False])
def test_flex_under_compile_matches(models, packed, regions):
    """--compile (whole model, or each decoder layer with --compile-regions) traces the flex call into
    the compiled graph (transformers uses plain flex_attention inside a dynamo trace): same logits."""
    import copy

    from vlmdoctor.run.compile import compile_vlm

    compiled = compile_vlm(copy.deepcopy(models["flex"]), "default", regions=regions)
    want, want_loss = _forward(models["flex"], packed)
    got, got_loss = _forward(compiled, packed)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_loss, want_loss, atol=1e-5, rtol=1e-5)


def test_flex_runs_get_the_compile_bookkeeping():
    """transformers compiles flex in the first steps: warm-up settling and recompile checks apply."""
    from vlmdoctor.run.compile import compiled
    from vlmdoctor.run.config import RunConfig
    from vlmdoctor.run.runner import recompile_warning

    assert compiled(RunConfig(attention="flex")) and not compiled(RunConfig(attention="sdpa"))
    warning = recompile_warning(RunConfig(attention="flex"), [{"step_ms": [100.0, 100.0, 900.0, 100.0]}])
    assert warning and warning.startswith("--attention flex")
