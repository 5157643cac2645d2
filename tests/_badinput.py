"""Shared checks for the bad-input suites: one line, the documented exit code, no traceback, nothing lost."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from typer.testing import CliRunner

from vlmdoctor.cli import app

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "fixtures" / "traces"
TRACE = TRACES / "default_s2.pt.trace.json.gz"
REPORT = TRACES / "bf16_s2.report.json"
REPORT_1 = TRACES / "bf16_s1.report.json"
#: the fastest run that still is a real one
FAST = ["--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-diagnose"]


def invoke(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env=env)


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root: its kind, and a hash for regular files (links are not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                out[str(p.relative_to(root))] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
            elif stat.S_ISLNK(st.st_mode):
                out[str(p.relative_to(root))] = ("link", os.readlink(p))
            else:
                out[str(p.relative_to(root))] = ("other", stat.S_IFMT(st.st_mode))
    return out


def assert_one_line(result, code: int, *needles: str) -> str:
    """The exit code, no traceback, and exactly one error line on stderr holding every needle."""
    text = result.output
    assert result.exit_code == code, (result.exit_code, text, result.exception)
    assert "Traceback" not in text and "Traceback" not in (result.stderr or "")
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [x for x in result.stderr.splitlines() if x.strip() and not x.startswith("USDT")]
    errors = [x for x in lines if x.startswith("error:")]
    assert len(errors) == 1, lines
    for n in needles:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def no_temp_files(root: Path) -> list[str]:
    """Leftovers of an interrupted atomic write or of a temporary trace."""
    return [
        str(p)
        for p in root.rglob("*")
        if p.name.endswith((".tmp", ".probe")) or p.name.startswith((".vlmdoctor-export-", "vlmdoctor-trace-"))
    ]
