"""`vlmdoctor analyze` on traces from a user's own training, not vlmdoctor's runs (issue 10, items 1-2).

The CPU traces are recorded here, once per module, by plain torch.profiler around a tiny native
transformers VLM trained by a user-style loop (fixtures/user_cpu/record.py). The GPU traces in
fixtures/user_h100/ were recorded by the same script on an H100 (its README says how): they
hold the classes a CPU trace cannot show (kernels, no data-loader ops, recompute on the GPU).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from vlmdoctor.cli import app
from vlmdoctor.doctor.rules import diagnose, load_rules
from vlmdoctor.trace.facts import (
    _measure,
    analyze,
    intersect,
    load_tables,
    op_context,
    subtract,
    total,
    union,
)

ROOT = Path(__file__).resolve().parents[1]
H100 = ROOT / "fixtures" / "user_h100"
RULES, _ = load_rules()

_spec = importlib.util.spec_from_file_location("user_record", ROOT / "fixtures" / "user_cpu" / "record.py")
user_record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(user_record)

#: what a user might have turned on; each is recorded once for the whole module
RECIPES = {
    "plain": {},  # the tutorial: schedule(wait=1, warmup=1, active=2), nothing else
    "stack_s1": {"with_stack": True, "stage": 1},
    "modules_s2": {"with_modules": True, "with_stack": True, "record_shapes": True},
    "qwen2vl_stack": {"model": "qwen2vl", "with_stack": True},
    "ckpt_2mb_noschedule": {"checkpointing": True, "micro_batches": 2, "schedule": False},
    "loader_shapes_memory_thread": {
        "dataloader": True,
        "record_shapes": True,
        "profile_memory": True,
        "busy_thread": True,
    },
    "inference": {"inference": True, "schedule": False},
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("user_traces")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model gains nothing from intra-op threads, and they thrash on a shared CPU
    try:
        out = {name: user_record.record(d / f"{name}.json", **kw) for name, kw in RECIPES.items()}
        out["handler_gz"] = user_record.record(d / "tb_gz", handler="gz")
        out["handler_json"] = user_record.record(d / "tb_json", handler="json")
    finally:
        torch.set_num_threads(threads)
    return out


@pytest.fixture(scope="module")
def facts_of(traces):
    cache: dict = {}

    def get(name: str, **kw) -> dict:
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = analyze(traces[name], **kw)["files"][0]["facts"]
        return cache[key]

    return get


def _h100(name: str) -> Path:
    return H100 / f"{name}.pt.trace.json.gz"


@pytest.fixture(scope="module")
def h100():
    cache: dict = {}

    def get(name: str, **kw) -> tuple[dict, dict]:
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            f = analyze(_h100(name), **kw)["files"][0]["facts"]
            cache[key] = (f, diagnose(f, RULES))
        return cache[key]

    return get


# --- 1. never a traceback ------------------------------------------------------------------------


def test_every_user_trace_analyzes_and_diagnoses(traces, facts_of):
    for name in RECIPES:
        f = facts_of(name)
        d = diagnose(f, RULES)
        assert f["trace.written_by_vlmdoctor"] is False
        assert f["trace.gpu_kernels"] is False  # CPU-only: said, not crashed on
        assert any("no GPU kernels" in w for w in f["trace.warnings"])
        assert d["findings"] == [] or all(x["evidence"] for x in d["findings"])


def test_window_source(facts_of):
    assert facts_of("plain")["trace.windows_from"] == "ProfilerStep"
    assert facts_of("plain")["trace.steps"] == 2  # schedule(wait=1, warmup=1, active=2)
    f = facts_of("inference")
    assert f["trace.windows_from"] == "whole trace" and f["trace.steps"] == 1
    assert any("no ProfilerStep" in w for w in f["trace.warnings"])


def test_tensorboard_handler_folders(traces):
    for name, suffix in (("handler_gz", ".pt.trace.json.gz"), ("handler_json", ".pt.trace.json")):
        files = list(traces[name].iterdir())
        assert files and all(p.name.endswith(suffix) for p in files)
        res = analyze(traces[name])
        assert len(res["files"]) == len(files)
        assert res["files"][0]["facts"]["trace.windows_from"] == "ProfilerStep"


def test_folder_of_ranks(tmp_path):
    for rank, name in enumerate(("llava_s2_plain", "llava_s1_plain")):
        shutil.copy(_h100(name), tmp_path / f"host_pid.{rank}.pt.trace.json.gz")
    res = analyze(tmp_path)
    assert [e["facts"]["run.stage"] for e in res["files"]] == [2, 1]


@pytest.mark.parametrize("name", sorted(p.name.split(".")[0] for p in H100.glob("*.json.gz")))
def test_gpu_traces_without_data_loader_ops_analyze(h100, name):
    """The H100 crash: no data-loader ops (batches built in the loop) is an empty interval set."""
    f, d = h100(name, stage=2)
    assert f["trace.gpu_kernels"] and f["gpu.busy_ms"] > 0
    if "dataloader" not in name:
        assert f["idle.data_loader.ms"] == 0.0
    else:
        assert f["idle.data_loader.ms"] >= 0.0
    assert f["part.source"] in ("module hierarchy", "none")


@pytest.mark.slow
def test_compiled_regions(tmp_path):
    """torch.compile (aot_eager keeps the compiled regions; Inductor on a CPU takes minutes): ~40 s, so slow."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        p = user_record.record(tmp_path / "compiled.json", compile="aot_eager", with_stack=True)
    finally:
        torch.set_num_threads(threads)
    f = analyze(p)["files"][0]["facts"]
    diagnose(f, RULES)
    assert f["shapes.micro_batches_per_step"] == 1 and "estimated" in f["shapes.micro_batches_per_step.source"]
    assert "run.stage" not in f and "no linear-layer backward" in f["run.stage_estimate_why"]


