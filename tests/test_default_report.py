"""The newcomer's first hour, item 2: the report of `vlmdoctor profile` and of `vlmdoctor run -- script` fits one
screen by default (80 columns, under 80 lines, progress lines aside): the headline with its doubt, the step's largest
accounts, the top prescriptions one line each with their fix, the notes that matter and where the full report is;
`--verbose` prints every table as before; `--json` is untouched.

The GPU reports are the committed H100 recordings (fixtures/traces, mem_h100, mode_traces, user_h100), diagnosed again
from their committed traces as `profile` does after measuring; the CPU report is a real `vlmdoctor run` of a small
script.
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.commands.knobs import run_command
from vlmdoctor.doctor.diagnosis import examine
from vlmdoctor.documents import as_report
from vlmdoctor.own.outputs import diagnose_report
from vlmdoctor.report import console as con
from vlmdoctor.report.html import profile_html
from vlmdoctor.report.summary import render_summary
from vlmdoctor.report.text import SafeConsole
from vlmdoctor.run import runner

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
COLUMNS = {"COLUMNS": "80"}
#: GPU reports: the most findings (dpo_full), the most lines today (input_grads), an unstable window (spare_fce),
#: no finding at all (treated), a stage-1 run with a pageable copy (cache_s1)
GPU = [
    "traces/sync_s2",
    "traces/input_grads_s2",
    "traces/cache_s1",
    "traces/treated_s2",
    "mem_h100/spare_fce_b16",
    "mode_traces/h100_dpo_full_s2",
]


def _lines(text: str, *paths: object) -> list[str]:
    """The printed lines, but those naming a path (a path is printed whole, however long the folder's name)."""
    return [line for line in text.splitlines() if not any(str(p) in line for p in paths)]


def _fits(text: str, *paths: object) -> None:
    lines = text.splitlines()
    assert len(lines) < 80, f"{len(lines)} lines:\n{text}"
    wide = [line for line in _lines(text, *paths) if len(line) > 80]
    assert not wide, wide


def _printed(render, width: int = 80) -> str:
    buf = io.StringIO()
    render(SafeConsole(file=buf, width=width))
    return buf.getvalue()


def _diagnosed(name: str, folder: Path) -> dict:
    """A committed GPU report diagnosed again from its committed trace (a copy), as `profile` does after its run."""
    src = FIX / f"{name}.report.json"
    report = json.loads(src.read_text())
    trace = folder / "trace" / f"{Path(name).name}.pt.trace.json.gz"
    trace.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIX / f"{name}.pt.trace.json.gz", trace)
    report["trace"] = {**report["trace"], "path": str(trace), "kept": True}  # kept: the analysis removes no copy
    return examine(report)


