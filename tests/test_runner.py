"""Real tiny training steps on the CPU: what trains, what the report measures, how failures end."""

from __future__ import annotations

import math

import pytest
import torch

import vlmdoctor.run.patient as patient
import vlmdoctor.run.runner as runner
from vlmdoctor.errors import EXIT_FAILED_RUN, EXIT_NAN, EXIT_OK, EXIT_OOM, UsageError
from vlmdoctor.run.data import BatchSampler, SyntheticVQA
from vlmdoctor.run.runner import build_patient, exit_code, run_profile, train_step
from vlmdoctor.run.zoo import resolve

CPU = torch.device("cpu")


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> list[str]:
    now = module.state_dict()
    return [k for k, v in before.items() if not torch.equal(v, now[k])]


def _grad_probe(params):
    """Record the gradient norm of each parameter as autograd produces it."""
    seen = {}
    for name, p in params:
        p.register_hook(lambda g, name=name: seen.__setitem__(name, float(g.float().norm())))
    return seen


# --- what each stage trains ---------------------------------------------------------------------------


@pytest.mark.parametrize("reentrant", [False, True])
def test_stage1_trains_only_the_projector(tiny_cfg, reentrant):
    p = build_patient(tiny_cfg(stage=1, checkpoint_use_reentrant=reentrant), CPU)
    vlm = p.vlm
    enabled = getattr(vlm.llm, "is_activation_checkpointing", None)
    assert enabled if enabled is not None else vlm.llm.is_gradient_checkpointing
    assert not any(q.requires_grad for q in vlm.llm.parameters())
    assert not any(q.requires_grad for q in vlm.vision.parameters())
    opt_params = {id(q) for g in p.optimizer.param_groups for q in g["params"]}
    assert opt_params == {id(q) for q in vlm.projector.parameters()}
    llm0, vis0, proj0 = _snapshot(vlm.llm), _snapshot(vlm.vision), _snapshot(vlm.projector)
    grads = _grad_probe(vlm.projector.named_parameters())
    for _ in range(2):
        loss, counts = train_step(p)
        assert math.isfinite(float(loss))
    # gradients reached the projector through the frozen (checkpointed) LLM
    assert set(grads) == {n for n, _ in vlm.projector.named_parameters()}
    assert all(g > 0 and math.isfinite(g) for g in grads.values())
    assert set(_changed(proj0, vlm.projector)) == set(proj0)
    assert _changed(llm0, vlm.llm) == []
    assert _changed(vis0, vlm.vision) == []


def test_stage2_trains_llm_and_projector_not_vision(tiny_cfg):
    p = build_patient(tiny_cfg(stage=2), CPU)
    vlm = p.vlm
    llm0, vis0, proj0 = _snapshot(vlm.llm), _snapshot(vlm.vision), _snapshot(vlm.projector)
    grads = _grad_probe(vlm.llm.named_parameters())
    train_step(p)
    assert grads and all(math.isfinite(g) for g in grads.values())
    changed = _changed(llm0, vlm.llm)
    # every LLM weight moves (AdamW: any non-zero gradient gives a step of ~lr)
    assert set(changed) == set(llm0)
    assert _changed(proj0, vlm.projector)
    assert _changed(vis0, vlm.vision) == []
    assert not any(q.requires_grad for q in vlm.vision.parameters())


def test_grad_accum_consumes_micro_batches(tiny_cfg):
    p = build_patient(tiny_cfg(grad_accum=2, batch_size=2), CPU)
    _, counts = train_step(p)
    assert counts["samples"] == 4
    assert len(counts["lengths"]) == 4


# --- the report -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ok_report():
    from vlmdoctor.run.config import RunConfig

    cfg = RunConfig(model="tiny", device="cpu", steps=2, warmup=1, num_samples=64, autocast="off")
    return cfg, run_profile(cfg)


