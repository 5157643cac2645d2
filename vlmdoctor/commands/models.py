"""`vlmdoctor models`: the presets, vision towers and LLMs with parameter counts and head dims (run/model.py's
catalogue)."""

from __future__ import annotations

import typer

from vlmdoctor.commands import options
from vlmdoctor.commands.app import exit_if_failed, out, user_errors
from vlmdoctor.commands.options import ForceJson
from vlmdoctor.files import check_writable, save_json
from vlmdoctor.report.console import render_models

JsonOut = options.json_out("catalogue")


def models(json_path: JsonOut = None, force: ForceJson = False) -> None:
    """List presets, vision towers and LLMs with parameter counts and head dims."""
    from vlmdoctor.run.model import catalogue  # deferred: torch, transformers

    with user_errors():
        check_writable(json_path, force)
        rows = catalogue()
        if json_path:
            exit_if_failed([save_json(rows, json_path, "model catalogue")])  # a list of rows, as before
    if json_path != "-":
        render_models(rows, out)


def register(app: typer.Typer) -> None:
    app.command()(models)
