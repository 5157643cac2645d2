"""Report output: JSON that never overwrites a user's file by accident, and a rich table."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .config import RunConfig, knob_table
from .errors import UsageError


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


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{v}{unit}"


def _changed_knobs(config: dict[str, Any]) -> list[str]:
    defaults = RunConfig().to_dict()
    layer = {row["name"]: row["layer"] for row in knob_table()}
    return [f"{k}={v}" for k, v in config.items() if v != defaults.get(k) and layer.get(k, 0) > 0]


def render(report: dict[str, Any], console: Console) -> None:
    cfg, env, model = report["config"], report.get("env", {}), report.get("model", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    title = f"vlmdoctor profile: {cfg['model']} stage {cfg['stage']} on {where}"
    changed = _changed_knobs(cfg)
    console.print(f"[bold]{title}[/bold]")
    console.print(f"model: {model.get('vision')} + {model.get('projector')} + {model.get('llm')}; "
                  f"{model.get('image_tokens')} image tokens")
    console.print("knobs changed from the default: " + (", ".join(changed) if changed else "none (the default config)"))
    if report["status"] not in ("ok", "nan_loss"):
        err = report.get("error", {})
        console.print(f"[bold red]{report['status']}[/bold red]: {err.get('message')}")
        if err.get("requested_gb") is not None:
            console.print(f"asked for {err['requested_gb']:.2f} GiB more; peak before failure "
                          f"{_fmt(err.get('peak_mem_gb_before_failure'), ' GiB', 2)} of "
                          f"{_fmt(err.get('device_mem_total_gb'), ' GiB', 1)}")
        return
    m, stats = report["metrics"], report.get("stats", {})
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column(f"spread over {m['repeats']} repeat(s) x {m['steps_per_repeat']} steps", justify="right")

    def spread(key: str, unit: str = "", digits: int = 1) -> str:
        s = stats.get(key)
        if not s or s["n"] < 2:
            return ""
        return f"{_fmt(s['min'], unit, digits)} .. {_fmt(s['max'], unit, digits)}"

    t.add_row("real tokens/s", _fmt(m["real_tokens_per_s"], "", 0), spread("real_tokens_per_s", "", 0))
    t.add_row("loss tokens/s", _fmt(m["loss_tokens_per_s"], "", 0), spread("loss_tokens_per_s", "", 0))
    t.add_row("pad fraction", _fmt(m["pad_fraction"] * 100, " %"), "")
    step = stats.get("step_ms", {})
    t.add_row("ms/step (median)", _fmt(m["step_ms"], " ms"),
              f"p10 {_fmt(m['step_ms_p10'])} / p90 {_fmt(m['step_ms_p90'])} (n={step.get('n')})")
    t.add_row("MFU", _fmt(m["mfu"] * 100 if m["mfu"] is not None else None, " %"), spread("mfu", "", 3))
    t.add_row("model TFLOP/s", _fmt(m["model_tflops_per_s"], "", 2), "")
    if m.get("peak_mem_gb") is not None:
        t.add_row("peak memory allocated / reserved",
                  f"{_fmt(m['peak_mem_gb'], ' GiB', 2)} / {_fmt(m['peak_mem_reserved_gb'], ' GiB', 2)}",
                  f"of {_fmt(m['device_mem_total_gb'], ' GiB')}")
    else:
        t.add_row("host peak RSS", _fmt(m["host_peak_rss_gb"], " GiB", 2), "")
    loss = m["final_loss"]
    t.add_row("final loss", _fmt(loss, "", 4) if m["loss_finite"] else f"[red]{loss} (not finite)[/red]", "")
    console.print(t)
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "transformers", "liger_kernel") if env.get(k))
    console.print(f"[dim]{versions}; driver {env.get('driver') or 'n/a'}[/dim]")
    tr = report.get("trace")
    if tr:
        traced = sorted(tr["traced_step_ms"])[len(tr["traced_step_ms"]) // 2]
        console.print(f"trace: {tr['path']} ({(tr['bytes'] or 0) / 2**20:.1f} MiB, {tr['steps']} steps; "
                      f"traced step {traced:.1f} ms vs untraced median {m['step_ms']:.1f} ms)")
    if report["status"] == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(show_header=True, header_style="bold")
    for col in ("kind", "name", "params", "layers", "hidden", "heads", "head dim", "notes"):
        t.add_column(col, justify="right" if col in ("params", "layers", "hidden", "heads", "head dim") else "left")
    for r in rows:
        t.add_row(r["kind"], r["name"], f"{r['params'] / 1e6:,.1f}M", str(r.get("layers", "")), str(r.get("hidden", "")),
                  str(r.get("heads", "")), str(r.get("head_dim", "")), r.get("notes", ""))
    console.print(t)