@pytest.fixture(scope="module")
def gpu_reports(tmp_path_factory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("gpu")
    return {name: _diagnosed(name, root / name.replace("/", "_")) for name in GPU}


# --- vlmdoctor profile: the committed GPU reports ------------------------------------------------------------


@pytest.mark.parametrize("name", GPU)
def test_the_default_gpu_diagnosis_fits_80_lines(gpu_reports, name):
    report = gpu_reports[name]
    command = lambda patch: run_command(report["config"], patch)  # noqa: E731
    text = _printed(lambda c: con.render_profile(report, c, False, command, ["out/report.json"]))
    _fits(text, report["trace"]["path"])
    assert text.startswith("vlmdoctor profile: ") and "H100" in text.splitlines()[0]
    assert "real tokens/s " in text and "ms/step " in text and "MFU " in text  # the headline
    assert "where the " in text and "traced step went:" in text  # the step's largest accounts
    assert "every table and each fix's evidence: --verbose" in text and "the full report: out/report.json" in text
    findings = report["diagnosis"]["findings"]
    if findings:
        top = con.by_rank(as_report(report).diagnosis.findings)[0]
        flat = " ".join(text.split())  # a title may be broken at 80 columns
        assert flat.index("1. x") < flat.index(f": {top.title or top.id}")  # biggest gain first, one line each
        assert 0 < text.count(", run:") <= min(con.TOP, len(findings))  # the top ones with the command
        assert "vlmdoctor profile --model" in text
    else:
        assert "no prescriptions" in text
    for f in findings:
        assert f["title"].split()[0] in text  # each prescription named
        assert not [e for e in f["evidence"] if e in text]  # its evidence waits for --verbose
    assert "┃" not in text  # no metrics table
    if (report.get("throughput") or {}).get("stable") is False:  # the doubt, said at the number and then why
        flat = " ".join(text.split())
        assert "unstable window (see the note below)" in flat and "note: unstable window:" in flat


@pytest.mark.parametrize("name", GPU[:3])
def test_verbose_is_every_table_as_before(gpu_reports, name):
    report = gpu_reports[name]
    command = lambda patch: run_command(report["config"], patch)  # noqa: E731
    verbose = _printed(lambda c: con.render_profile(report, c, True, command))

    def before(c):  # what `profile` printed before the compact default: the tables, then the findings
        con.render(report, c)
        con.render_findings(report["diagnosis"], c, command)

    assert verbose == _printed(before)
    for table in ("┃ metric", "spread over", "loss tokens/s", "pad fraction", "final loss", "time split of"):
        assert table in verbose, table
    assert verbose.count("seen: ") >= len(report["diagnosis"]["findings"]) and "fix: " in verbose
    assert len(verbose.splitlines()) > len(_printed(lambda c: con.render_profile(report, c)).splitlines())


def test_the_allocators_retries_are_said_where_the_run_counted_some(gpu_reports):
    """`metrics.alloc_retries` (a run at the memory wall: the caching allocator freed its cache and retried) is said
    in the default memory line and in the verbose table; a run with none, or that did not count them, says nothing."""
    report = copy.deepcopy(gpu_reports[GPU[0]])
    plain = _printed(lambda c: con.render_profile(report, c, True))
    assert "allocator retries" not in plain
    report["metrics"]["alloc_retries"] = 30
    default = _printed(lambda c: con.render_profile(report, c))
    verbose = _printed(lambda c: con.render_profile(report, c, True))
    assert "30 allocator retries (the card was full)" in " ".join(default.split())
    assert "│ allocator retries        │                    30 │" in verbose and "timed steps: card full" in verbose
    _fits(default, report["trace"]["path"])
    assert "allocator retries" in profile_html(report) and "allocator retries" not in profile_html(gpu_reports[GPU[0]])


def test_a_report_without_accounts_or_diagnosis_prints_its_numbers():
    """An older report (no accounts, never diagnosed): the headline, the split where there is one, and no crash."""
    for name in ("traces/default_s2", "mem_h100/wall_plain_ce_b40"):
        report = json.loads((FIX / f"{name}.report.json").read_text())
        text = _printed(lambda c, r=report: con.render_profile(r, c))
        _fits(text, report["trace"]["path"])
        assert "real tokens/s " in text and "traced step went" not in text
        assert ("split of the traced step" in text) == bool(report.get("split"))


def test_a_failed_run_says_how_it_ended():
    report = json.loads((FIX / "traces" / "default_s2.report.json").read_text())
    report.update(
        status="oom",
        error={"type": "OutOfMemoryError", "message": "CUDA out of memory", "requested_gb": 2.0, "where": "gpu"},
    )
    report["error"] |= {"peak_mem_gb_before_failure": 70.5, "device_mem_total_gb": 79.2}
    for verbose in (False, True):
        text = _printed(lambda c, v=verbose: con.render_profile(report, c, v))
        assert "oom: CUDA out of memory" in text and "asked for 2.00 GiB more; peak before failure 70.50 GiB" in text
        assert "real tokens/s" not in text


# --- the command itself, on a GPU report the runner stands in for --------------------------------------------


@pytest.fixture
def recorded_run(monkeypatch, tmp_path):
    """`vlmdoctor profile` whose run is a committed H100 run (its report and its trace, a copy): the command
    diagnoses, writes and prints it as it would after measuring."""
    name = "traces/sync_s2"
    recorded = json.loads((FIX / f"{name}.report.json").read_text())
    trace = tmp_path / "trace" / "sync_s2.pt.trace.json.gz"
    trace.parent.mkdir()
    shutil.copy(FIX / f"{name}.pt.trace.json.gz", trace)

    def run_profile(cfg, progress=None, trace_options=None, **_):
        report = copy.deepcopy(recorded)
        report["trace"] = {**report["trace"], "path": str(trace), "kept": True}
        return report

    monkeypatch.setattr(runner, "run_profile", run_profile)

    def invoke(*extra: str):
        r = CliRunner().invoke(app, ["profile", "--model", "tiny", "--device", "cpu", *map(str, extra)], env=COLUMNS)
        assert r.exit_code == 0, r.output
        return r.stdout

    return invoke, trace


def test_profile_prints_one_screen_and_every_table_with_verbose(recorded_run, tmp_path, monkeypatch):
    invoke, trace = recorded_run
    page = tmp_path / "report.html"
    default = invoke("--html", page)
    _fits(default, trace, page)
    assert "traced step went:" in default and "\n1. x" in default and ", run:" in default
    assert "the full report:" in default and str(page) in default and "--verbose" in default
    verbose = invoke("--verbose")
    for table in ("┃ metric", "spread over 1 repeat(s)", "peak memory allocated", "driver 580.159.04", "#1 "):
        assert table in verbose, table
    assert "\n   seen: " in verbose and "\n   seen: " not in default  # each prescription's evidence
    assert invoke("-v") == verbose
    monkeypatch.setenv("KINETO_LOG_LEVEL", "6")  # what --quiet sets, put back after the test
    assert invoke("--quiet") == ""


def test_profile_json_is_untouched_by_the_console(recorded_run, tmp_path):
    invoke, _ = recorded_run
    plain, verbose = invoke("--json", "-"), invoke("--json", "-", "--verbose")
    assert plain == verbose  # the document, and nothing else on standard output
    report = json.loads(plain)
    assert report["findings"] and report["accounts"]["rows"] and "┃" not in plain
    out = tmp_path / "r.json"
    invoke("--json", out)
    assert json.loads(out.read_text()) == report


# --- the user's own training: a GPU report, and a real CPU run of `vlmdoctor run` ----------------------------


def _own_gpu(tmp_path: Path, trace_name: str) -> dict:
    """A report of a user's loop on one H100 (fixtures/user_h100's trace), diagnosed with the fix in their terms."""
    report = json.loads((FIX / "traces" / "bf16_s2.report.json").read_text())
    trace = tmp_path / "trace" / trace_name
    trace.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIX / "user_h100" / trace_name, trace)
    report.update(
        config={"source": "script", "model": "LlavaForConditionalGeneration", "stage": None, "stage_source": "unknown"},
        model={**report["model"], "class": "LlavaForConditionalGeneration", "parts": {"llm": "Qwen2Model"}},
        notes=["the run had 2 optimizers; only the first is measured"],
        trace={"path": str(trace), "kept": True, "steps": 2},
    )
    return diagnose_report(report, "loop")


