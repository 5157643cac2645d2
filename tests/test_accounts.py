"""The step's accounts: every millisecond of a traced GPU step in one named account, on real traces recorded on
GPUs (fixtures/), and the causes given by what the host was doing."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from vlmdoctor.trace.accounts import MAX_UNATTRIBUTED, step_accounts
from vlmdoctor.trace.facts import analyze
from vlmdoctor.trace.families.idle import name_cause
from vlmdoctor.trace.read import iter_events

FIX = Path(__file__).resolve().parents[1] / "fixtures"
#: GPU traces of several classes and habits: vlmdoctor's own runs, users' scripts (plain torch.profiler, the
#: Trainer, with_stack), a compiled run, a DDP rank, a trace without ProfilerStep markers
TRACES = [
    "traces/default_s2.pt.trace.json.gz",
    "traces/liger_compile_s2.pt.trace.json.gz",
    "traces/fp32_noautocast_s2.pt.trace.json.gz",
    "user_traces/qwen2vl_fce_s2.pt.trace.json.gz",
    "user_traces/gemma3_trainer_healthy_s2.pt.trace.json.gz",
    "user_traces/qwen2vl_fp32_autocast_s2.pt.trace.json.gz",
    "user_h100/llava_s2_modules.pt.trace.json.gz",
    "dist_h100/ddp_1gpu_rank0.pt.trace.json.gz",
]


@cache
def analyzed(trace: str) -> dict:
    """One trace's first file entry, analyzed once for every test of this module."""
    return analyze(FIX / trace)["files"][0]


@pytest.fixture(scope="module", params=TRACES)
def entry(request) -> dict:
    return analyzed(request.param)


def test_the_accounts_add_up_to_the_step(entry):
    f, acc = entry["facts"], entry["accounts"]
    assert acc["step_ms"] == f["step.ms"]
    busy = sum(r["ms"] for r in acc["rows"] if r["side"] == "GPU busy")
    idle = sum(r["ms"] for r in acc["rows"] if r["side"] == "GPU idle") + acc["unattributed_ms"]
    assert busy == pytest.approx(f["gpu.busy_ms"], rel=1e-6, abs=1e-6)
    assert idle == pytest.approx(f["gpu.idle_ms"], rel=1e-6, abs=1e-6)
    assert abs(acc["residual_ms"]) < 1e-3 * acc["step_ms"]
    assert acc["unattributed_share"] <= MAX_UNATTRIBUTED
    assert [r["ms"] for r in acc["rows"]] == sorted((r["ms"] for r in acc["rows"]), reverse=True)
    # the old idle split is the same arithmetic: its named host work is the sum of the finer accounts
    host = sum(r["ms"] for r in acc["rows"] if r["account"].startswith("idle.host."))
    assert host == pytest.approx(f["idle.other_host.ms"], rel=1e-6, abs=1e-6)


def test_a_trace_without_step_markers_says_what_no_cause_covers():
    """No ProfilerStep: outside every step marker nothing says the host ran the step, so the idle time under no
    host event is unattributed, not given to Python."""
    acc = analyzed("user_traces/qwen2vl_fp32_autocast_s2.pt.trace.json.gz")["accounts"]
    assert 0 < acc["unattributed_share"] <= MAX_UNATTRIBUTED
    assert "idle.host.python" not in {r["account"] for r in acc["rows"]}


@pytest.mark.parametrize(
    ("trace", "account", "least"),
    [
        ("traces/fp32_noautocast_s2.pt.trace.json.gz", "busy.gemm_fp32", 0.25),  # FP32 weights, no autocast
        ("traces/liger_compile_s2.pt.trace.json.gz", "idle.host.compile", 0.15),  # compiled in the window
        ("user_traces/qwen25vl_healthy_s2.pt.trace.json.gz", "idle.host.cudnn", 0.5),  # cuDNN plans, new lengths
        ("user_traces/gemma3_trainer_healthy_s2.pt.trace.json.gz", "idle.data_loader", 0.1),  # the Trainer's loader
        ("user_h100/llava_s2_modules.pt.trace.json.gz", "idle.host.python_model", 0.05),  # with_stack: model code
    ],
)
def test_the_planted_cost_is_its_own_account(trace, account, least):
    acc = analyzed(trace)["accounts"]
    share = {r["account"]: r["share"] for r in acc["rows"]}
    assert share.get(account, 0.0) >= least, share


def test_a_healthy_run_is_mostly_gemm_and_attention():
    """The tuned 1.5b run (compiled, bf16, fused loss): the GPU's compute accounts lead, no host cause is large."""
    acc = analyze(FIX / "traces/treated_1.5b_s2.pt.trace.json.gz")["files"][0]["accounts"]
    assert acc["rows"][0]["account"] == "busy.gemm_bf16"
    assert all(r["share"] < 0.1 for r in acc["rows"] if r["side"] == "GPU idle")


