"""Trace analysis on the real H100 traces under fixtures/traces/, on foreign traces, and on bad input."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.trace.facts import analyze
from vlmdoctor.trace.kernels import classify

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
MANIFEST = json.loads((TRACES / "manifest.json").read_text())


@cache
def facts(name: str) -> dict:
    return analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]


def test_every_fixture_in_manifest_exists_and_is_small():
    for fx in MANIFEST["fixtures"]:
        p = TRACES / f"{fx['name']}.pt.trace.json.gz"
        assert p.exists() and p.stat().st_size < 3.5 * 2**20, fx["name"]
    assert MANIFEST["device"].startswith("NVIDIA H100")


@pytest.mark.parametrize("fx", MANIFEST["fixtures"], ids=lambda fx: fx["name"])
def test_stage_and_steps_come_from_the_trace(fx):
    f = facts(fx["name"])
    assert f["run.stage"] == fx["stage"]
    assert f["trace.steps"] == (1 if "--trace-steps 1 " in fx["command"] else 2) and not f["trace.partial"]
    assert f["trace.written_by_vlmdoctor"]
    assert 0 < f["gpu.busy_frac"] <= 1


def test_fp32_gemms_high_without_autocast_and_zero_in_bf16():
    assert facts("fp32_noautocast_s2")["gemm.fp32_share"] > 0.9
    assert {"llm", "vision"} <= set(facts("fp32_noautocast_s2")["part.fp32_gemm_parts"])
    assert facts("fp32_noautocast_s2")["attention.fp32_kernels"] > 0
    for name in ("bf16_s2", "healthy_s2", "liger_fce_s2"):
        assert facts(name)["gemm.fp32_share"] < 0.01, name
        assert facts(name)["attention.fp32_kernels"] == 0


def test_autocast_over_fp32_weights_casts_every_step():
    # fp32 weights + bf16 autocast: every weight is cast on every use; bf16 weights need far fewer casts
    assert facts("default_s2")["kernels.cast.count"] > 1000
    assert facts("default_s2")["kernels.cast.count"] > 2 * facts("bf16_s2")["kernels.cast.count"]


def test_fused_ce_counted_per_step_and_logits_not_materialized():
    for name in ("liger_fce_s1", "liger_fce_s2"):
        f = facts(name)
        assert f["liger.cross_entropy.launches"] > 0 and f["liger.rms_norm.launches"] > 0
        assert f["ops.fused_linear_cross_entropy"] and "loss.logits_gb" not in f
    assert facts("bf16_s2")["liger.cross_entropy.launches"] == 0
    assert facts("bf16_s2")["loss.logits_gb"] > 1  # 16 x 320 x 151936 fp32
    # the healthy config has Liger norm/activation kernels but no FusedCE
    assert facts("healthy_s2")["liger.swiglu.launches"] > 0 and facts("healthy_s2")["liger.cross_entropy.launches"] == 0
    assert facts("healthy_s2")["liger.rope.launches"] > 0


def test_recompute_found_only_where_checkpointing_was_on():
    assert facts("ckpt_s2")["recompute.kind"] == "non_reentrant"
    assert facts("ckpt_reentrant_s2")["recompute.kind"] == "reentrant"
    assert facts("default_s2")["recompute.kind"] == "non_reentrant"
    for name in ("ckpt_s2", "ckpt_reentrant_s2"):
        assert 0.05 < facts(name)["recompute.share"] < 0.4
    for name in ("bf16_s2", "liger_fce_s1", "liger_fce_s2", "healthy_s2", "bucketed_b32_s2", "compile_s2"):
        assert facts(name)["recompute.kind"] == "none" and facts(name)["recompute.share"] == 0, name


def test_compiled_kernels_only_under_compile():
    assert facts("compile_s2")["triton_compiled.launches"] > 100
    assert facts("bf16_s2")["triton_compiled.launches"] == 0


def test_shape_churn_without_padding_multiple():
    assert facts("default_s2")["shapes.distinct_token_batches"] == 2  # two steps, two lengths
    assert facts("bf16_s2")["shapes.distinct_token_batches"] == 1  # pad_to_multiple_of 64


def test_idle_time_is_attributed_to_cudnn_replanning_in_the_default():
    f = facts("default_s2")
    assert f["gpu.busy_frac"] < 0.2 < facts("healthy_s2")["gpu.busy_frac"]
    top = f["idle.top_host_ops"][0]
    assert top["op"] == "aten::_cudnn_attention_forward" and top["share"] > 0.1
    assert f["attention.backend.cudnn.calls"] > 0
    shares = sum(f[k] for k in f if k.startswith("idle.") and k.endswith(".share"))
    assert shares == pytest.approx(1.0, abs=1e-6)  # every idle microsecond has exactly one cause


def test_gpu_time_attributed_to_model_parts():
    for name in ("default_s2", "ckpt_reentrant_s2", "bf16_s2"):
        f = facts(name)
        parts = {k.split(".")[1]: f[k] for k in f if k.startswith("part.") and k.endswith(".ms")}
        assert max(parts, key=parts.get) == "llm", parts
        assert parts["vision"] > 0 and parts["optimizer"] > 0 and parts["projector"] > 0
        assert f.get("part.other.share", 0) + f.get("part.unattributed.share", 0) < 0.05, parts
    assert facts("liger_fce_s2")["part.loss.ms"] > facts("bf16_s2")["part.loss.ms"]  # chunked LM head counts as loss


def test_launch_statistics():
    f = facts("default_s2")
    assert f["launch.kernels"] > 1000 and 0 < f["launch.tiny_kernel_frac"] < 1
    assert f["launch.delay_us_median"] > 0 and f["launch.api_ms"] > 0
    assert facts("compile_s2")["launch.kernels"] < f["launch.kernels"]


def test_kernel_names_from_other_gpus_classify():
    assert classify("cutlass_80_simt_sgemm_128x256_8x4_nn_align1") == "gemm_fp32_simt"
    assert classify("magma_sgemmEx_kernel") == "gemm_fp32_simt"
    assert classify("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x16") == "gemm_tf32"
    assert classify("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "gemm_tensor_core"
    assert classify("flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>") == "attention_flash"
    assert classify("_rms_norm_forward_kernel") == "liger_rms_norm"
    assert classify("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "memcpy"


# --- traces vlmdoctor did not write ---------------------------------------------------------------


def _plain_trace(path: Path, steps: int = 3, schedule: bool = True) -> Path:
    """A plain torch.profiler loop over a small model, as anyone's training script would record it."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler import schedule as sched

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kwargs = (
        {
            "schedule": sched(wait=0, warmup=1, active=steps),
            "on_trace_ready": lambda p: p.export_chrome_trace(str(path)),
        }
        if schedule
        else {}
    )
    with profile(activities=[ProfilerActivity.CPU], **kwargs) as prof:
        for _ in range(steps + 1):
            loss = model(torch.randn(8, 32)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if schedule:
                prof.step()
    if not schedule:
        prof.export_chrome_trace(str(path))
    return path


def test_foreign_cpu_trace_gives_a_partial_analysis(tmp_path):
    p = _plain_trace(tmp_path / "plain.json.gz")
    f = analyze(p)["files"][0]["facts"]
    assert not f["trace.written_by_vlmdoctor"]
    assert f["trace.steps"] == 3
    assert f["trace.partial"] and any("no GPU kernels" in w for w in f["trace.warnings"])
    assert "run.model" not in f  # never guessed
    # the stage is estimated from the weight-gradient GEMMs (issue 10), and said to be an estimate
    assert f["run.stage"] == 2 and f["run.stage_source"].startswith("estimated")
    f2 = analyze(p, stage=1, model="0.5b")["files"][0]["facts"]
    assert f2["run.stage"] == 1 and f2["run.model"] == "0.5b"


def test_trace_without_step_markers_is_marked_partial(tmp_path):
    p = _plain_trace(tmp_path / "nosteps.json", schedule=False)
    f = analyze(p)["files"][0]["facts"]
    assert f["trace.steps"] == 1 and any("no ProfilerStep markers" in w for w in f["trace.warnings"])


def test_folder_of_rank_traces(tmp_path):
    src = (TRACES / "compile_s2.pt.trace.json.gz").read_bytes()
    (tmp_path / "rank0.json.gz").write_bytes(src)
    (tmp_path / "rank1.json.gz").write_bytes(src)
    res = analyze(tmp_path)
    assert [Path(r["file"]).name for r in res["files"]] == ["rank0.json.gz", "rank1.json.gz"]


# --- bad input -------------------------------------------------------------------------------------


def _cli(args):
    return CliRunner().invoke(app, args)


def _user_error(result, needle):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and needle in " ".join(result.output.split())


def test_not_a_trace(tmp_path):
    p = tmp_path / "notes.json"
    p.write_text("hello, this is not JSON")
    _user_error(_cli(["analyze", str(p)]), "not a JSON object")
    q = tmp_path / "data.csv"
    q.write_text("a,b\n")
    _user_error(_cli(["analyze", str(q)]), "expected a torch.profiler Chrome trace")


def test_truncated_trace(tmp_path):
    raw = gzip.decompress((TRACES / "compile_s2.pt.trace.json.gz").read_bytes())
    p = tmp_path / "cut.json"
    p.write_bytes(raw[: len(raw) // 2])
    _user_error(_cli(["analyze", str(p)]), "malformed or truncated")
    g = tmp_path / "cut.json.gz"
    g.write_bytes((TRACES / "compile_s2.pt.trace.json.gz").read_bytes()[:50_000])
    _user_error(_cli(["analyze", str(g)]), "truncated")


def test_json_without_events_and_empty_folder(tmp_path):
    p = tmp_path / "empty.json"
    p.write_text(json.dumps({"traceEvents": []}))
    _user_error(_cli(["analyze", str(p)]), "no trace events")
    (tmp_path / "d").mkdir()
    _user_error(_cli(["analyze", str(tmp_path / "d")]), "holds no trace files")
    _user_error(_cli(["analyze", str(tmp_path / "missing.json")]), "no such file")


def test_analyze_cli_json_and_no_overwrite(tmp_path):
    out = tmp_path / "facts.json"
    r = _cli(["analyze", str(TRACES / "ckpt_s2.pt.trace.json.gz"), "--json", str(out)])
    assert r.exit_code == 0, r.output
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1 and data["files"][0]["facts"]["recompute.kind"] == "non_reentrant"
    before = out.read_bytes()
    _user_error(_cli(["analyze", str(TRACES / "ckpt_s2.pt.trace.json.gz"), "--json", str(out)]), "--force")
    assert out.read_bytes() == before


def test_profile_report_carries_the_trace_facts(tmp_path):
    out = tmp_path / "r.json"
    r = _cli(
        [
            "profile",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--autocast",
            "off",
            "--trace-dir",
            str(tmp_path / "tr"),
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["facts"]["trace.steps"] == 2 and report["facts"]["run.stage"] == 2
    assert report["facts"]["trace.written_by_vlmdoctor"]


# --- the vectorized building blocks, against brute force ----------------------------------------------


def _random_laminar(rng, n=60):
    """Properly nested intervals: children inside parents, siblings disjoint."""
    out = []

    def fill(lo, hi, depth):
        t = lo
        while t < hi and len(out) < n:
            a = t + rng.uniform(0, (hi - lo) / 4)
            b = min(hi, a + (hi - lo) * rng.uniform(0.05, 0.5))
            if b <= a:
                break
            out.append((a, b))
            if depth < 4 and rng.random() < 0.6:
                fill(a, b, depth + 1)
            t = b

    fill(0.0, 1000.0, 0)
    return sorted(out, key=lambda x: (x[0], -x[1]))


def test_nesting_and_innermost_match_brute_force():
    import numpy as np

    from vlmdoctor.trace.facts import innermost, nesting

    rng = np.random.default_rng(0)
    for _ in range(20):
        iv = _random_laminar(rng)
        ts, end = np.array([a for a, _ in iv]), np.array([b for _, b in iv])
        depth, parent = nesting(ts, end)
        for i, (a, b) in enumerate(iv):
            anc = [j for j, (c, d) in enumerate(iv) if j != i and c <= a and b <= d and (c, -d) < (a, -b)]
            assert depth[i] == len(anc)
            assert parent[i] == (max(anc) if anc else -1)
        pts = rng.uniform(-10, 1010, 200)
        got = innermost(ts, end, parent, pts)
        for p, g in zip(pts, got):
            inside = [j for j, (c, d) in enumerate(iv) if c <= p < d]
            assert g == (max(inside) if inside else -1)


def test_interval_algebra_matches_a_grid():
    import numpy as np

    from vlmdoctor.trace.facts import intersect, subtract, total, union

    rng = np.random.default_rng(1)
    grid = np.arange(0, 100, 0.25) + 0.125
    for _ in range(30):
        s1 = rng.integers(0, 90, 15).astype(float)
        a = union(s1, s1 + rng.integers(1, 10, 15))
        s2 = rng.integers(0, 90, 15).astype(float)
        b = union(s2, s2 + rng.integers(1, 10, 15))
        inside = lambda iv: np.array([any(s <= x < e for s, e in zip(*iv)) for x in grid])
        assert np.all(np.diff(a[0]) > 0) and np.all(a[0][1:] > a[1][:-1])  # sorted and disjoint
        assert np.array_equal(inside(intersect(a, b)), inside(a) & inside(b))
        assert np.array_equal(inside(subtract(a, b)), inside(a) & ~inside(b))
        assert total(intersect(a, b)) == pytest.approx(0.25 * (inside(a) & inside(b)).sum())


def test_gpu_idle_agrees_with_traceinsight(tmp_path):
    """Holistic Trace Analysis, an independent implementation, reads the same idle share from the same trace."""
    import warnings

    from hta.trace_analysis import TraceAnalysis

    (tmp_path / "t.json.gz").write_bytes((TRACES / "default_s2.pt.trace.json.gz").read_bytes())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tb = TraceAnalysis(trace_dir=str(tmp_path), include_last_profiler_step=True).get_temporal_breakdown(
            visualize=False
        )
    hta_idle = float(tb["idle_time_pctg"].iloc[0])
    ours = 100 * (1 - facts("default_s2")["gpu.busy_frac"])
    assert abs(hta_idle - ours) < 2.0, (hta_idle, ours)


@pytest.mark.parametrize("name", ["default_s2", "bf16_s2", "healthy_s2", "liger_fce_s1"])
def test_memory_flops_and_per_step_busy(name):
    f = facts(name)
    report = json.loads((TRACES / f"{name}.report.json").read_text())
    assert len(f["gpu.busy_ms_list"]) == f["trace.steps"]
    assert sum(f["gpu.busy_ms_list"]) / f["trace.steps"] == pytest.approx(
        f["gpu.busy_ms"], rel=1e-4
    )  # list is rounded to µs
    assert f["memory.device_total_gb"] == pytest.approx(report["metrics"]["device_mem_total_gb"], rel=1e-3)
    # the trace sees padded token batches, so its FLOPs bound the report's real-token FLOPs from above
    real_tflop_per_step = report["metrics"]["model_tflops_per_s"] * report["metrics"]["step_ms"] / 1e3
    assert f["flops.model_tflop_per_step_upper"] >= 0.95 * real_tflop_per_step
    assert 0 < f["mfu.upper_bound"] < 1


def test_no_flops_without_model_or_stage(tmp_path):
    p = _plain_trace(tmp_path / "plain.json.gz")
    assert not any(k.startswith(("flops.", "mfu.")) for k in analyze(p)["files"][0]["facts"])


# --- facts the issue-4 rules read ------------------------------------------------------------------


def test_only_device_syncs_count_as_syncs():
    """aten::item on the optimizer's CPU step counters is no sync; loss.item() on the device is."""
    assert facts("default_s2")["host.sync_calls"] < 10  # foreach AdamW makes ~1,180 CPU item() calls per step
    sync = facts("sync_s2")
    ops = {o["op"]: o["calls"] for o in sync["host.sync_ops"]}
    assert ops.get("aten::item") == 4  # one loss.item() per micro-batch
    assert sync["shapes.micro_batches_per_step"] == 4 and facts("healthy_s2")["shapes.micro_batches_per_step"] == 1
    assert "aten::item" not in {o["op"] for o in facts("healthy_s2")["host.sync_ops"]}
    assert 0 < sync["idle.sync.ms"] < 0.01 * sync["step.ms"]  # host-bound: the gaps they open are small


def test_frozen_tower_backward_is_measured():
    assert facts("input_grads_s2")["part.vision.backward_ms"] > 1.0
    assert facts("bf16_s2")["part.vision.backward_ms"] == 0.0 and facts("bf16_s2")["part.vision.forward_ms"] > 1.0


def test_attention_head_dims_per_part_from_shapes():
    big = facts("healthy_1.5b_s2")
    assert big["attention.vision.head_dims"] == [72] and big["attention.vision.head_dim_pow2"] is False
    assert big["attention.llm.head_dims"] == [128] and big["attention.llm.head_dim_pow2"] is True
    assert big["attention.backends"] == ["cudnn"]
    assert 50 < big["attention.vision.fwd_tflops"] < 989  # achieved, under the H100's peak
    assert facts("bf16_s2")["attention.vision.head_dims"] == [64]


def test_eager_attention_shows_softmax_calls_and_no_sdpa():
    eager, sdpa = facts("eager_s2"), facts("bf16_s2")
    assert eager["attention.eager_softmax_calls"] == 36  # 24 LLM layers + 12 tower layers
    assert eager["attention.sdpa_calls"] == 0 and eager["attention.backends"] == []
    assert sdpa["attention.eager_softmax_calls"] == 0 and sdpa["attention.sdpa_calls"] > 0


def test_lm_head_rows_against_positions():
    assert facts("healthy_s2")["loss.head_rows_frac"] == pytest.approx(1.0)
    assert 0.3 < facts("labeled_s2")["loss.head_rows_frac"] < 0.7
    assert facts("healthy_s2")["flops.lm_head_tflop_per_step"] > 0


def test_cached_features_run_no_tower_but_count_its_flops():
    cache = facts("cache_s1")
    assert "part.vision.forward_ms" not in cache and cache["memcpy.HtoD.ms"] > 0
    assert cache["flops.vision_tflop_per_step"] > 0 and cache["gpu.busy_tflops"] > 0