def test_report_ok_run(ok_report):
    cfg, r = ok_report
    assert r["status"] == "ok"
    assert exit_code(r) == EXIT_OK
    assert r["schema_version"] == 1
    assert r["config"] == cfg.to_dict()
    m = r["metrics"]
    assert m["real_tokens_per_s"] > 0
    assert 0 < m["loss_tokens_per_s"] < m["real_tokens_per_s"]
    assert 0 <= m["pad_fraction"] < 1
    assert math.isfinite(m["final_loss"]) and m["loss_finite"] is True
    assert m["mfu"] is None  # no peak for a CPU
    assert m["peak_mem_gb"] is None
    assert m["step_ms"] > 0
    assert m["steps_per_repeat"] == 2
    assert len(r["repeats"][0]["step_ms"]) == 2
    env = r["env"]
    assert env["torch"] == torch.__version__
    import transformers

    assert env["transformers"] == transformers.__version__
    assert env["device_type"] == "cpu" and env["gpu"] is None
    assert r["model"]["params"]["llm"] > 0
    assert r["data"]["source"] == "synthetic"


def test_warmup_time_is_reported_apart_from_step_time(ok_report):
    _, r = ok_report
    assert r["metrics"]["warmup_s"] > 0 and r["metrics"]["compile_s"] is None  # compile off: nothing to compile
    assert r["warmup"]["steps"] == 1 and r["warmup"]["warmup_s"] == pytest.approx(sum(r["warmup"]["step_s"]))
    assert "graphs_compiled" not in r["warmup"] and not r.get("warnings")


def test_warmup_times_split_compilation_from_steady_steps():
    from vlmdoctor.run.runner import _warmup_times

    w = _warmup_times([30.0, 2.0, 0.5, 0.5])
    assert w["warmup_s"] == pytest.approx(33.0) and w["compile_s"] == pytest.approx(29.5 + 1.5)
    assert _warmup_times([])["compile_s"] == 0.0


def test_compile_helpers_mark_lengths_dynamic_and_name_cache_folders(tmp_path):
    from vlmdoctor.run.compile import cache_env, graphs_compiled, mark_lengths_dynamic

    batch = {
        "input_ids": torch.zeros(2, 64, dtype=torch.long),
        "attention_mask": torch.ones(2, 64),
        "loss_index": torch.arange(10),
        "pixel_values": torch.zeros(2, 3, 8, 8),
    }
    mark_lengths_dynamic(batch)
    assert 1 in getattr(batch["input_ids"], "_dynamo_weak_dynamic_indices", set()) | getattr(
        batch["input_ids"], "_dynamo_dynamic_indices", set()
    )
    assert 0 in getattr(batch["loss_index"], "_dynamo_weak_dynamic_indices", set()) | getattr(
        batch["loss_index"], "_dynamo_dynamic_indices", set()
    )
    for k in (
        "input_ids",
        "attention_mask",
        "pixel_values",
    ):  # the batch dimension: one graph for every batch size
        assert 0 in getattr(batch[k], "_dynamo_weak_dynamic_indices", set()) | getattr(
            batch[k], "_dynamo_dynamic_indices", set()
        )
    assert 1 not in getattr(batch["pixel_values"], "_dynamo_weak_dynamic_indices", set())  # image sizes stay fixed
    env = cache_env(tmp_path / "cc")
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path)) and env["TRITON_CACHE_DIR"].endswith("triton")
    assert graphs_compiled() >= 0


