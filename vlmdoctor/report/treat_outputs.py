"""What `vlmdoctor treat` leaves in its folder: the ladder as JSON, chart, page and final config."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from vlmdoctor.files import json_text, save
from vlmdoctor.report.chart import ladder_png
from vlmdoctor.report.html import treat_html
from vlmdoctor.run.config import RunConfig


def write_outputs(result: dict[str, Any], out_dir: Path) -> tuple[dict[str, Path], list[str]]:
    """treat.json, final_config.yaml (runs again with `vlmdoctor profile --config`), ladder.png and treat.html.

    Each goes through the one writer; one that cannot be written is kept in a fallback file, and the
    second value holds a line for each such failure (the treatment is never lost to a full disk).
    """
    failures: list[str] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        failures.append(f"cannot create {out_dir}: {e.strerror}")
    paths = {
        "report": out_dir / "treat.json",
        "config": out_dir / "final_config.yaml",
        "chart": out_dir / "ladder.png",
        "html": out_dir / "treat.html",
    }
    result["outputs"] = {k: str(v) for k, v in paths.items()}
    if not result["ladder"]:
        paths.pop("chart")
        result["outputs"].pop("chart")
    failures.append(save(paths["report"], json_text(result), "treatment JSON"))
    failures.append(
        save(
            paths["config"],
            RunConfig.from_dict(result["final_config"], source="treat").dump_text(),
            "final config",
        )
    )
    if "chart" in paths:
        buf = io.BytesIO()
        ladder_png(result, buf)
        failures.append(save(paths["chart"], buf.getvalue(), "ladder chart"))
    failures.append(save(paths["html"], treat_html(result), "HTML report"))
    return paths, [f for f in failures if f]