@pytest.mark.parametrize("trace_name", ["llava_s2_plain.pt.trace.json.gz", "llava_s2_modules.pt.trace.json.gz"])
def test_the_own_report_and_its_summary_fit_80_lines_together(tmp_path, trace_name):
    report = _own_gpu(tmp_path, trace_name)
    paths = {"report": "out/report.json", "html": "out/report.html", "log": "out/script.log"}
    paths["trace"] = report["trace"]["path"]
    text = _printed(lambda c: con.render_own(report, c)) + _printed(lambda c: render_summary(report, c, paths))
    _fits(text, paths["trace"])
    assert "where the " in text and "in your loop:" in text and "┃" not in text
    assert "every table and each fix's evidence: --verbose (or verbose=True)" in text
    verbose = _printed(lambda c: con.render_own(report, c, True))
    assert "┃ metric" in verbose and "change in your loop:" in verbose and "   seen: " in verbose


#: reports of users' own training recorded on H100s and H200s (bench/results: `vlmdoctor run`, Doctor, DoctorCallback,
#: torchrun and accelerate jobs of 2 and 4 ranks), as they were written
OWN_RECORDED = [
    "2026-11-27-h100-ways-in/run_report.json",
    "2026-11-27-h100-ways-in/trainer_report.json",
    "2026-11-27-2xh100-ways-in/torchrun_report.json",
    "2026-11-27-2xh100-ways-in/accelerate_report.json",
    "2026-11-27-4xh200-issue42/user_run4_warm40/report.json",
]


@pytest.mark.parametrize("name", OWN_RECORDED)
def test_recorded_own_reports_and_their_summary_fit_80_lines_together(name):
    report = json.loads((ROOT / "bench" / "results" / name).read_text())
    paths = {"report": "out/report.json", "html": "out/report.html", "log": "out/script.log"}
    paths["trace"] = report["trace"]["path"]
    shown = _printed(lambda c: con.render_own(report, c))
    _fits(shown + _printed(lambda c: render_summary(report, c, paths)), report["trace"]["path"])
    assert "real tokens/s " in shown and "prescriptions, biggest expected gain first" in shown and "┃" not in shown
    if report.get("distributed"):
        assert "ranks: the job's numbers above" in " ".join(shown.split())
    verbose = _printed(lambda c: con.render_own(report, c, True))
    assert "┃ metric" in verbose and "change in your" in verbose