def test_report_token_counts_come_from_the_real_batches(ok_report):
    """Pad fraction and the loss/real token ratio equal what the sampler's timed batches hold."""
    cfg, r = ok_report
    spec = resolve("tiny")
    ds = SyntheticVQA(spec, cfg.num_samples, cfg.seed)
    batches = list(BatchSampler(ds.lengths, cfg.batch_size, bucketed=False, seed=cfg.seed))
    warm = r["warmup"]["steps"]  # the warm-up asked, or longer where its steps had not settled
    timed = batches[warm : warm + cfg.steps]
    real = sum(ds.lengths[i] for b in timed for i in b)
    padded = sum(cfg.batch_size * max(ds.lengths[i] for i in b) for b in timed)
    answer = sum(int(ds.answers[i]) for b in timed for i in b)
    m = r["metrics"]
    assert m["pad_fraction"] == pytest.approx(1 - real / padded)
    rep = r["repeats"][0]
    assert sum(rep["step_real_tokens"]) == real and sum(rep["step_loss_tokens"]) == answer
    # the headline is the one estimator: the median of the per-step rates (run/throughput.py)
    rates = sorted(t / (ms / 1e3) for t, ms in zip(rep["step_real_tokens"], rep["step_ms"]))
    assert m["real_tokens_per_s"] == pytest.approx((rates[0] + rates[1]) / 2)  # two steps: their mean
    assert m["real_tokens_per_s"] == r["throughput"]["real_tokens_per_s"]
    assert m["mfu"] is None and m["mfu_reason"].startswith("no peak known for ")  # a CPU run
    assert m["flops_per_step"] > 0
    assert m["flops_per_step"] == pytest.approx(sum(rep["step_flops"]) / len(rep["step_flops"]))


def test_first_loss_is_near_uniform_over_vocab(ok_report):
    # random init: cross entropy starts near ln(vocab) (an independent sanity check that the loss is real)
    _, r = ok_report
    assert abs(r["metrics"]["final_loss"] - math.log(2048)) < 0.5


def test_repeats(tiny_cfg):
    r = run_profile(tiny_cfg(repeats=2))
    assert r["status"] == "ok"
    assert r["metrics"]["repeats"] == 2
    assert r["stats"]["real_tokens_per_s"]["n"] == 2
    assert len(r["repeats"]) == 2
    assert r["stats"]["step_ms"]["n"] == 4  # 2 repeats x 2 steps
    s = r["stats"]["real_tokens_per_s"]
    assert s["min"] <= r["metrics"]["real_tokens_per_s"] <= s["max"]


def test_oom_is_recorded(tiny_cfg, monkeypatch):
    def oom(_p):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(runner, "train_step", oom)
    r = run_profile(tiny_cfg())
    assert r["status"] == "oom"
    assert r["error"]["requested_gb"] == 2.0
    assert "out of memory" in r["error"]["message"]
    assert exit_code(r) == EXIT_OOM
    assert "metrics" not in r


@pytest.mark.parametrize(
    "error, gb, where",
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB."), 0.5, "gpu"),
        (MemoryError(), None, "host"),  # the host's memory, on a CPU run: exit 3 as on the GPU, not 1
        (
            RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes."),
            1,
            "host",
        ),
    ],
)
def test_out_of_memory_on_the_gpu_or_the_host_is_recorded_and_exits_3(tiny_cfg, monkeypatch, error, gb, where):
    def oom(_p):
        raise error

    monkeypatch.setattr(runner, "train_step", oom)
    r = run_profile(tiny_cfg())
    assert r["status"] == "oom" and exit_code(r) == EXIT_OOM
    assert r["error"]["requested_gb"] == (pytest.approx(gb) if gb else None) and r["error"]["where"] == where


def test_crash_in_a_step_is_a_failed_run(tiny_cfg, monkeypatch):
    def crash(_p):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(runner, "train_step", crash)
    r = run_profile(tiny_cfg())
    assert r["status"] == "error"
    assert r["error"]["type"] == "RuntimeError"
    assert "illegal memory access" in r["error"]["message"]
    assert exit_code(r) == EXIT_FAILED_RUN


