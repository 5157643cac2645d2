"""Generated tests of each class of "First, do no harm", drawn from the reliability probe's own generators
(bench/probe/: the cases, how each is observed and judged; docs/reliability.md).

Each test runs one probe case as the probe does (the real command in a process of its own, its files, its
signals, a small tmpfs for a full disk) and asserts what the case expects: the exit code, one error line where
the input was bad, every file of the user unchanged, nothing written outside, no process and no temp file left,
no raw control character on the console, the user's loop ending with its own results, and the case's own check.

The default run holds a few cases of every class (marked `ci` in the generators: about a minute of CPU); the
other cases that run no training steps are `slow`. The cases that train are the probe's alone
(`python bench/probe/probe.py`). Cases that need a tmpfs mount are skipped where mounting is not allowed.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "probe"))

from cases import all_cases  # noqa: E402
from harness import CLASSES, OK, aims, default_signals, run_case  # noqa: E402

CASES = all_cases()
DEFAULT = [c for c in CASES if c.ci]
SLOW = [c for c in CASES if not c.ci and not c.heavy]


@pytest.fixture(scope="module", autouse=True)
def _signals():
    default_signals()  # a suite started in the background must not pass ignored signals to the commands


def _judged(case, tmp_path):
    r = run_case(case, tmp_path)
    if r.skipped:
        pytest.skip(r.skipped)
    assert r.setup_error is None, r.setup_error
    return r


def _check(case, r) -> None:
    shown = "; ".join(f"{k}: {w}" for k, w in r.defects)
    assert r.verdict == OK, f"{case.id} ({case.expect}): {shown}"
    if case.codes() is not None:
        assert r.obs.rc in case.codes(), (r.obs.rc, r.obs.stderr[-400:])
    assert not r.obs.procs_left and not r.obs.timed_out
    if case.user_training:
        assert "USER-OK" in r.obs.stdout


def test_every_class_has_a_generated_test_in_the_default_run():
    covered = {aims(c) for c in DEFAULT}
    assert set(CLASSES) <= covered, sorted(set(CLASSES) - covered)
    assert len(CASES) >= 250 and len({c.id for c in CASES}) == len(CASES)
    assert {c.command for c in CASES} >= {
        "profile",
        "analyze",
        "run",
        "treat",
        "sweep",
        "gate",
        "compare",
        "export",
        "rules",
        "facts",
        "models",
        "api",
        "callback",
    }


@pytest.mark.parametrize("case", DEFAULT, ids=[f"{aims(c)}: {c.id}" for c in DEFAULT])
def test_case(case, tmp_path):
    _check(case, _judged(case, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[f"{aims(c)}: {c.id}" for c in SLOW])
def test_case_slow(case, tmp_path):
    _check(case, _judged(case, tmp_path))
