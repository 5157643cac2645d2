"""What `vlmdoctor treat` leaves in its folder: the ladder as JSON, chart, page and final config."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vlmdoctor.files import write_json
from vlmdoctor.report.chart import ladder_png
from vlmdoctor.report.html import treat_html, write_html
from vlmdoctor.run.config import RunConfig


def write_outputs(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """treat.json, final_config.yaml (runs again with `vlmdoctor profile --config`), ladder.png and treat.html."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"report": out_dir / "treat.json", "config": out_dir / "final_config.yaml", "chart": out_dir / "ladder.png",
             "html": out_dir / "treat.html"}
    RunConfig.from_dict(result["final_config"], source="treat").dump(paths["config"])
    result["outputs"] = {k: str(v) for k, v in paths.items()}
    if result["ladder"]:
        ladder_png(result, paths["chart"])
    else:
        paths.pop("chart")
        result["outputs"].pop("chart")
    write_json(result, str(paths["report"]))
    write_html(treat_html(result), paths["html"], force=True)
    return paths
