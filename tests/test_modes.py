"""Training modes on the tiny preset, on CPU: LoRA placement, the DPO loss and reference, preference data,
the knobs' usage errors, and each mode's FLOP count against torch's own FLOP counter."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch

from tests.conftest import write_jsonl
from vlmdoctor.errors import UsageError
from vlmdoctor.run import flops, modes, runner
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.data import Collator, PairCollator, PreferenceFile, SyntheticPairs

CPU = torch.device("cpu")


def _cfg(**kw) -> RunConfig:
    base = dict(
        model="tiny",
        device="cpu",
        steps=1,
        warmup=0,
        num_samples=4,
        batch_size=1,
        autocast="off",
        gradient_checkpointing=False,
    )
    base.update(kw)
    return RunConfig(**base)


# --- knobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, words",
    [
        ({"train": "lora", "stage": 1}, "stage 1 trains the projector only"),
        ({"train": "qlora", "stage": 1}, "use --stage 2"),
        ({"lora_targets": " , "}, "comma list"),
        ({"lora_targets": "q_proj;v_proj"}, "comma list"),
        ({"objective": "dpo", "packing": True}, "--packing is for the SFT loss"),
        ({"objective": "dpo", "lm_head_labeled_only": True}, "--lm-head-labeled-only"),
        ({"optimizer": "paged_adamw", "fused_optimizer": True}, "does not combine"),
        ({"lora_rank": 0}, "--lora-rank must be"),
        ({"dpo_beta": 0}, "--dpo-beta must be"),
        ({"train": "dora"}, "choose one of: full, lora, qlora"),
    ],
)
def test_bad_mode_knobs_are_one_line_usage_errors(changes, words):
    with pytest.raises(UsageError) as e:
        RunConfig().replace(source="command line", **changes)
    assert words in e.value.message and "\n" not in e.value.message


def test_mode_knobs_go_through_a_saved_config(tmp_path):
    cfg = RunConfig(
        train="lora",
        lora_rank=8,
        lora_targets="q_proj,v_proj",
        objective="dpo",
        dpo_beta=0.2,
        dpo_reference_dtype="bf16",
        dpo_reference_no_grad=True,
        dpo_precompute_reference=True,
    )
    cfg.dump(tmp_path / "c.yaml")
    assert RunConfig.load(tmp_path / "c.yaml") == cfg


def test_qlora_and_paged_optimizers_refused_on_cpu():
    for kw in ({"train": "qlora"}, {"optimizer": "paged_adamw_8bit"}):
        with pytest.raises(UsageError) as e:
            runner.check(_cfg(**kw))
        assert "CUDA GPU only" in e.value.message


def test_qlora_without_bitsandbytes_says_how_to_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_bnb(name, *a, **k):
        if name.startswith("bitsandbytes"):
            raise ImportError("no bitsandbytes")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_bnb)
    with pytest.raises(UsageError) as e:
        modes.check_mode_device(_cfg(train="qlora"), torch.device("cuda"))
    assert "pip install bitsandbytes" in e.value.message


def test_unknown_lora_target_names_the_llm_layers():
    with pytest.raises(UsageError) as e:
        runner.build_patient(_cfg(train="lora", lora_targets="q_proj,qkv"), CPU)
    assert "no linear layer named qkv" in e.value.message and "gate_proj" in e.value.message


# --- LoRA placement ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model, targets, per_layer",
    [("tiny", "attention_mlp", 7), ("tiny", "q_proj,v_proj", 2), ("tiny-llava", "attention", 4)],
)
def test_lora_adapts_the_llm_only_and_the_projector_trains(model, targets, per_layer):
    p = runner.build_patient(_cfg(model=model, train="lora", lora_rank=4, lora_targets=targets), CPU)
    parts = {"vision": p.vlm.vision, "projector": p.vlm.projector, "llm": p.vlm.llm} if model == "tiny" else p.vlm.parts
    assert not any(x.requires_grad for x in parts["vision"].parameters())
    assert all(x.requires_grad for x in parts["projector"].parameters())
    named = dict((p.vlm if model == "tiny" else p.vlm.hf).named_parameters())
    trainable_llm = [
        n for n, x in named.items() if x.requires_grad and id(x) not in {id(q) for q in parts["projector"].parameters()}
    ]
    assert trainable_llm and all("lora_A" in n or "lora_B" in n for n in trainable_llm)
    layers = modes.lora_layers(parts["llm"])
    n_layers = (p.spec.llm["config"] if model == "tiny" else p.spec.text_config)["num_hidden_layers"]
    assert len(layers) == per_layer * n_layers and not modes.lora_layers(parts["vision"])
    assert p.mode_info["adapter_params"] == modes.adapter_params(parts["llm"])
    expected = modes.expected_adapter_params(
        p.spec.llm["config"] if model == "tiny" else p.spec.text_config, p.spec.llm_head_dim, targets, 4
    )
    assert expected == p.mode_info["adapter_params"]


def test_disabled_adapters_give_the_base_output():
    p = runner.build_patient(_cfg(train="lora", lora_rank=4, lora_dropout=0.0), CPU)
    for layer in modes.lora_layers(p.vlm.llm):  # adapters that change the output (B starts at zero)
        torch.nn.init.normal_(layer.lora_B["default"].weight)
    x = torch.randint(10, 100, (1, 12))
    with torch.no_grad():
        adapted = p.vlm.llm(input_ids=x).logits
        with modes.adapters_disabled(p.vlm.llm):
            base = p.vlm.llm(input_ids=x).logits
        for layer in modes.lora_layers(p.vlm.llm):
            torch.nn.init.zeros_(layer.lora_B["default"].weight)
        zeroed = p.vlm.llm(input_ids=x).logits
    assert not torch.allclose(adapted, base) and torch.allclose(base, zeroed, atol=1e-5)


# --- DPO -----------------------------------------------------------------------------------------
def test_dpo_loss_matches_a_hand_computation():
    pc, pr, rc, rr = (torch.tensor(v) for v in ([-10.0, -4.0], [-12.0, -3.0], [-11.0, -4.5], [-11.0, -2.0]))
    beta = 0.1
    loss, m = modes.dpo_loss(pc, pr, rc, rr, beta)
    # pair 0: (-10 + 11) - (-12 + 11) = 2; pair 1: (-4 + 4.5) - (-3 + 2) = 1.5
    hand = (math.log(1 + math.exp(-0.2)) + math.log(1 + math.exp(-0.15))) / 2
    assert loss.item() == pytest.approx(hand, rel=1e-6)
    assert m["accuracy"].item() == 1.0 and m["reward_margin"].item() == pytest.approx(0.175)
    same, _ = modes.dpo_loss(pc, pr, pc, pr, beta)  # policy == reference: log 2
    assert same.item() == pytest.approx(math.log(2))


def test_sequence_logps_sum_the_labeled_tokens_only():
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, -100], [-100, 1, 2, 6, 0]])
    logp = torch.log_softmax(logits, -1)
    hand = torch.stack([logp[0, 1, 3] + logp[0, 2, 4], logp[1, 0, 1] + logp[1, 1, 2] + logp[1, 2, 6] + logp[1, 3, 0]])
    assert torch.allclose(modes.sequence_logps(logits, labels), hand, atol=1e-6)


def test_synthetic_pairs_share_prompt_and_image(tiny_spec):
    ds = SyntheticPairs(tiny_spec, 16, seed=3)
    for i in range(4):
        s = ds[i]
        c, r = s["chosen"], s["rejected"]
        start = next(k for k, x in enumerate(c["labels"]) if x != -100)
        assert c["input_ids"][:start] == r["input_ids"][:start] and r["labels"][:start] == [-100] * start
        assert ds.lengths[i] == max(len(c["input_ids"]), len(r["input_ids"]))
    assert len({len(ds[i]["rejected"]["input_ids"]) - len(ds[i]["chosen"]["input_ids"]) for i in range(16)}) > 1
    batch = PairCollator(Collator(0))([ds[0], ds[1]])
    assert batch["input_ids"].shape[0] == 4 and batch["pixel_values"].shape[0] == 4
    assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][2]) and batch["pair_index"] == [0, 1]


def _pref(img: str, k: int) -> dict:
    return {
        "prompt": "<image>\nWhat is in the picture?",
        "images": [img],
        "chosen": f"A red cat sits on a blue mat {k}.",
        "rejected": "The sky is clear.",
    }


def test_preference_file_reads_trl_records_and_counts_bad_ones(tmp_path, llava_dir, tokenizer_dir, tiny_spec):
    conv = {
        "prompt": [{"role": "user", "content": "What is in the picture?"}],
        "image": "images/img1.png",
        "chosen": [{"role": "assistant", "content": "A cat."}],
        "rejected": "A dog.",
    }
    path = write_jsonl(
        llava_dir / "pref.jsonl",
        [
            _pref("images/img0.png", 0),
            conv,
            "{not json",
            {**_pref("images/img0.png", 1), "rejected": ""},
            {**_pref("images/nope.png", 2)},
        ],
    )
    with pytest.raises(UsageError) as e:
        PreferenceFile(str(path), str(tokenizer_dir), tiny_spec, "stop")
    assert "pref.jsonl:line 3" in e.value.message and "--bad-records skip" in e.value.message
    ds = PreferenceFile(str(path), str(tokenizer_dir), tiny_spec, "skip")
    assert len(ds) == 2 and ds.stats.skipped == 3 and ds.stats.records == 5
    pair = ds[1]
    n_img = sum(x == ds.ids["image_pad"] for x in pair["chosen"]["input_ids"])
    assert n_img == tiny_spec.image_tokens and pair["pixel_values"].shape[0] == 3
    start = next(k for k, x in enumerate(pair["chosen"]["labels"]) if x != -100)
    assert pair["chosen"]["input_ids"][:start] == pair["rejected"]["input_ids"][:start]


def test_dpo_on_a_preference_file_runs(llava_dir, tokenizer_dir):
    path = write_jsonl(llava_dir / "pref.jsonl", [_pref(f"images/img{k}.png", k) for k in range(3)])
    report = runner.run_profile(_cfg(objective="dpo", data=str(path), tokenizer=str(tokenizer_dir)))
    assert report["status"] == "ok" and report["data"]["samples"] == 3
    assert report["metrics"]["final_loss"] == pytest.approx(math.log(2), abs=0.05)  # policy == reference at the start


@pytest.mark.parametrize("train", ["full", "lora"])
def test_reference_is_a_copy_or_the_base_with_adapters_off(train):
    p = runner.build_patient(_cfg(objective="dpo", train=train, dpo_reference_dtype="bf16", lora_rank=4), CPU)
    ref = p.reference
    if train == "full":
        assert ref.model is not p.vlm and next(ref.model.parameters()).dtype == torch.bfloat16
        assert ref.params_bytes() == sum(x.numel() * 2 for x in p.vlm.parameters())
    else:  # no second base: only the projector's starting weights are kept
        assert ref.model is p.vlm and ref.params_bytes() == sum(x.numel() * 4 for x in p.vlm.projector.parameters())
    report_info = p.mode_info["reference"]
    assert ("copy" in report_info) == (train == "full")


def test_reference_stays_at_the_start_while_the_policy_trains():
    """After steps the reference log-probs of a batch are those of the initial model (LoRA: base + old projector)."""
    p = runner.build_patient(_cfg(objective="dpo", train="lora", lora_rank=4, lr=1e-2, dpo_reference_no_grad=True), CPU)
    batch = next(p.batches)
    batch.pop("counts"), batch.pop("pair_index")
    labels = batch.pop("labels")
    before = p.reference.logps(dict(batch), labels)
    p.batches = itertools.chain(
        [{**batch, "labels": labels, "counts": _counts(batch, labels), "pair_index": [0]}], p.batches
    )
    for _ in range(2):
        runner.train_step(p)
    after = p.reference.logps(dict(batch), labels)
    with torch.no_grad():
        policy = modes.sequence_logps(p.vlm(**batch, labels=None).logits, labels)
    assert torch.allclose(before, after, atol=1e-4) and not torch.allclose(policy, before, atol=1e-3)


def _counts(batch, labels):
    mask = batch["attention_mask"]
    return {
        "real_tokens": int(mask.sum()),
        "loss_tokens": int((labels != -100).sum()),
        "padded_tokens": mask.numel(),
        "samples": 1,
        "lengths": mask.sum(1).tolist(),
        "rows": mask.shape[0],
        "width": mask.shape[1],
    }


def test_precomputed_reference_is_reported_and_leaves_the_step(monkeypatch):
    report = runner.run_profile(
        _cfg(objective="dpo", dpo_precompute_reference=True, dpo_reference_no_grad=True, num_samples=3)
    )
    pre = report["mode"]["precompute"]
    assert report["status"] == "ok" and pre["pairs"] == 3 and pre["wall_s"] > 0 and pre["tflop"] > 0


# --- FLOPs against torch's FLOP counter ------------------------------------------------------------
GEMM_OPS = ("mm", "addmm", "convolution")


def _counted(p: runner.Patient) -> tuple[float, dict]:
    from torch.utils.flop_counter import FlopCounterMode

    batch = next(p.batches)
    p.batches = itertools.chain([batch], p.batches)
    counts = dict(batch["counts"])
    with FlopCounterMode(display=False) as fc:
        runner.train_step(p)
    per_op = fc.get_flop_counts()["Global"]
    return sum(v for k, v in per_op.items() if str(k).split(".")[1] in GEMM_OPS), counts


@pytest.mark.parametrize(
    "kw",
    [
        {"stage": 2},
        {"stage": 1},
        {"train": "lora", "lora_rank": 8, "lora_targets": "attention"},
        {"objective": "dpo", "dpo_reference_no_grad": True},
        {"objective": "dpo", "train": "lora", "lora_rank": 4, "dpo_reference_no_grad": True},
        {
            "objective": "dpo",
            "dpo_reference_no_grad": True,
            "dpo_precompute_reference": True,
            "num_samples": 2,
        },
    ],
)
def test_mode_flops_match_torch_flop_counter(kw):
    """The GEMM FLOPs (linear layers, patch convolution) of one step, counted independently by
    torch.utils.flop_counter on the padded batch; attention is left out of both sides (layers = 0)."""
    p = runner.build_patient(_cfg(lora_dropout=0.0, **kw), CPU)
    counted, c = _counted(p)
    linear_only = dataclasses.replace(p.flop_model, llm_layers=0, vision_layers=0)
    rows = c["rows"]
    expected = linear_only.step([c["width"]] * rows, p.cfg.stage, mode=p.flop_mode)["total"]
    assert counted == pytest.approx(expected, rel=1e-6)


def test_a_reference_that_tracks_grad_does_work_the_model_flops_leave_out():
    counted = {}
    for no_grad in (True, False):
        p = runner.build_patient(_cfg(objective="dpo", dpo_reference_no_grad=no_grad), CPU)
        counted[no_grad], c = _counted(p)
    assert counted[False] > counted[True] * 1.2  # its backward: waste, not in the model FLOPs


def test_lora_counts_two_base_passes_plus_six_adapter_passes(tiny_spec):
    fm = flops.FlopModel.from_spec(tiny_spec)
    full = fm.step([100], 2)
    lora = fm.step([100], 2, mode=flops.Mode("lora", adapter_params=1000))
    lin, att = fm.llm_forward([100])
    assert lora["llm"] == pytest.approx(2 * lin + 3 * att + 6 * 1000 * 100) and lora["llm"] < full["llm"]
    dpo = fm.step([100, 90], 2, mode=flops.Mode(objective="dpo"))
    lin2, att2 = fm.llm_forward([100, 90])
    assert dpo["reference"] == pytest.approx(
        lin2 + att2 + fm.vision_forward(2) + 2 * fm.projector_params * fm.image_tokens * 2
    )
    assert fm.step([100, 90], 2, mode=flops.Mode(objective="dpo", reference_in_step=False))["reference"] == 0


# --- a whole run per mode ------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"model": "tiny-llava", "train": "lora", "objective": "dpo"}])
def test_profile_reports_the_mode(kw, tmp_path):
    """A native class in both modes at once (the composite model's runs: the DPO and precompute tests above)."""
    report = runner.run_profile(_cfg(**kw))
    assert report["status"] == "ok", report.get("error")
    assert report["mode"]["train"] == kw.get("train", "full") and report["mode"]["objective"] == kw.get(
        "objective", "sft"
    )
    assert report["metrics"]["model_tflops_per_s"] > 0 and math.isfinite(report["metrics"]["final_loss"])
    json.dumps(report)


def test_advice_says_each_mode_fix_in_user_terms():
    from vlmdoctor.doctor.advice import advise

    t = advise({"dpo_precompute_reference": True, "dpo_reference_no_grad": True}, "trainer")
    assert "DPOConfig(precompute_ref_log_probs=True)  # TRL" in t and any("torch.no_grad()" in x for x in t)
    loop = advise({"dpo_reference_dtype": "bf16", "train": "lora", "optimizer": "paged_adamw_8bit"}, "loop")
    assert any("torch.bfloat16" in x for x in loop) and any("get_peft_model" in x for x in loop)
    assert any("PagedAdamW8bit" in x for x in loop)
    for audience in ("trainer", "loop"):
        lines = advise({"lora_rank": 8, "lora_targets": "attention", "dpo_beta": 0.2, "train": "qlora"}, audience)
        assert lines and not any("equivalent known" in x for x in lines)
