"""Every numeric flag of every command, out of range or not finite: exit 2 and one line naming the flag,
before any model is built. And the top-level handler: every exception class becomes one line with
the documented exit code; a bug's traceback goes to a file the line names."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from _badinput import FAST, REPORT, TRACE, assert_one_line, invoke

from vlmdoctor.run.config import FLAGS, RunConfig, _base_type

TINY = ["--model", "tiny", "--device", "cpu"]


def _knob_cases():
    """(flag, bad value) for every numeric knob: below its minimum, above its maximum, not finite."""
    for f in dataclasses.fields(RunConfig):
        kind = _base_type(f.type)
        if kind not in (int, float):
            continue
        flag = FLAGS.get(f.name, "--" + f.name.replace("_", "-"))
        m = f.metadata
        if m.get("minimum") is not None:
            yield flag, str(m["minimum"] - 1)
        if m.get("above") is not None:
            yield flag, str(m["above"])
        if m.get("maximum") is not None:
            yield flag, str(m["maximum"] * 10 + 1 if kind is int else m["maximum"] * 10)
        if kind is float:
            yield flag, "nan"
            yield flag, "inf"


KNOB_CASES = list(_knob_cases())


def test_every_numeric_knob_has_bounds():
    """A new numeric knob without bounds would accept -1 or 10**12: the class the probe found. Integers
    size things (samples, steps, workers), so they need a maximum; floats must be finite (always checked)."""
    for f in dataclasses.fields(RunConfig):
        kind = _base_type(f.type)
        if kind in (int, float) and f.name != "stage":
            m = f.metadata
            assert m.get("minimum") is not None or m.get("above") is not None, f.name
            assert kind is float or m.get("maximum") is not None, f.name


@pytest.mark.parametrize("flag, value", KNOB_CASES, ids=[f"{f}={v}" for f, v in KNOB_CASES])
def test_profile_numeric_flag_out_of_range(tmp_path, monkeypatch, flag, value):
    monkeypatch.chdir(tmp_path)
    r = invoke(["profile", *FAST, flag, value])
    assert_one_line(r, 2, flag)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag, value", KNOB_CASES, ids=[f"{f}={v}" for f, v in KNOB_CASES])
def test_the_same_values_in_a_config_file_name_the_file_and_knob(tmp_path, flag, value):
    knob = next(k for k, v in FLAGS.items() if v == flag) if flag in FLAGS.values() else flag[2:].replace("-", "_")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"{knob}: {value if value not in ('nan', 'inf') else '.' + value}\n")
    r = invoke(["profile", *FAST, "--config", cfg])
    assert_one_line(r, 2, str(cfg), knob)


OTHER = [
    (["profile", *FAST, "--trace-steps", "0"], "--trace-steps"),
    (["profile", *FAST, "--trace-steps", "100000"], "--trace-steps"),
    (["treat", *TINY, "--max-trials", "-1"], "--max-trials"),
    (["treat", *TINY, "--time-budget", "0"], "--time-budget"),
    (["treat", *TINY, "--time-budget", "nan"], "--time-budget"),
    (["treat", *TINY, "--min-gain", "-0.5"], "--min-gain"),
    (["treat", *TINY, "--min-gain", "nan"], "--min-gain"),
    (["treat", *TINY, "--trial-timeout", "0"], "--trial-timeout"),
    (["treat", *TINY, "--trial-timeout", "inf"], "--trial-timeout"),
    (["treat", *TINY, "--set", "lr=-1"], "lr"),
    (["treat", *TINY, "--set", "seed=-1"], "seed"),
    (["sweep", "--set", "batch_size=1,2", "--timeout", "0"], "--timeout"),
    (["sweep", "--set", "batch_size=1,-2"], "batch_size"),
    (["sweep", "--set", "lr=nan"], "lr"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--max-regression", "-1"], "--max-regression"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--max-regression", "1"], "--max-regression"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--max-regression", "nan"], "--max-regression"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--alpha", "7"], "--alpha"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--alpha", "0"], "--alpha"),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--max-memory-growth", "-1"], "--max-memory-growth"),
    (
        ["gate", "--baseline", REPORT, "--current", REPORT, "--max-memory-growth", "inf"],
        "--max-memory-growth",
    ),
    (["gate", "--baseline", REPORT, "--current", REPORT, "--fail-on", "critical"], "--fail-on"),
    (["analyze", TRACE, "--stage", "3"], "--stage"),
    (["profile", *FAST, "--compile", "reduce-overhead"], "reduce-overhead"),
]


@pytest.mark.parametrize("args, needle", OTHER, ids=[" ".join(map(str, a[:1] + a[-2:])) for a, _ in OTHER])
def test_other_numbers_and_choices(tmp_path, monkeypatch, args, needle):
    monkeypatch.chdir(tmp_path)
    r = invoke(args)
    assert_one_line(r, 2, needle)


@pytest.mark.parametrize(
    "command",
    [["analyze", TRACE], ["profile", *FAST], ["treat", *TINY], ["rules", "list"], ["rules", "show", "x"]],
)
def test_a_missing_rules_folder_is_refused(tmp_path, command):
    r = invoke([*command, "--rules", tmp_path / "no_such_dir"])
    assert_one_line(r, 2, "no_such_dir")


# --- the top-level handler -------------------------------------------------------------------------


def _raise(exc):
    def f(*a, **k):
        raise exc

    return f


@pytest.mark.parametrize(
    "exc, code, needle",
    [
        (MemoryError(), 3, "out of host memory"),
        (OSError(28, "No space left on device"), 1, "No space left"),
        (PermissionError(13, "Permission denied", "/some/file"), 2, "/some/file"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 2, "not UTF-8"),
        (ValueError("a bug"), 1, "internal error"),
    ],
)
def test_every_exception_class_is_one_line(monkeypatch, exc, code, needle):
    import vlmdoctor.report.compare as compare

    monkeypatch.setattr(compare, "compare", _raise(exc))
    r = invoke(["compare", REPORT, REPORT])
    line = assert_one_line(r, code, needle)
    if "internal error" in line:  # the traceback is kept, in a file the line names
        saved = Path(line.split("full traceback: ")[1].split(";")[0])
        assert "Traceback" in saved.read_text() and "a bug" in saved.read_text()
        saved.unlink()


def test_ctrl_c_exits_130_without_a_traceback(monkeypatch):
    import vlmdoctor.report.compare as compare

    monkeypatch.setattr(compare, "compare", _raise(KeyboardInterrupt()))
    r = invoke(["compare", REPORT, REPORT])
    assert r.exit_code == 130 and "Traceback" not in r.output and "interrupted" in r.stderr


def test_quiet_failed_run_still_says_why(tmp_path, monkeypatch):
    """--quiet silences progress and tables, not the news that the run failed."""
    import vlmdoctor.run.runner as runner

    real = runner.run_profile

    def crash_in_step(cfg, *a, **k):  # a real run whose training step raises, as a CUDA fault would
        def bad_step(p):
            raise RuntimeError("illegal memory access")

        monkeypatch.setattr(runner, "train_step", bad_step)
        return real(cfg, *a, **k)

    monkeypatch.setattr(runner, "run_profile", crash_in_step)
    monkeypatch.chdir(tmp_path)
    r = invoke(["profile", *FAST, "--quiet", "--warmup", "1"])
    assert_one_line(r, 1, "status error", "illegal memory access")


def test_lr_messages_name_the_flag_and_range(tmp_path):
    r = invoke(["profile", *FAST, "--lr", "-1"])
    assert_one_line(r, 2, "--lr must be a finite number > 0")
    assert math.isfinite(RunConfig().lr)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["profile", "--steps", "1e3"], "--steps"),
        (["profile", "--nope"], "--nope"),
        (["gate"], "--baseline"),
        (["profile", "--model", "tiny", "--device", "cpu", "--lr", "nan"], "--lr"),
    ],
)
def test_the_console_entry_point_prints_usage_errors_as_one_line(tmp_path, args, needle):
    """click's own usage errors (a value that does not parse, an unknown flag) are one line too."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-m", "vlmdoctor", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], lines
