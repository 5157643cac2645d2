"""FP8 training (torchao.float8, the `fp8` knob): refusals, the layer filter, FP8 GEMM kernels in traces,
and the rule precision-fp8-gemm on the real H100 traces. The GPU measurement is bench/treat11/fp8.sh."""

from __future__ import annotations

import gzip
import json
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from _badinput import FAST, assert_one_line, invoke
from torch import nn

from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.errors import UsageError
from vlmdoctor.run import fp8
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace.facts import analyze, merge_measured
from vlmdoctor.trace.kernels import GEMM_CLASSES, classify

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
RULES, _ = load_rules()
RULE = "precision-fp8-gemm"


# --- the knob and its refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, needles",
    [
        ({"train": "lora"}, ("--fp8 and --train lora", "use --train full")),
        ({"train": "qlora"}, ("--fp8 and --train qlora",)),
        ({"stage": 1}, ("stage 1 freezes the LLM", "--stage 2")),
        ({"unsloth": True, "weight_dtype": "bf16"}, ("--fp8 and --unsloth",)),
    ],
)
def test_combinations_that_do_not_train_full_linear_layers_are_refused(changes, needles):
    with pytest.raises(UsageError) as e:
        RunConfig().replace(source="command line", fp8="tensorwise", **changes)
    assert all(n in e.value.message for n in needles) and "\n" not in e.value.message


def test_the_rules_patch_is_a_valid_config_from_the_default_and_from_a_liger_run():
    patch = {"fp8": "tensorwise", "compile": "default", "compile_regions": True}
    assert RunConfig().replace(**patch).fp8 == "tensorwise"
    assert RunConfig(liger_fused_linear_cross_entropy=True, pad_to_multiple_of=64).replace(**patch).compile == "default"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cpu_run_is_refused_in_one_line_with_exit_2(tmp_path, monkeypatch, recipe):
    monkeypatch.chdir(tmp_path)
    r = invoke(["profile", *FAST, "--fp8", recipe])
    assert_one_line(r, 2, f"--fp8 {recipe}", "compute capability 8.9+", "this device is the CPU")
    assert list(tmp_path.iterdir()) == []


def test_a_config_file_sets_the_knob_and_a_bad_value_names_the_file(tmp_path):
    good, bad = tmp_path / "fp8.yaml", tmp_path / "bad.yaml"
    good.write_text("model: tiny\ndevice: cpu\nfp8: rowwise\n")
    bad.write_text("model: tiny\ndevice: cpu\nfp8: e4m3\n")
    assert RunConfig.load(good).fp8 == "rowwise"
    assert_one_line(
        invoke(["profile", "--config", str(good), "--steps", "1", "--no-diagnose"]),
        2,
        "--fp8 rowwise",
        "this device is the CPU",
    )
    assert_one_line(invoke(["profile", "--config", str(bad), "--no-diagnose"]), 2, str(bad), "fp8", "tensorwise")


class _Cuda:
    type = "cuda"


