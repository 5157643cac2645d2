"""Collective facts per rank and the ranks joined, on real 2-rank gloo traces (fixtures/dist_cpu and one
recorded here), plus the NCCL name and size conventions."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.trace.comms import bus_factor, kind_of, rank_of
from vlmdoctor.trace.facts import analyze
from vlmdoctor.trace.ranks import hta_overlap

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "fixtures" / "dist_cpu"
CASES = sorted(p.name for p in DIST.iterdir() if p.is_dir())


@cache
def result(case: str) -> dict:
    return analyze(DIST / case)


def cross(case: str) -> dict:
    return result(case)["cross_rank"]["facts"]


@cache
def _trained_params() -> int:
    """The recorder's own model, built the way it builds it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("dist_cpu_record", DIST / "record.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return sum(p.numel() for p in mod.build_model().parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """A 2-rank DDP run recorded now, whose last rank's data loader is slow."""
    out = tmp_path_factory.mktemp("dist") / "ddp_loader"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [
            sys.executable,
            str(DIST / "record.py"),
            "--parallel",
            "ddp",
            "--straggler",
            "loader",
            "--port",
            str(port),
            "--out",
            str(out),
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=300,
    )
    return out


def test_every_case_has_one_trace_per_rank_and_the_rank_from_distributed_info():
    for case in CASES:
        r = result(case)
        assert sorted(e["rank"] for e in r["files"]) == [0, 1], case
        for e in r["files"]:
            assert e["meta"]["distributedInfo"]["rank"] == e["rank"]
            assert e["facts"]["comm.backend"] == "gloo"
            assert e["facts"]["comm.parallel"] == case.split("_")[0]


@pytest.mark.parametrize("case", CASES)
def test_per_rank_comm_time_splits_into_exposed_and_hidden(case):
    for e in result(case)["files"]:
        f = e["facts"]
        assert f["comm.ms"] > 0 and f["comm.world_size"] == 2
        assert 0 <= f["comm.exposed_ms"] <= f["comm.ms"] + 1e-9
        assert f["comm.exposed_ms"] + f["comm.hidden_ms"] == pytest.approx(f["comm.ms"])
        assert sum(f[f"comm.{k}.ms"] for k in f["comm.kinds"]) >= f["comm.ms"] - 1e-6  # overlapping calls count once


def test_collectives_and_their_bytes_are_the_wrappers_own():
    grad_bytes = 4 * _trained_params()  # fp32 gradients, each synchronized once per step
    ddp = result("ddp")["files"][0]["facts"]
    assert set(ddp["comm.kinds"]) >= {"all_reduce"} and "all_gather" not in ddp["comm.kinds"]
    assert ddp["comm.all_reduce.bytes"] == grad_bytes
    fsdp = result("fsdp2")["files"][0]["facts"]
    assert set(fsdp["comm.kinds"]) == {
        "all_gather",
        "reduce_scatter",
    }  # gloo ran the reduce-scatter as all_reduce
    assert fsdp["comm.reduce_scatter.bytes"] == grad_bytes
    assert fsdp["comm.all_gather.bytes"] >= grad_bytes  # every parameter gathered at least once, for forward
    for f, kind, factor in (
        (ddp, "all_reduce", 2 * (2 - 1) / 2),
        (fsdp, "all_gather", (2 - 1) / 2),
        (fsdp, "reduce_scatter", (2 - 1) / 2),
    ):
        assert f[f"comm.{kind}.busbw_gbps"] == pytest.approx(f[f"comm.{kind}.algbw_gbps"] * factor)
        assert f[f"comm.{kind}.algbw_gbps"] > 0


def test_gradient_syncs_per_micro_batch_are_counted():
    for case, synced, extra in (
        ("ddp_accum", 2, True),
        ("ddp_accum_nosync", 1, False),
        ("fsdp2_accum", 2, True),
        ("ddp", 1, False),
        ("fsdp2", 1, False),
    ):
        f = cross(case)
        assert f["dist.micro_batches_per_step"] == (2 if "accum" in case else 1), case
        assert f["dist.synced_micro_batches_per_step"] == synced, case
        assert (f["dist.grad_sync.extra_ms"] > 0) is extra, case
        assert (f["dist.grad_sync.extra_bytes"] == 4 * _trained_params()) is extra, case


def test_fsdp2_prefetch_order_is_read_from_its_own_ranges():
    for case in ("fsdp2", "fsdp2_accum"):
        f = cross(case)
        # FSDP2 by default gathers a layer inside its own pre-forward and prefetches in backward
        assert f["dist.fsdp.forward_prefetched_frac"] == 0.0
        assert f["dist.fsdp.backward_prefetched_frac"] == 1.0
    assert "dist.fsdp.prefetched_frac" not in cross("ddp")


def test_a_rank_with_more_tokens_is_the_straggler_and_the_others_wait_for_it():
    f = cross("ddp_tokens")
    rows = {r["rank"]: r for r in result("ddp_tokens")["cross_rank"]["ranks"]}
    assert f["dist.straggler.rank"] == 1 and f["dist.straggler.cause"] == "tokens"
    assert f["dist.straggler.tokens_excess_frac"] == pytest.approx(7.0)  # 8x longer sequences
    assert rows[1]["tokens"] == 8 * rows[0]["tokens"]
    assert rows[0]["wait_ms"] > rows[1]["wait_ms"]  # the early rank's collectives last longer
    assert f["dist.late_wait_ms_max"] == pytest.approx(rows[0]["wait_ms"])
    assert f["dist.step_skew_frac"] > 0.15


def _loader_straggler(res: dict) -> None:
    f = res["cross_rank"]["facts"]
    assert f["dist.straggler.rank"] == 1 and f["dist.straggler.cause"] == "data_loader"
    assert f["dist.straggler.loader_excess_ms"] > 20  # it sleeps 30 ms per batch
    rows = {r["rank"]: r for r in res["cross_rank"]["ranks"]}
    assert rows[0]["wait_ms"] > rows[1]["wait_ms"]


def test_a_slow_data_loader_is_named_as_the_cause():
    _loader_straggler(result("ddp_loader"))


@pytest.mark.slow  # ~8-18 s on 2 shared cores; the committed recordings above prove the facts
def test_a_fresh_recording_reads_the_same(fresh):
    res = analyze(fresh)
    _loader_straggler(res)
    assert res["cross_rank"]["facts"]["dist.parallel"] == "ddp"


def test_balanced_ranks_name_no_cause():
    for case in ("ddp", "ddp_accum_nosync"):
        f = cross(case)
        assert f["dist.step_skew_frac"] < 0.15, case
        assert f["dist.straggler.cause"] in ("balanced", "unexplained", "host_gaps"), case


def test_rank_from_metadata_then_file_name_else_none():
    assert rank_of({"distributedInfo": {"rank": 3}}, "whatever.json") == 3
    for name, rank in (
        ("trace_rank5.json.gz", 5),
        ("rank-12.Apr_03.pt.trace.json.gz", 12),
        ("x_rank_2.json", 2),
    ):
        assert rank_of({}, name) == rank
    assert rank_of({"distributedInfo": {"backend": "nccl"}}, "worker.json.gz") is None


def test_a_folder_without_ranks_or_with_one_rank_twice_says_why(tmp_path):
    trace = DIST / "ddp" / "trace_rank0.json.gz"
    both = tmp_path / "same"
    both.mkdir()
    shutil.copy(trace, both / "a.json.gz")
    shutil.copy(trace, both / "b.json.gz")
    skipped = analyze(both)["cross_rank"]["skipped"]
    assert "both rank 0" in skipped
    h100 = ROOT / "fixtures" / "traces"
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in ("bf16_s1", "bf16_s2"):
        shutil.copy(h100 / f"{name}.pt.trace.json.gz", plain / f"{name}.pt.trace.json.gz")
    r = analyze(plain)
    assert "no rank" in r["cross_rank"]["skipped"]
    assert all("rank" not in e and not any(k.startswith("comm.") for k in e["facts"]) for e in r["files"])


def test_a_single_trace_gets_no_rank_and_no_cross_section():
    r = analyze(ROOT / "fixtures" / "traces" / "bf16_s2.pt.trace.json.gz")
    assert "cross_rank" not in r and "rank" not in r["files"][0]
    assert not any(k.startswith(("comm.", "dist.")) for k in r["files"][0]["facts"])


@pytest.mark.parametrize(
    "name, kind",
    [
        ("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", "all_gather"),
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*)", "reduce_scatter"),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)", "all_reduce"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "send_recv"),
        ("ncclDevKernel_Broadcast_RING_LL(ncclDevComm*)", "broadcast"),
        ("ncclDevKernel_Reduce_Sum_f32_RING_LL(ncclDevComm*)", "reduce"),
        ("nccl:_all_gather_base", "all_gather"),
        ("nccl:_reduce_scatter_base", "reduce_scatter"),
        ("nccl:all_to_all", "all_to_all"),
        ("c10d::alltoall_base_", "all_to_all"),
        ("c10d::allreduce_", "all_reduce"),
        ("c10d::_allgather_base_", "all_gather"),
        ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
        ("gloo:all_reduce", "all_reduce"),
        ("allreduce", "all_reduce"),
        ("_reduce_scatter_base", "reduce_scatter"),
        ("nccl:send", "send_recv"),
        ("c10d::barrier", "barrier"),
    ],
)
def test_collective_names_in_every_spelling(name, kind):
    assert kind_of(name) == kind


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather", 8) == bus_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == bus_factor("send_recv", 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0


def test_traceinsight_cross_check_skips_cleanly(monkeypatch):
    assert "skipped" in result("ddp")["cross_rank"]["hta"]  # gloo traces: no NCCL kernels for it to read
    monkeypatch.setitem(sys.modules, "hta", None)
    monkeypatch.setitem(sys.modules, "hta.trace_analysis", None)
    assert "not installed" in hta_overlap(DIST / "ddp")["skipped"]


NCCL_DIR = os.environ.get("VLMDOCTOR_NCCL_TRACES")


@pytest.mark.skipif(not NCCL_DIR, reason="set VLMDOCTOR_NCCL_TRACES to a folder of real per-rank NCCL traces")
def test_nccl_traces_and_the_traceinsight_cross_check():
    r = analyze(NCCL_DIR)
    for e in r["files"]:
        assert e["facts"]["comm.backend"] == "nccl" and e["facts"]["comm.ms"] > 0
    hta = r["cross_rank"]["hta"]
    if "overlap_pct" in hta:
        for rank, pct in hta["overlap_pct"].items():
            assert pct == pytest.approx(hta["ours_overlap_pct"][rank], abs=1.0)  # same steps, same unions


def test_cli_prints_the_cross_rank_section_in_80_columns_and_json(tmp_path):
    env = {"COLUMNS": "80"}
    res = CliRunner().invoke(app, ["analyze", str(DIST / "ddp_tokens")], env=env)
    assert res.exit_code == 0, res.output
    assert "cross-rank: 2 ranks of 2, ddp over gloo" in res.output
    assert "slowest rank 1" in res.output and "cause: tokens" in res.output
    assert "batching-rank-token-imbalance" in res.output
    assert max(len(line) for line in res.output.splitlines()) <= 80
    out = tmp_path / "a.json"
    res = CliRunner().invoke(app, ["analyze", str(DIST / "ddp_tokens"), "--json", str(out)], env=env)
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    c = doc["cross_rank"]
    assert c["facts"]["dist.straggler.rank"] == 1 and [r["rank"] for r in c["ranks"]] == [0, 1]
    assert [f["id"] for f in c["findings"]] == ["batching-rank-token-imbalance"]
    assert c["findings"][0]["config_patch"] == {"balance_tokens": True}
    # the per-rank diagnoses stay what they were: the job-level rules are not applicable to one trace
    na = {n["id"]: n["why"] for n in doc["files"][0]["diagnosis"]["not_applicable"]}
    assert "several ranks" in na["batching-rank-token-imbalance"]


def test_html_report_holds_the_cross_rank_section(tmp_path):
    out = tmp_path / "a.html"
    res = CliRunner().invoke(app, ["analyze", str(DIST / "ddp_loader"), "--html", str(out)])
    assert res.exit_code == 0, res.output
    page = out.read_text()
    assert "Cross-rank: 2 ranks of 2, ddp over gloo" in page and "data_loader" in page


@pytest.mark.parametrize("verbose", [[], ["--verbose"]], ids=["compact", "verbose"])
def test_identical_rank_diagnoses_are_printed_once(verbose):
    """Two CPU ranks and the job with nothing to prescribe: the ranks' and the job's diagnoses are one list,
    "no rule fired" said once, and a warning both ranks' traces carry said once (compact)."""
    folder = str(Path(__file__).resolve().parents[1] / "fixtures/dist_cpu/ddp")
    r = CliRunner().invoke(app, ["analyze", folder, *verbose], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert text.count("no prescriptions: no rule fired") == 1
    assert "cross-rank: 2 ranks of 2, ddp over gloo" in text
    if not verbose:
        assert text.count("no GPU kernels in the trace") == 1
