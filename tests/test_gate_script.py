"""The gate on a user's own training script: `vlmdoctor run` records the command, `gate --remeasure-baseline`
runs it again on both sides, alternating, and judges the paired ratios (real runs of a real script, CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_cpu.py"


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    """Two checkouts of a user's repository: `base` as recorded, `slow` where a change added three no-grad
    forwards to every step (four times the tokens through the model, about twice the step time); the baseline
    recorded in `base`."""
    root = tmp_path_factory.mktemp("repo")
    base, slow = root / "base", root / "slow"
    base.mkdir()
    slow.mkdir()
    shutil.copy(SCRIPT, base / "train.py")
    text = SCRIPT.read_text()
    changed = text.replace(
        'p.add_argument("--eval-forward", type=int, default=0,', 'p.add_argument("--eval-forward", type=int, default=3,'
    )
    assert changed != text
    (slow / "train.py").write_text(changed)
    out = root / "record"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        mp.setenv("OMP_NUM_THREADS", "1")
        r = CliRunner().invoke(
            app,
            ["run", "--out", str(out), "--warmup", "3", "--steps", "30", "--trace-steps", "1", "--stop-after-window"]
            + ["--quiet", "--", "python", "train.py", "--steps", "1000"],
        )
    assert r.exit_code == 0, r.output
    return base, slow, out / "report.json"


def test_run_records_the_command_to_run_again(checkouts):
    base, _, report = checkouts
    script = json.loads(report.read_text())["script"]
    assert script["command"] == ["python", "train.py", "--steps", "1000"]
    assert script["cwd"] == str(base) and script["warmup"] == 3 and script["steps"] == 30
    assert script["env"].get("OMP_NUM_THREADS") == "1"
    assert not any("TOKEN" in k or "KEY" in k for k in script["env"])


def gate(cwd: Path, baseline: Path, tmp: Path, *extra: str):
    verdict = tmp / "verdict.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        r = CliRunner().invoke(
            app,
            ["gate", "--baseline", str(baseline), "--remeasure-baseline", "--max-pairs", "3", "--json", str(verdict)]
            + list(extra),
        )
    return r, (json.loads(verdict.read_text()) if verdict.exists() else None)


def test_unchanged_script_passes(checkouts, tmp_path):
    base, _, report = checkouts
    r, v = gate(base, report, tmp_path)
    assert r.exit_code == 0, r.output
    t = v["checks"][0]
    assert t["method"].startswith("paired") and t["samples"].endswith("(CPU time)") and t["pairs"] >= 3
    assert any("same code and command" in n for n in v["notes"])


def test_no_grad_forwards_added_to_every_step_fail(checkouts, tmp_path):
    """Counted per forward, the tokens per step grew fourfold and this slowdown passed as a gain (one stray
    forward passed as +46%); counted per optimizer step (the training forward's), it is the regression it is."""
    base, slow, report = checkouts
    r, v = gate(slow, report, tmp_path, "--baseline-cwd", str(base))
    assert r.exit_code == 1, r.output
    t = v["checks"][0]
    assert t["verdict"] == "fail" and t["ratio"] < 0.75 and t["slower_ci_high"] < 1
    assert any(f"in {base}" in n and f"in {slow}" in n for n in v["notes"])


def test_usage_errors_of_a_script_gate(checkouts, tmp_path):
    base, _, report = checkouts
    r, _ = gate(base, report, tmp_path, "--baseline-cwd", str(tmp_path / "nowhere"))
    assert r.exit_code == 2 and "no such folder" in r.output
    r, _ = gate(tmp_path, report, tmp_path)  # the script is not in this folder
    assert r.exit_code == 2 and "no such script file" in r.output
    with pytest.MonkeyPatch.context() as mp:  # without --remeasure-baseline there is nothing to compare with
        mp.chdir(base)
        r = CliRunner().invoke(app, ["gate", "--baseline", str(report)])
    assert r.exit_code == 2 and "--remeasure-baseline" in r.output
    old = json.loads(report.read_text())
    del old["script"]["command"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    r, _ = gate(base, tmp_path / "old.json", tmp_path)
    assert r.exit_code == 2 and "records no command" in r.output
