"""Did it take effect? (trace/effects.py) on recorded traces: each optimization's state is what the recording planted
(fixtures/README.md, fixtures/corpus_h200/labels.yaml), and the opposite where it was not planted; the compact line
fits 80 columns and the verbose table replaces the scattered line; an analysis without effects still loads."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path

import msgspec
import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.documents import AnalyzedFile, Effect, as_document
from vlmdoctor.report.analysis_tables import effects_line, render_effects
from vlmdoctor.trace.effects import STATES, effects, summary
from vlmdoctor.trace.facts import analyze

FIX = Path(__file__).resolve().parents[1] / "fixtures"
CORPUS = yaml.safe_load((FIX / "corpus_h200" / "labels.yaml").read_text())
NAMES = ["compile", "liger", "attention", "fused_loss", "optimizer", "precision"]


@cache
def entry(trace: str) -> dict:
    """One trace's analysis entry (analyzed once per test module)."""
    return analyze(FIX / f"{trace}.pt.trace.json.gz")["files"][0]


def rows(trace: str) -> dict[str, Effect]:
    got = msgspec.convert(entry(trace)["effects"], list[Effect])
    assert [r.name for r in got] == NAMES and all(r.state in STATES for r in got)
    return {r.name: r for r in got}


def planted(run: str) -> str:
    """The habit the corpus recording planted in a run (its labels)."""
    return CORPUS["runs"][run]["habit"]


# --- torch.compile ------------------------------------------------------------------------------------------


def test_compile_partial_and_recompiling_where_only_the_llm_is_compiled():
    """deepseekvl_compile_static: language_model.compile(dynamic=False) on varying lengths; each active step
    recompiles, and the vision tower runs eager."""
    assert planted("deepseekvl_compile_static") == "compile_static"
    f = entry("corpus_h200/deepseekvl_compile_static")["facts"]
    assert f["compile.compiles"] == 1.0 and f["compile.frames"] == ["0/1", "0/2"]
    assert 0.8 < f["compile.gpu_share"] < 0.95 and f["compile.eager_ms"] == 0.0
    c = rows("corpus_h200/deepseekvl_compile_static")["compile"]
    assert c.state == "partial" and c.brief == f"compile partial ({f['compile.gpu_share'] * 100:.0f}%)"
    assert "2 recompile(s)" in c.seen and "ran eager" in c.why and "recompiled inside the traced steps" in c.why


def test_compile_on_for_a_whole_model_compile_and_off_without_one():
    """traces/compile_s2: the 0.5b preset under torch.compile; aya_forloop_adamw: no compile."""
    f = entry("traces/compile_s2")["facts"]
    assert f["compile.gpu_share"] > 0.95 and f["compile.compiles"] == 0.0
    assert rows("traces/compile_s2")["compile"].state == "on"
    off = rows("corpus_h200/aya_forloop_adamw")["compile"]
    assert (off.state, off.brief, off.why) == ("off", "compile off", None)


# --- Liger and the fused loss ----------------------------------------------------------------------------------


def test_liger_and_fused_loss_on_with_fusedce():
    """traces/liger_fce_s2: Liger RMSNorm, SwiGLU, RoPE and FusedCE (its run config says so)."""
    r = rows("traces/liger_fce_s2")
    assert r["liger"].state == "on" and r["liger"].why is None
    for module in ("LigerRMSNorm", "LigerSwiGLUMLP", "liger_rotary_pos_emb", "LigerFusedLinearCrossEntropy"):
        assert module in r["liger"].seen
    assert r["fused_loss"].state == "on" and "never materialized" in r["fused_loss"].seen
    assert "GiB" in r["fused_loss"].seen  # shapes were recorded: the size it saved


def test_liger_and_fused_loss_off_in_the_bf16_baseline():
    """traces/bf16_s2: no Liger, plain cross entropy over fp32 logits (shapes recorded: their size)."""
    r = rows("traces/bf16_s2")
    assert (r["liger"].state, r["liger"].brief) == ("off", "Liger off")
    assert r["fused_loss"].state == "off" and "2.90 GiB (float)" in r["fused_loss"].seen
    assert r["optimizer"].brief == "optimizer foreach" and r["optimizer"].state == "partial"


# --- attention -------------------------------------------------------------------------------------------------


def test_sdpa_math_fallback_is_off_with_why():
    """aya_sdpa_math: flash, memory-efficient and cuDNN SDPA switched off; shapes not recorded."""
    assert planted("aya_sdpa_math") == "sdpa_math"
    a = rows("corpus_h200/aya_sdpa_math")["attention"]
    assert (a.state, a.brief) == ("off", "SDPA math")
    assert "math 6" in a.seen and "ms/step" in a.seen
    assert "no fused backend took any call" in a.why and "record_shapes=True" in a.why


def test_sdpa_fused_backend_is_on_in_the_same_class():
    a = rows("corpus_h200/aya_forloop_adamw")["attention"]
    assert (a.state, a.brief, a.why) == ("on", "SDPA cudnn", None)


def test_eager_attention_is_off():
    """blip2_eager_attention: attn_implementation='eager' everywhere."""
    assert planted("blip2_eager_attention") == "eager_attention"
    a = rows("corpus_h200/blip2_eager_attention")["attention"]
    assert (a.state, a.brief) == ("off", "attention eager") and "eager" in a.why


