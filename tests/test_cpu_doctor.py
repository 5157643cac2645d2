"""The doctor on a CPU run: facts from CPU ops, the bf16-on-CPU rule, and output that fits 80 columns.

Traces here are recorded by torch.profiler in the test: a small language-model-shaped module
(embedding, projections, LM head, cross entropy) inside a `vlmdoctor::llm` range, with and
without bf16 autocast.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.commands.knobs import knob_flags, run_command
from vlmdoctor.doctor.rules import diagnose, load_rules, rule_page
from vlmdoctor.report.console import render_findings
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.envinfo import matmul_probe
from vlmdoctor.trace.facts import analyze

VOCAB = 512
ROOT = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=1)
def _probe() -> dict[str, float]:
    return matmul_probe()


def _record(path: Path, autocast: bool, weight_dtype: torch.dtype = torch.float32, steps: int = 2) -> Path:
    """A real torch.profiler trace of a few training steps of a tiny LM on the CPU."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, 32),
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 32),
        torch.nn.Linear(32, VOCAB),
    ).to(weight_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {
        "config": {
            **RunConfig(model="tiny", device="cpu").to_dict(),
            "autocast": "bf16" if autocast else "off",
        },
        "env": {
            "device_type": "cpu",
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_matmul_gflops": _probe(),
        },
    }
    with profile(
        activities=[ProfilerActivity.CPU],
        record_shapes=True,
        schedule=schedule(wait=0, warmup=1, active=steps, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    ) as prof:
        for i in range(1 + steps):
            if i == 1:
                prof.add_metadata_json("vlmdoctor", json.dumps(meta))
            ids = torch.randint(0, VOCAB, (4, 96))
            with (
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
                record_function("vlmdoctor::llm"),
            ):
                logits = model(ids)
                loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    return path


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu_traces")
    return {
        "bf16": _record(d / "bf16.pt.trace.json", True),
        "fp32": _record(d / "fp32.pt.trace.json", False),
        "bf16_weights": _record(d / "bf16w.pt.trace.json", False, torch.bfloat16),
    }


def _facts(path: Path) -> dict:
    return analyze(path)["files"][0]["facts"]


def test_cpu_facts_see_autocast_casts_and_matmul_dtypes(traces):
    on, off, weights = (_facts(traces[k]) for k in ("bf16", "fp32", "bf16_weights"))
    for f in (on, off, weights):
        assert f["trace.cpu_only"] and f["trace.steps"] == 2
        assert 0 < f["cpu.matmul.ms"] < f["step.ms"]
        assert f["cpu.part.llm.forward_ms"] > 0
        assert "cpu.probe.fp32_gflops" in f and "cpu.probe.bf16_gflops" in f
        assert f["cpu.lm_head.ms"] > 0  # the matmuls with the vocabulary as a dimension
    # autocast: every weight is cast on use (4 weight matrices + biases each step), matmuls in bf16
    assert on["cpu.cast.count"] >= 4 and on["cpu.cast.ms"] > 0
    assert on["cpu.matmul.dtypes"] == ["bf16"] and on["cpu.matmul.bf16_gflop"] > 0
    assert on["cpu.bf16_cost.ms"] >= max(on["cpu.cast.ms"], on["cpu.matmul.bf16_ms"])
    # fp32: no bf16 casts, fp32 matmuls with their FLOPs and achieved rate
    assert off["cpu.cast.count"] == 0 and off["cpu.cast.ms"] == 0
    assert off["cpu.matmul.dtypes"] == ["fp32"] and off["cpu.bf16_cost.ms"] == 0
    assert off["cpu.matmul.fp32_gflops"] > 0
    # bf16 weights without autocast: bf16 matmuls too (the fix is fp32 weights, not only autocast off)
    assert weights["cpu.matmul.dtypes"] == ["bf16"] and weights["cpu.bf16_cost.ms"] > 0


def _with_probe(facts: dict, bf16: float, fp32: float) -> dict:
    return {**facts, "cpu.probe.bf16_gflops": bf16, "cpu.probe.fp32_gflops": fp32}


def test_bf16_cpu_rule_fires_from_the_measurement(traces):
    """It needs both measurements: a large bf16 share of the step and a CPU that multiplies bf16 slower."""
    rules, problems = load_rules()
    assert not problems
    on, off = _facts(traces["bf16"]), _facts(traces["fp32"])
    emulated = diagnose(_with_probe({**on, "cpu.bf16_cost.share": 0.5}, 1.0, 50.0), rules)
    hit = [f for f in emulated["findings"] if f["id"] == "precision-cpu-bf16-emulated"]
    assert hit, emulated
    gain = hit[0]["expected_gain"]
    expected = on["cpu.cast.ms"] + on["cpu.matmul.bf16_ms"] * (1 - 1.0 / 50.0)
    assert gain["saves_ms_per_step"] == pytest.approx(expected) and gain["how"]
    assert hit[0]["config_patch"] == {"autocast": "off", "weight_dtype": "fp32"}
    native = diagnose(_with_probe({**on, "cpu.bf16_cost.share": 0.5}, 60.0, 50.0), rules)  # AMX / AVX512-BF16
    assert "precision-cpu-bf16-emulated" not in [f["id"] for f in native["findings"]]
    fp32 = diagnose(_with_probe(off, 1.0, 50.0), rules)  # nothing in bf16: nothing to fix, whatever the CPU
    assert "precision-cpu-bf16-emulated" not in [f["id"] for f in fp32["findings"]]
    # the same facts with the config saying bf16 but no measured bf16 work do not fire either
    assert "precision-cpu-bf16-emulated" not in [
        f["id"] for f in diagnose(_with_probe({**off, "config.autocast": "bf16"}, 1.0, 50.0), rules)["findings"]
    ]


def test_gpu_rules_do_not_apply_to_a_cpu_trace(traces):
    rules, _ = load_rules()
    d = diagnose(_facts(traces["bf16"]), rules)
    na = {n["id"]: n["why"] for n in d["not_applicable"]}
    for rid in (
        "batching-gpu-underfed",
        "precision-fp32-gemms",
        "precision-autocast-casts",
        "system-data-loader",
    ):
        assert "GPU" in na[rid]
    assert not any(n["id"] in na for n in d["not_evaluated"])


def test_padding_and_lm_head_gains_are_numbers_on_cpu(traces):
    rules, _ = load_rules()
    facts = {**_facts(traces["fp32"]), "data.pad_fraction": 0.12, "data.loss_token_frac": 0.5}
    d = diagnose({**facts, "loss.head_rows_frac": 1.0}, rules)
    by_id = {f["id"]: f for f in d["findings"]}
    pad = by_id["data-padding-waste"]["expected_gain"]["saves_ms_per_step"]
    assert pad == pytest.approx((facts["step.ms"] - facts["cpu.data_loader.ms"]) * 0.12 * 0.8)
    head = by_id["fusion-lm-head-unlabeled"]["expected_gain"]["saves_ms_per_step"]
    assert head == pytest.approx(facts["cpu.lm_head.ms"] * 0.5)


def test_knob_flags_come_from_the_typer_app():
    flags = knob_flags()
    assert flags["liger_fused_linear_cross_entropy"] == ("--liger-fused-ce", "--no-liger-fused-ce")
    assert flags["checkpoint_use_reentrant"] == ("--checkpoint-reentrant", "--no-checkpoint-reentrant")
    assert flags["batch_size"] == ("--batch-size", None)
    rules, _ = load_rules()
    for r in rules:  # every knob a shipped rule can prescribe has a flag to paste
        assert set(r.patch) <= set(flags), r.id


def test_run_command_is_the_runs_own_command_with_the_patch():
    cfg = RunConfig(model="tiny", stage=2, device="cpu", batch_size=8).to_dict()
    assert run_command(cfg, {"sampler": "length_bucketed"}) == (
        "vlmdoctor profile --model tiny --stage 2 --device cpu --batch-size 8 --sampler length_bucketed"
    )
    # a patch replaces the knob's old value; booleans take --x / --no-x; a no-op knob is left out
    cmd = run_command(cfg, {"batch_size": 32, "gradient_checkpointing": False, "weight_dtype": "fp32"})
    assert cmd.endswith("--batch-size 32 --no-gradient-checkpointing") and "--batch-size 8" not in cmd
    assert "--weight-dtype" not in cmd


def test_patch_commands_paste_whole_at_80_columns(traces):
    """Each patch's command fits 80 columns, broken only between flags with a shell continuation: read back
    as the shell reads it (backslash-newline joins the lines), it is the whole command."""
    rules, _ = load_rules()
    facts = {
        **_facts(traces["bf16"]),
        "data.pad_fraction": 0.2,
        "data.loss_token_frac": 0.5,
        "loss.head_rows_frac": 1.0,
        "cpu.bf16_cost.share": 0.5,
        "cpu.probe.bf16_gflops": 1.0,
        "cpu.probe.fp32_gflops": 50.0,
    }
    d = diagnose(facts, rules)
    assert len(d["findings"]) >= 3
    cfg = RunConfig(
        model="tiny",
        stage=2,
        device="cpu",
        liger_fused_linear_cross_entropy=True,
        checkpoint_use_reentrant=True,
        pad_to_multiple_of=64,
    ).to_dict()
    console = Console(width=80, record=True, color_system=None)
    render_findings(d, console, lambda patch: run_command(cfg, patch))
    text = console.export_text()
    assert all(len(line) <= 80 for line in text.splitlines())
    lines = [" ".join(line.split()) for line in text.replace(" \\\n", " ").splitlines()]
    for f in d["findings"]:
        cmd = run_command(cfg, f["config_patch"])
        assert cmd in lines, (cmd, lines)
    assert not any("…" in line for line in lines if line.startswith("vlmdoctor profile"))


def test_version_and_json_on_reporting_commands(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip().startswith("vlmdoctor 0.")
    listed = json.loads(runner.invoke(app, ["rules", "list", "--json", "-"]).stdout)
    assert "precision-cpu-bf16-emulated" in [x["id"] for x in listed["rules"]]
    page = json.loads(runner.invoke(app, ["rules", "show", "precision-cpu-bf16-emulated", "--json", "-"]).stdout)
    assert page == rule_page(next(r for r in load_rules()[0] if r.id == "precision-cpu-bf16-emulated"))
    assert {"detects", "evidence", "fix", "thresholds", "sources"} <= set(page)
    assert all(t["why"] for t in page["thresholds"])
    models = json.loads(runner.invoke(app, ["models", "--json", "-"]).stdout)
    assert "tiny" in [m["name"] for m in models]
    out = tmp_path / "rules.json"
    assert runner.invoke(app, ["rules", "list", "--json", str(out)]).exit_code == 0
    again = runner.invoke(app, ["rules", "list", "--json", str(out)])  # never overwritten without --force
    assert again.exit_code == 2 and "--force" in again.output
    for command in (
        ["profile"],
        ["analyze"],
        ["rules", "list"],
        ["rules", "show"],
        ["models"],
        ["compare"],
        ["gate"],
        ["sweep"],
        ["export"],
    ):
        help_text = " ".join(runner.invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).stdout.split())
        assert "--json" in help_text and "'-': standard output" in help_text, command


def test_analyze_json_to_stdout_and_export_json(traces, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["analyze", str(traces["fp32"]), "--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["files"][0]["facts"]["trace.cpu_only"]
    r = runner.invoke(app, ["export", str(traces["fp32"]), "--chrome", str(tmp_path / "t.json.gz"), "--json", "-"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["written"]["chrome"].endswith("t.json.gz")


def test_no_color_is_respected(tmp_path):
    bad = tmp_path / "rules"
    bad.mkdir()
    (bad / "broken.yaml").write_text("id: [\n")  # its problem line is printed in yellow
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
    env.update(FORCE_COLOR="1", COLUMNS="80", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "vlmdoctor", "rules", "list", "--rules", str(bad)]
    colored = subprocess.run(cmd, env=env, capture_output=True, text=True)
    color = re.compile(r"\x1b\[[0-9;]*(3[0-7]|38;[0-9;]+|9[0-7])m")
    assert color.search(colored.stdout + colored.stderr)
    plain = subprocess.run(cmd, env={**env, "NO_COLOR": "1"}, capture_output=True, text=True)
    assert plain.returncode == colored.returncode == 2
    assert "broken.yaml" in plain.stderr and not color.search(plain.stdout + plain.stderr)


def test_the_runner_carries_the_matmul_probe_into_the_trace(tiny_cfg, tmp_path):
    """End to end on the real runner (fp32, to stay fast): the probe and the CPU facts reach the diagnosis."""
    from vlmdoctor.doctor.diagnosis import examine
    from vlmdoctor.run.capture import TraceOptions
    from vlmdoctor.run.runner import run_profile

    report = run_profile(
        tiny_cfg(steps=1, warmup=1, batch_size=2), trace=TraceOptions(str(tmp_path), 1, True, False, False)
    )
    from vlmdoctor.trace.read import read_metadata

    # the timed window's measurements travel in the trace, so `analyze` of it alone merges them as profile does
    carried = read_metadata(Path(report["trace"]["path"]))["vlmdoctor"]["metrics"]
    assert carried["pad_fraction"] == report["metrics"]["pad_fraction"]
    assert carried["real_tokens_per_s"] == report["metrics"]["real_tokens_per_s"]
    examine(report)
    f = report["facts"]
    assert f["cpu.probe.fp32_gflops"] > 0 and f["cpu.probe.bf16_gflops"] > 0 and f["cpu.capability"]
    assert f["cpu.matmul.dtypes"] == ["fp32"] and f["cpu.cast.count"] == 0
    assert {"cpu.part.vision.forward_ms", "cpu.part.projector.forward_ms", "cpu.part.llm.forward_ms"} <= set(f)
    d = report["diagnosis"]
    assert not d["not_evaluated"], d["not_evaluated"]  # on a CPU run every rule is evaluated or does not apply


def test_the_matmul_probe_draws_nothing_from_the_users_random_streams():
    """It runs inside the user's process (Doctor, the callback, `vlmdoctor run`): a draw from torch's global
    generator changed every later batch and dropout mask of the user's training."""
    import random

    import numpy as np

    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    matmul_probe(max_rounds=2)
    after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    assert torch.equal(before[0], after[0])
    assert (before[1] == after[1]).all() and before[2] == after[2]


def test_a_long_probe_call_is_timed_once_a_round_and_a_process_probes_once(monkeypatch):
    """An emulated bf16 matmul of the probe's shape took about 100 ms on a 2-core CPU: best-of-three rounds made the
    probe 0.6 s of every CPU run. A call at least PROBE_LONG_S long ends its round; and one process probes once."""
    from vlmdoctor.run import envinfo

    reads = []  # the probe's clock: each read twice PROBE_LONG_S later (other callers of the clock read 0)

    def clock() -> float:
        if sys._getframe(1).f_code.co_name != "_rate":
            return 0.0
        reads.append(1)
        return len(reads) * 2 * envinfo.PROBE_LONG_S

    monkeypatch.setattr(envinfo.time, "perf_counter", clock)
    rates = matmul_probe()
    m, k, n = envinfo.PROBE_SHAPE
    one_call = pytest.approx(2 * m * k * n / (2 * envinfo.PROBE_LONG_S) / 1e9)
    assert rates == {"fp32": one_call, "bf16": one_call}
    assert len(reads) == 2 * 2 * 2  # per dtype two rounds (they agree), one timed call each: two clock reads a call
    envinfo._probed.cache_clear()
    first = envinfo.collect(torch.device("cpu"))["cpu_matmul_gflops"]
    assert len(reads) == 16
    assert envinfo.collect(torch.device("cpu"))["cpu_matmul_gflops"] == first and len(reads) == 16
