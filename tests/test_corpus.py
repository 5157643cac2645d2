"""The labelled corpus recorded on two H200s (fixtures/corpus_h200, fixtures/dist_gpu; bench/corpus/): plain
user scripts of ten transformers VLM classes not in the other fixtures, one habit planted each. Every planted cause
the rules know is named, the new rules stay silent where their cause is absent, no precision (layer 1) finding where
the weights are bf16, and every millisecond of each step sits in a named account."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from vlmdoctor.doctor.rules import MIN_ACCOUNT_SHARE, diagnose, load_rules
from vlmdoctor.trace.accounts import MAX_UNATTRIBUTED
from vlmdoctor.trace.facts import analyze

FIX = Path(__file__).resolve().parents[1] / "fixtures"
ONE = FIX / "corpus_h200"
DIST = FIX / "dist_gpu"
RULES, _ = load_rules()

#: the corpus's labels (fixtures/labels.yaml, the precision table's): per run, the rules that name its planted
#: cause (`fire`) and the rules whose cause it does not plant (`silent`)
LABELS = {
    key: lab
    for key, lab in yaml.safe_load((FIX / "labels.yaml").read_text())["traces"].items()
    if key.startswith(("corpus_h200/", "dist_gpu/"))
}
#: runs whose weights or autocast are the planted cause: the only ones a precision finding may name
PRECISION_PLANTED = {"corpus_h200/janus_fp32_weights", "corpus_h200/blip2_fp16_scaler"}
RUNS = sorted(f"corpus_h200/{p.name.removesuffix('.pt.trace.json.gz')}" for p in ONE.glob("*.pt.trace.json.gz"))


@cache
def entry(run: str) -> dict[str, Any]:
    """One run's analysis and diagnosis (a folder of rank traces: the first rank's facts and the ranks joined)."""
    path = FIX / run  # a label key: a folder of rank traces, or a trace file without its suffix
    doc = analyze(path if path.is_dir() else FIX / f"{run}.pt.trace.json.gz")
    facts = dict(doc["files"][0]["facts"])
    facts.update((doc.get("cross_rank") or {}).get("facts", {}))
    d = diagnose(facts, RULES)
    fired = {f["id"]: f for f in d["findings"] + d["superseded"]}
    return {"facts": facts, "accounts": doc["files"][0]["accounts"], "diagnosis": d, "fired": fired}


def test_the_corpus_is_the_recorded_one():
    assert len(RUNS) == 24 and len([p for p in DIST.iterdir() if p.is_dir()]) == 11


@pytest.mark.parametrize("run", sorted(k for k, lab in LABELS.items() if lab.get("fire")))
def test_the_planted_cause_is_named(run):
    assert set(LABELS[run]["fire"]) <= set(entry(run)["fired"]), sorted(entry(run)["fired"])


@pytest.mark.parametrize("run", sorted(k for k, lab in LABELS.items() if lab.get("silent")))
def test_the_new_rules_stay_silent_where_their_cause_is_absent(run):
    assert not set(LABELS[run]["silent"]) & set(entry(run)["fired"])


@pytest.mark.parametrize("run", RUNS)
def test_no_precision_finding_where_the_weights_are_bf16(run):
    layer1 = {f for f, x in entry(run)["fired"].items() if x["layer"] == 1}
    assert not layer1 or run in PRECISION_PLANTED, layer1


@pytest.mark.parametrize("run", RUNS + [f"dist_gpu/{p.name}" for p in sorted(DIST.iterdir()) if p.is_dir()])
def test_every_millisecond_is_in_an_account_and_every_large_one_is_named(run):
    e = entry(run)
    acc = e["accounts"]
    assert acc["unattributed_share"] <= MAX_UNATTRIBUTED
    assert abs(acc["residual_ms"]) < 1e-3 * acc["step_ms"]
    said = {a["account"]: a["verdict"] for a in e["diagnosis"]["accounts"]}
    for row in acc["rows"]:
        if row["share"] >= MIN_ACCOUNT_SHARE:
            assert said[row["account"]] in ("prescribed", "work", "no prescription known")


def test_the_slower_rank_is_explained_by_the_work_it_was_given():
    """Rank 1 got texts twice as long; shapes were not recorded, so its GEMM time (+32%) measures its work."""
    f = entry("dist_gpu/ddp_long_rank1")["facts"]
    assert f["dist.straggler.rank"] == 1 and f["dist.straggler.cause"] == "gemm_work"
    assert f["dist.straggler.gemm_excess_frac"] > 0.2
    slow = entry("dist_gpu/ddp_slow_loader_rank1")["facts"]
    assert slow["dist.straggler.rank"] == 1 and slow["dist.straggler.cause"] == "data_loader"
