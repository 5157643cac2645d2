"""The project's own settings: the `[tool.vlmdoctor]` table of the nearest pyproject.toml, found as ruff finds its.

    [tool.vlmdoctor]
    ignore = ["fusion-lm-head-unlabeled", "low"]   # rule ids, layers (1-5 or names), severities
    select = ["precision", "batching"]             # only these (default: every rule)
    rules = ["ci/rules"]                           # extra rule folders, relative to this file
    fail-on = "medium"                             # gate: fail on new findings of this severity or above
    max-regression = 0.03                          # gate: largest real tokens/s drop allowed
    max-memory-growth = 0.10                       # gate: largest peak memory growth allowed

The command line wins over the table: `--select` replaces `select`, `--ignore` adds to `ignore`,
`--rules` adds folders, and a gate option given on the command line replaces the table's value.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any

from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import read_text

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MAX_TOML_BYTES = 2**22  # a pyproject.toml is a few KB
#: the gate's thresholds where neither the command line nor the table sets one: the severity of a new finding
#: that fails it, the real tokens/s drop allowed, the peak memory growth allowed
FAIL_ON = "high"
MAX_REGRESSION = 0.05
MAX_MEMORY_GROWTH = 0.10
#: the gate's significance level of the Mann-Whitney U test on per-step throughput (`--alpha`; not in the table)
ALPHA = 0.01
#: the paired gate's runs (`--remeasure-baseline`; not in the table): pairs at most (at least: decide.MIN_PAIRS),
#: and the intra-op threads a side on a CPU baseline (0: torch's default; one keeps a shared host's load from
#: stalling a side's parallel regions)
MAX_PAIRS = 16
CPU_THREADS = 1
#: every key the table may hold: (what it takes, in words)
KEYS = {
    "select": "rule ids, layers or severities",
    "ignore": "rule ids, layers or severities",
    "extend-ignore": "rule ids, layers or severities (added to ignore)",
    "rules": "folders of rule files",
    "extend-rules": "folders of rule files (added to rules)",
    "fail-on": f"{', '.join(SEVERITIES[:-1])} or {SEVERITIES[-1]}",
    "max-regression": "a fraction, 0 to 1",
    "max-memory-growth": "a fraction, 0 to 100",
}


def find_pyproject(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest pyproject.toml, from `start` (the working folder) upward, whose TOML holds a `tool.vlmdoctor`
    table, in any of TOML's spellings (`[tool.vlmdoctor]`, `[ tool . "vlmdoctor" ]`, dotted keys, an inline
    table), as ruff finds its own. A pyproject.toml on the way that is not valid TOML stops the search with
    its reason: its settings cannot be known, and a parent folder's must not apply instead."""
    here = Path(start or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "pyproject.toml"
        try:
            if not candidate.is_file():
                continue
        except OSError:
            continue
        tool = _load(candidate).get("tool")
        if isinstance(tool, dict) and "vlmdoctor" in tool:
            return candidate
    return None


def _load(path: Path) -> dict[str, Any]:
    """One pyproject.toml, parsed by the one TOML parser (tomllib); an unreadable or invalid one said."""
    try:
        return tomllib.loads(read_text(path, "pyproject.toml", max_bytes=MAX_TOML_BYTES))
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML ({e})") from None
    except RecursionError:
        raise UsageError(f"{path}: not valid TOML here (values nested too deeply)") from None


def _strings(path: Path, key: str, value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise UsageError(f"{path}: [tool.vlmdoctor] {key} must be a string or a list of strings ({KEYS[key]})")


def _number(path: Path, key: str, value: Any, top: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UsageError(f"{path}: [tool.vlmdoctor] {key} must be a number ({KEYS[key]}), got {value!r}")
    if not 0 <= value <= top:
        raise UsageError(f"{path}: [tool.vlmdoctor] {key} must be within 0 and {top:g}, got {value!r}")
    return float(value)


def read_settings(path: str | os.PathLike) -> dict[str, Any]:
    """The [tool.vlmdoctor] table of one pyproject.toml, checked; folders resolved against the file's folder."""
    path = Path(path)
    doc = _load(path)
    tool = doc.get("tool")
    table = tool.get("vlmdoctor") if isinstance(tool, dict) else None
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise UsageError(f"{path}: [tool.vlmdoctor] must be a table")
    out: dict[str, Any] = {"_where": str(path)}
    for key, value in table.items():
        if key not in KEYS:
            close = difflib.get_close_matches(key, list(KEYS), n=1)
            hint = f"; did you mean {close[0]}?" if close else f"; valid keys: {', '.join(KEYS)}"
            raise UsageError(f"{path}: [tool.vlmdoctor] has an unknown key {key!r}{hint}")
        if key in ("select", "ignore", "extend-ignore"):
            out.setdefault("ignore" if key != "select" else "select", []).extend(_strings(path, key, value))
        elif key in ("rules", "extend-rules"):
            out.setdefault("rules", []).extend(str(path.parent / d) for d in _strings(path, key, value))
        elif key == "fail-on":
            if value not in SEVERITIES:
                raise UsageError(f"{path}: [tool.vlmdoctor] fail-on must be {KEYS[key]}, got {value!r}")
            out["fail-on"] = value
        else:
            out[key] = _number(path, key, value, 1 if key == "max-regression" else 100)
    return out


def project_settings(start: str | os.PathLike | None = None) -> dict[str, Any]:
    """The settings of the project the command runs in ({} without a [tool.vlmdoctor] table)."""
    path = find_pyproject(start)
    return read_settings(path) if path else {}
