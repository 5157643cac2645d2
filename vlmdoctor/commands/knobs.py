"""The run config's knobs on the command line: an option for each knob, generated from its declaration in
run/config.py (flag, help, panel, choices), for `profile` (every knob), `treat` and `sweep` (a few: the several
GPUs' --nproc-per-node and --parallel among them); `--set knob=value`; and the way back, a config and a patch as the
`vlmdoctor profile` command line that runs them.
"""

from __future__ import annotations

import inspect
import shlex
from collections.abc import Callable
from typing import Any

import typer
from rich.markup import escape

from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import parse_yaml
from vlmdoctor.run.config import RunConfig, _base_type, fields_by_name, flag, panel


def _flags(name: str) -> tuple[str, str | None]:
    """A knob's flag, and its --no- form for an on/off knob (None otherwise)."""
    spelled = flag(name)
    return spelled, f"--no-{spelled[2:]}" if _base_type(fields_by_name()[name].type) is bool else None


def _knob_param(name: str, default: Any, panels: bool, note: str) -> inspect.Parameter:
    """A run-config knob as a typer option, all from its declaration: flag, help, panel, choices.

    The option's own default is None, so the command sees which knobs the command line set;
    `default` is what the help says the knob is when it is not given."""
    meta = fields_by_name()[name].metadata
    kind = _base_type(fields_by_name()[name].type)
    on, off = _flags(name)
    decls = f"{on}/{off}" if off else on
    words = [meta["help"] + (f" {note}" if note else "")]
    if meta["choices"] and kind is not bool:
        words.append("[" + ", ".join(str(c) for c in meta["choices"]) + "]")
    if default is not None and default is not False:  # a switch not given is off: no need to say it
        words.append(f"[default: {'on' if default is True else default}]")
    option = typer.Option(
        None,
        decls,
        help=escape(" ".join(words)),  # rich markup would eat "[default: ...]"
        rich_help_panel=panel(name) if panels else None,
        show_default=False,
    )
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind | None)


def knob_options(
    names: tuple[str, ...] | None = None, defaults: dict[str, Any] | None = None, panels: bool = True, note: str = ""
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command an option for each run-config knob (all, or `names`), generated from the config.

    The command takes them as `**knobs` (None where not given); `defaults`: what the command uses
    where it does not use the config's own default (treat's shorter window), said in the help."""

    def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
        own = inspect.signature(func, eval_str=True)  # the command's own options: Annotated aliases, resolved now
        made = [
            _knob_param(n, (defaults or {}).get(n, f.default), panels, note)
            for n, f in RunConfig.__dataclass_fields__.items()
            if names is None or n in names
        ]
        kept = [p.replace(kind=p.KEYWORD_ONLY) for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
        func.__signature__ = own.replace(parameters=made + kept)
        func.__annotations__ = {**func.__annotations__, **{p.name: p.annotation for p in made}}
        return func

    return wrap


def knob_flags() -> dict[str, tuple[str, str | None]]:
    """Each run-config knob's flag on `profile`, as `knob_options` gives it: (flag, its --no- form or None)."""
    return {name: _flags(name) for name in RunConfig.__dataclass_fields__}


def run_command(config: dict[str, Any], patch: dict[str, Any]) -> str:
    """The `vlmdoctor profile` command that runs `config` with `patch` applied, to paste into a shell.

    Model, stage and device always; other knobs only where they differ from the default; the
    patch's flags last, so the change stands at the end of the line.
    """
    flags = knob_flags()
    defaults = RunConfig().to_dict()
    parts = ["vlmdoctor", "profile"]
    patch = {k: v for k, v in patch.items() if config.get(k, defaults.get(k)) != v}  # a no-op knob needs no flag

    def add(knob: str, value: Any) -> None:
        if knob not in flags or value is None:
            return
        on, off = flags[knob]
        if isinstance(value, bool):
            if value or off:
                parts.append(on if value else off)
        else:
            parts.extend([on, shlex.quote(str(value))])

    for knob in ("model", "stage", "device"):
        if knob not in patch:
            add(knob, config.get(knob, defaults.get(knob)))
    for knob, value in config.items():
        if knob not in ("model", "stage", "device") and knob not in patch and value != defaults.get(knob):
            add(knob, value)
    for knob, value in patch.items():
        add(knob, value)
    return " ".join(parts)


def parse_sets(sets: list[str], many: bool = False) -> dict[str, Any]:
    """`--set knob=value` pairs (YAML values; with many, comma-separated lists) into a dict."""
    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            raise UsageError(f"--set {item!r}: expected knob=value")
        k, v = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in RunConfig.__dataclass_fields__:
            raise UsageError(
                f"--set {k}: unknown knob; valid knobs: {', '.join(sorted(RunConfig.__dataclass_fields__))}"
            )
        kind = _base_type(RunConfig.__dataclass_fields__[k].type)
        # "off" is a string here, not YAML's False
        parse = (lambda x, _: x.strip()) if kind is str else parse_yaml
        out[k] = [parse(x, f"--set {item}") for x in v.split(",")] if many else parse(v, f"--set {item}")
    return out