@pytest.mark.parametrize(
    ("name", "runtime", "cause"),
    [
        ("cudaLaunchKernel", True, "launch"),
        ("cuLaunchKernelEx", True, "launch"),
        ("cudaStreamWaitEvent", True, "runtime"),
        ("aten::_cudnn_attention_forward", False, "cudnn"),
        ("Torch-Compiled Region: 0/1", False, "compile"),
        ("TorchDynamo Cache Lookup", False, "compile"),
        ("## Call CompiledFxGraph fa5h2hzu34r6 ##", False, "launch"),
        ("c10d::allreduce_", False, "ranks"),
        ("nccl:all_reduce", False, "ranks"),
        ("aten::copy_", False, "dispatch"),
        ("autograd::engine::evaluate_function: MmBackward0", False, "dispatch"),
        ("nn.Module: Qwen2DecoderLayer_3", False, "python_model"),
        ("LigerRMSNormFunction", False, "python_range"),
        ("LigerRMSNormFunctionBackward", False, "python_range"),
        ("MmBackward0", False, "dispatch"),
        ("## forward ##", False, "python_range"),
        ("vlmdoctor::llm", False, "python_range"),
    ],
)
def test_names_give_causes(name, runtime, cause):
    assert name_cause(name, runtime) == cause


def test_a_cpu_trace_has_no_gpu_accounts():
    assert step_accounts({"step.ms": 10.0, "trace.gpu_kernels": False}) is None


# --- every large account gets a word in the diagnosis ------------------------------------------------------------


@pytest.mark.parametrize("trace", TRACES)
def test_every_large_account_is_named_in_the_diagnosis(trace):
    from vlmdoctor.doctor.rules import MIN_ACCOUNT_SHARE, diagnose, load_rules

    entry = analyzed(trace)
    rules, _ = load_rules()
    d = diagnose(entry["facts"], rules)
    said = {a["account"]: a for a in d["accounts"]}
    for row in entry["accounts"]["rows"]:
        if row["share"] >= MIN_ACCOUNT_SHARE:
            a = said[row["account"]]
            assert a["verdict"] in ("prescribed", "work", "no prescription known")
            fired = {f["id"] for f in d["findings"] + d["superseded"] + d["muted"]}
            assert (a["verdict"] == "prescribed") == bool(a["findings"]) and set(a["findings"]) <= fired
    assert all(a["share"] >= MIN_ACCOUNT_SHARE for a in d["accounts"])


def test_a_tiny_models_host_bound_step_is_prescribed_whatever_its_launch_count():
    """A user's tiny LLaVA on one H100 80GB (567 launches a step, GPU busy 3%): the host's torch ops, launches and
    Python hold most of the step, and the host-bound finding names them (it once needed 1,000 launches)."""
    from vlmdoctor.doctor.rules import diagnose, load_rules

    f = analyzed("user_h100/llava_s2_plain.pt.trace.json.gz")["facts"]
    assert f["launch.kernels"] < 1000
    d = diagnose(f, load_rules()[0])
    host = {a["account"]: a for a in d["accounts"]}["idle.host.dispatch"]
    assert host["verdict"] == "prescribed" and "batching-host-bound" in host["findings"]


def test_a_rule_naming_an_unknown_account_is_refused(tmp_path):
    from vlmdoctor.doctor.rules import load_rules

    text = (Path(__file__).resolve().parents[1] / "rules" / "system-sync-calls.yaml").read_text()
    (tmp_path / "r.yaml").write_text(
        text.replace("id: system-sync-calls", "id: my-sync").replace("[idle.sync]", "[idle.synk]")
    )
    _, problems = load_rules(tmp_path)
    assert any("unknown: idle.synk" in p for p in problems)


@pytest.mark.parametrize("trace", ["traces/default_s2.pt.trace.json.gz", "traces/bucketed_b32_s2.pt.trace.json.gz"])
def test_the_loaders_least_step_is_the_shorter_call_not_the_mean(trace):
    """Two traced steps of the single-process loader on an H100: one call stalled (50.1 and 90.9 ms), the other
    did the batch's work (9.0 and 19.8 ms). `idle.data_loader.least_ms` is the GPU's wait in the step with the
    shorter call (the GPU idles through it), the mean is mostly the stall: what `treat` moves per sample is the
    least (rules/system-data-loader.yaml `gain.grows_ms`)."""
    events = [e for e in iter_events(FIX / trace) if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") == "user_annotation"]  # the step markers and the loader's calls
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in host if e["name"].startswith("ProfilerStep#")]
    calls = [e for e in host if "DataLoader" in e["name"]]
    per_step = [
        max((c["dur"] for c in calls if s <= c["ts"] < end), default=0.0) / 1e3 for s, end in steps[-2:]
    ]  # the outermost call of each of the analyzed (last two) steps
    f = analyzed(trace)["facts"]
    assert f["idle.data_loader.least_ms"] == pytest.approx(min(per_step), rel=0.05)
    assert f["idle.data_loader.least_ms"] < 0.5 * f["idle.data_loader.ms"]
