"""The `vlmdoctor` command line: real tiny CPU profiles, report files, and one-line user errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from vlmdoctor.cli import app
from vlmdoctor.commands.knobs import knob_flags
from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.zoo import presets

FAST = ["--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--autocast", "off"]
METRIC_KEYS = {"real_tokens_per_s", "loss_tokens_per_s", "pad_fraction", "step_ms", "peak_mem_gb", "mfu"}


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _invoke(cli_runner, args):
    return cli_runner.invoke(app, args)


def _assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output)
    text = result.output
    assert "Traceback" not in text
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    flat = " ".join(text.split())  # rich may wrap a long line; compare on whitespace-normalized text
    for n in needles:
        assert n in flat, (n, text)


@pytest.mark.parametrize("stage", [1, 2])
def test_profile_writes_report(cli_runner, tmp_path, stage):
    out = tmp_path / "report.json"
    result = _invoke(cli_runner, ["profile", *FAST, "--stage", str(stage), "--json", str(out)])
    assert result.exit_code == 0, result.output
    r = json.loads(out.read_text())
    assert {"schema_version", "config", "env", "metrics"} <= set(r)
    assert r["schema_version"] == 1
    assert r["status"] == "ok"
    assert r["config"]["stage"] == stage and r["config"]["model"] == "tiny"
    m = r["metrics"]
    assert METRIC_KEYS <= set(m)
    assert m["real_tokens_per_s"] > 0 and 0 < m["loss_tokens_per_s"] < m["real_tokens_per_s"]
    assert 0 <= m["pad_fraction"] < 1
    assert m["step_ms"] > 0
    assert m["peak_mem_gb"] is None or m["peak_mem_gb"] > 0
    assert m["mfu"] is None  # CPU: no peak FLOP/s
    assert math.isfinite(m["final_loss"])
    assert r["env"]["torch"] == torch.__version__
    # trainable parameters follow the stage
    params = r["model"]["params"]
    expected = params["projector"] + (params["llm"] if stage == 2 else 0)
    assert params["trainable"] == expected
    # the human-readable table went to stdout
    assert "real tokens/s" in result.stdout


def test_existing_report_is_not_overwritten_without_force(cli_runner, tmp_path):
    out = tmp_path / "r.json"
    assert _invoke(cli_runner, ["profile", *FAST, "--stage", "1", "--json", str(out)]).exit_code == 0
    before = out.read_bytes()
    again = _invoke(cli_runner, ["profile", *FAST, "--stage", "1", "--steps", "1", "--json", str(out)])
    _assert_user_error(again, "--force")
    assert out.read_bytes() == before
    forced = _invoke(cli_runner, ["profile", *FAST, "--stage", "1", "--steps", "1", "--json", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert out.read_bytes() != before
    assert json.loads(out.read_text())["config"]["steps"] == 1


def test_existing_save_config_is_not_overwritten_without_force(cli_runner, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("keep: me\n")
    result = _invoke(cli_runner, ["profile", *FAST, "--save-config", str(cfg)])
    _assert_user_error(result, "--force")
    assert cfg.read_text() == "keep: me\n"


def test_unknown_model_names_valid_presets(cli_runner):
    result = _invoke(cli_runner, ["profile", "--model", "nope", "--device", "cpu"])
    _assert_user_error(result, "nope", *presets())


def test_user_error_is_one_line(cli_runner):
    result = _invoke(cli_runner, ["profile", "--model", "nope", "--device", "cpu"])
    assert result.exit_code == 2
    lines = [ln for ln in result.output.splitlines()]
    assert len(lines) == 1, lines
    assert "valid presets" in lines[0] and "llava-1.5-7b" in lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bug shows on machines without a GPU")
def test_unknown_model_without_device_names_valid_presets(cli_runner):
    result = _invoke(cli_runner, ["profile", "--model", "nope"])
    _assert_user_error(result, "unknown model preset", *presets())


def test_bad_weight_dtype(cli_runner):
    result = _invoke(cli_runner, ["profile", *FAST, "--weight-dtype", "fp16"])
    _assert_user_error(result, "--weight-dtype", "fp32", "bf16")


@pytest.mark.parametrize("flag", ["--liger-rms-norm", "--liger", "--liger-fused-ce"])
def test_liger_on_cpu_is_refused(cli_runner, tmp_path, flag):
    out = tmp_path / "r.json"
    result = _invoke(cli_runner, ["profile", flag, "--device", "cpu", "--json", str(out)])
    _assert_user_error(result, "Triton")
    assert "GPU" in result.output
    assert not out.exists()


def test_gpu_preset_without_gpu_hints_device_cpu(cli_runner):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    _assert_user_error(_invoke(cli_runner, ["profile", "--model", "0.5b"]), "--device cpu")


def test_save_config_then_config_reproduces_it(cli_runner, tmp_path):
    saved, r1, r2 = tmp_path / "c.yaml", tmp_path / "r1.json", tmp_path / "r2.json"
    args = [
        *FAST,
        "--stage",
        "1",
        "--batch-size",
        "2",
        "--sampler",
        "length_bucketed",
        "--pad-to-multiple-of",
        "8",
        "--no-gradient-checkpointing",
        "--seed",
        "3",
    ]
    first = _invoke(cli_runner, ["profile", *args, "--save-config", str(saved), "--json", str(r1)])
    assert first.exit_code == 0, first.output
    on_disk = yaml.safe_load(saved.read_text())
    assert on_disk["batch_size"] == 2 and on_disk["sampler"] == "length_bucketed"
    assert on_disk["gradient_checkpointing"] is False and on_disk["seed"] == 3
    second = _invoke(cli_runner, ["profile", "--config", str(saved), "--json", str(r2)])
    assert second.exit_code == 0, second.output
    c1, c2 = json.loads(r1.read_text())["config"], json.loads(r2.read_text())["config"]
    assert c1 == c2 == on_disk
    assert RunConfig.load(saved) == RunConfig.from_dict(c1)


def test_flags_override_config_file(cli_runner, tmp_path):
    saved, r = tmp_path / "c.json", tmp_path / "r.json"
    RunConfig(model="tiny", device="cpu", steps=1, warmup=0, autocast="off", batch_size=2).dump(saved)
    result = _invoke(cli_runner, ["profile", "--config", str(saved), "--batch-size", "3", "--json", str(r)])
    assert result.exit_code == 0, result.output
    cfg = json.loads(r.read_text())["config"]
    assert cfg["batch_size"] == 3 and cfg["steps"] == 1 and cfg["autocast"] == "off"


def test_a_flag_can_complete_a_config_file(tmp_path):
    """Knobs are checked against each other after the flags apply: a file naming compile_regions
    runs with --compile given on the command line; a file wrong on its own is still named."""
    part = tmp_path / "regions.yaml"
    part.write_text("compile_regions: true\n")
    with pytest.raises(UsageError, match="regions.yaml: compile_regions"):
        RunConfig.load(part)
    cfg = RunConfig.load(part, {"compile": "default"})
    assert cfg.compile_regions and cfg.compile == "default"
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: four\n")
    with pytest.raises(UsageError, match="bad.yaml"):
        RunConfig.load(bad, {"compile": "default"})
    assert knob_flags()["compile_regions"][0] == "--compile-regions"


def test_report_json_can_be_rerun_as_config(cli_runner, tmp_path):
    r1, r2 = tmp_path / "r1.json", tmp_path / "r2.json"
    assert _invoke(cli_runner, ["profile", *FAST, "--stage", "1", "--json", str(r1)]).exit_code == 0
    result = _invoke(cli_runner, ["profile", "--config", str(r1), "--json", str(r2)])
    assert result.exit_code == 0, result.output
    assert json.loads(r2.read_text())["config"] == json.loads(r1.read_text())["config"]


def test_json_to_stdout(cli_runner):
    result = _invoke(cli_runner, ["profile", *FAST, "--stage", "1", "--json", "-"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout)  # stdout holds the report and nothing else
    assert r["status"] == "ok" and r["metrics"]["real_tokens_per_s"] > 0
    assert not Path("-").exists()


def test_bad_config_file_is_usage_error(cli_runner, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch_size: four\n")
    _assert_user_error(_invoke(cli_runner, ["profile", "--config", str(bad)]), "batch_size")


def test_nan_run_exits_4(cli_runner, tmp_path):
    # lr has no flag: set it through a config file
    cfg, out = tmp_path / "c.json", tmp_path / "r.json"
    RunConfig(model="tiny", device="cpu", steps=2, warmup=1, autocast="off", lr=1e30).dump(cfg)
    result = _invoke(cli_runner, ["profile", "--config", str(cfg), "--json", str(out)])
    assert result.exit_code == 4, result.output
    assert json.loads(out.read_text())["status"] == "nan_loss"


def test_oom_exits_3_and_writes_report(cli_runner, tmp_path, monkeypatch):
    import vlmdoctor.run.runner as runner

    def oom(_p):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(runner, "train_step", oom)
    out = tmp_path / "r.json"
    result = _invoke(cli_runner, ["profile", *FAST, "--json", str(out)])
    assert result.exit_code == 3, result.output
    r = json.loads(out.read_text())
    assert r["status"] == "oom" and r["error"]["requested_gb"] == 2.0


def test_models_table(cli_runner, monkeypatch):
    import vlmdoctor.cli as cli

    monkeypatch.setattr(cli.out, "width", 200)  # a wide terminal: cells are not wrapped
    result = _invoke(cli_runner, ["models"])
    assert result.exit_code == 0, result.output
    for name in presets():
        assert name in result.stdout


def test_python_m_vlmdoctor_end_to_end(tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", "profile", *FAST, "--stage", "1", "--json", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""  # --quiet: no table
    r = json.loads(out.read_text())
    assert r["status"] == "ok" and METRIC_KEYS <= set(r["metrics"])

    bad = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", "profile", "--model", "nope", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and "unknown model preset" in bad.stderr


def test_pretrained_without_checkpoint_is_user_error(cli_runner):
    result = _invoke(cli_runner, ["profile", *FAST, "--weights", "pretrained"])
    _assert_user_error(result, "no published checkpoint", "--weights random")


def test_pretrained_unreachable_hub_says_so(tmp_path):
    """No network and an empty cache: one message naming the checkpoints, exit 2, no traceback.

    A subprocess, because huggingface_hub reads HF_HUB_OFFLINE when it is imported.
    """
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmdoctor",
            "profile",
            "--model",
            "0.5b",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--weights",
            "pretrained",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    flat = " ".join(proc.stderr.split())
    for needle in ("Qwen/Qwen2.5-0.5B-Instruct", "not reachable", "--weights random"):
        assert needle in flat, proc.stderr


def test_trace_dir_writes_profiled_window(cli_runner, tmp_path):
    """--trace-dir: a gzipped Chrome trace with ProfilerStep markers for the active steps and the config inside."""
    import gzip

    out = tmp_path / "r.json"
    result = _invoke(
        cli_runner,
        ["profile", *FAST, "--trace-dir", str(tmp_path / "tr"), "--trace-steps", "2", "--json", str(out)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    trace_file = Path(report["trace"]["path"])
    assert trace_file.parent == tmp_path / "tr" and trace_file.name.endswith(".json.gz")
    data = json.load(gzip.open(trace_file))
    steps = {e["name"] for e in data["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert len(steps) == 2  # wait and warm-up steps are not recorded
    assert data["vlmdoctor"]["config"]["model"] == "tiny"
    assert len(report["trace"]["traced_step_ms"]) == 2
    assert report["trace"]["untraced_step_ms_median"] == report["metrics"]["step_ms"]
    parts = {e["name"] for e in data["traceEvents"] if e.get("cat") == "user_annotation"}
    assert {"vlmdoctor::vision", "vlmdoctor::projector", "vlmdoctor::llm"} <= parts


def test_small_rates_keep_their_digits():
    """A tiny model's TFLOP/s and GFLOP per step read as their significant digits, never as 0.00."""
    from vlmdoctor.report.text import fmt_small as _fmt_small

    assert _fmt_small(0.0042) == "0.0042" and _fmt_small(12.345) == "12.35" and _fmt_small(None) == "n/a"
