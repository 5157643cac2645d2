"""The newcomer's first hour: output that fits an 80-column terminal, words a newcomer knows, progress one
can follow, and outputs where one would put them (issue 41)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.report.console import render_ladder
from vlmdoctor.report.prescriptions import command_lines
from vlmdoctor.report.progress import TreatProgress
from vlmdoctor.report.text import SafeConsole

ROOT = Path(__file__).resolve().parent.parent
TRACE = str(ROOT / "fixtures" / "traces" / "default_s2.pt.trace.json.gz")
TREAT = ROOT / "bench" / "results" / "2026-11-25-h100-treat24" / "run_a" / "treat.json"
COLUMNS = {"COLUMNS": "80"}


@pytest.fixture(scope="module")
def analyzed() -> dict[str, str]:
    """`vlmdoctor analyze` of the default config's H100 trace at 80 columns, compact and verbose."""
    out = {}
    for name, extra in (("compact", []), ("verbose", ["--verbose"])):
        r = CliRunner().invoke(app, ["analyze", TRACE, *extra], env=COLUMNS)
        assert r.exit_code == 0, r.output
        out[name] = r.stdout
    return out


def test_the_compact_analysis_fits_one_screen(analyzed):
    lines = analyzed["compact"].splitlines()
    assert len(lines) <= 80, len(lines)
    assert max(len(line) for line in lines) <= 80
    text = analyzed["compact"]
    assert "GPU busy 8%" in text and "idle.host.cudnn" in text  # the headline and the step's accounts
    assert text.index("1. x1.58 high") < text.index("2. x1.45 high")  # biggest gain first, one line each
    assert "--pad-to-multiple-of 64" in text and "every table: --verbose" in text
    assert "kernel classes" not in text and "seen:" not in text  # the tables and evidence wait for --verbose


def test_the_verbose_analysis_holds_every_table_and_still_fits_80_columns(analyzed):
    text = analyzed["verbose"]
    for table in ("accounts of the traced step", "host work while the GPU waited", "kernel classes (per step)"):
        assert table in text, table
    assert "aten::_cudnn_attention_forward" in text and "gemm_tensor_core" in text  # names whole, never cut
    assert "…" not in text
    assert text.count("seen: ") >= 6 and text.count("fix: ") == 6  # each prescription's evidence and fix
    assert "not evaluated: data-packing" in text
    assert max(len(line) for line in text.splitlines()) <= 80


def test_quiet_prints_nothing_and_still_writes(tmp_path):
    out = tmp_path / "a.json"
    r = CliRunner().invoke(app, ["analyze", TRACE, "--quiet", "--json", str(out)], env=COLUMNS)
    assert r.exit_code == 0 and r.stdout == ""
    assert json.loads(out.read_text())["files"][0]["findings"]
    r = CliRunner().invoke(app, ["analyze", TRACE, "--json", str(tmp_path / "b.json")], env=COLUMNS)
    assert "the full report:" in r.stdout and "b.json" in r.stdout  # where the written report is


def test_a_command_breaks_between_flags_and_pastes_whole():
    cmd = "vlmdoctor profile --model 0.5b --stage 2 --device auto --steps 5 --compile default --compile-regions"
    lines = command_lines(cmd, 50, "  ")
    assert all(len(x) <= 50 for x in lines) and all(x.endswith(" \\") for x in lines[:-1])
    assert " ".join(" ".join(lines).replace(" \\", " ").split()) == cmd
    assert not any(x.rstrip(" \\").endswith("--compile") for x in lines)  # a flag keeps its value


def test_the_treat_ladder_never_cuts_a_knob():
    """The H100 ladder whose 80-column table read "compile_regions=Tr / ue": each knob whole on a line."""
    result = json.loads(TREAT.read_text())
    buf = io.StringIO()
    render_ladder(result, SafeConsole(file=buf, width=80))
    text = buf.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    for knob in result["ladder"][1]["change"].split(", "):
        assert any(line.rstrip().endswith(knob) for line in text.splitlines()), knob
    assert "system-checkpoint-recompute" in text and "…" not in text


def test_treat_progress_numbers_rounds_and_their_pairs():
    follow = TreatProgress()
    said = [
        follow(m)
        for m in (
            "measuring the start config",
            "round 1: compile (5 changes)",
            "round 1: current",
            "round 1: compile",
            "round 2: current",
            "round 2: compile (batch 48, sized from memory) (3 changes)",
            "round 1: current",
            "ablation of 2 changes in the final config",
            "round 1: final",
        )
    ]
    assert said == [
        "measuring the start config",
        "round 1: compile (5 changes)",
        "  round 1, pair 1: current",
        "  round 1, pair 1: compile",
        "  round 1, pair 2: current",
        "round 2: compile (batch 48, sized from memory) (3 changes)",
        "  round 2, pair 1: current",
        "ablation of 2 changes in the final config",
        "  ablation, pair 1: final",
    ]


@pytest.mark.parametrize("command", [[], ["analyze"], ["profile"], ["treat"], ["models"]])
def test_help_and_models_speak_plain_words(command):
    runner = CliRunner()
    text = runner.invoke(app, [*command] if command == ["models"] else [*command, "--help"], env=COLUMNS).stdout
    for word in ("<bool>", "<str>", "<int>", "<float>", "SiQ-VL", "seed 00", "the seed's", "roadmap"):
        assert word not in text, word
    if not command:
        assert "--install-completion" in text  # typer's shell completion


def test_quiet_keeps_the_profilers_usdt_lines_off_stderr_but_not_errors():
    """torch's profiler prints `USDT: ... profiler_start` on stderr; under --quiet vlmdoctor sets kineto's log
    level above them. A Python error in the same process still reaches stderr."""
    code = (
        "from vlmdoctor.commands.options import hush_profiler\n"
        "hush_profiler()\n"
        "import torch\n"
        "with torch.profiler.profile():\n"
        "    torch.ones(4) @ torch.ones(4)\n"
        "raise ValueError('the user error')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "KINETO_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "USDT" not in r.stderr and "profiler_start" not in r.stderr
    assert "ValueError: the user error" in r.stderr


def test_treat_takes_an_html_inside_its_out_folder(tmp_path, monkeypatch):
    """`treat --out o --html o/report.html`, as `run` takes it: the folder is made, both pages written."""
    import vlmdoctor.doctor.treat as treat_module

    result = json.loads(TREAT.read_text())
    monkeypatch.setattr(treat_module, "treat", lambda cfg, run_one, opts, notify=None: result)
    monkeypatch.chdir(tmp_path)
    args = ["treat", "--model", "tiny", "--device", "cpu", "--quiet", "--out", "o", "--html", "o/report.html"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "report.html").is_file() and (tmp_path / "o" / "treat.html").is_file()
    r = CliRunner().invoke(app, [*args[:-1], "o2/treat.html", "--out", "o2"])
    assert r.exit_code == 2 and "name the same file" in r.output  # the page --out always holds
