"""Native transformers VLM classes as patients: tiny CPU runs, refused knobs, full-size parameter counts."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmdoctor.errors import UsageError
from vlmdoctor.run.capture import TraceOptions
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.flops import FlopModel
from vlmdoctor.run.native import (
    build_native,
    native_catalogue,
    native_param_counts,
    native_presets,
    qwen2vl_patches,
    resolve_native,
)
from vlmdoctor.run.runner import check, run_profile
from vlmdoctor.trace.facts import analyze

TINY = ["tiny-llava", "tiny-qwen2-vl", "tiny-smolvlm"]
ROOT = Path(__file__).resolve().parents[1]


def _cfg(model: str, **changes) -> RunConfig:
    base = dict(model=model, device="cpu", steps=1, warmup=0, num_samples=8, batch_size=2, autocast="off")
    return RunConfig(**{**base, **changes})


def _ops_per_range(path: str) -> dict[str, int]:
    """aten ops that ran inside each vlmdoctor part range (same thread, inside its time span)."""
    with gzip.open(path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e["name"].startswith("vlmdoctor::")]
    ops = [e for e in events if e["name"].startswith("aten::")]
    out: dict[str, int] = {}
    for r in ranges:
        inside = sum(
            1 for o in ops if o["tid"] == r["tid"] and r["ts"] <= o["ts"] and o["ts"] + o["dur"] <= r["ts"] + r["dur"]
        )
        out[r["name"]] = out.get(r["name"], 0) + inside
    return out


@pytest.fixture(scope="module", params=TINY)
def stage_reports(request, tmp_path_factory):
    """Stage 1 untraced, stage 2 traced, for one tiny native preset."""
    model = request.param
    s1 = run_profile(_cfg(model, stage=1))
    trace = TraceOptions(str(tmp_path_factory.mktemp(model)), steps=1)
    s2 = run_profile(_cfg(model, stage=2), trace=trace)
    return model, s1, s2


def test_tiny_native_runs_both_stages(stage_reports):
    model, s1, s2 = stage_reports
    for r in (s1, s2):
        assert r["status"] == "ok", r.get("error")
        assert r["model"]["class"] == resolve_native(model).cls_name
        m = r["metrics"]
        assert m["real_tokens_per_s"] > 0 and m["loss_finite"]
        assert 0 <= m["pad_fraction"] < 1
        assert m["model_tflops_per_s"] > 0


def test_trainable_params_per_stage(stage_reports):
    _, s1, s2 = stage_reports
    p1, p2 = s1["model"]["params"], s2["model"]["params"]
    assert p1 == {**p2, "trainable": p1["trainable"]}  # same model, only the trainable count differs
    assert min(p1["vision"], p1["projector"], p1["llm"]) > 0
    assert p1["vision"] + p1["projector"] + p1["llm"] == p1["total"]
    assert p1["trainable"] == p1["projector"]  # stage 1: the projector only
    assert p2["trainable"] == p2["projector"] + p2["llm"]  # stage 2: + LLM (LM head included); tower frozen


def test_trace_carries_part_ranges_around_the_ops(stage_reports):
    """mark_parts' ranges wrap each part's CPU ops; the analyzer reads the trace as a run of this preset.

    The analyzer's part.* facts attribute GPU kernel time, so a CPU trace has none: the ranges and
    the ops inside them are what is checked here.
    """
    model, _, s2 = stage_reports
    path = s2["trace"]["path"]
    inside = _ops_per_range(path)
    for part in ("vision", "projector", "llm"):
        assert inside.get(f"vlmdoctor::{part}", 0) > 0, part
    facts = analyze(path, 2, model)["files"][0]["facts"]
    assert facts["run.model"] == model and facts["run.stage"] == 2 and facts["trace.steps"] == 1


@pytest.mark.parametrize("model", TINY)
def test_stage1_gradients_reach_only_the_projector(model):
    """Gradients flow through the frozen LLM to the projector; nothing else gets one."""
    spec = resolve_native(model)
    from vlmdoctor.run.native import configure

    vlm = build_native(spec)
    configure(vlm, _cfg(model, stage=1, gradient_checkpointing=False))
    from vlmdoctor.run.data import Collator, SyntheticVQA

    ds = SyntheticVQA(spec, 1)  # type: ignore[arg-type]
    batch = Collator(spec.llm["special_tokens"]["pad"])([ds[0]])
    batch.pop("counts")
    vlm(**batch).loss.backward()
    got = {n for n, p in vlm.named_parameters() if p.grad is not None}
    proj = {n for n, p in vlm.named_parameters() if any(p is q for q in vlm.parts["projector"].parameters())}
    assert got == proj


def test_qwen2vl_patches_match_the_image_processor_layout():
    """Patch i of merge group g holds the pixels the processor puts there (checked against a direct slice)."""
    img = torch.arange(2 * 3 * 56 * 56, dtype=torch.float32).reshape(2, 3, 56, 56)
    flat, grid = qwen2vl_patches(img, patch=14, temporal=2, merge=2)
    assert flat.shape == (2 * 16, 3 * 2 * 14 * 14) and grid.tolist() == [[1, 4, 4]] * 2
    # image 1, merge group (row 1, col 0), inner position (0, 1): patch row 2, patch col 1
    k = 16 + (1 * 2 + 0) * 4 + 0 * 2 + 1
    expect = img[1, :, 28:42, 14:28]
    got = flat[k].reshape(3, 2, 14, 14)
    assert torch.equal(got[:, 0], expect) and torch.equal(got[:, 1], expect)


@pytest.mark.parametrize(
    "knob",
    [
        {"packing": True},
        {"cache_vision_features": True},
        {"vision": "siglip-tiny"},
        {"pixel_shuffle": 2},
    ],
)
@pytest.mark.parametrize("model", TINY)
def test_composite_only_knobs_are_refused(model, knob):
    with pytest.raises(UsageError, match="not supported for the native preset"):
        check(_cfg(model, **knob))


def test_refused_knob_through_the_cli_is_one_line_exit_2():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmdoctor",
            "profile",
            "--model",
            "tiny-llava",
            "--device",
            "cpu",
            "--packing",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    lines = [x for x in (proc.stderr + proc.stdout).splitlines() if x.strip()]
    assert len(lines) == 1 and "--packing" in lines[0] and "tiny-llava" in lines[0] and "Traceback" not in lines[0]


def test_pretrained_without_a_checkpoint_is_refused():
    with pytest.raises(UsageError, match="no published checkpoint"):
        check(_cfg("tiny-llava", weights="pretrained"))


# --- full size, on the meta device --------------------------------------------------------------
#: the public checkpoints' parameter counts (model cards / safetensors metadata)
PUBLIC = {"qwen2-vl-2b": 2_208_985_600, "smolvlm-256m": 256_484_928}


@pytest.mark.parametrize("model", sorted(PUBLIC))
def test_full_size_params_match_the_public_checkpoints(model):
    counts = native_param_counts(build_native(resolve_native(model), device="meta"))
    assert counts["total"] == PUBLIC[model]


def test_llava_siglip2_05b_is_its_parts_plus_the_mlp_projector():
    """No checkpoint of this pairing exists: its tower and LLM must be the shipped SigLIP-2 base and Qwen2.5-0.5B."""
    from vlmdoctor.run.model import build_model, param_counts
    from vlmdoctor.run.zoo import resolve

    composite = param_counts(build_model(resolve("0.5b"), device="meta"))
    counts = native_param_counts(build_native(resolve_native("llava-siglip2-0.5b"), device="meta"))
    assert counts["vision"] == composite["vision"]
    assert counts["llm"] == composite["llm"]
    assert counts["projector"] == 768 * 896 + 896 + 896 * 896 + 896


def test_every_native_preset_is_listed_with_head_dims():
    rows = {r["name"]: r for r in native_catalogue()}
    assert set(rows) == set(native_presets())
    assert rows["qwen2-vl-2b"]["head_dim"] == "80/128"
    assert rows["smolvlm-256m"]["head_dim"] == "64/64"
    assert rows["llava-siglip2-0.5b"]["head_dim"] == "64/64"
    assert rows["smolvlm-256m"]["image_tokens"] == 64 and rows["qwen2-vl-2b"]["image_tokens"] == 256


def _matmul_weights(module: torch.nn.Module, skip: torch.nn.Module | None = None) -> int:
    """Weights of the linear and convolution layers in module, those inside skip left out."""
    skipped = {id(m) for m in skip.modules()} if skip is not None else set()
    kinds = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d)
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, kinds) and id(m) not in skipped)


@pytest.mark.parametrize("model", sorted(native_presets()))
def test_flop_model_counts_each_classes_parts(model):
    """The FLOP model's weights are the built class's matmul weights; token counts are the class's."""
    spec = resolve_native(model)
    fm = FlopModel.from_native(spec)
    vlm = build_native(spec, device="meta")
    parts = vlm.parts
    assert fm.vision_linear_params == _matmul_weights(parts["vision"], skip=parts["projector"])
    assert fm.projector_params == _matmul_weights(parts["projector"])
    assert fm.llm_linear_params == _matmul_weights(parts["llm"]) + vlm.hf.lm_head.weight.numel()
    assert fm.vision_patches == spec.patches and fm.image_tokens == spec.image_tokens
    step1, step2 = fm.step([300, 400], 1), fm.step([300, 400], 2)
    assert step1["vision"] == step2["vision"] > 0 and step2["llm"] > step1["llm"] > 0


