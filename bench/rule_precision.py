"""Each rule's precision and recall on the labelled corpus of recorded traces (fixtures/labels.yaml).

Every trace is analyzed as `vlmdoctor analyze` reads it, with the same run's report.json merged where
one exists (as `vlmdoctor profile` diagnoses it); a folder of rank traces gives each rank's findings
and the joined ranks'. A finding that is superseded counts as fired (the rule matched). Against the
labels: fired on "fire" = true positive, fired on "silent" = false positive, silent on "fire" = false
negative; unlabelled cells are "don't care" and count nowhere.

    python bench/rule_precision.py                 # print the table
    python bench/rule_precision.py --write docs/rules.md   # and put it in the doc (between markers)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from functools import cache
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "fixtures"
LABELS = FIXTURES / "labels.yaml"
BEGIN = "<!-- rule-precision:begin (bench/rule_precision.py writes this section) -->"
END = "<!-- rule-precision:end -->"
TARGET_PRECISION_HIGH = 0.95
TARGET_RECALL = 0.9


def load_labels(path: Path = LABELS) -> dict[str, Any]:
    """The labels file: `traces` (key -> labels) and `known_misses` (trace -> rule -> cause)."""
    return yaml.safe_load(path.read_text())


def trace_path(key: str) -> Path:
    """A label key names a trace file (without .pt.trace.json.gz) or a folder of rank traces."""
    folder = FIXTURES / key
    return folder if folder.is_dir() else FIXTURES / f"{key}.pt.trace.json.gz"


def fired(key: str) -> frozenset[str]:
    """The rules that matched on one trace: its findings and superseded findings, ranks joined."""
    return outcome(key)[0]


def contradicted(key: str) -> tuple[tuple[str, str], ...]:
    """The findings on one trace whose title its own facts contradict: (rule, what contradicts it), per rank."""
    return outcome(key)[1]


@cache
def outcome(key: str) -> tuple[frozenset[str], tuple[tuple[str, str], ...], int]:
    """What the rules did on one trace, ranks and the joined ranks each diagnosed: the rules that matched, the
    findings a `contradicted_by` check of their rule says are contradicted, and how many findings there were."""
    from vlmdoctor.doctor.rules import CONTRADICTED, diagnose, load_rules
    from vlmdoctor.trace.facts import analyze, merge_measured

    rules, _ = load_rules()
    path = trace_path(key)
    result = analyze(path)
    report = FIXTURES / f"{key}.report.json"
    out: set[str] = set()
    bad: list[tuple[str, str]] = []
    found = 0
    diagnoses = []
    for entry in result["files"]:
        facts = entry["facts"]
        if report.is_file() and len(result["files"]) == 1:
            facts = merge_measured(facts, json.loads(report.read_text()))
        diagnoses.append(diagnose(facts, rules))
    cross = result.get("cross_rank") or {}
    if "facts" in cross:
        diagnoses.append(diagnose(cross["facts"], [r for r in rules if r.uses_dist]))
    for d in diagnoses:
        for f in d["findings"] + d["superseded"]:
            out.add(f["id"])
            found += 1
            bad += [(f["id"], e.removeprefix(CONTRADICTED)) for e in f["evidence"] if e.startswith(CONTRADICTED)]
    return frozenset(out), tuple(bad), found


def confusion(labels: dict[str, Any], keys: list[str]) -> tuple[dict[str, Counter], list[dict[str, str]]]:
    """Per rule: tp, fp, fn, tn counts over the labelled cells of these traces; and each mismatch."""
    per: dict[str, Counter] = {}
    misses = []
    for key in keys:
        lab = labels["traces"][key]
        got = fired(key)
        for want, table in (("fire", lab.get("fire") or {}), ("silent", lab.get("silent") or {})):
            for rule, why in table.items():
                c = per.setdefault(rule, Counter())
                hit = rule in got
                cell = {("fire", True): "tp", ("fire", False): "fn", ("silent", True): "fp", ("silent", False): "tn"}
                c[cell[(want, hit)]] += 1
                if (want == "fire") != hit:
                    misses.append({"trace": key, "rule": rule, "kind": "FN" if want == "fire" else "FP", "label": why})
    return per, misses


def ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def rule_table(per: dict[str, Counter]) -> list[dict[str, Any]]:
    """One row per rule with its layer and severity, precision and recall (None where nothing to divide)."""
    from vlmdoctor.doctor.rules import load_rules

    rules = {r.id: r for r in load_rules()[0]}
    rows = []
    for rid in sorted(rules, key=lambda r: (rules[r].layer, r)):
        c = per.get(rid, Counter())
        rows.append(
            {
                "id": rid,
                "layer": rules[rid].layer,
                "severity": rules[rid].severity,
                **{k: c[k] for k in ("tp", "fp", "fn", "tn")},
                "precision": ratio(c["tp"], c["tp"] + c["fp"]),
                "recall": ratio(c["tp"], c["tp"] + c["fn"]),
            }
        )
    return rows


def layer_table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rules' cells summed per layer."""
    out = []
    for layer in sorted({r["layer"] for r in rows}):
        c = Counter()
        for r in rows:
            if r["layer"] == layer:
                c.update({k: r[k] for k in ("tp", "fp", "fn", "tn")})
        out.append(
            {
                "layer": layer,
                **c,
                "precision": ratio(c["tp"], c["tp"] + c["fp"]),
                "recall": ratio(c["tp"], c["tp"] + c["fn"]),
            }
        )
    return out


