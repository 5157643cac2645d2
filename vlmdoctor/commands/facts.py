"""`vlmdoctor facts [NAME]`: what a fact is, where it is computed, what records it and which rules read it (the
catalogue: trace/catalog.py)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from vlmdoctor.commands import options
from vlmdoctor.commands.app import exit_if_failed, out, user_errors
from vlmdoctor.commands.options import ForceJson
from vlmdoctor.errors import UsageError
from vlmdoctor.files import check_writable, save_json

Name = Annotated[str | None, typer.Argument(help="a fact (gpu.busy_frac, kernels.cast.ms); none: every fact")]
Markdown = Annotated[bool, typer.Option("--markdown", help="print the table of docs/analysis.md instead")]
JsonOut = options.json_out("fact catalogue")


def facts(name: Name = None, markdown: Markdown = False, json_path: JsonOut = None, force: ForceJson = False) -> None:
    """What a fact is, where it is computed and what records it (the catalogue: trace/catalog.py)."""
    from vlmdoctor.doctor.rules import load_rules  # deferred: pandas
    from vlmdoctor.trace import catalog  # deferred: the command's own module

    with user_errors():
        check_writable(json_path, force)
        found = [catalog.lookup(name)] if name else catalog.FACTS
        if found == [None]:
            near = catalog.suggest(name)
            raise UsageError(f"no fact {name!r}" + (f"; did you mean {', '.join(near)}?" if near else ""))
        rules, _ = load_rules()
        docs = [
            {
                **catalog.describe(f),
                "read_by": sorted(r.id for r in rules if any(map(f.pattern.fullmatch, r.facts_used()))),
            }
            for f in found
        ]
        if json_path:
            exit_if_failed([save_json(docs[0] if name else docs, json_path, "fact catalogue")])
    if markdown and json_path != "-":
        out.print(catalog.markdown_facts(), end="", markup=False, highlight=False, soft_wrap=True)
    elif json_path != "-":
        for d in docs:
            out.print(
                f"[bold]{escape(d['name'])}[/bold] ({escape(d['unit'])}): {escape(d['meaning'])}", highlight=False
            )
            if name:
                out.print(f"  computed in {d['computed_in']}", highlight=False)
                out.print(f"  recorded by {escape('; '.join(d['recorded_by']))}", highlight=False)
                for k, v in {**d.get("values", {}), "ranks": d.get("ranks"), "rules": ", ".join(d["read_by"])}.items():
                    if v:
                        out.print(f"  {k}: {escape(v)}", highlight=False)


def register(app: typer.Typer) -> None:
    app.command()(facts)
