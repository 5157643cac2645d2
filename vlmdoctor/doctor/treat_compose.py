"""A round's compositions for `treat` (doctor/treat.py): the diagnosis's config patches applied together in layer
order, an alternative (torch.compile or Liger's kernels) composed beside them, and a composition's batch step halved
after it ran out of memory. No run here: configs only."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from vlmdoctor.errors import UsageError
from vlmdoctor.run.config import RunConfig

#: knobs that only say how a run is measured, never what it trains: a patch may raise them (compile needs a
#: longer warm-up) and an ablation does not remove them
MEASUREMENT_KNOBS = ("warmup", "steps", "repeats")


def config_key(cfg: RunConfig) -> str:
    """A config's identity: a treatment never measures one config twice as a new candidate."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


def _change(f: dict[str, Any], cfg: RunConfig) -> dict[str, Any] | None:
    patch = {k: v for k, v in f["config_patch"].items() if getattr(cfg, k, None) != v}
    if not {k for k in patch if k not in MEASUREMENT_KNOBS}:
        return None
    return {
        "rule": f["id"],
        "layer": f["layer"],
        "title": f["title"],
        "config_patch": patch,
        "expected_gain": f.get("expected_gain"),
    }


def apply(cfg: RunConfig, changes: list[dict[str, Any]]) -> RunConfig:
    """The config with every change's patch; an earlier (lower-layer) change wins a knob both set."""
    merged: dict[str, Any] = {}
    for c in changes:
        for k, v in c["config_patch"].items():
            if k in MEASUREMENT_KNOBS and k in merged:
                merged[k] = max(merged[k], v)
            merged.setdefault(k, v)
    return cfg.replace(source="composed prescriptions", **merged)


def compose(
    cfg: RunConfig,
    report: dict[str, Any],
    skipped: list[dict[str, Any]],
    validate: Callable[[RunConfig], Any] = lambda c: None,
) -> list[dict[str, Any]]:
    """The compositions a diagnosis supports: the findings in layer order, and for each alternative
    (a superseded finding whose patch contradicts the one that superseded it, like Liger on vs
    torch.compile with Liger off) one more composition with the alternative instead.

    A change that would make an invalid config, or one this machine refuses (`validate`: a GPU-only
    knob on a CPU), is left out and reported in `skipped`, so one such change cannot sink the others.
    """
    from vlmdoctor.doctor.rules import in_apply_order  # deferred: the rule engine loads pandas

    findings = in_apply_order(report.get("findings") or [])  # listed by gain; composed in layer order
    superseded = report.get("superseded") or []

    def skip(f: dict[str, Any], why: str) -> None:
        entry = {"rule": f["id"], "config_patch": f["config_patch"], "why": why}
        if entry not in skipped:
            skipped.append(entry)

    def build(chosen: list[dict[str, Any]], note: bool) -> tuple[list[dict[str, Any]], RunConfig] | None:
        changes: list[dict[str, Any]] = []
        for f in chosen:
            c = _change(f, cfg)
            if c is None:
                if note:
                    skip(f, "the config already has it")
                continue
            try:
                validate(apply(cfg, changes + [c]))
            except UsageError as e:
                if note:
                    skip(f, e.message)
                continue
            changes.append(c)
        return (changes, apply(cfg, changes)) if changes else None

    out = []
    primary = build(findings, note=True)
    if primary:
        out.append({"name": "composition", "changes": primary[0], "config": primary[1]})
    ids = [f["id"] for f in findings]
    for s in superseded:
        by = next((f for f in findings if f["id"] == s.get("superseded_by")), None)
        if by is None or all(by["config_patch"].get(k, object()) == v for k, v in s["config_patch"].items()):
            continue  # a repeat of the earlier fix, not an alternative to it
        alt = build([s if f["id"] == by["id"] else f for f in findings], note=False)
        if alt and all(alt[1] != o["config"] for o in out):
            out.append(
                {
                    "name": f"composition with {s['id']} instead of {by['id']}",
                    "changes": alt[0],
                    "config": alt[1],
                }
            )
        if len(out) >= 3 or s["id"] in ids:
            break
    return out


def smaller_batch(cfg: RunConfig, comp: dict[str, Any]) -> dict[str, Any] | None:
    """The composition with its batch-size step halved (dropped when that reaches the current batch): from
    batch 22 a step to 55 that ran out of memory is measured again at 38, not at 27."""
    changes = []
    found = False
    for ch in comp["changes"]:
        bs = ch["config_patch"].get("batch_size")
        if isinstance(bs, int) and bs > cfg.batch_size:
            found = True
            smaller = cfg.batch_size + (bs - cfg.batch_size) // 2  # half the step, not half the batch
            if smaller == cfg.batch_size:
                rest = {k: v for k, v in ch["config_patch"].items() if k != "batch_size"}
                if rest:
                    changes.append({**ch, "config_patch": rest})
                continue
            ch = {**ch, "config_patch": {**ch["config_patch"], "batch_size": smaller}}
        changes.append(ch)
    if not found or not changes:
        return None
    try:
        config = apply(cfg, changes)
    except UsageError:
        return None
    base = comp["name"].split(" (batch")[0]
    return {"name": f"{base} (batch halved after OOM)", "changes": changes, "config": config}


def merged_patch(changes: list[dict[str, Any]]) -> dict[str, Any]:
    """The changes' patches as one, the first change's value for a knob two set (their layer order)."""
    merged: dict[str, Any] = {}
    for c in changes:
        for k, v in c["config_patch"].items():
            merged.setdefault(k, v)
    return merged
