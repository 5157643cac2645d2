"""Every file vlmdoctor writes goes through here: refused up front, written atomically."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError


def check_writable(path: str | None, force: bool) -> None:
    """Refuse up front, before minutes of GPU time are spent, to overwrite an existing file."""
    if path and path != "-" and Path(path).exists() and not force:
        raise UsageError(f"{path} exists; pass --force to overwrite it")


def write_json(report: dict[str, Any], path: str) -> None:
    """Write atomically (temp file + rename) so an interrupted write leaves the old file intact."""
    text = json.dumps(report, indent=2, default=str) + "\n"
    if path == "-":
        print(text, end="")
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; a report is an ordinary file
    os.replace(tmp, target)
