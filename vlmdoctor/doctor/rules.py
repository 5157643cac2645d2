"""The rule engine: the rules loaded from their folders (`rules/*.yaml`), and run over a trace's measured facts.

A rule's condition is an expression over named facts, evaluated without `eval` (doctor/rule_expr.py); each
rule file is checked when it loads (doctor/rule_file.py); a finding's evidence lines are doctor/evidence.py's.
A rule that needs a fact the trace does not hold is reported as not evaluated, never as fired.

A finding's severity follows its expected gain (doctor/gain.py, capped by the rule's own
`severity`), and findings are listed biggest expected gain first (`rank`); the layer (1 precision
... 5 system tuning) is the order in which the fixes are applied (`apply_order`). A finding whose
config patch contradicts or repeats an earlier-applied one's, or that names it under `conflicts`,
is kept as superseded rather than prescribed twice. A finding the user muted (`--ignore`,
`[tool.vlmdoctor]`) is kept under `muted`, never dropped.
"""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from vlmdoctor.doctor.evidence import CONTRADICTED, contradictions, evidence_lines, missing_hint
from vlmdoctor.doctor.gain import gain_ratio, gain_severity, share_of_gpu
from vlmdoctor.doctor.rule_expr import (
    EVAL_ERRORS,
    MissingFact,
    RuleEvalError,
    alternatives,
    evaluate,
    looks_like_expr,
    names,
    parsed,
)
from vlmdoctor.doctor.rule_file import Rule, rule_from
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import read_yaml
from vlmdoctor.run.config import LAYER_NAMES
from vlmdoctor.trace import catalog
from vlmdoctor.trace.accounts import ACCOUNT_FACTS, WORK, step_accounts
from vlmdoctor.trace.families.idle import SYNC_CODE


def _builtin_rules_dir() -> Path:
    """The shipped rules: package data in an installed wheel, the top-level rules/ in a source checkout."""

    try:
        found = resources.files("vlmdoctor.builtin_rules")
        for entry in getattr(found, "_paths", [found]):  # a namespace package may span several folders
            if Path(str(entry)).is_dir() and any(Path(str(entry)).glob("*.yaml")):
                return Path(str(entry))
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parents[2] / "rules"


RULES_DIR = _builtin_rules_dir()
#: an account of the step this large gets a word in every diagnosis: a finding, or "no prescription known"
MIN_ACCOUNT_SHARE = 0.05


