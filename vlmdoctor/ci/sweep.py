"""A grid of run configs, one fresh process each: the seed's style of experiment.

A grid file is YAML: `defaults` (knobs for every row), `runs` (each a `name`, the knobs it `set`s
and optionally the `stages` it runs in), `stages` (default [2]) and optionally `models` (every row
again for each preset). Or the grid is the product of
`--set knob=v1,v2` lists.
"""

from __future__ import annotations

import csv
import io
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmdoctor.errors import UsageError, VlmdoctorError
from vlmdoctor.files import append_text, json_text, save, write_text
from vlmdoctor.inputs import read_yaml
from vlmdoctor.run.config import RunConfig

Plan = list[tuple[str, RunConfig]]


GRID_KEYS = {"defaults", "models", "stages", "runs"}
ROW_KEYS = {"name", "set", "stages"}


def grid_rows(
    path: str | Path, extra: dict[str, Any] | None = None, stages: list[int] | None = None
) -> list[tuple[int, str, RunConfig]]:
    """(row index, name, config) for every row, model and stage of a grid file.

    Bad knobs are user errors naming the row."""

    grid = read_yaml(path, "grid file")
    if not isinstance(grid, dict) or not isinstance(grid.get("runs"), list):
        raise UsageError(f"{path}: expected a mapping with a list under 'runs'")
    if not all(isinstance(r, dict) and isinstance(r.get("set") or {}, dict) for r in grid["runs"]):
        raise UsageError(f"{path}: each run must be a mapping with an optional 'set' mapping of knobs")
    unknown = sorted(set(grid) - GRID_KEYS)
    if unknown:
        raise UsageError(
            f"{path}: unknown key(s) {', '.join(map(str, unknown))}; a grid has {', '.join(sorted(GRID_KEYS))}"
        )
    for i, row in enumerate(grid["runs"]):
        unknown = sorted(set(row) - ROW_KEYS)
        if unknown:
            raise UsageError(
                f"{path}: run {i}: unknown key(s) {', '.join(map(str, unknown))}; a run has "
                f"{', '.join(sorted(ROW_KEYS))} (knobs go under 'set')"
            )
        name = row.get("name", "")
        if isinstance(name, bool) or not isinstance(name, (str, int, float)):
            raise UsageError(f"{path}: run {i}: 'name' must be a text, got {type(name).__name__}")
    for key in ("models", "stages"):
        if grid.get(key) is not None and not isinstance(grid[key], list):
            raise UsageError(f"{path}: '{key}' must be a list")
    if not isinstance(grid.get("defaults") or {}, dict):
        raise UsageError(f"{path}: 'defaults' must be a mapping of knobs")
    out = []
    models = grid.get("models") or [None]  # optional axis: every row for each model preset
    for model in models:
        for stage in stages or grid.get("stages", [2]):
            for i, row in enumerate(grid["runs"]):
                row_stages = row.get("stages", [stage])
                if not isinstance(row_stages, list):
                    raise UsageError(f"{path}: run {i}: 'stages' must be a list")
                if stage not in row_stages:
                    continue
                knobs = {
                    **(grid.get("defaults") or {}),
                    **(row.get("set") or {}),
                    **(extra or {}),
                    "stage": stage,
                }
                if model is not None:
                    knobs["model"] = model
                name = str(row.get("name", f"row {i}")) + (f" [{model}]" if len(models) > 1 else "")
                out.append((i, name, RunConfig.from_dict(knobs, source=f"{path}: run {i}")))
    return out


def load_grid(path: str | Path, extra: dict[str, Any] | None = None, stages: list[int] | None = None) -> Plan:
    """(name, config) for every row, model and stage of a grid file."""
    return [(name, cfg) for _, name, cfg in grid_rows(path, extra, stages)]


def product_grid(values: dict[str, list[Any]], stages: list[int] | None = None) -> Plan:
    """Every combination of the listed knob values."""
    keys = list(values)
    plan: Plan = []
    for stage in stages or [values.get("stage", [2])[0]]:
        for combo in itertools.product(*(values[k] for k in keys if k != "stage")):
            knobs = dict(zip([k for k in keys if k != "stage"], combo))
            name = ", ".join(f"{k}={v}" for k, v in knobs.items())
            plan.append((name, RunConfig().replace(source="--set", **knobs, stage=stage)))
    return plan


def row(name: str, report: dict[str, Any]) -> dict[str, Any]:
    m = report.get("metrics") or {}
    return {
        "name": name,
        "stage": report.get("config", {}).get("stage"),
        "status": report.get("status"),
        "real_tokens_per_s": m.get("real_tokens_per_s"),
        "loss_tokens_per_s": m.get("loss_tokens_per_s"),
        "pad_fraction": m.get("pad_fraction"),
        "step_ms": m.get("step_ms"),
        "step_ms_p10": m.get("step_ms_p10"),
        "step_ms_p90": m.get("step_ms_p90"),
        "mfu": m.get("mfu"),
        "peak_mem_gb": m.get("peak_mem_gb"),
        "final_loss": m.get("final_loss"),
        "error": (report.get("error") or {}).get("message"),
        "findings": ";".join(f["id"] for f in report.get("findings") or []),
    }


def run_sweep(
    plan: Plan,
    timeout: float,
    diagnose: bool,
    jsonl: str | None,
    notify: Callable[[int, int, str], None] = lambda *_: None,
    problems: list[str] | None = None,
    rows: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Run each config in its own process; each report is appended to jsonl as soon as it exists.

    An append that fails (a full disk) does not end the sweep: the report goes to a fallback file
    and `problems` gets a line saying where. `rows` (the caller's list) gets each run's row as it
    ends, so that an interruption (Ctrl-C, SIGTERM: the run in flight is stopped) keeps the finished ones.
    """
    from vlmdoctor.run.runner import run_isolated  # deferred: the runner imports torch

    rows = [] if rows is None else rows
    for i, (name, cfg) in enumerate(plan, start=1):
        notify(i, len(plan), name)
        report = run_isolated(cfg, timeout=timeout, diagnose=diagnose)
        if jsonl:
            line = json_text({**report, "sweep": {"name": name}}, indent=None)
            try:
                append_text(jsonl, line)
            except VlmdoctorError as e:
                spare = Path.cwd() / f"vlmdoctor-rescued-{Path(jsonl).name}.run{i}.json"
                kept = save(spare, line, "report") or f"its report was saved to {spare}"
                if problems is not None:
                    problems.append(f"{e.message}; run {i} ({name}): {kept}")
        rows.append(row(name, report))
    return rows


#: a spreadsheet reads a cell starting with one of these as a formula (CSV injection)
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: Any) -> Any:
    """A text cell a spreadsheet would run as a formula (`=HYPERLINK(...)` as a run name) gets a leading `'`,
    which spreadsheets show as text; numbers stay numbers. Quoting is the csv module's."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def csv_text(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO(newline="")
    w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["name"])
    w.writeheader()
    w.writerows({k: csv_cell(v) for k, v in r.items()} for r in rows)
    return buf.getvalue()


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    """Through the one writer: a full disk leaves the old file (or none), never a 0-byte one."""

    write_text(path, csv_text(rows))
