"""`vlmdoctor treat` and `vlmdoctor sweep`, end to end on CPU with the tiny preset (real runs, fresh processes)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.runner import run_isolated
from vlmdoctor.doctor.treat import TreatOptions, decide, treat

TINY = ["--model", "tiny", "--device", "cpu", "--steps", "8", "--warmup", "5", "--repeats", "3",
        "--set", "num_samples=128", "--set", "autocast=off", "--set", "batch_size=1"]

# Rules that fire on any CPU run, so that the treatment's three outcomes happen for sure: batch 1 -> 4
# (measured on 2 cores: 12k -> 18k tokens/s, spread under 10%), then padding every row to 2048
# tokens (several times the work per real token), then a GPU-only knob (the run refuses it).
# Layer 1 puts them before the shipped rules.
RULE = """id: {id}
layer: 1
title: {id}
severity: high
when: {when}
evidence: ["step {{step.ms:.1f}} ms"]
fix: test
patch: {patch}
"""


@pytest.fixture(scope="module")
def treated(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("treat")
    rules = tmp / "rules"
    rules.mkdir()
    for rid, when, patch in (("t1-bigger-batch", "step.ms > 0 and config.batch_size < 4", "{batch_size: 4}"),
                             ("t2-pad-to-2048", "step.ms > 0 and config.batch_size >= 4", "{pad_to_multiple_of: 2048}"),
                             ("t3-gpu-only-knob", "step.ms > 0", "{liger_rms_norm: true}")):
        (rules / f"{rid}.yaml").write_text(RULE.format(id=rid, when=when, patch=patch))
    out = tmp / "out"
    r = CliRunner().invoke(app, ["treat", *TINY, "--rules", str(rules), "--max-trials", "3", "--out", str(out)])
    return r, out


def test_treat_applies_measures_keeps_and_reverts(treated):
    r, out = treated
    assert r.exit_code == 0, r.output
    result = json.loads((out / "treat.json").read_text())
    outcomes = {t["rule"]: t["outcome"] for t in result["trials"]}
    assert outcomes == {"t1-bigger-batch": "kept", "t2-pad-to-2048": "harmful", "t3-gpu-only-knob": "not_applicable"}
    kept, harmful = result["trials"][0], result["trials"][1]
    assert kept["gain"] > kept["margin"] > 0 and harmful["gain"] < -harmful["margin"]
    assert len(kept["tokens_per_s_repeats"]) == 3  # the noise comes from the repeats
    assert kept["profile"]["step.ms"] > 0  # each run's traced window travels with it
    ladder = result["ladder"]
    assert [step["change"] for step in ladder] == ["start", "batch_size=4"]
    assert ladder[1]["speedup"] > 1 and ladder[1]["real_tokens_per_s"] > ladder[0]["real_tokens_per_s"]
    assert result["final_config"]["batch_size"] == 4 and result["final_config"]["pad_to_multiple_of"] == 1  # reverted
    assert result["stopped_because"] == "--max-trials 3 reached"
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (out / "treat.html").read_text()
    assert "ladder" in r.output and "t2-pad-to-2048" in r.output


def test_final_config_runs_again(treated):
    _, out = treated
    cfg = RunConfig.load(out / "final_config.yaml")
    assert cfg.batch_size == 4 and cfg.model == "tiny"
    r = CliRunner().invoke(app, ["profile", "--config", str(out / "final_config.yaml"), "--steps", "1", "--warmup", "0",
                                 "--repeats", "1", "--no-diagnose", "--quiet"])
    assert r.exit_code == 0, r.output


def test_treat_refuses_to_overwrite_results(treated):
    _, out = treated
    r = CliRunner().invoke(app, ["treat", *TINY, "--out", str(out)])
    assert r.exit_code == 2 and "already holds files" in r.output


def test_interrupt_keeps_the_ladder_measured_so_far(tmp_path):
    cfg = RunConfig(model="tiny", device="cpu", steps=2, warmup=0, repeats=2, num_samples=64, autocast="off")
    calls = []

    def run(c: RunConfig) -> dict:
        calls.append(c)
        if len(calls) > 1:
            raise KeyboardInterrupt  # Ctrl-C during the first trial
        return run_isolated(c)

    result = treat(cfg, run, TreatOptions())
    assert result["interrupted"] and result["stopped_because"] == "interrupted (Ctrl-C)"
    assert len(result["ladder"]) == 1 and result["ladder"][0]["real_tokens_per_s"] > 0
    assert result["final_config"] == cfg.to_dict()


def test_a_start_config_that_fails_is_reported(tmp_path):
    cfg = RunConfig(model="tiny", device="cpu", steps=2, warmup=0, num_samples=64, autocast="off")
    result = treat(cfg, lambda c: {"status": "oom", "error": {"message": "CUDA out of memory"}}, TreatOptions())
    assert result["ladder"] == [] and "did not run (oom)" in result["stopped_because"]


@pytest.mark.parametrize("a,b,outcome", [
    ([100, 101, 99], [120, 121, 119], "kept"),
    ([100, 101, 99], [101, 102, 100], "no_gain"),      # +1% is under the 3% floor
    ([100, 130, 70], [120, 121, 119], "no_gain"),      # +20% is inside a 60% spread
    ([100, 101, 99], [80, 81, 79], "harmful"),
])
def test_decision_rule(a, b, outcome):
    rep = lambda xs: {"repeats": [{"real_tokens_per_s": x} for x in xs]}  # noqa: E731
    assert decide(rep(a), rep(b), 0.03)["outcome"] == outcome


def test_sweep_product_of_knob_values(tmp_path):
    out = tmp_path / "s.csv"
    r = CliRunner().invoke(app, ["sweep", "--set", "model=tiny", "--set", "device=cpu", "--set", "batch_size=1,4",
                                 "--set", "steps=2", "--set", "warmup=0", "--set", "num_samples=64",
                                 "--set", "autocast=off", "--csv", str(out), "--jsonl", str(tmp_path / "s.jsonl")])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(out.open()))
    assert [row["name"] for row in rows] == ["model=tiny, device=cpu, batch_size=1, steps=2, warmup=0, num_samples=64, "
                                             "autocast=off", "model=tiny, device=cpu, batch_size=4, steps=2, warmup=0, "
                                             "num_samples=64, autocast=off"]
    assert all(row["status"] == "ok" and float(row["real_tokens_per_s"]) > 0 for row in rows)
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == 2


def test_sweep_grid_file_with_a_bad_knob_names_the_row(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text("defaults: {model: tiny}\nruns:\n  - {name: ok, set: {}}\n  - {name: bad, set: {batch_sise: 2}}\n")
    r = CliRunner().invoke(app, ["sweep", str(grid)])
    assert r.exit_code == 2 and "run 1" in r.output and "batch_sise" in r.output


def test_seed_grid_is_48_runs_over_models_and_stages():
    from vlmdoctor.ci.sweep import load_grid

    plan = load_grid(Path(__file__).resolve().parents[1] / "bench" / "grids" / "seed_48.yaml")
    assert len(plan) == 48
    assert {(c.model, c.stage) for _, c in plan} == {("0.5b", 1), ("0.5b", 2), ("1.5b", 1), ("1.5b", 2)}