def test_a_prescription_of_a_composite_only_knob_is_refused_when_the_config_is_made():
    """treat builds each trial with RunConfig.replace: the refusal comes there, before any process starts."""
    cfg = RunConfig.from_dict({"model": "tiny-qwen2-vl", "device": "cpu"})
    with pytest.raises(UsageError, match="packing is not supported for the native preset"):
        cfg.replace(packing=True)
    assert cfg.replace(pad_to_multiple_of=64).pad_to_multiple_of == 64  # shared knobs stay open


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-llava"])
def test_vision_no_grad_keeps_the_tower_out_of_autograd_but_not_the_projector(model):
    """With checkpointing the class hooks input-embedding grads, so the tower builds a graph; no_grad stops it.

    Qwen2-VL's merger (the projector) sits inside its tower and must still get gradients.
    """
    from vlmdoctor.run.data import Collator, SyntheticVQA
    from vlmdoctor.run.native import configure

    spec = resolve_native(model)
    ds = SyntheticVQA(spec, 1)  # type: ignore[arg-type]
    batch = Collator(spec.llm["special_tokens"]["pad"])([ds[0]])
    batch.pop("counts")
    for no_grad, tower_graph in ((False, True), (True, False)):
        vlm = build_native(spec)
        configure(vlm, _cfg(model, stage=1, vision_no_grad=no_grad, gradient_checkpointing=True))
        seen: list[bool] = []
        blocks = [m for m in vlm.parts["vision"].modules() if type(m).__name__.endswith(("EncoderLayer", "Block"))]
        blocks[-1].register_forward_hook(
            lambda _m, _a, out: seen.append((out[0] if isinstance(out, tuple) else out).requires_grad)  # noqa: B023
        )
        vlm(**batch).loss.backward()
        assert seen == [tower_graph]
        assert all(p.grad is not None for p in vlm.parts["projector"].parameters())


