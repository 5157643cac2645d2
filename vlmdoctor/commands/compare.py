"""`vlmdoctor compare A B`: two reports side by side (report/compare.py); here: the options and the column heads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import exit_if_failed, out, user_errors
from vlmdoctor.commands.options import ForceJson
from vlmdoctor.files import check_inputs_kept, check_writable, json_text, save, write_json

Before = Annotated[str, typer.Argument(help="report JSON (before)")]
After = Annotated[str, typer.Argument(help="report JSON (after)")]
AllowDifferent = Annotated[bool, typer.Option("--allow-different", help="compare different models or stages")]
JsonOut = options.json_out("comparison")


def compare(
    a: Before, b: After, allow_different: AllowDifferent = False, json_path: JsonOut = None, force: ForceJson = False
) -> None:
    """Side by side: metrics, GPU time by kernel class, idle causes, findings added or gone, knobs changed."""
    # deferred: the reader of reports and the comparison; keeps --help fast
    from vlmdoctor.ci.gate import load_report
    from vlmdoctor.report import compare as comparison

    with user_errors():
        check_writable(json_path, force, "--json")
        check_inputs_kept({"report A": a, "report B": b}, {"--json": json_path})
        result = comparison.compare(load_report(a), load_report(b), allow_different, labels=compare_labels(a, b))
        if json_path == "-":
            write_json(result, "-")
            return
        comparison.render_compare(result, out)
        if json_path:
            exit_if_failed([save(json_path, json_text(result), "comparison JSON")])


def compare_labels(a: str, b: str) -> tuple[str, str]:
    """Column heads for two reports: their file names, or, where those are the same (two runs' report.json),
    the shortest trailing paths that tell them apart."""
    pa, pb = Path(a), Path(b)
    for depth in range(1, max(len(pa.parts), len(pb.parts)) + 1):
        la, lb = str(Path(*pa.parts[-depth:])), str(Path(*pb.parts[-depth:]))
        if la != lb:
            return la, lb
    return a, b


def register(app: typer.Typer) -> None:
    app.command()(compare)