def test_empty_interval_sets():
    empty = (np.zeros(0), np.zeros(0))
    a = union(np.array([0.0, 5.0]), np.array([2.0, 9.0]))
    for iv in (intersect(a, empty), intersect(empty, a), subtract(empty, a), intersect(empty, empty)):
        assert total(iv) == 0.0
    assert total(subtract(a, empty)) == total(a) == 6.0
    assert list(_measure(empty, np.array([1.0, 3.0]))) == [0.0, 0.0]


# --- 2. estimates, said to be estimates ----------------------------------------------------------


def test_micro_batches_estimated_and_flagged(facts_of):
    f = facts_of("plain")
    assert f["shapes.micro_batches_per_step"] == 1
    assert f["shapes.micro_batches_per_step.source"].startswith("estimated from forward/backward")
    f = facts_of("ckpt_2mb_noschedule")  # 2 loop steps x 2 micro-batches, the whole trace one window
    assert f["shapes.micro_batches_per_step"] == 4
    assert "estimated" in f["shapes.micro_batches_per_step.source"]
    f = facts_of("loader_shapes_memory_thread")  # record_shapes: measured, and says so
    assert f["shapes.micro_batches_per_step"] == 1
    assert f["shapes.micro_batches_per_step.source"].startswith("measured")
    f = facts_of("inference")  # no backward: the loss calls (2 forward passes with labels)
    assert f["shapes.micro_batches_per_step"] == 2
    assert "loss" in f["shapes.micro_batches_per_step.source"]


def test_stage_estimated_from_weight_gradients(facts_of, h100):
    for f in (
        facts_of("plain"),
        facts_of("modules_s2"),
        facts_of("qwen2vl_stack"),
        h100("llava_s2_plain")[0],
    ):
        assert f["run.stage"] == 2 and f["run.stage_source"].startswith("estimated")
    for f in (facts_of("stack_s1"), h100("llava_s1_plain")[0]):
        assert f["run.stage"] == 1 and "LLM frozen" in f["run.stage_source"]
    assert "LLM" in facts_of("stack_s1")["run.stage_source"]  # module hierarchy: the LLM's own layers
    f = facts_of("inference")
    assert "run.stage" not in f and "no backward" in f["run.stage_estimate_why"]


def test_not_evaluated_names_the_profiler_option(facts_of, h100):
    f, d = h100("llava_s2_plain", stage=2)
    hints = {n["id"]: n.get("hint") for n in d["not_evaluated"]}
    assert hints["batching-gpu-underfed"] == "profile_memory=True"
    assert "record_shapes=True" in hints.values()
    assert any(h and "with_stack=True" in h for h in hints.values())  # parts: no module hierarchy recorded
    f, d = h100("llava_s2_dataloader_shapes_mem", stage=2)  # memory and shapes on: those hints are gone
    hints = {n["id"]: n.get("hint") for n in d["not_evaluated"]}
    assert "profile_memory=True" not in hints.values() and "record_shapes=True" not in hints.values()
    d = diagnose(facts_of("plain"), RULES)  # CPU-only: rules that need GPU kernel facts do not apply here
    assert any("a fact of GPU runs" in n["why"] for n in d["not_applicable"])