def test_findings_with_refused_knobs_are_set_aside_for_native_presets():
    """A rule that fires on a native run but prescribes a composite-only knob moves to not_applicable."""
    from vlmdoctor.doctor.diagnosis import _set_aside_refused

    finding = {
        "id": "data-packing",
        "config_patch": {"packing": True},
        "evidence": ["x"],
    }
    other = {"id": "system-non-fused-optimizer", "config_patch": {"fused_optimizer": True}, "evidence": ["y"]}
    for model, kept in (("tiny-llava", [other]), ("tiny", [finding, other])):
        d = {"findings": [finding, other], "not_applicable": []}
        _set_aside_refused(d, model)
        assert d["findings"] == kept
        assert [n["id"] for n in d["not_applicable"]] == ([] if model == "tiny" else ["data-packing"])


@pytest.mark.parametrize("model", ["tiny-llava", "tiny-qwen2-vl", "tiny-smolvlm"])
def test_the_labeled_only_head_of_a_native_class_is_the_same_loss_and_head_gradient(model):
    """lm_head_labeled_only on a native class: its base model, then the head and loss on the labeled rows only."""
    from vlmdoctor.run.patient import build_patient, to_device

    out = []
    for labeled in (False, True):
        p = build_patient(_cfg(model, stage=2, batch_size=3, lm_head_labeled_only=labeled), torch.device("cpu"))
        batch = to_device(next(p.batches), torch.device("cpu"), torch.float32)
        counts = batch.pop("counts")
        assert ("loss_index" in batch) == labeled
        if labeled:
            assert len(batch["loss_index"]) == counts["loss_tokens"] < counts["padded_tokens"]
        loss = p.model(**batch).loss
        loss.backward()
        out.append((float(loss.detach()), p.vlm.hf.get_output_embeddings().weight.grad.clone()))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-5)
    assert torch.allclose(out[0][1], out[1][1], atol=1e-5)
