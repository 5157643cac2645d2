"""`vlmdoctor rules list` and `vlmdoctor rules show ID`: the prescription rules (rules/*.yaml), read by the rule
engine (doctor/rules.py); a rule's page is its `rule_page`."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from vlmdoctor.commands import options
from vlmdoctor.commands.app import err, exit_if_failed, out, user_errors
from vlmdoctor.commands.options import ForceJson, RuleFolders
from vlmdoctor.doctor.select import suggest
from vlmdoctor.errors import EXIT_USAGE, UsageError
from vlmdoctor.files import check_inputs_kept, check_writable, save_json
from vlmdoctor.inputs import check_rules_dirs
from vlmdoctor.report.console import esc, render_rule_page

rules_app = typer.Typer(help="The prescription rules (rules/*.yaml).", no_args_is_help=True)

ListJson = options.json_out("rule list")
PageJson = options.json_out("rule page")
RuleId = Annotated[str, typer.Argument(help="rule id (vlmdoctor rules list)")]


@rules_app.command("list")
def rules_list(rules_dirs: RuleFolders = None, json_path: ListJson = None, force: ForceJson = False) -> None:
    """Every rule, in layer order, with what it detects."""
    from vlmdoctor.doctor.rules import load_rules  # deferred: pandas

    with user_errors():
        check_writable(json_path, force, "--json")
        check_rules_dirs(rules_dirs or [])
        check_inputs_kept({"a --rules folder": rules_dirs}, {"--json": json_path})
        rules, problems = load_rules(*(rules_dirs or []))
        rules = sorted(rules, key=lambda r: (r.layer, r.id))
        if json_path:
            listing = [
                {"id": r.id, "layer": r.layer, "severity": r.severity, "title": r.title, "file": str(r.path)}
                for r in rules
            ]
            exit_if_failed([save_json({"rules": listing, "problems": problems}, json_path, "rule list")])
    if json_path != "-":
        # an id is never cut (it is what --ignore and rules show take): the title wraps instead
        t = Table(show_header=True, header_style="bold")
        t.add_column("layer", no_wrap=True)
        t.add_column("id", no_wrap=True, min_width=max((len(r.id) for r in rules), default=2))
        t.add_column("max", no_wrap=True)
        t.add_column("title", overflow="fold")
        for r in rules:
            t.add_row(esc(r.layer), esc(r.id), esc(r.severity), esc(r.title))
        out.print(t)
        out.print("[dim]max: the highest severity a finding can have; its expected gain sets it[/dim]")
        out.print("[dim]vlmdoctor rules show ID: what a rule detects, its evidence, fix and thresholds[/dim]")
    for p in problems:
        err.print(f"[yellow]rule problem:[/yellow] {esc(p)}", highlight=False)
    if problems:
        raise typer.Exit(EXIT_USAGE)


@rules_app.command("show")
def rules_show(
    rule_id: RuleId, rules_dirs: RuleFolders = None, json_path: PageJson = None, force: ForceJson = False
) -> None:
    """One rule's page: what it detects, why it matters, its evidence, the fix, where its thresholds come from."""
    from vlmdoctor.doctor.rules import load_rules, rule_page  # deferred: pandas

    with user_errors():
        check_writable(json_path, force, "--json")
        check_rules_dirs(rules_dirs or [])
        check_inputs_kept({"a --rules folder": rules_dirs}, {"--json": json_path})
        rules, _ = load_rules(*(rules_dirs or []))
        match = [r for r in rules if r.id == rule_id]
        if not match:
            close = suggest(rule_id, sorted(r.id for r in rules))
            raise UsageError(
                f"no rule {rule_id!r}"
                + (f"; did you mean {', '.join(close)}?" if close else "; vlmdoctor rules list shows every id")
            )
        page = rule_page(match[0])
        if json_path:
            exit_if_failed([save_json(page, json_path, "rule page")])
        if json_path != "-":
            render_rule_page(page, out)


def register(app: typer.Typer) -> None:
    app.add_typer(rules_app, name="rules")