def test_a_job_of_two_ranks_fits_with_its_scaling_doubt():
    """`profile --nproc-per-node 2 --parallel fsdp2 --measure-one-gpu` on two H200s: the ranks and the scaling."""
    report = json.loads((ROOT / "bench" / "results" / "2026-11-27-2xh200-issue42" / "0.5b_fsdp2.json").read_text())
    text = _printed(lambda c: con.render_profile(report, c))
    _fits(text, report["trace"]["path"])
    flat = " ".join(text.split())
    assert "2 ranks: the job's numbers above" in flat and "scaling efficiency not measured" in flat
    assert "where the " in text and "┃" not in text and "rank " in flat
    assert "┃ metric" in _printed(lambda c: con.render_profile(report, c, True))


PLAIN = """
import torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(12):
    ids = torch.randint(1, 50, (4, 8))
    model(ids.float()).sum().backward()
    opt.step(); opt.zero_grad()
    print("script step", i, flush=True)
"""


def _run(tmp_path: Path, *extra: str) -> tuple[str, dict]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(PLAIN))
    out = tmp_path / ("doc" + "".join(extra))
    cmd = [sys.executable, "-m", "vlmdoctor", "run", "--out", str(out), "--warmup", "1", "--steps", "3"]
    cmd += ["--trace-steps", "1", *extra, "--", sys.executable, str(script)]
    env = dict(os.environ) | COLUMNS
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    # ours: from the report's first line to the end, the script's own lines aside (the one progress line after it,
    # "report written", is counted: the count is the stricter for it)
    printed = proc.stdout[proc.stdout.index("vlmdoctor: Sequential (script)") :]
    ours = [line for line in printed.splitlines() if not line.startswith(("script step", "USDT:"))]
    return "\n".join(ours) + "\n", report


def test_vlmdoctor_run_on_a_cpu_prints_one_screen_and_every_table_with_verbose(tmp_path):
    text, report = _run(tmp_path)
    _fits(text, tmp_path)
    assert report["env"]["gpu"] is None and "on CPU" in text
    assert "real tokens/s " in text and "ms/step " in text and "MFU n/a" in text
    assert "split of the traced step (CPU op time)" in text  # no accounts on a CPU: the split says where
    assert "┃" not in text and "vlmdoctor summary" in text
    verbose, _ = _run(tmp_path, "--verbose")
    assert "┃ metric" in verbose and "FLOPs/step" in verbose and "time split of the traced step" in verbose


def test_compact_reports_show_report_text_as_text(gpu_reports, monkeypatch, tmp_path):
    """Hostile text in every string of a report reaches the compact console as text (tests/test_bad_text.py)."""
    from test_bad_text import assert_shown_as_text, poison

    monkeypatch.setattr(SafeConsole, "render_str", lambda self, text, **kw: Console.render_str(self, text, **kw))
    for render in (
        lambda c: con.render_profile(poison(gpu_reports["traces/sync_s2"]), c),
        lambda c: con.render_own(poison(_own_gpu(tmp_path, "llava_s2_plain.pt.trace.json.gz")), c),
    ):
        text = _printed(render, 4000)
        assert "KEEP" in text
        assert_shown_as_text(text)


def test_the_one_line_gain_keeps_a_number_with_thousands_whole():
    """The compact line's gain is the first part of the gain in words, never the text before a thousands comma."""
    from vlmdoctor.documents import ExpectedGain, Finding
    from vlmdoctor.report.prescriptions import gain_words

    ms_only = Finding(id="r", expected_gain=ExpectedGain(saves_ms_per_step=1234.5))
    assert gain_words(ms_only, short=True) == "-1,234.5 ms/step"
    both = Finding(id="r", expected_gain=ExpectedGain(saves_ms_per_step=1234.5, share_of_step=0.5, step_ms=2469.0))
    assert gain_words(both, short=True) == "x2.00" and "(50% of the 2,469.0 ms traced step)" in gain_words(both)
    assert gain_words(Finding(id="r"), short=True) == "gain n/a"