# --- precision -------------------------------------------------------------------------------------------------


def test_fp32_weights_turn_precision_off_and_attention_partial():
    """janus_fp32_weights: the model left in fp32, no autocast: FP32 GEMMs and the FP32 attention kernels."""
    assert planted("janus_fp32_weights") == "fp32_weights"
    r = rows("corpus_h200/janus_fp32_weights")
    assert (r["precision"].state, r["precision"].brief) == ("off", "FP32 GEMMs")
    assert r["attention"].state == "partial" and r["attention"].brief == "SDPA efficient (fp32)"
    on = rows("corpus_h200/aya_forloop_adamw")["precision"]  # bf16 weights
    assert (on.state, on.brief) == ("on", "bf16 GEMMs")


def test_math_attention_fp32_gemms_are_not_the_weights():
    """aya_sdpa_math's FP32 GEMMs are the math path's: the weights are bf16 (its label's `not`)."""
    p = rows("corpus_h200/aya_sdpa_math")["precision"]
    assert p.state == "on" and "SDPA math attention's" in p.seen


# --- the optimizer ---------------------------------------------------------------------------------------------


def test_for_loop_optimizer_is_off_and_fused_is_on():
    """aya_forloop_adamw: AdamW(foreach=False, fused=False); the corpus's other runs: fused AdamW."""
    assert planted("aya_forloop_adamw") == "forloop_adamw"
    o = rows("corpus_h200/aya_forloop_adamw")["optimizer"]
    assert (o.state, o.brief) == ("off", "optimizer for-loop") and "600 per-parameter" in o.seen
    fused = rows("corpus_h200/aya_sdpa_math")["optimizer"]
    assert (fused.state, fused.brief, fused.why) == ("on", "optimizer fused", None)


# --- what a CPU trace cannot say ------------------------------------------------------------------------------


def test_a_cpu_trace_says_unknown_and_which_option_records_it():
    r = rows("user_cpu/llava_s2_plain")
    for name in ("liger", "optimizer", "precision"):
        assert r[name].state == "unknown" and "GPU trace" in r[name].why
    assert r["attention"].brief == "SDPA flash_cpu"


# --- the output ------------------------------------------------------------------------------------------------


def test_the_compact_line_wraps_at_commas_within_80_columns():
    got = effects(entry("traces/liger_fce_s2")["facts"])
    line = effects_line(got)
    assert all(len(x) <= 80 for x in line.splitlines()) and len(line.splitlines()) == 2
    assert all(x.rstrip().endswith(",") for x in line.splitlines()[:-1])
    assert " ".join(x.strip() for x in line.splitlines()) == summary(got)
    assert summary(got) == (
        "in effect: compile off, Liger on (rms_norm+swiglu+rope+ce), SDPA cudnn, fused loss on, "
        "optimizer foreach, bf16 GEMMs"
    )


def test_analyze_prints_the_line_and_verbose_prints_the_table(tmp_path):
    path = str(FIX / "corpus_h200" / "aya_forloop_adamw.pt.trace.json.gz")
    out = tmp_path / "a.json"
    r = CliRunner().invoke(app, ["analyze", path, "--json", str(out)], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "in effect: compile off, Liger off, SDPA cudnn, fused loss off," in r.output
    assert "optimizer for-loop" in r.output
    doc = json.loads(out.read_text())
    assert [e["name"] for e in doc["files"][0]["effects"]] == NAMES
    r = CliRunner().invoke(app, ["analyze", path, "--verbose"], env={"COLUMNS": "120"})
    assert r.exit_code == 0, r.output
    assert "did it take effect?" in r.output and "in effect:" not in r.output
    assert re.search(r"optimizer\s+│ off\s+│ for-loop: 600", r.output)
    assert "SDPA backend:" not in r.output and "Liger launches/step" not in r.output


def test_the_table_escapes_text_from_a_document():
    console = Console(record=True, width=100)
    render_effects([Effect(name="attention", state="off", seen="[bold]x[/bold]", why="[red]y")], console)
    text = console.export_text()
    assert "[bold]x[/bold]" in text and "[red]y" in text


def test_an_analysis_without_effects_still_loads():
    old = {k: v for k, v in entry("corpus_h200/aya_sdpa_math").items() if k != "effects"}
    assert as_document(old, AnalyzedFile, "analysis").effects == []
    new = as_document({**old, "effects": [{"name": "compile", "state": "off", "extra": 1}]}, AnalyzedFile, "a")
    assert new.effects[0].state == "off" and new.effects[0].why is None


@pytest.mark.parametrize("trace", ["traces/treated_s2", "traces/liger_compile_s2"])
def test_compiled_graphs_launch_the_model_and_graph_breaks_are_measured(trace):
    """treated_s2 compiles each layer and the LM head with its loss; liger_compile_s2 compiles the model around
    Liger's kernels, whose RoPE breaks the graph."""
    f = entry(trace)["facts"]
    assert f["compile.gpu_share"] > 0.95 and rows(trace)["compile"].state == "on"
    assert (f["compile.eager_ms"] > 0) == (trace == "traces/liger_compile_s2")