# --- 3. --stage / --model overrides --------------------------------------------------------------


def test_stage_override_that_contradicts_the_trace_warns(h100, cli_runner, tmp_path):
    f, _ = h100("llava_s1_plain", stage=2)
    assert f["run.stage"] == 2 and f["run.stage_source"] == "--stage" and f["run.stage_estimate"] == 1
    assert any("--stage 2 contradicts" in n for n in f["run.notes"])
    f, _ = h100("llava_s2_plain", stage=2)
    assert f["run.notes"] == []
    out = tmp_path / "a.json"
    r = cli_runner.invoke(app, ["analyze", str(_h100("llava_s2_plain")), "--stage", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "contradicts" in " ".join(r.output.split())
    assert json.loads(out.read_text())["files"][0]["facts"]["run.notes"]


def test_stage_override_of_a_recorded_run_config_warns():
    trace = ROOT / "fixtures" / "traces" / "bf16_s2.pt.trace.json.gz"
    f = analyze(trace, stage=1)["files"][0]["facts"]
    assert f["run.stage"] == 1 and any("overrides stage 2" in n for n in f["run.notes"])
    f = analyze(trace)["files"][0]["facts"]
    assert f["run.stage_source"] == "run config in the trace" and f["run.notes"] == []


def test_unknown_model_is_refused(cli_runner):
    r = cli_runner.invoke(app, ["analyze", str(_h100("llava_s2_plain")), "--model", "bogus"])
    assert r.exit_code == 2 and "valid presets" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) <= 2


# --- 4. rules fire on the facts a user's trace has -----------------------------------------------


def test_recompute_fires_without_memory_with_a_caveat(h100):
    f, d = h100("llava_s2_ckpt_autocast")
    assert "memory.peak_reserved_frac" not in f and f["recompute.share"] > 0.05
    hit = {x["id"]: x for x in d["findings"] + d["superseded"]}
    ev = " ".join(hit["system-checkpoint-recompute"]["evidence"])
    assert "not measured: memory.peak_reserved_frac (record with profile_memory=True)" in ev
    assert "n/a" not in ev  # the memory line is left out, not shown empty


def test_memory_still_rules_the_fix_out_when_measured(h100):
    f, _ = h100("llava_s2_ckpt_autocast")
    full = {
        **f,
        "memory.peak_reserved_frac": 0.9,
        "memory.peak_reserved_gb": 70.0,
        "memory.device_total_gb": 79.0,
    }
    assert "system-checkpoint-recompute" not in {x["id"] for x in diagnose(full, RULES)["findings"]}


def test_cast_rule_tells_weight_casts_by_their_op_without_shapes(h100):
    f, d = h100("llava_s2_ckpt_autocast")
    assert "precision-autocast-casts" not in {n["id"] for n in d["not_evaluated"]}
    # no record_shapes: a cast inside aten::linear is autocast casting an fp32 weight, and the evidence says how
    assert f["casts.classified_by"] == "parent op" and f["casts.weight.count"] > f["casts.island.count"]
    found = [x for x in d["findings"] if x["id"] == "precision-autocast-casts"]
    assert found and any("told apart by parent op" in e for e in found[0]["evidence"])


def test_has_in_rules_is_validated(tmp_path):
    from vlmdoctor.doctor.rule_expr import RuleError
    from vlmdoctor.doctor.rule_file import rule_from

    base = {"id": "x", "layer": 5, "title": "t", "severity": "low", "evidence": [], "fix": "f", "patch": {}}
    with pytest.raises(RuleError):
        rule_from(tmp_path / "x.yaml", {**base, "when": "has(no.such_fact)"})
    with pytest.raises(RuleError):
        rule_from(tmp_path / "x.yaml", {**base, "when": "has(1)"})
    r = rule_from(tmp_path / "x.yaml", {**base, "when": "has(memory.peak_reserved_frac)"})
    assert diagnose({}, [r])["findings"] == [] and diagnose({}, [r])["not_evaluated"] == []
    assert diagnose({"memory.peak_reserved_frac": 0.1}, [r])["findings"]


# --- 5. model parts from the module hierarchy ----------------------------------------------------


def _op_parts(path: Path) -> dict[str, set]:
    t = load_tables(path)
    ctx = op_context(t)
    mm = t.ops["name"].astype(str).isin(["aten::mm", "aten::addmm"]).to_numpy()
    out: dict[str, set] = {}
    for part, phase in zip(ctx["part"].to_numpy()[mm], ctx["phase"].to_numpy()[mm]):
        out.setdefault(phase, set()).add(part)
    return out


def test_parts_from_module_hierarchy_on_cpu(traces, facts_of):
    for name in ("modules_s2", "qwen2vl_stack"):
        assert facts_of(name)["part.source"] == "module hierarchy"
        parts = _op_parts(traces[name])
        assert {"vision", "projector", "llm"} <= parts["forward"], (name, parts)
        assert {"projector", "llm"} <= parts["backward"], (
            name,
            parts,
        )  # backward GEMMs through sequence numbers
    assert facts_of("plain")["part.source"] == "none"
    assert _op_parts(traces["plain"])["forward"] <= {"other", "loss"}


def test_head_dims_per_part_from_module_hierarchy(facts_of):
    f = facts_of("modules_s2")  # with_stack + record_shapes: SDPA shapes land in the part that called them
    assert f["attention.vision.head_dims"] == [16] and f["attention.llm.head_dims"] == [16]  # hidden 64, 4 heads
    assert "attention.vision.head_dims" not in facts_of("plain")


def test_gpu_time_by_part_from_module_hierarchy(h100):
    f, _ = h100("llava_s2_modules")
    assert f["part.source"] == "module hierarchy"
    for part in ("vision", "projector", "llm"):
        assert f[f"part.{part}.ms"] > 0
    assert f["part.llm.backward_ms"] > 0 and f["part.projector.backward_ms"] > 0
    assert f["part.other.share"] < 0.2  # only the LM head and glue are left outside a part
    f, d = h100("llava_s2_plain")
    assert f["part.source"] == "none" and f["part.other.share"] > 0.8


# --- 6. files that are not torch.profiler traces -------------------------------------------------

BAD = {
    "not_json.json": "hello, not json",
    "array.json": "[1, 2]",
    "no_events.json": '{"schemaVersion": 1}',
    "non_objects.json": '{"traceEvents": [1, 2, 3]}',
    "text_ts.json": '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": "soon", "dur": 1}]}',
    "truncated.json": '{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1',
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_not_a_trace_is_one_line_exit_2(cli_runner, tmp_path, name):
    p = tmp_path / name
    p.write_text(BAD[name])
    r = cli_runner.invoke(app, ["analyze", str(p)])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and r.output.startswith("error:")


def test_empty_folder_and_empty_trace_are_one_line_exit_2(cli_runner, tmp_path):
    import torch

    (tmp_path / "empty").mkdir()
    with torch.profiler.profile() as prof:
        pass
    prof.export_chrome_trace(str(tmp_path / "empty.json"))
    for p in (tmp_path / "empty", tmp_path / "empty.json", tmp_path / "missing.json"):
        r = cli_runner.invoke(app, ["analyze", str(p)])
        assert r.exit_code == 2 and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("drop", ["ops", "runtime", "steps", "one_step", "kernels", "gpu_in_window"])
def test_facts_survive_any_table_being_empty(drop):
    """A real H100 trace with one of its tables emptied: the classes of input whose sets can be empty."""
    from vlmdoctor.trace.facts import compute_facts

    t = load_tables(_h100("llava_s2_plain"))
    cut = {
        "ops": {"ops": t.ops.iloc[0:0]},
        "runtime": {"runtime": t.runtime.iloc[0:0]},
        "steps": {"steps": t.steps.iloc[0:0]},
        "one_step": {"steps": t.steps.iloc[0:1]},
        "kernels": {"gpu": t.gpu[t.gpu["cat"] == "gpu_memcpy"].reset_index(drop=True)},  # copies only
        "gpu_in_window": {"gpu": t.gpu[t.gpu["ts"] >= t.steps["ts"].iloc[1]].reset_index(drop=True)},  # step 1 idle
    }[drop]
    f = compute_facts(dataclasses.replace(t, **cut))
    diagnose(f, RULES)
    if drop == "gpu_in_window":
        assert f["gpu.busy_ms_list"][0] == 0.0 and f["gpu.busy_ms_list"][1] > 0
    assert f["gpu.busy_ms"] >= 0 and f["trace.windows_from"] == ("whole trace" if drop == "steps" else "ProfilerStep")


def test_gpu_backward_on_its_own_thread(h100):
    """On a GPU, autograd runs backward on a device thread: the estimates read across threads."""
    t = load_tables(_h100("llava_s2_ckpt_autocast"))
    assert t.ops["tid"].nunique() >= 2
    f, _ = h100("llava_s2_ckpt_autocast")
    assert f["shapes.micro_batches_per_step"] == 1 and f["run.stage"] == 2
    assert f["recompute.kind"] == "non_reentrant"