def test_a_gpu_below_8_9_is_named_and_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UsageError) as e:
        fp8.check_device(RunConfig(fp8="tensorwise"), _Cuda())
    assert "NVIDIA A100-SXM4-80GB (8.0)" in e.value.message and "8.9+" in e.value.message


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0)])
def test_an_fp8_gpu_without_torchao_says_how_to_install_it(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError, installed or not
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(UsageError) as e:
        fp8.check_device(RunConfig(fp8="rowwise"), _Cuda())
    assert "pip install torchao" in e.value.message and "cannot be imported" in e.value.message


# --- which layers are converted --------------------------------------------------------------------------------


def test_filter_takes_aligned_projections_and_leaves_the_lm_head_and_odd_dims():
    assert fp8.fp8_filter(nn.Linear(896, 4864), "model.layers.0.mlp.gate_proj")
    assert fp8.fp8_filter(nn.Linear(1536, 256), "layers.3.self_attn.k_proj")
    assert not fp8.fp8_filter(nn.Linear(896, 151936), "lm_head")  # aligned, but the output projection
    assert not fp8.fp8_filter(nn.Linear(72, 200), "x.fc")  # 200 % 16 != 0
    assert not fp8.fp8_filter(nn.Linear(1000, 1024), "x.fc")
    assert not fp8.fp8_filter(nn.LayerNorm(64), "x.norm")


def test_filter_on_the_tiny_presets_llm_takes_every_decoder_projection(tiny_spec):
    from vlmdoctor.run.model import build_model

    vlm = build_model(tiny_spec, "fp32", "sdpa", "random", torch.device("cpu"))
    taken = {n for n, m in vlm.llm.named_modules() if isinstance(m, nn.Linear) and fp8.fp8_filter(m, n)}
    linears = {n for n, m in vlm.llm.named_modules() if isinstance(m, nn.Linear)}
    assert taken == {n for n in linears if "layers." in n}  # q/k/v/o, gate/up/down of every layer
    assert "lm_head" in linears - taken


@pytest.mark.parametrize(
    "pad, packing, aligned",
    [(64, False, True), (16, False, True), (1, False, False), (8, False, False), (1, True, True)],
)
def test_torchao_pads_the_token_dim_only_where_collation_does_not(pad, packing, aligned):
    assert fp8.tokens_aligned(RunConfig(pad_to_multiple_of=pad, packing=packing)) is aligned


def test_conversion_runs_a_training_step_in_emulation(tiny_spec):
    """torchao's emulated FP8 (high-precision math, same module swap) on the CPU; skipped without torchao."""
    pytest.importorskip("torchao.float8")
    from vlmdoctor.run.model import build_model

    vlm = build_model(tiny_spec, "fp32", "sdpa", "random", torch.device("cpu"))
    info = fp8.convert(vlm.llm, "tensorwise", pad_inner_dim=True, emulate=True)
    swapped = [n for n, m in vlm.llm.named_modules() if type(m).__name__ == "Float8Linear"]
    assert info["converted_linear_layers"] == len(swapped) > 0 and "lm_head" in info["skipped_linear_layers"]
    assert all("layers." in n for n in swapped)
    ids = torch.randint(0, 100, (2, 24))
    out = vlm.llm(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss) and vlm.llm.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.slow  # 10-20 s a run; and it needs torchao, which CI does not install
@pytest.mark.parametrize("model, recipe", [("tiny", "tensorwise"), ("tiny-llava", "rowwise")])
def test_the_runner_converts_the_composite_and_the_native_llm(monkeypatch, model, recipe):
    """A real profile run through the runner with torchao's emulation standing in for the FP8 GEMMs (the
    device check lifted: this is the CPU); skipped without torchao."""
    pytest.importorskip("torchao.float8")
    import functools

    from vlmdoctor.run import runner

    monkeypatch.setattr(fp8, "check_device", lambda cfg, device: None)
    monkeypatch.setattr(fp8, "convert", functools.partial(fp8.convert, emulate=True))
    cfg = RunConfig(
        model=model, device="cpu", steps=2, warmup=1, num_samples=32, autocast="off", batch_size=2, fp8=recipe
    )
    report = runner.run_profile(cfg)
    assert report["status"] == "ok", report.get("error")
    info = report["mode"]["fp8"]
    assert info["recipe"] == recipe and info["converted_linear_layers"] > 0 and info["pad_inner_dim"] is True
    assert "lm_head" not in str(info["skipped_linear_layers"]) or model == "tiny"  # the native LLM part has no head


# --- FP8 GEMM kernels in a trace ---------------------------------------------------------------------------------

FP8_GEMMS = [
    "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
    "sm90_xmma_gemm_e5m2e4m3_e4m3f32_f32_tn_n_tilesize128x256x64_cgasize1x2x1_warpgroupsize2x1x1_execute_segment_k_off_kernel",
    "sm89_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x64_stage3_warpsize2x2x1_tensor16x8x32_kernel",
    "cutlass3x_sm90_tensorop_gemm_e4m3_e4m3_f32_bf16_bf16_128x128x128_1x2x1_0_tnt_align16_warpspecialized_cooperative",
    "nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT",
    "nvjet_qqhsh_112x128_128x7_2x1_v_bz_coopA_algo2_TNN",
    "nvjet_sm103_qqtst_128x256_128x6_2x2_2cta_h_bz_Avec32UE8M0_Bvec32UE8M0_TNT",
    "void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::kernel::GemmUniversal<"
    "cute::tuple<int, int, int, int>, cutlass::gemm::collective::CollectiveMma<cutlass::gemm::"
    "MainloopSm90TmaGmmaWarpSpecializedPingpongFP8FastAccum<8>, cutlass::float_e4m3_t, cutlass::float_e4m3_t> > > >(...)",  # noqa: E501 (a kernel name as the GPU reports it)
    "void fbgemm_gpu::f8f8bf16_rowwise_impl<128, 128, 128, 2, 1, 1>(...)",
    "triton_tem_fused__scaled_mm_0",  # Inductor's max-autotune template for torch._scaled_mm
]
NOT_FP8 = {
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas": "gemm_tensor_core",  # noqa: E501 (a kernel name as the GPU reports it)
    "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm_tensor_core",
    "nvjet_hsh_128x128_64x4_2x1_v_bz_TNT": "gemm_tensor_core",
    "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8": "gemm_tensor_core",
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_kernel": "gemm_fp32_simt",  # noqa: E501 (a kernel name as the GPU reports it)
    "ampere_sgemm_128x64_tn": "gemm_fp32_simt",
    "cutlass_80_simt_sgemm_128x128_8x4_nn_align1": "gemm_fp32_simt",
    "sm80_xmma_gemm_tf32f32_tf32f32_f32_nn_n_tilesize64x64x16_stage4_warpsize2x2x1_tensor16x8x8_kernel": "gemm_tf32",
    # eager torchao casts: an amax reduction and a copy to Float8_e4m3fn are not GEMMs
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::direct_copy_kernel_cuda("
    "at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(c10::Float8_e4m3fn)#1}, std::array<char*, 2ul> >"  # noqa: E501 (a kernel name as the GPU reports it)
    "(int, ...)": "cast",
    "triton_red_fused__to_copy_abs_amax_clamp_0": "triton_compiled",
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "nccl",
}


@pytest.mark.parametrize("name", FP8_GEMMS)
def test_fp8_gemm_kernels_are_a_gemm_class(name):
    assert classify(name) == "gemm_fp8" and "gemm_fp8" in GEMM_CLASSES


@pytest.mark.parametrize("name, cls", sorted(NOT_FP8.items()))
def test_bf16_fp32_and_cast_kernels_are_not_fp8(name, cls):
    assert classify(name) == cls


# --- facts and the rule on the real H100 traces ---------------------------------------------------------------


@cache
def measured(name: str) -> dict:
    facts = analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
    return merge_measured(facts, json.loads((TRACES / f"{name}.report.json").read_text()))


def test_gemm_facts_split_bf16_and_fp8_and_name_the_gpu():
    f = measured("healthy_1.5b_s2")
    assert f["device.compute_capability"] == 9.0 and "H100" in f["device.name"]
    assert f["gemm.fp8_share"] == 0.0 and f["gemm.fp8_ms"] == 0.0
    assert f["gemm.bf16_ms"] == pytest.approx(f["kernels.gemm_tensor_core.ms"])
    assert f["gemm.bf16_share_of_gpu"] == pytest.approx(f["kernels.gemm_tensor_core.share"])
    assert 0 < f["gemm.bf16_llm_ms"] < f["gemm.bf16_ms"]  # the tower's GEMMs are not the LLM's


def test_capability_falls_back_to_the_runs_environment():
    """A GPU trace whose deviceProperties were dropped: the report's env (run/envinfo.py) says 9.0."""
    report = json.loads((TRACES / "healthy_1.5b_s2.report.json").read_text())
    facts = {
        k: v
        for k, v in analyze(TRACES / "healthy_1.5b_s2.pt.trace.json.gz")["files"][0]["facts"].items()
        if k != "device.compute_capability"
    }
    assert report["env"]["compute_capability"] == "9.0"
    assert merge_measured(facts, report)["measured.device.compute_capability"] == 9.0
    # the rule reads the run's capability where the trace has none
    merged = merge_measured({k: v for k, v in wide().items() if k != "device.compute_capability"}, report)
    assert "device.compute_capability" not in merged and RULE in _ids(merged)
    cpu = {"trace.cpu_only": True}  # a CPU trace gets no GPU capability, whatever the report says
    assert "measured.device.compute_capability" not in merge_measured(cpu, report)


def test_fp8_share_counts_fp8_kernel_time(tmp_path):
    """Not a recording: the compiled 0.5b trace with its bf16 GEMM kernels renamed to cuBLASLt's FP8 names
    (durations untouched), to check the arithmetic of gemm.fp8_share against the unchanged trace."""
    src = TRACES / "compile_s2.pt.trace.json.gz"
    with gzip.open(src) as fh:
        trace = json.load(fh)
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel" and classify(e["name"]) == "gemm_tensor_core":
            e["name"] = "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_" + e["name"][-20:]
    renamed = tmp_path / "renamed.pt.trace.json.gz"
    with gzip.open(renamed, "wt") as fh:
        json.dump(trace, fh)
    before = analyze(src)["files"][0]["facts"]
    after = analyze(renamed)["files"][0]["facts"]
    assert after["gemm.ms"] == pytest.approx(before["gemm.ms"])
    assert after["gemm.fp8_ms"] == pytest.approx(before["gemm.bf16_ms"]) and after["gemm.bf16_ms"] == 0.0
    assert after["gemm.fp8_share"] == pytest.approx(before["gemm.bf16_ms"] / before["gemm.ms"])
    assert after["gemm.fp8_share"] > 0.9  # bf16 GEMMs were all but a stray FP32 one


def _ids(facts: dict) -> set[str]:
    d = diagnose(facts, RULES)
    return {f["id"] for f in d["findings"] + d["superseded"]}


def wide(name: str = "healthy_1.5b_s2") -> dict:
    """Not a recording: the 1.5b step's facts with its bf16 GEMM time in GEMMs 5x as long (fewer, wider
    ones), the regime the rule waits for; no run here has measured it."""
    f = measured(name)
    return {**f, "gemm.bf16_mean_ms": f["gemm.bf16_mean_ms"] * 5}


def test_rule_stays_quiet_at_1_5b_where_fp8_was_measured_to_lose():
    """H100, 1.5b stage 2, batch 16, compiled by region: tensorwise FP8 measured 19,511 against 24,130
    tokens/s. The 1.5b fixture's GEMMs are as narrow (0.125 ms each), so the rule does not fire there."""
    f = measured("healthy_1.5b_s2")
    assert f["gemm.bf16_mean_ms"] == pytest.approx(f["gemm.bf16_ms"] / f["kernels.gemm_tensor_core.count"])
    assert (
        0.1 < f["gemm.bf16_mean_ms"] < 0.5 and f["measured.gpu.busy_frac"] > 0.7 and f["gemm.bf16_share_of_gpu"] > 0.4
    )
    assert RULE not in _ids(f)


def test_rule_fires_on_a_gemm_bound_step_of_wide_gemms_with_an_honest_gain():
    f = wide()
    finding = next(x for x in diagnose(f, RULES)["findings"] if x["id"] == RULE)
    assert finding["config_patch"] == {
        "fp8": "tensorwise",
        "compile": "default",
        "compile_regions": True,
        "warmup": 10,
    }
    gain = finding["expected_gain"]
    assert gain["saves_ms_per_step"] == pytest.approx(f["gemm.bf16_llm_ms"] / 3)  # 1 - 1/1.5 of the LLM's GEMMs
    assert gain["saves_ms_per_step"] < f["gemm.bf16_ms"] < f["step.ms"] and "upper bound" in gain["how"]
    assert "compute capability 9.0" in " ".join(finding["evidence"]) and len(finding["evidence"]) == 4


def test_a_trace_without_part_attribution_gets_the_whole_bf16_gemm_time_as_the_base():
    """A compiled run loses vlmdoctor's part ranges: the gain falls back to all bf16 GEMM time, the evidence
    keeps its other lines."""
    f = {k: v for k, v in wide().items() if k != "gemm.bf16_llm_ms"}
    finding = next(x for x in diagnose(f, RULES)["findings"] if x["id"] == RULE)
    assert finding["expected_gain"]["saves_ms_per_step"] == pytest.approx(f["gemm.bf16_ms"] / 3)
    assert len(finding["evidence"]) == 3 and "of GPU time" in finding["evidence"][0]
    RunConfig(**json.loads((TRACES / "healthy_1.5b_s2.report.json").read_text())["config"]).replace(
        **finding["config_patch"]
    )  # the patch makes a valid config from the run's own


@pytest.mark.parametrize(
    "name",
    ["healthy_s2", "compile_s2", "bf16_s2", "labeled_s2", "liger_fce_s2", "default_s2", "sync_compile_s2"],
)
def test_rule_stays_quiet_on_the_host_bound_0_5b_steps(name):
    """0.5b on the H100: the GPU is busy 12-75% of the untraced step, and its bf16 GEMMs average under
    0.08 ms, narrower than the 1.5b GEMMs where FP8 lost 19%. No kernel of these bf16 runs may be classed
    FP8 either."""
    f = measured(name)
    assert f["measured.gpu.busy_frac"] < 0.76 and f["gemm.bf16_mean_ms"] < 0.08 and RULE not in _ids(f)
    assert f["gemm.fp8_share"] == 0.0 and "kernels.gemm_fp8.count" not in f and f["gemm.bf16_ms"] > 0


@pytest.mark.parametrize(
    "changes",
    [
        {"gemm.fp8_share": 0.8},  # FP8 already on
        {"device.compute_capability": 8.0},  # an A100
        {"measured.gpu.busy_frac": 0.5},  # host-bound (the untraced run's share, which the rule reads)
        {"gemm.bf16_share_of_gpu": 0.3},  # not GEMM-bound
        {"config.fp8": "rowwise"},
        {"config.train": "lora"},
        {"lora.lowrank_gemm_count": 1008.0},  # a user's LoRA run: its trace says so, it has no config facts
        {"qlora.dequant_count": 1008.0},
    ],
)
def test_rule_does_not_fire_where_fp8_cannot_or_need_not_help(changes):
    assert RULE in _ids(wide())
    assert RULE not in _ids({**wide(), **changes})


def test_rule_on_a_trace_without_the_capability_is_not_evaluated_and_on_cpu_does_not_apply():
    f = {k: v for k, v in wide().items() if k != "device.compute_capability"}
    d = diagnose(f, RULES)
    assert {"id": RULE, "missing": ["device.compute_capability"]} in d["not_evaluated"]
    cpu = {"trace.cpu_only": True, "run.stage": 2, "step.ms": 10.0}
    assert RULE in {n["id"] for n in diagnose(cpu, RULES)["not_applicable"]}


def test_treat_applies_the_patch_where_the_machine_runs_it_and_skips_it_on_cpu():
    from vlmdoctor.doctor.treat import compose
    from vlmdoctor.run.runner import check

    finding = next(x for x in diagnose(wide(), RULES)["findings"] if x["id"] == RULE)
    base = RunConfig(model="tiny", device="cpu", weight_dtype="bf16", pad_to_multiple_of=64)
    skipped: list = []
    comps = compose(base, {"findings": [finding]}, skipped)
    assert [c["rule"] for c in comps[0]["changes"]] == [RULE] and skipped == []
    cfg = comps[0]["config"]
    assert (cfg.fp8, cfg.compile, cfg.compile_regions, cfg.warmup) == ("tensorwise", "default", True, 10)
    skipped = []
    assert compose(base, {"findings": [finding]}, skipped, check) == []
    assert skipped[0]["rule"] == RULE and "compute capability 8.9+" in skipped[0]["why"]


@pytest.mark.parametrize("audience", ["trainer", "loop"])
def test_advice_says_the_torchao_lines(audience):
    from vlmdoctor.doctor.advice import advise

    lines = advise({"fp8": "rowwise", "compile": "default", "compile_regions": True}, audience)
    text = "\n".join(lines)
    assert "convert_to_float8_training(" in text and "from_recipe_name('rowwise')" in text
    assert "% 16 == 0" in text and "block.compile()" in text and max(map(len, lines)) <= 80