def test_huge_learning_rate_diverges_to_nan(tiny_cfg):
    # a real divergence: lr=1e30 blows the weights up after the first AdamW step
    r = run_profile(tiny_cfg(lr=1e30, steps=3))
    assert r["status"] == "nan_loss"
    assert r["metrics"]["loss_finite"] is False
    assert not math.isfinite(r["metrics"]["final_loss"])
    assert exit_code(r) == EXIT_NAN
    # control: the same run at a sane learning rate stays finite
    ok = run_profile(tiny_cfg(steps=3))
    assert ok["status"] == "ok" and math.isfinite(ok["metrics"]["final_loss"])


# --- data-layout knobs ---------------------------------------------------------------------------------


def test_packing_lowers_padding(tiny_cfg):
    # default batch (4) and pack length (2048): the 4 samples of a step share one row
    plain = run_profile(tiny_cfg())
    packed = run_profile(tiny_cfg(packing=True))
    assert plain["status"] == packed["status"] == "ok"
    assert plain["metrics"]["pad_fraction"] > 0.02
    assert packed["metrics"]["pad_fraction"] < plain["metrics"]["pad_fraction"]
    assert packed["metrics"]["pad_fraction"] < 0.01
    # the same samples, so the same real tokens per step
    assert packed["repeats"][0]["step_real_tokens"] == plain["repeats"][0]["step_real_tokens"]
    assert math.isfinite(packed["metrics"]["final_loss"])


def test_length_bucketed_run(tiny_cfg):
    r = run_profile(tiny_cfg(sampler="length_bucketed", batch_size=8))
    assert r["status"] == "ok"
    assert 0 <= r["metrics"]["pad_fraction"] < 0.05


def test_pad_to_multiple_of_run(tiny_cfg):
    plain = run_profile(tiny_cfg())
    r = run_profile(tiny_cfg(pad_to_multiple_of=64))
    assert r["status"] == "ok"
    # the same batches, padded further: more padding, same real tokens per step
    assert r["metrics"]["pad_fraction"] > plain["metrics"]["pad_fraction"]
    assert r["repeats"][0]["step_real_tokens"] == plain["repeats"][0]["step_real_tokens"]


def test_cached_vision_features_give_the_same_losses(tiny_cfg):
    plain = run_profile(tiny_cfg())
    cached = run_profile(tiny_cfg(cache_vision_features=True))
    assert cached["status"] == "ok"
    assert cached["repeats"][0]["final_loss"] == pytest.approx(plain["repeats"][0]["final_loss"], abs=1e-4)
    # the tower does not run, so the model FLOPs per step drop
    assert sum(cached["repeats"][0]["step_flops"]) < sum(plain["repeats"][0]["step_flops"])


def test_bf16_autocast_run(tiny_cfg):
    r = run_profile(tiny_cfg(autocast="bf16", steps=1, warmup=0))
    assert r["status"] == "ok"
    assert math.isfinite(r["metrics"]["final_loss"])


# --- usage errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["liger_rope", "liger_rms_norm", "liger_swiglu", "liger_fused_linear_cross_entropy"])
def test_liger_on_cpu_is_usage_error(tiny_cfg, flag):
    with pytest.raises(UsageError, match="Triton|GPU|CUDA"):
        run_profile(tiny_cfg(**{flag: True}))


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_gpu_only_attention_on_cpu_is_usage_error(tiny_cfg, backend):
    with pytest.raises(UsageError, match=backend):
        run_profile(tiny_cfg(attention=backend))


def test_packing_with_eager_attention_is_usage_error(tiny_cfg):
    with pytest.raises(UsageError, match="sdpa"):
        run_profile(tiny_cfg(packing=True, attention="eager"))