def load_rules(*dirs: str | Path) -> tuple[list[Rule], list[str]]:
    """Rules of the shipped folder plus any extra folders; problems are reported, the other rules still load."""
    rules: list[Rule] = []
    problems: list[str] = []
    seen: dict[str, Path] = {}
    if not any(RULES_DIR.glob("*.y*ml")):
        raise UsageError(
            f"no built-in rules found (looked in {RULES_DIR}); this vlmdoctor install is broken: "
            "reinstall it (pip install --force-reinstall vlmdoctor)"
        )
    folders: dict[Path, Path] = {}  # a folder named twice (--rules and [tool.vlmdoctor] rules) loads once
    for d in [RULES_DIR, *dirs]:
        folders.setdefault(Path(os.path.abspath(d)), Path(d))
    for d in folders.values():
        if not d.is_dir():
            problems.append(f"{d}: not a folder of rule files")
            continue
        try:
            paths = sorted(d.glob("*.y*ml"))
        except OSError as e:
            problems.append(f"{d}: cannot read the folder ({e.strerror})")
            continue
        for path in paths:
            if not path.is_file():
                problems.append(f"{path}: not a file")
                continue
            try:
                rule = rule_from(path, read_yaml(path, "rule file"))
            except UsageError as e:
                problems.append(e.message)
                continue
            except (TypeError, ValueError, AttributeError, RecursionError) as e:
                problems.append(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            if rule.id in seen:
                problems.append(f"{path}: rule id {rule.id!r} is already used by {seen[rule.id]}")
                continue
            seen[rule.id] = path
            rules.append(rule)
    return rules, problems


def rule_page(rule: Rule) -> dict[str, Any]:
    """A rule as a page a person reads: detects, evidence, fix, and where each threshold comes from."""
    return {
        "id": rule.id,
        "title": rule.title,
        "layer": rule.layer,
        "layer_name": LAYER_NAMES[rule.layer],
        "severity": rule.severity,
        "stages": rule.stages,
        "file": str(rule.path),
        "detects": " ".join(rule.detects.split()),
        "when": rule.when,
        "unless": rule.unless,
        "evidence": list(rule.evidence),
        "fix": rule.fix,
        "patch": dict(rule.patch),
        "gain": {k: v for k, v in rule.gain.items()},
        "thresholds": [{"name": k, "value": c.get("value"), "why": c.get("why")} for k, c in rule.constants.items()],
        "facts": sorted(rule.facts_used()),
        "conflicts": list(rule.conflicts),
        "sources": list(rule.sources),
    }


# --- diagnosis ------------------------------------------------------------------------------------------


def diagnose(
    facts: dict[str, Any],
    rules: list[Rule],
    problems: list[str] | None = None,
    selection: Any = None,
) -> dict[str, Any]:
    """Findings biggest expected gain first, plus what was muted, superseded, not evaluated or not applicable.

    `problems` (rule files that did not load) travel with the diagnosis so reports show them.
    `selection` (vlmdoctor.doctor.select.Selection) mutes findings before supersession: a muted
    fix covers nothing, so a finding it would have superseded is prescribed instead.
    """
    fired, not_evaluated, not_applicable = [], [], []
    stage = facts.get("run.stage")
    for rule in rules:
        if set(rule.stages) != {1, 2}:
            if stage is None:
                not_evaluated.append({"id": rule.id, "missing": ["run.stage"]})
                continue
            if stage not in rule.stages:
                not_applicable.append(
                    {"id": rule.id, "why": f"applies in stage {', '.join(map(str, rule.stages))} only"}
                )
                continue
        try:
            finding = _fire(rule, facts, not_evaluated, not_applicable)
        except EVAL_ERRORS as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
            problems = [
                *(problems or []),
                f"{rule.path}: rule {rule.id} failed while being evaluated ({why})",
            ]
            continue
        if finding is not None:
            fired.append(finding)
    fired.sort(key=lambda f: (f["layer"], -f["_order"]))
    fired, muted = selection.split(fired) if selection is not None else (fired, [])
    kept, superseded = [], []
    for f in fired:  # superseded: a declared conflict, or an earlier fix already sets every knob this one sets
        clash = next(
            (
                k
                for k in kept
                if f["id"] in k["conflicts"]
                or k["id"] in f["conflicts"]
                or (f["config_patch"] and set(f["config_patch"]) <= set(k["config_patch"]))
            ),
            None,
        )
        if clash:
            superseded.append({**f, "superseded_by": clash["id"]})
        else:
            kept.append(f)
    for f in kept + superseded + muted:
        f.pop("conflicts", None)
        f.pop("_order", None)
    return {
        "findings": rank_findings(kept),
        "superseded": superseded,
        "muted": muted,
        "not_evaluated": not_evaluated,
        "not_applicable": not_applicable,
        "problems": list(problems or []),
        "accounts": account_verdicts(facts, kept + superseded + muted),
    }


def account_verdicts(
    facts: dict[str, Any], findings: list[dict[str, Any]], job: Sequence[dict[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Every account of the step that holds at least MIN_ACCOUNT_SHARE of it, with what the diagnosis says of it:
    the findings that speak to it, or that it is the step's own work, or that no prescription is known. No cost of
    that size goes unnamed. `job`: the findings on the joined ranks, for one rank's accounts: a rank's wait for the
    others is caused on another rank, so only the job's finding (the straggler's loader, its extra tokens) names it."""
    acc = step_accounts(facts)
    if acc is None:
        return []
    where = _where(facts)
    out = []
    for row in acc["rows"]:
        if row["share"] < MIN_ACCOUNT_SHARE:
            continue
        named = [f["id"] for f in findings if row["account"] in f.get("accounts", ())]
        named += [f["id"] for f in job if row["account"] in f.get("accounts", ()) and f["id"] not in named]
        verdict = "prescribed" if named else "work" if row["account"] in WORK else "no prescription known"
        out.append(
            {
                "account": row["account"],
                "meaning": row["meaning"],
                "ms": row["ms"],
                "share": row["share"],
                "verdict": verdict,
                "findings": named,
                "where": where.get(row["account"], []),
            }
        )
    if acc["unattributed_share"] >= MIN_ACCOUNT_SHARE:
        out.append(
            {
                "account": "unattributed",
                "meaning": "GPU idle under no host event, outside every step marker",
                "ms": acc["unattributed_ms"],
                "share": acc["unattributed_share"],
                "verdict": "no prescription known",
                "findings": [],
                "where": ["record with a torch.profiler schedule and prof.step() so that steps are marked"],
            }
        )
    return out


def _where(facts: dict[str, Any]) -> dict[str, list[str]]:
    """Where an idle account's time went: the innermost host ops and calls the GPU waited on, by their cause."""
    out: dict[str, list[str]] = {}
    for row in facts.get("idle.top_host_ops") or []:
        cause = row.get("cause") if isinstance(row, dict) else None
        if isinstance(cause, str) and len(out.get(f"idle.host.{cause}", [])) < 3:
            out.setdefault(f"idle.host.{cause}", []).append(f"{row['op']} {row['ms']:,.1f} ms")
    for row in facts.get("idle.sync.by_code") or []:  # the sync account: whose code made the syncs
        if isinstance(row, dict) and isinstance(row.get("ms"), (int, float)) and row["ms"] > 0:
            code = row.get("code")
            out.setdefault("idle.sync", []).append(f"{SYNC_CODE.get(code, code)} {row['ms']:,.1f} ms")
    return out


def _fire(
    rule: Rule,
    facts: dict[str, Any],
    not_evaluated: list[dict[str, Any]],
    not_applicable: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """The finding of one rule, or None; errors in the rule's expressions propagate to the caller."""
    env = _env(rule, facts)
    try:
        hit = bool(evaluate(parsed(rule.when), env))
    except MissingFact as m:
        why = _not_applicable(m.name, facts)
        if why:
            not_applicable.append({"id": rule.id, "why": why})
        else:
            hint = missing_hint(m.name, facts)
            not_evaluated.append({"id": rule.id, "missing": [m.name], **({"hint": hint} if hint else {})})
        return None
    if hit and rule.unless:
        try:
            hit = not evaluate(parsed(rule.unless), env)
        except MissingFact:
            pass  # an exception that cannot be checked does not hide a measured problem
    if not hit:
        return None
    patch = {}
    for knob, value in rule.patch.items():
        if isinstance(value, str) and looks_like_expr(value):
            try:
                value = evaluate(parsed(value), env)
            except MissingFact:
                continue
        patch[knob] = value
    env.update({f"patch.{k}": v for k, v in patch.items()})
    saves = _gain(rule, "saves_ms", env)
    speedup = _gain(rule, "speedup", env)
    grows = _gain(rule, "grows_ms", env) if saves is not None else None
    step = facts.get("step.ms")
    if speedup is None and saves is not None and step and saves < step:
        speedup = step / (step - saves)
    equivalent = step * (1 - 1 / speedup) if speedup and step and speedup > 1 else saves
    share = (saves / step) if saves and step else None
    gpu_share = share_of_gpu(saves, facts.get("gpu.busy_ms")) if rule.gain_per == "gpu" else None
    severity, basis = gain_severity(gain_ratio({"throughput_x": speedup, "share_of_step": share}), rule.severity)
    return {
        "id": rule.id,
        "layer": rule.layer,
        "layer_name": LAYER_NAMES[rule.layer],
        "title": rule.title,
        "severity": severity,
        "severity_from": basis,
        "rule_severity": rule.severity,
        "evidence": evidence_lines(rule, env) + [CONTRADICTED + c for c in contradictions(rule, env)],
        "fix": rule.fix,
        "config_patch": patch,
        "expected_gain": {
            "saves_ms_per_step": saves,
            "share_of_step": share,
            # the step the ms and the share are of: the traced window's (facts' step.ms), never the timed median
            "step_ms": step,
            "window": "traced",
            "throughput_x": speedup,
            "how": rule.gain.get("how"),
            "per": rule.gain_per,
            # the part of saves_ms that each sample costs (gain.grows_ms), never more than saves_ms
            **({"grows_ms_per_step": min(grows, saves)} if grows is not None else {}),
            # per: gpu, the share of the GPU's work it removes, which carries to a GPU-bound config
            **({"share_of_gpu": gpu_share} if gpu_share is not None else {}),
        },
        "_order": equivalent or 0.0,
        "sources": rule.sources,
        "conflicts": rule.conflicts,
        "accounts": list(rule.accounts),
    }


def _not_applicable(name: str, facts: dict[str, Any]) -> str | None:
    """Why a rule that needs the missing fact `name` does not apply to this kind of trace; None: it could have
    been measured here, so the rule is not evaluated (and the profiler option that records it is named)."""
    if name.startswith("dist.") and "dist.ranks" not in facts:
        return f"needs {name}, a fact of several ranks' traces together (analyze a folder of per-rank traces)"
    if facts.get("trace.cpu_only") and catalog.gpu_only(name):
        return f"needs {name}, a fact of GPU runs (this trace ran on the CPU)"
    if name.startswith("dpo."):  # only vlmdoctor's runs and ranges a user named after the reference have them
        return f"needs {name}: no DPO reference forward found; in a DPO loop, wrap it in record_function('ref_forward')"
    if "gpu.busy_ms" in facts and name.startswith("cpu."):
        return f"needs {name}, a fact of CPU-only runs (this trace has GPU kernels)"
    return None


def rank_findings(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings in order of application (layer order) numbered `apply_order`, then listed by expected gain.

    `rank` 1 is the biggest expected win; findings whose gain cannot be computed come after those
    with one, in order of application.
    """
    for i, f in enumerate(findings, 1):
        f["apply_order"] = i
    ranked = sorted(
        findings,
        key=lambda f: (
            gain_ratio(f.get("expected_gain")) is None,
            -(gain_ratio(f.get("expected_gain")) or 0.0),
            f["apply_order"],
        ),
    )
    for i, f in enumerate(ranked, 1):
        f["rank"] = i
    return ranked


def in_apply_order(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Findings in the order their fixes are applied (layer order): `apply_order`, else the layer (older reports)."""
    return sorted(
        findings,
        key=lambda f: (f.get("apply_order") if f.get("apply_order") is not None else 10**6, f.get("layer") or 9),
    )


#: facts of the whole step that a `saves_ms` scales by (padding's share of the GPU's busy time): reading one is
#: not sharing a cost with another rule
WHOLE_STEP_FACTS = frozenset({"step.ms", "gpu.busy_ms", "gpu.busy_tflops", "gpu.busy_frac", "measured.gpu.busy_frac"})


def target_ms(rule: Rule, facts: dict[str, Any]) -> float | None:
    """The milliseconds per step of the cost the rule's fix removes, read from one trace's facts whether or not the
    rule fires there (treat's trace attribution reads it in the start and the final trace), from `_target_source`;
    None where the trace lacks it."""
    source = _target_source(rule)
    if source == "accounts":
        ms = [facts.get(ACCOUNT_FACTS.get(a, "")) for a in rule.accounts]
        ms = [float(v) for v in ms if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return sum(ms) if ms else None
    return _gain(rule, source, _env(rule, facts))


def undo_ms(rule: Rule, facts: dict[str, Any]) -> float | None:
    """The milliseconds per step that undoing the rule's fix would cost a config that has the fix (`gain.undo_ms`,
    read in that config's trace: treat's final ablation expects it); None where the rule declares none or the trace
    lacks its facts."""
    return _gain(rule, "undo_ms", _env(rule, facts))


def target_names(rule: Rule) -> frozenset[str]:
    """What `target_ms` reads: two rules that read one account or fact measure one cost together."""
    source = _target_source(rule)
    if source == "accounts":
        return frozenset(rule.accounts)
    return frozenset(
        n
        for e in alternatives(rule.gain.get(source))
        for n in names(parsed(e))
        if not n.isupper() and n not in WHOLE_STEP_FACTS
    )


def _target_source(rule: Rule) -> str:
    """Where a rule's target is read: its `gain.target_ms` where it declares one, else its `saves_ms` where that reads
    measured facts only (`casts.weight.ms`, not all of `busy.cast`), else the step accounts it names (`accounts`: no
    saved fraction applied), else its `saves_ms`."""
    if rule.gain.get("target_ms"):
        return "target_ms"
    if rule.accounts and not _reads_facts_only(rule):
        return "accounts"
    return "saves_ms"


def _reads_facts_only(rule: Rule) -> bool:
    """The rule's `saves_ms` is facts alone: no constant, no number (a saved fraction is an estimate)."""
    exprs = alternatives(rule.gain.get("saves_ms"))
    trees = [parsed(e) for e in exprs]
    return bool(trees) and not any(
        isinstance(n, ast.Constant) or (isinstance(n, ast.Name) and n.id.isupper()) for t in trees for n in ast.walk(t)
    )


def _env(rule: Rule, facts: dict[str, Any]) -> dict[str, Any]:
    """What a rule's expressions read: the trace's facts and the rule's own constants."""
    return {**facts, **{k: c["value"] for k, c in rule.constants.items()}}


def _gain(rule: Rule, key: str, env: dict[str, Any]) -> float | None:
    for expr in alternatives(rule.gain.get(key)):
        try:
            value = float(evaluate(parsed(expr), env))
        except (MissingFact, ZeroDivisionError, TypeError, ValueError, OverflowError, RuleEvalError):
            continue
        if math.isfinite(value):
            return value
    return None
