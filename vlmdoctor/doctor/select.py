"""Which findings the user muted: `--select` / `--ignore` and `[tool.vlmdoctor]`, by rule id, layer or severity.

A muted finding is moved to the diagnosis' `muted` list with what muted it, never dropped; gate,
treat and the reports read `findings` (the active ones) and show `muted` as such.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vlmdoctor.doctor.gain import SEVERITIES
from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import LAYER_NAMES

#: short layer words, as the rule ids start (fusion-..., system-...), besides the layer's number and name
_LAYER_WORDS = {"data": 3, "fusion": 4, "system": 5}


def layer_aliases() -> dict[str, int]:
    """Every word that names a layer in a selection: '1', 'precision', 'data-layout', 'data_layout', 'data', ..."""
    out: dict[str, int] = {}
    for n, name in LAYER_NAMES.items():
        if n == 0:
            continue
        out[str(n)] = n
        for sep in ("-", "_", " "):
            out[name.replace(" ", sep)] = n
    out.update(_LAYER_WORDS)
    return out


def split_tokens(values: Iterable[str] | None) -> list[str]:
    """Comma-separated and repeated option values as one list of tokens (lower case, blanks dropped)."""
    return [t.strip().lower() for v in values or [] for t in str(v).split(",") if t.strip()]


def suggest(token: str, candidates: Sequence[str], n: int = 3) -> list[str]:
    """The closest names to a mistyped or cut one: names it starts (a cut id) first, then difflib's."""
    stem = token.rstrip(".…").strip()
    starts = [c for c in candidates if stem and c.startswith(stem)] if stem != token or len(stem) >= 3 else []
    close = difflib.get_close_matches(stem or token, candidates, n=n, cutoff=0.6)
    return list(dict.fromkeys(starts + close))[:n]


def check_tokens(tokens: Sequence[str], rule_ids: Sequence[str], where: str) -> None:
    """Every token names a rule (or a glob of ids), a layer or a severity; else one line with the closest names."""
    words = [*layer_aliases(), *SEVERITIES]
    for t in tokens:
        if t in rule_ids or t in words:
            continue
        if any(ch in t for ch in "*?[") and fnmatch.filter(rule_ids, t):
            continue
        close = suggest(t, [*sorted(rule_ids), *words])
        hint = f"; did you mean {', '.join(close)}?" if close else "; see vlmdoctor rules list"
        raise UsageError(
            f"{where}: {t!r} is not a rule id, layer (1-5 or its name) or severity (high, medium, low){hint}"
        )


def matches(token: str, finding: dict[str, Any]) -> bool:
    """Whether a token names this finding: its id (or a glob of ids), its layer, or its severity."""
    fid = str(finding.get("id", "")).lower()
    if token == fid or (any(ch in token for ch in "*?[") and fnmatch.fnmatchcase(fid, token)):
        return True
    layer = layer_aliases().get(token)
    if layer is not None:
        return finding.get("layer") == layer
    return token == finding.get("severity")


@dataclass
class Selection:
    """Tokens that choose (select) and mute (ignore) findings, each with where it was given."""

    select: list[tuple[str, str]] | None = None  # None: every rule is selected
    ignore: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return self.select is not None or bool(self.ignore)

    def muted_by(self, finding: dict[str, Any]) -> str | None:
        """What mutes this finding ('--ignore low', 'not in --select ...'), or None when it stays active."""
        if self.select is not None and not any(matches(t, finding) for t, _ in self.select):
            where = self.select[0][1] if self.select else "--select"
            return f"not in {where} {','.join(t for t, _ in self.select)}"
        for t, where in self.ignore:
            if matches(t, finding):
                return f"{where} {t}"
        return None

    def split(self, findings: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(active, muted): each muted finding carries `muted_by`."""
        active, muted = [], []
        for f in findings:
            why = self.muted_by(f)
            if why is None:
                active.append(f)
            else:
                muted.append({**f, "muted_by": why})
        return active, muted

    def to_json(self) -> dict[str, Any]:
        """The tokens with where each was given, for a child process (`vlmdoctor run`'s script)."""
        return {
            "select": None if self.select is None else [list(x) for x in self.select],
            "ignore": [list(x) for x in self.ignore],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> Selection:
        data = data or {}
        select = data.get("select")
        return cls(
            None if select is None else [(str(t), str(w)) for t, w in select],
            [(str(t), str(w)) for t, w in data.get("ignore") or []],
        )


def build_selection(
    select: Sequence[str] | None,
    ignore: Sequence[str] | None,
    rule_ids: Sequence[str],
    settings: dict[str, Any] | None = None,
) -> Selection:
    """The command line's --select / --ignore over the project's [tool.vlmdoctor] ones, checked against the rules.

    As in ruff, a --select on the command line replaces the table's `select`; --ignore adds to its `ignore`.
    """
    settings = settings or {}
    where = settings.get("_where", "pyproject.toml")
    sel_cli, ign_cli = split_tokens(select), split_tokens(ignore)
    sel_cfg, ign_cfg = split_tokens(settings.get("select")), split_tokens(settings.get("ignore"))
    ids = [i.lower() for i in rule_ids]
    check_tokens(sel_cli, ids, "--select")
    check_tokens(ign_cli, ids, "--ignore")
    check_tokens(sel_cfg, ids, f"{where} [tool.vlmdoctor] select")
    check_tokens(ign_cfg, ids, f"{where} [tool.vlmdoctor] ignore")
    chosen: list[tuple[str, str]] | None = None
    if sel_cli:
        chosen = [(t, "--select") for t in sel_cli]
    elif sel_cfg:
        chosen = [(t, f"{where} select") for t in sel_cfg]
    muted = [(t, f"{where} ignore") for t in ign_cfg] + [(t, "--ignore") for t in ign_cli]
    return Selection(chosen, muted)


def mute_diagnosis(diagnosis: dict[str, Any], selection: Selection) -> dict[str, Any]:
    """Mute findings of a diagnosis already made (a stored report): active ones move to `muted`, in place."""
    if not selection or not isinstance(diagnosis, dict):
        return diagnosis
    active, muted = selection.split(list(diagnosis.get("findings") or []))
    diagnosis["findings"] = active
    diagnosis["muted"] = list(diagnosis.get("muted") or []) + muted
    return diagnosis


def mute_report(report: dict[str, Any], selection: Selection) -> dict[str, Any]:
    """A stored report's findings muted by `selection`, in place: the top-level `findings` (what gate and treat
    read) and its diagnosis' each move what the selection mutes to their `muted`."""
    if not selection or not isinstance(report, dict) or not isinstance(report.get("findings"), list):
        return report
    diagnosis = report.get("diagnosis")
    if isinstance(diagnosis, dict) and isinstance(diagnosis.get("findings"), list):
        mute_diagnosis(diagnosis, selection)
    active, muted = selection.split(list(report["findings"]))
    report["findings"] = active
    report["muted"] = list(report.get("muted") or []) + muted
    return report