def test_too_few_samples_is_usage_error(tiny_cfg):
    with pytest.raises(UsageError, match="num-samples"):
        run_profile(tiny_cfg(num_samples=2, batch_size=4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("model", ["0.5b", "1.5b", "llava-1.5-7b"])
def test_gpu_preset_without_gpu_says_use_device_cpu(model):
    from vlmdoctor.run.config import RunConfig

    with pytest.raises(UsageError, match="--device cpu"):
        run_profile(RunConfig(model=model, device="auto"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_gpu_is_usage_error(tiny_cfg):
    with pytest.raises(UsageError, match="--device cpu"):
        run_profile(tiny_cfg(device="cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_tiny_with_device_auto_runs_on_cpu(tiny_cfg):
    r = run_profile(tiny_cfg(device="auto", steps=1, warmup=0))
    assert r["status"] == "ok" and r["env"]["device_type"] == "cpu"


# --- knobs that reproduce common mistakes, and their fixes ----------------------------------------


def _loss_and_head_grad(cfg) -> tuple[float, torch.Tensor, dict, dict]:
    """One batch through a fresh patient: the loss, the LM head's gradient, the batch and its counts."""
    p = build_patient(cfg, CPU)
    batch = patient.to_device(next(p.batches), CPU, torch.float32)
    counts = batch.pop("counts")
    loss = p.model(**batch).loss
    loss.backward()
    return float(loss.detach()), p.vlm.llm.get_output_embeddings().weight.grad.clone(), batch, counts


def test_labeled_only_head_gives_the_same_loss_and_gradients(tiny_cfg):
    """The LM head on labeled positions only is the same loss, with the same gradients, on fewer rows."""
    losses, grads = [], []
    for labeled in (False, True):
        loss, grad, batch, counts = _loss_and_head_grad(
            tiny_cfg(stage=2, lm_head_labeled_only=labeled, gradient_checkpointing=False)
        )
        assert ("loss_index" in batch) == labeled
        if labeled:
            assert len(batch["loss_index"]) == counts["loss_tokens"] < counts["real_tokens"]
        losses.append(loss)
        grads.append(grad)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


@pytest.mark.slow
def test_regional_compilation_gives_the_eager_loss_and_gradients(tiny_cfg):
    """The compiled layers and the compiled head-and-loss region compute what eager does."""
    losses, grads = [], []
    for regions in (False, True):
        extra = {"compile": "default", "compile_regions": True} if regions else {}
        loss, grad, _, _ = _loss_and_head_grad(
            tiny_cfg(stage=2, lm_head_labeled_only=True, gradient_checkpointing=False, **extra)
        )
        losses.append(loss)
        grads.append(grad)
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def test_the_labeled_head_traces_inside_a_whole_model_graph(tiny_cfg):
    """Dynamo (eager backend: tracing only, no Inductor) goes through the labeled head's path: its
    dynamic mark is skipped while compiling, where dynamo forbids it."""
    p = build_patient(tiny_cfg(stage=2, lm_head_labeled_only=True, gradient_checkpointing=False), CPU)
    batch = patient.to_device(next(p.batches), CPU, torch.float32)
    batch.pop("counts")
    eager = float(p.vlm(**batch).loss)
    traced = torch.compile(p.vlm, backend="eager", fullgraph=False)(**batch).loss
    assert float(traced) == pytest.approx(eager, rel=1e-5)


def test_labeled_only_head_counts_fewer_model_flops(tiny_cfg):
    full = run_profile(tiny_cfg(steps=1, warmup=0))["repeats"][0]
    labeled = run_profile(tiny_cfg(steps=1, warmup=0, lm_head_labeled_only=True))["repeats"][0]
    assert sum(labeled["step_flops"]) < sum(full["step_flops"])


def test_input_require_grads_makes_the_frozen_tower_build_a_graph(tiny_cfg):
    for flag, no_grad, graph in ((False, False, False), (True, False, True), (True, True, False)):
        p = build_patient(tiny_cfg(input_require_grads=flag, vision_no_grad=no_grad), CPU)
        batch = patient.to_device(next(p.batches), CPU, torch.float32)
        feats = p.vlm.encode_images(batch["pixel_values"])
        assert feats.requires_grad == graph, (flag, no_grad)
        assert not any(q.requires_grad for q in p.vlm.vision.parameters())


def test_sync_loss_reads_the_loss_every_micro_batch(tiny_cfg):
    p = build_patient(tiny_cfg(sync_loss=True, grad_accum=2, batch_size=2), CPU)
    loss, counts = train_step(p)
    assert len(counts["host_losses"]) == 2
    assert sum(counts["host_losses"]) == pytest.approx(float(loss), rel=1e-5)


def test_a_compiled_run_warms_up_until_its_time_per_token_settles():
    from vlmdoctor.run.runner import SETTLE_RATIO, _unsettled

    assert _unsettled([1.0, 1.0])  # fewer than three steps: not yet
    assert _unsettled([3.0, 1.5, 1.0])  # still getting faster
    assert not _unsettled([5.0, 1.0, 1.1, 1.0])  # the last three agree
    assert _unsettled([1.0, 1.0, SETTLE_RATIO * 1.05])  # one slow step among them


def test_regional_compilation_finds_the_stacks_of_any_model():
    """The tower's encoder layers and the decoder layers, by structure, each compiled in place; and the
    LM head with its loss as one more region, unless Liger's FusedCE computes them."""
    from vlmdoctor.run.compile import compile_regions, repeated_blocks
    from vlmdoctor.run.model import build_model

    vlm = build_model(resolve("tiny"))
    blocks = repeated_blocks(vlm)
    decoder, tower = list(vlm.llm.model.layers), [m for m in blocks if m not in list(vlm.llm.model.layers)]
    assert all(any(b is d for b in blocks) for d in decoder) and len(tower) >= 2
    assert not any(b is vlm.llm.model for b in blocks)  # whole models stay eager around their layers
    eager_loss = vlm.head_loss
    n = compile_regions(vlm, "default")
    assert n == len(blocks) + 1 and all(getattr(b, "_compiled_call_impl", None) is not None for b in blocks)
    assert vlm.head_loss is not eager_loss and getattr(vlm.head_loss, "_torchdynamo_orig_callable", None) is eager_loss

    fused = build_model(resolve("tiny"))
    fused.fused_ce = True  # Liger's kernel takes the head and the loss: nothing to compile there
    assert compile_regions(fused, "default") == len(repeated_blocks(fused)) and fused.head_loss is eager_loss


def test_regional_compilation_is_a_way_to_compile_not_a_switch_of_its_own():
    from vlmdoctor.run.config import RunConfig

    with pytest.raises(UsageError, match="add --compile"):
        RunConfig(compile_regions=True).validate("command line")
    with pytest.raises(UsageError, match="do not stack"):
        RunConfig(compile="default", compile_regions=True, compile_vision="fullgraph").validate("command line")
    # CUDA graphs per layer: measured on the H100, the next layer's replay overwrote the last one's output
    with pytest.raises(UsageError, match="reduce-overhead do not stack"):
        RunConfig(compile="reduce-overhead", compile_regions=True).validate("command line")
    for mode in ("default", "max-autotune"):
        RunConfig(compile=mode, compile_regions=True).validate("command line")


@pytest.mark.slow
@pytest.mark.parametrize("regions", [True, False])
def test_a_compiled_tiny_model_with_the_labeled_head_trains(regions):
    """By region (the head-and-loss region too) and whole: the labeled head's dynamic mark is made only
    outside a compiled graph, where dynamo allows it (inside one it raised)."""
    from vlmdoctor.run.config import RunConfig

    cfg = RunConfig(
        model="tiny",
        device="cpu",
        steps=2,
        warmup=3,
        compile="default",
        compile_regions=regions,
        pad_to_multiple_of=16,
        lm_head_labeled_only=True,
    )
    r = runner.run_profile(cfg)
    assert r["status"] == "ok", r.get("error")
    assert r["warmup"]["graphs_compiled_in_timed_windows"] == 0