def corpus_summary(labels: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """Traces, model classes, training habits and devices of the corpus."""
    t = labels["traces"]
    return {
        "traces": len(keys),
        "classes": sorted({t[k]["class"] for k in keys}),
        "habits": dict(Counter(t[k]["habit"] for k in keys)),
        "devices": dict(Counter(t[k]["device"] for k in keys)),
        "labelled_cells": sum(len(t[k].get("fire") or {}) + len(t[k].get("silent") or {}) for k in keys),
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(labels: dict[str, Any], keys: list[str], seconds: float) -> str:
    """The doc section: corpus size, the per-rule and per-layer tables, the targets, the misses, and the titles
    contradicted by their own evidence."""
    per, misses = confusion(labels, keys)
    against = Counter(rule for k in keys for rule, _ in contradicted(k))
    findings = sum(outcome(k)[2] for k in keys)
    rows = rule_table(per)
    s = corpus_summary(labels, keys)
    known = labels.get("known_misses") or {}
    lines = [
        BEGIN,
        "",
        f"Corpus: {s['traces']} recorded traces, {s['labelled_cells']} labelled (trace, rule) cells; "
        f"{len(s['classes'])} model classes; habits: "
        + ", ".join(f"{v} {k}" for k, v in sorted(s["habits"].items()))
        + "; devices: "
        + ", ".join(f"{v} {k.upper()}" for k, v in sorted(s["devices"].items()))
        + f". Generated by `python bench/rule_precision.py --write docs/rules.md` in {seconds:.0f} s.",
        "",
        "Model classes: " + "; ".join(s["classes"]) + ".",
        "",
        "| rule | layer | severity | TP | FP | FN | TN | precision | recall | contradicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r['id']}` | {r['layer']} | {r['severity']} | {r['tp']} | {r['fp']} | {r['fn']} | {r['tn']} | "
            f"{_pct(r['precision'])} | {_pct(r['recall'])} | {against[r['id']]} |"
        )
    lines += ["", "| layer | TP | FP | FN | TN | precision | recall |", "|---|---|---|---|---|---|---|"]
    for r in layer_table(rows):
        lines.append(
            f"| {r['layer']} | {r['tp']} | {r['fp']} | {r['fn']} | {r['tn']} | {_pct(r['precision'])} | "
            f"{_pct(r['recall'])} |"
        )
    high = [r for r in rows if r["severity"] == "high" and r["precision"] is not None]
    low_p = [r["id"] for r in high if r["precision"] < TARGET_PRECISION_HIGH]
    low_r = [r["id"] for r in rows if r["recall"] is not None and r["recall"] < TARGET_RECALL]
    lines += [
        "",
        f"Targets: precision >= {TARGET_PRECISION_HIGH} for every high-severity rule "
        f"({'met' if not low_p else 'missed by ' + ', '.join(low_p)}); recall >= {TARGET_RECALL} per rule "
        f"({'met' if not low_r else 'missed by ' + ', '.join(low_r)}).",
        "",
    ]
    lines += [
        f"Titles contradicted by their own evidence (a finding whose rule's `contradicted_by` check holds on the "
        f"same facts): {sum(against.values())} of {findings} findings on every trace, every rank and the joined "
        f"ranks (target 0){'.' if not against else ':'}",
        "",
    ]
    for k in keys:
        lines += [f"- `{rule}` on `{k}`: {why}" for rule, why in contradicted(k)]
    if against:
        lines.append("")
    if misses:
        lines += ["Misses, each with its cause:", ""]
        for m in misses:
            cause = (known.get(m["trace"]) or {}).get(m["rule"], "NOT EXPLAINED (add it to known_misses)")
            lines.append(f"- {m['kind']} `{m['rule']}` on `{m['trace']}`: {cause}")
    else:
        lines.append("No misses: every labelled cell agrees.")
    lines += ["", END]
    return "\n".join(lines)


def write_section(doc: Path, section: str) -> None:
    """Replace the generated section of the doc (or append it where the doc has none)."""
    text = doc.read_text() if doc.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    doc.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="DOC", help="put the table into this Markdown file, between its markers")
    ap.add_argument("--only", nargs="*", help="label keys to evaluate (default: every trace in the labels)")
    a = ap.parse_args(argv)
    labels = load_labels()
    keys = a.only or list(labels["traces"])
    t0 = time.perf_counter()
    for k in keys:
        t1 = time.perf_counter()
        got = fired(k)
        print(f"{time.perf_counter() - t1:5.1f}s {k}: {' '.join(sorted(got))}", file=sys.stderr)
    section = markdown(labels, keys, time.perf_counter() - t0)
    print(section)
    if a.write:
        write_section(Path(a.write), section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
