"""Faults during a run: a temporary trace never outlives the command, and a compiled run that
compiles inside its timed window says its numbers are wrong."""

from __future__ import annotations

import tempfile

import pytest
from _badinput import invoke

from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.runner import recompile_warning

DIAGNOSED = ["--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--trace-steps", "1"]


@pytest.mark.parametrize("fault, code", [(KeyboardInterrupt, 130), (RuntimeError, 1)])
def test_a_failed_or_interrupted_trace_leaves_no_temporary_folder(tmp_path, monkeypatch, fault, code):
    import vlmdoctor.run.runner as runner

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.chdir(tmp_path)
    real = runner.capture

    def capture_then_fail(*a, **k):  # the trace is on disk when the fault comes
        real(*a, **k)
        assert list(tmp.glob("vlmdoctor-trace-*/*.json.gz"))
        raise fault("fault after the trace was written")

    monkeypatch.setattr(runner, "capture", capture_then_fail)
    r = invoke(["profile", *DIAGNOSED, "--quiet"])
    assert r.exit_code == code, r.output
    assert "Traceback" not in r.output
    assert not list(tmp.glob("vlmdoctor-trace-*"))


def _windows(*steps_ms):
    return [{"step_ms": list(s)} for s in steps_ms]


def test_recompilation_inside_the_timed_window_is_warned():
    cfg = RunConfig(compile="default", device="cpu", model="tiny")
    # the probe's numbers: 54 s for the first timed step, then 0.7 s
    w = recompile_warning(cfg, _windows([54000.0, 700.0, 690.0, 710.0]))
    assert w and "compilation ran inside the timed window" in w and "--warmup" in w
    assert recompile_warning(cfg, _windows([700.0, 690.0, 710.0, 705.0])) is None
    assert recompile_warning(cfg, _windows([700.0, 690.0], [690.0, 9000.0, 700.0])) is not None  # any window
    assert recompile_warning(RunConfig(compile="off"), _windows([54000.0, 700.0, 690.0])) is None


def test_ctrl_c_during_treats_start_measurement_says_interrupted(monkeypatch):
    """Ctrl-C reaches the child run too; its exit 130 must end the treatment as interrupted, not as
    'the start config did not run: None'."""
    import vlmdoctor.run.runner as runner
    from vlmdoctor import supervise
    from vlmdoctor.doctor.treat import TreatOptions, treat

    def child_interrupted(cmd, **kw):
        return supervise.Outcome(130)

    monkeypatch.setattr(supervise, "run", child_interrupted)
    cfg = RunConfig(model="tiny", device="cpu", steps=1, warmup=0)
    result = treat(cfg, lambda c, d, t, **_: runner.run_isolated(c, timeout=60, diagnose=d), TreatOptions())
    assert result["interrupted"] and result["stopped_because"] == "interrupted (Ctrl-C)"
    assert result["ladder"] == []
