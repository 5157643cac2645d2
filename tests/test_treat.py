"""`vlmdoctor treat` and `vlmdoctor sweep`, end to end on CPU with the tiny preset (real runs, fresh processes)."""

from __future__ import annotations

import csv
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.doctor import treat as treat_module
from vlmdoctor.doctor import treat_ablation
from vlmdoctor.doctor.decide import verdict
from vlmdoctor.doctor.treat import TreatOptions, treat
from vlmdoctor.doctor.treat_trials import adopted_outcome
from vlmdoctor.run.config import RunConfig

TINY = [
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--steps",
    "3",
    "--warmup",
    "2",
    "--repeats",
    "1",
    "--set",
    "num_samples=64",
    "--set",
    "autocast=off",
    "--set",
    "batch_size=1",
]

# Rules that fire on any CPU run: batch 1 -> 4 (measured on 2 cores: 12k -> 18k tokens/s) and a
# GPU-only knob, which the composition leaves out (this machine refuses it) instead of failing with it.
# Layer 1 puts them before the shipped rules (which may fire too: the composition is checked for
# what it must and must not contain).
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
    """One real treatment on CPU: fresh processes, real profiles, real diagnoses (about a minute)."""
    tmp = tmp_path_factory.mktemp("treat")
    rules = tmp / "rules"
    rules.mkdir()
    for rid, when, patch in (
        ("t1-bigger-batch", "step.ms > 0 and config.batch_size < 4", "{batch_size: 4}"),
        ("t3-gpu-only-knob", "step.ms > 0", "{liger_rms_norm: true}"),
    ):
        (rules / f"{rid}.yaml").write_text(RULE.format(id=rid, when=when, patch=patch))
    out = tmp / "out"
    r = CliRunner().invoke(
        app,
        [
            "treat",
            *TINY,
            "--rules",
            str(rules),
            "--max-trials",
            "1",
            "--max-pairs",
            "3",
            "--out",
            str(out),
            "--json",
            str(tmp / "t.json"),
        ],
    )
    return r, out, tmp / "t.json"


def test_treat_composes_verifies_on_pairs_and_skips_what_cannot_run(treated):
    r, out, json_path = treated
    assert r.exit_code == 0, r.output
    result = json.loads((out / "treat.json").read_text())
    assert json.loads(json_path.read_text())["ladder"] == result["ladder"]  # --json writes the same result
    comp = result["trials"][0]
    assert comp["kind"] == "composition" and "t1-bigger-batch" in comp["rule"]
    assert "t3-gpu-only-knob" not in comp["rule"]
    assert any(s["rule"] == "t3-gpu-only-knob" and "Liger" in s["why"] for s in result["skipped"])
    n = comp["pairs"]
    assert len(comp["ratios"]) == n and comp["runs"] == n  # paired runs of each side
    # the verdict follows from the recorded pairs (whether batch 4 wins on this shared 2-core machine
    # depends on its load; the decision rule itself is tested on the fake runner below): three pairs,
    # or two when both show a large effect
    if n == 2:  # adopted; "kept" only when the two pairs' interval also excludes no gain
        want = "kept" if comp["ci_low"] > 1 else "adopted"
        assert comp["outcome"] == want and min(comp["ratios"]) > 1.5
    else:
        d = verdict(comp["ratios"], 0.02, final=True)
        assert n == 3 and comp["outcome"] == adopted_outcome(d["outcome"], d)  # a likely gain is "adopted"
    assert comp["ratio"] == pytest.approx(math.prod(comp["ratios"]) ** (1 / n))
    ladder = result["ladder"]
    assert ladder[0]["change"] == "start"
    if comp["outcome"] in ("kept", "adopted"):
        assert ladder[1]["speedup"] == pytest.approx(comp["ratio"]) and result["final_config"]["batch_size"] == 4
        assert result["stopped_because"] == "--max-trials 1 reached"
    else:
        assert len(ladder) == 1 and result["final_config"]["batch_size"] == 1
    assert result["wall_s"] > 0 and ladder[0]["elapsed_s"] <= result["wall_s"]
    assert (out / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in (out / "treat.html").read_text()
    assert "ladder" in r.output
    assert all(len(line) <= 80 for line in r.output.splitlines())


def test_final_config_runs_again(treated):
    _, out, _ = treated
    cfg = RunConfig.load(out / "final_config.yaml")
    assert cfg.model == "tiny"
    r = CliRunner().invoke(
        app,
        [
            "profile",
            "--config",
            str(out / "final_config.yaml"),
            "--steps",
            "1",
            "--warmup",
            "0",
            "--repeats",
            "1",
            "--no-diagnose",
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output


def test_treat_refuses_to_overwrite_results(treated):
    _, out, _ = treated
    r = CliRunner().invoke(app, ["treat", *TINY, "--out", str(out)])
    assert r.exit_code == 2 and "already holds files" in r.output


# --- the decision logic, on a fake runner: a throughput model of the knobs plus seeded noise ---------

BASE = RunConfig(model="tiny", device="cpu", steps=2, warmup=0, repeats=1, num_samples=64, autocast="off")


#: what each knob value does to throughput in the fake world: batch 8 pays 60%, padding costs 15%,
#: the fused optimizer does nothing, compile pays 40%, Liger pays 10%; bf16 weights pay 30% but only
#: together with batch 8 (the interaction a one-at-a-time ladder misses), and then batch 16 pays 20%
def fake_speed(c: RunConfig) -> float:
    v = 1000.0
    v *= 1.6 if c.batch_size >= 8 else 1.0
    v *= 1.2 if c.batch_size == 16 else 1.0
    v *= 0.85 if c.pad_to_multiple_of == 64 else 1.0
    v *= 1.4 if c.compile != "off" else 1.0
    v *= 1.1 if c.liger_rms_norm else 1.0
    v *= 1.3 if (c.weight_dtype == "bf16" and c.batch_size >= 8) else 1.0
    return v


def F(fid: str, layer: int, patch: dict, **extra) -> dict:  # noqa: N802
    return {"id": fid, "layer": layer, "title": fid, "config_patch": patch, **extra}


def fake_diagnosis(c: RunConfig) -> tuple[list[dict], list[dict]]:
    findings, superseded = [], []
    if c.weight_dtype == "fp32":
        findings.append(F("bf16", 1, {"weight_dtype": "bf16"}))
    if c.batch_size < 8:
        findings.append(F("batch", 2, {"batch_size": 8}))
    elif c.batch_size == 8 and c.weight_dtype == "bf16":  # bf16 weights freed the memory for a bigger batch
        findings.append(F("batch-16", 2, {"batch_size": 16}))
    if c.pad_to_multiple_of == 1:
        findings.append(F("pad", 3, {"pad_to_multiple_of": 64}))
    if c.compile == "off" and not c.liger_rms_norm:
        findings.append(F("compile", 4, {"compile": "default", "liger_rms_norm": False, "warmup": 10}))
        superseded.append(F("liger", 4, {"liger_rms_norm": True}, superseded_by="compile"))
    if not c.fused_optimizer:
        findings.append(F("fused-adamw", 5, {"fused_optimizer": True}))
    return findings, superseded


class FakeRunner:
    def __init__(self, seed: int = 0, noise: float = 0.01, fail: dict | None = None):
        self.rng = np.random.default_rng(seed)
        self.noise, self.fail = noise, fail or {}
        self.calls: list[tuple[RunConfig, bool, float | None]] = []

    def __call__(self, c: RunConfig, diagnose: bool, timeout: float | None, **_) -> dict:
        self.calls.append((c, diagnose, timeout))
        for knob, (value, status) in self.fail.items():
            if getattr(c, knob) == value:
                return {"status": status, "error": {"message": status}}
        v = fake_speed(c) * float(np.exp(self.rng.normal(0, self.noise)))
        findings, superseded = fake_diagnosis(c)
        return {
            "status": "ok",
            "config": c.to_dict(),
            "repeats": [{"real_tokens_per_s": v}],
            "metrics": {"real_tokens_per_s": v, "step_ms": 1e3 / v, "mfu": None},
            "findings": findings if diagnose else None,
            "superseded": superseded if diagnose else None,
        }


def run_fake(runner: FakeRunner, **opts) -> dict:
    return treat(BASE, runner, TreatOptions(**{"time_budget_s": None, **opts}), validate=lambda c: None)


def test_composition_then_ablation_in_the_final_config_keeps_what_pays_and_drops_the_rest():
    result = run_fake(FakeRunner())
    assert result["ladder"][1]["composed_of"] == ["bf16", "batch", "pad", "compile", "fused-adamw"]
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    # each change's own contribution, from its leave-one-out ablation in the final config (batch 16): bf16
    # weights pay there (in the fake world they pay only from batch 8 on)
    assert contrib["bf16"]["outcome"] == "kept" and contrib["bf16"]["ratio"] == pytest.approx(1.3, rel=0.05)
    assert contrib["compile"]["outcome"] == "kept" and contrib["compile"]["ratio"] == pytest.approx(1.4, rel=0.05)
    assert contrib["pad"]["outcome"] == "harmful" and contrib["fused-adamw"]["outcome"] == "no_gain"
    assert contrib["batch"]["outcome"] == "superseded"  # round 2 set the batch again: nothing to ablate
    assert result["final_ablation"]["dropped"] == ["pad", "fused-adamw"]
    final = RunConfig.from_dict(result["final_config"])
    assert (
        final.weight_dtype,
        final.batch_size,
        final.compile,
        final.pad_to_multiple_of,
        final.fused_optimizer,
    ) == ("bf16", 16, "default", 1, False)  # batch 16: round 2
    assert final.warmup == 10  # the compile patch's warm-up stays with compile
    kinds = [t["kind"] for t in result["trials"]]
    assert kinds == ["composition"] * 3 + ["ablation"] * 4  # round 1 (two alternatives), round 2, the ablation
    # rung 1: the composition's paired ratio, padding's cost included; the last rung: without what was dropped
    assert result["ladder"][1]["paired_ratio"] == pytest.approx(1.6 * 1.3 * 1.4 * 0.85, rel=0.05)
    last = result["ladder"][-1]
    assert last["change"] == "without pad, fused-adamw"
    assert last["speedup"] == pytest.approx(1.6 * 1.3 * 1.4 * 1.2, rel=0.05)


def test_an_ablation_left_open_by_the_pairs_keeps_the_change():
    """A change whose interval is still open when the pairs run out stays: its composition paid.
    (On the H100, bf16 weights measured x1.23 [0.99-1.54] in 4 pairs and were dropped before this.)"""

    def speed(c):
        return 1000.0 * (1.6 if c.batch_size >= 8 else 1.0) * (1.15 if c.weight_dtype == "bf16" else 1.0)

    class Runner(FakeRunner):
        def __call__(self, c, diagnose, timeout, **_):
            self.calls.append((c, diagnose, timeout))
            v = speed(c) * float(np.exp(self.rng.normal(0, self.noise)))
            findings = [
                F(k, 1, p)
                for k, p in (("bf16", {"weight_dtype": "bf16"}), ("batch", {"batch_size": 8}))
                if getattr(c, next(iter(p))) != next(iter(p.values()))
            ]
            return {
                "status": "ok",
                "repeats": [{"real_tokens_per_s": v}],
                "metrics": {"real_tokens_per_s": v},
                "findings": findings if diagnose else None,
                "superseded": [],
            }

    result = run_fake(Runner(seed=1, noise=0.15), max_pairs=4)
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    k = contrib["bf16"]
    assert k["pairs"] == 4 and k["ci_low"] < 1.02 < k["ci_high"]  # not resolved in 4 pairs at 15% noise
    # at the limit it is read for its lean: every one of its 4 pairs above x1.02 makes it a likely gain
    assert min(k["ratios"]) > 1.02 and k["outcome"] == "likely_gain"
    assert result["final_config"]["weight_dtype"] == "bf16"


def test_alternatives_are_both_measured_and_the_better_is_adopted():
    result = run_fake(FakeRunner())
    names = [result["trials"][i - 1]["name"] for i in result["rounds"][0]["compositions"]]
    assert names == ["composition", "composition with liger instead of compile"]
    assert result["rounds"][0]["adopted"] == "composition"  # compile (1.4x) beats Liger (1.1x)
    comps = [result["trials"][i - 1] for i in result["rounds"][0]["compositions"]]
    assert comps[0]["ratio"] > comps[1]["ratio"] > 1


def test_rediagnoses_after_a_round_before_any_ablation():
    result = run_fake(FakeRunner())
    # round 2 starts from round 1's config: its diagnosis finds batch 16 (visible only once bf16 and
    # batch 8 are in); no ablation runs before it
    assert len(result["rounds"]) == 2
    r2 = result["trials"][result["rounds"][1]["compositions"][0] - 1]
    assert r2["trial"] == 3 and r2["rule"] == "batch-16" and r2["outcome"] == "kept"
    assert result["final_config"]["batch_size"] == 16 and result["final_config"]["pad_to_multiple_of"] == 1
    assert result["ladder"][2]["speedup"] == pytest.approx(1.6 * 1.3 * 1.4 * 0.85 * 1.2, rel=0.05)
    assert result["stopped_because"].startswith("no prescription left: the adopted config was diagnosed again")


def test_paired_runs_alternate_and_only_a_compositions_first_run_is_diagnosed():
    runner = FakeRunner()
    run_fake(runner, max_trials=2)
    diag = [d for _, d, _ in runner.calls]
    assert diag[0] is True  # the start, diagnosed
    kinds = ["cur" if c == BASE else "compile" if c.compile != "off" else "liger" for c, _, _ in runner.calls]
    # round 1 reuses the start run; then the order rotates: (cur) A B, A B cur; both compositions are
    # large effects (> 1.5x in both pairs), decided on two pairs
    assert kinds == ["cur", "compile", "liger", "compile", "liger", "cur"]
    comp_calls = [d for (c, d, _) in runner.calls if c != BASE]
    assert comp_calls[:2] == [True, True] and not any(comp_calls[2:])  # each composition's first run is diagnosed
    assert not any(d for (c, d, _) in runner.calls[1:] if c == BASE)


def test_a_composition_that_runs_out_of_memory_is_reverted():
    result = run_fake(FakeRunner(fail={"batch_size": (8, "oom")}), max_trials=2)
    outcomes = [t["outcome"] for t in result["trials"]]
    assert outcomes == ["oom", "oom"] and len(result["ladder"]) == 1
    assert result["final_config"] == BASE.to_dict()


def test_max_trials_leaves_changes_unconfirmed_not_dropped():
    result = run_fake(FakeRunner(), max_trials=5)  # 3 compositions + 2 of the 4 ablations
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    assert len([t for t in result["trials"] if t["kind"] == "ablation"]) == 2
    undecided = [r for r, c in contrib.items() if c["outcome"] == "undecided"]
    assert len(undecided) == 2 and all(contrib[r]["how"].startswith("not ablated") for r in undecided)
    assert result["final_config"]["compile"] == "default"  # measured in the composition, kept
    assert result["stopped_because"].startswith("no prescription left")


def test_time_budget_caps_runs_and_the_treatment(monkeypatch):
    clock = {"t": 1000.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    runner = FakeRunner()

    def timed(c, d, timeout, **_):
        clock["t"] += 40.0  # every run takes 40 s
        return runner(c, d, timeout)

    result = treat(BASE, timed, TreatOptions(time_budget_s=300, trial_timeout_s=900), validate=lambda c: None)
    assert result["stopped_because"].startswith("--time-budget 300 s")
    assert result["wall_s"] <= 300 + 2 * 40 + 60  # no run starts after the budget; the last may finish
    assert all(t <= 300 + 60 for _, _, t in runner.calls)  # a run's limit is what is left, not 900 s


def test_interrupt_keeps_the_ladder_measured_so_far():
    runner = FakeRunner()

    def run(c, d, timeout, **_):
        if len(runner.calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C during the first round of pairs
        return runner(c, d, timeout)

    result = treat(BASE, run, TreatOptions(), validate=lambda c: None)
    assert result["interrupted"] and result["stopped_because"] == "interrupted (Ctrl-C)"
    assert len(result["ladder"]) == 1 and result["ladder"][0]["real_tokens_per_s"] > 0
    assert result["final_config"] == BASE.to_dict()


def test_a_start_config_that_fails_is_reported():
    result = treat(
        BASE, lambda c, d, t, **_: {"status": "oom", "error": {"message": "CUDA out of memory"}}, TreatOptions()
    )
    assert result["ladder"] == [] and "did not run (oom)" in result["stopped_because"]


def test_compose_leaves_out_what_the_machine_refuses():
    from vlmdoctor.doctor.treat import compose
    from vlmdoctor.errors import UsageError

    report = FakeRunner()(BASE, True, None)
    skipped: list = []

    def refuse_compile(c):
        if c.compile != "off":
            raise UsageError("no compiler here")

    comps = compose(BASE, report, skipped, refuse_compile)
    assert [ch["rule"] for ch in comps[0]["changes"]] == ["bf16", "batch", "pad", "fused-adamw"]
    assert skipped == [
        {"rule": "compile", "config_patch": report["findings"][3]["config_patch"], "why": "no compiler here"}
    ]


def test_sweep_product_of_knob_values(tmp_path):
    out = tmp_path / "s.csv"
    r = CliRunner().invoke(
        app,
        [
            "sweep",
            "--set",
            "model=tiny",
            "--set",
            "device=cpu",
            "--set",
            "batch_size=1,4",
            "--set",
            "steps=2",
            "--set",
            "warmup=0",
            "--set",
            "num_samples=64",
            "--set",
            "autocast=off",
            "--csv",
            str(out),
            "--jsonl",
            str(tmp_path / "s.jsonl"),
        ],
    )
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(out.open()))
    assert [row["name"] for row in rows] == [
        "model=tiny, device=cpu, batch_size=1, steps=2, warmup=0, num_samples=64, autocast=off",
        "model=tiny, device=cpu, batch_size=4, steps=2, warmup=0, num_samples=64, autocast=off",
    ]
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


def test_every_change_is_ablated_when_one_pair_each_fits(monkeypatch):
    """900 s at 40 s a run: the start and round 1 (two alternatives, large effects decided on two
    pairs) take 240 s, round 2 (one composition, three pairs) 200 s, the adopted config diagnosed again
    before stopping 40 s; the 420 s left hold 10 runs. Before, ablations were sized for three pairs: 2 of
    the 4 changes were ablated and 2 stayed "not ablated". Now every change gets an arm (4 runs a pair),
    the comparison measures 2 pairs, and each arm is judged with the spread pooled over the treatment's
    pairs: each change's own worth is known, the padding (-15%) and the fused optimizer (nothing) dropped."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    monkeypatch.setattr(treat_ablation, "TWO_ROUNDS_S", math.inf)  # the fake runs measure no arms in one process
    runner = FakeRunner()

    def timed(c, d, timeout, **_):
        clock["t"] += 40.0
        return runner(c, d, timeout)

    result = treat(BASE, timed, TreatOptions(time_budget_s=900), validate=lambda c: None)
    assert len(result["final_ablation"]["trials"]) == 4
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    outcomes = {r: c["outcome"] for r, c in contrib.items()}
    assert outcomes == {
        "bf16": "kept",
        "batch": "superseded",
        "pad": "harmful",
        "compile": "kept",
        "fused-adamw": "no_gain",
    }
    ablated = [c for c in contrib.values() if c.get("trial")]
    assert all(c["pairs"] == 2 and c["decided_by"].startswith("sd pooled") for c in ablated)
    assert result["final_ablation"]["dropped"] == ["pad", "fused-adamw"]
    assert result["final_ablation"]["pooled_df"] >= 4
    assert result["wall_s"] <= 900 + 40


def test_treat_json_to_stdout_with_the_runs_faked(tmp_path, monkeypatch):
    """`--json -`: the result on stdout and nothing else (the runs are faked; the CLI, the compile
    cache folder and the outputs are real)."""
    import vlmdoctor.run.runner as runner_mod

    fake = FakeRunner()
    envs = []

    def run_isolated(cfg, timeout=None, diagnose=True, rules_dirs=None, env=None, python=None, **_):
        envs.append(env)
        return fake(cfg, diagnose, timeout)

    monkeypatch.setattr(runner_mod, "run_isolated", run_isolated)
    out = tmp_path / "out"
    r = CliRunner().invoke(
        app,
        [
            "treat",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--set",
            "autocast=off",
            "--max-trials",
            "2",
            "--out",
            str(out),
            "--json",
            "-",
        ],
    )
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["kind"] == "treat" and result["trials"][0]["kind"] == "composition"
    assert all(e["TORCHINDUCTOR_CACHE_DIR"] == str((out / "compile-cache" / "inductor").resolve()) for e in envs)
    assert (out / "treat.json").exists()


def test_changes_that_pay_only_together_are_kept_as_a_group():
    """Two +4% changes under a 5% bar: together (+8%) they clear it, alone neither does."""

    def speed(c):
        return 1000.0 * (1.04 if c.fused_optimizer else 1.0) * (1.04 if c.sampler == "length_bucketed" else 1.0)

    class Runner(FakeRunner):
        def __call__(self, c, diagnose, timeout, **_):
            self.calls.append((c, diagnose, timeout))
            v = speed(c) * float(np.exp(self.rng.normal(0, 0.003)))
            findings = [
                F(k, 5, p)
                for k, p in (("fused", {"fused_optimizer": True}), ("bucket", {"sampler": "length_bucketed"}))
                if getattr(c, next(iter(p))) != next(iter(p.values()))
            ]
            return {
                "status": "ok",
                "repeats": [{"real_tokens_per_s": v}],
                "metrics": {"real_tokens_per_s": v},
                "findings": findings if diagnose else None,
                "superseded": [],
            }

    result = run_fake(Runner(seed=3), min_gain=0.05)
    assert result["trials"][0]["outcome"] == "kept"
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    assert {c["outcome"] for c in contrib.values()} == {"no_gain"}
    assert all(c["kept_as_group"] for c in contrib.values())
    assert result["final_config"]["fused_optimizer"] and result["final_config"]["sampler"] == "length_bucketed"


def test_a_composition_that_runs_out_of_memory_is_retried_with_a_smaller_batch():
    """The batch was sized from the current config's memory; the composition's other changes need more."""
    result = run_fake(FakeRunner(fail={"batch_size": (8, "oom")}), max_trials=4)
    trials = result["trials"]
    assert [t["outcome"] for t in trials[:2]] == ["oom", "oom"]
    retry = trials[2]
    # batch 4 -> 8 with its step halved: batch 6, with the rest of the composition
    assert retry["name"].endswith("(batch halved after OOM)") and retry["config_patch"]["batch_size"] == 6
    assert retry["outcome"] == "kept" and result["final_config"]["batch_size"] == 6
    assert result["final_config"]["compile"] == "default"


def test_smaller_batch_halves_the_batch_step():
    from vlmdoctor.doctor.treat_compose import smaller_batch

    cfg = BASE.replace(batch_size=2)
    comp = {
        "name": "composition",
        "changes": [{"rule": "batch", "layer": 2, "title": "b", "config_patch": {"batch_size": 48}}],
        "config": None,
    }
    sizes = []
    while comp is not None:
        comp = smaller_batch(cfg, comp)
        if comp:
            sizes.append(comp["config"].batch_size)
    assert sizes == [25, 13, 7, 4, 3]  # the step 2 -> 48 halved each time, then the batch change goes


def test_a_round_the_time_cut_short_shows_what_it_measured():
    """H100, 0.5b stage 1: round 3 (batch 163) measured x1.18 and x1.19, 174K tokens/s, before the budget ran
    out. The console and the HTML page show those pairs and the knobs, within 80 columns."""
    import io

    from rich.console import Console

    from vlmdoctor.report.console import render_ladder
    from vlmdoctor.report.html import treat_html

    result = json.loads(
        (Path(__file__).parents[1] / "bench/results/2026-11-23-h100-treat11d/s1_05b/treat.json").read_text()
    )
    buf = io.StringIO()
    render_ladder(result, Console(file=buf, width=80, color_system=None))
    text = buf.getvalue()
    assert "1.18, 1.19 (2 of 3 pairs)" in text and "batch_size=163" in text and "173,573" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "x1.18, x1.19: 2 pair(s) measured before the time ran out" in treat_html(result)


def test_with_room_for_one_pair_each_every_change_is_ablated_and_judged_pooled(monkeypatch):
    """160 s left at 40 s a run: no arm fits three pairs, four fit one each (the final config's first run is
    round 2's). Before, only the change expected at 1.5x or more was ablated (on the H100 a 0.5b ladder ended
    with 183 s left at 39 s a run and ablated nothing). Now every change gets its pair, read with the spread
    pooled over the treatment's pairs; the largest expected goes first."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    monkeypatch.setattr(treat_ablation, "TWO_ROUNDS_S", math.inf)  # the fake runs measure no arms in one process
    speed, diagnosis = fake_speed, fake_diagnosis

    def big_compile(c):  # compile pays 2x here, and the rule says so
        return speed(c) * (2.0 / 1.4 if c.compile != "off" else 1.0)

    def with_gains(c):
        findings, superseded = diagnosis(c)
        for f in findings:
            f["expected_gain"] = {"throughput_x": 2.0 if f["id"] == "compile" else 1.1}
        return findings, superseded

    monkeypatch.setitem(globals(), "fake_speed", big_compile)
    monkeypatch.setitem(globals(), "fake_diagnosis", with_gains)
    runner = FakeRunner()

    def timed(c, d, timeout, **_):
        clock["t"] += 40.0
        return runner(c, d, timeout)

    result = treat(BASE, timed, TreatOptions(time_budget_s=600), validate=lambda c: None)
    ablated = [t for t in result["trials"] if t["kind"] == "ablation"]
    assert [t["rule"] for t in ablated] == ["compile", "bf16", "pad", "fused-adamw"]
    assert all(t["pairs"] == 1 and t["decided_by"].startswith("sd pooled") for t in ablated)
    outcomes = {t["rule"]: t["outcome"] for t in ablated}
    assert outcomes["compile"] == "kept" and outcomes["bf16"] == "kept" and outcomes["pad"] == "harmful"
    assert outcomes["fused-adamw"] == "undecided"  # one pair of x1.03: neither shown nor shown out: it stays
    contrib = {c["rule"]: c["contribution"] for r in result["ladder"][1:3] for c in r["changes"]}
    assert contrib["compile"]["how"] == "leave-one-out ablation in the final config"
    assert result["final_ablation"]["dropped"] == ["pad"] and result["final_config"]["fused_optimizer"]
    # the padding rule expected x1.1 and the padding measured x0.86 on its own: far off, in the calibration
    cal = {(r["kind"], r["rule"]): r for r in result["calibration"]}
    assert cal[("ablation", "pad")]["far_off"] and cal[("ablation", "pad")]["expected_x"] == 1.1
    assert not cal[("ablation", "compile")]["far_off"]
    assert cal[("composition", "bf16, batch, pad, compile, fused-adamw")]["expected_x"] == pytest.approx(2 * 1.1**4)


def test_an_ablation_arm_that_runs_out_of_memory_keeps_the_change_and_says_why():
    """H100, 0.5b stage 2: the final config (batch 83) without compile ran out of memory, since the eager loss
    holds the fp32 logits. The change is needed; the table says why, not an empty cell."""
    import io

    from rich.console import Console

    from vlmdoctor.report.console import render_ladder
    from vlmdoctor.report.html import treat_html

    class Runner(FakeRunner):
        def __call__(self, c, diagnose, timeout, **_):
            if c.batch_size == 16 and c.compile == "off":
                self.calls.append((c, diagnose, timeout))
                return {
                    "status": "oom",
                    "error": {"message": "CUDA out of memory. Tried to allocate 11.76 GiB"},
                }
            return super().__call__(c, diagnose, timeout)

    result = run_fake(Runner())
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    assert contrib["compile"]["outcome"] == "kept" and contrib["compile"]["why"] == "out of memory without it"
    assert "why" not in contrib["bf16"]  # an arm that ran: its ratio says it
    assert result["final_config"]["compile"] == "default"
    buf = io.StringIO()
    render_ladder(result, Console(file=buf, width=80, color_system=None))
    row = next(line for line in buf.getvalue().splitlines() if "compile" in line and "kept" in line)
    assert "out of memory without it" in row
    assert "out of memory without it: CUDA out of memory" in treat_html(result)


def test_the_h100_ladder_whose_ablation_ran_out_of_memory_renders():
    result = json.loads(
        (Path(__file__).parents[1] / "bench/results/2026-11-23-h100-treat11e/s2_05b/treat.json").read_text()
    )
    from vlmdoctor.report.html import treat_html

    assert result["trials"][2]["status"] == "oom" and result["trials"][2]["outcome"] == "kept"
    assert "CUDA out of memory" in treat_html(result)


# --- the batch ceiling and what "kept" means ---------------------------------------------------------


class MemoryRunner(FakeRunner):
    """A GPU-like fake: peak allocated memory grows linearly with the batch (fixed + per sample), a run over
    `oom_at` runs out of memory, throughput saturates with the batch, and the batch rule fires only on
    the diagnoses listed in `fires` (the noisy GPU-busy threshold)."""

    def __init__(self, fixed=5.0, per=0.44, total=79.0, oom_at=None, half=20, fires=(), **kw):
        super().__init__(**kw)
        self.fixed, self.per, self.total, self.oom_at, self.half = fixed, per, total, oom_at, half
        self.fires, self.diagnoses = set(fires), 0

    def __call__(self, c, diagnose, timeout, **_):
        self.calls.append((c, diagnose, timeout))
        peak = self.fixed + self.per * c.batch_size
        if peak > self.total or (self.oom_at and c.batch_size >= self.oom_at):
            return {"status": "oom", "error": {"message": "CUDA out of memory"}}
        v = 1e5 * c.batch_size / (c.batch_size + self.half) * float(np.exp(self.rng.normal(0, self.noise)))
        findings = []
        if diagnose:
            self.diagnoses += 1
            if self.diagnoses in self.fires:  # batching-gpu-underfed's patch, from the measured memory
                b = c.batch_size
                findings.append(F("batching-gpu-underfed", 2, {"batch_size": min(8 * b, int(b * 0.7 * 79 / peak))}))
        return {
            "status": "ok",
            "config": c.to_dict(),
            "repeats": [{"real_tokens_per_s": v}],
            "metrics": {"real_tokens_per_s": v, "peak_mem_gb": peak, "device_mem_total_gb": self.total},
            "findings": findings if diagnose else None,
            "superseded": [],
        }


def test_no_prescription_but_memory_to_spare_probes_a_larger_batch():
    """The diagnosis never fires (the GPU-busy threshold trips the other way every time), yet 4 GiB of 80 are
    in use at batch 4: treat sizes a larger batch from the measured memory and keeps it."""
    runner = MemoryRunner(fixed=2.0, per=0.5, total=80.0, half=30)
    result = run_fake(runner)
    # sized in round 1: the probe's first run at 32 (8x, the cap, from one measured batch), then the ceiling
    # from two measured batches, (0.9 x 80 - 2 GiB fixed) / 0.5 GiB a sample = 140, at most 4x the largest batch
    # measured (PROBE_STEP_X): 128, in one round, not two
    sizing = [(s["batch_size"], s["status"]) for s in result["rounds"][0]["sizing"]]
    assert sizing == [(32, "ok"), (128, "ok")]
    first = result["trials"][0]
    assert first["rule"] == "treat-batch-probe" and first["config_patch"] == {"batch_size": 128}
    assert first["outcome"] in ("kept", "adopted") and len(result["rounds"]) == 1
    assert result["final_config"]["batch_size"] == 128
    # re-diagnosed before stopping; the memory model's ceiling named in the reason (140: no step of 25% left)
    assert result["rediagnosed"] and "memory model ceiling 140" in result["stopped_because"]


def test_the_issue_case_does_not_stop_at_batch_22_with_14_gib_of_79():
    """H100, 0.5b stage 2: treat stopped at batch 22 ("no prescription left", 14.7 of 79 GiB in use) while the
    same config, diagnosed again, prescribed batching-gpu-underfed and batch 80 ran 1.5x faster."""
    start = BASE.replace(batch_size=22)
    runner = MemoryRunner(fires={2})  # only the second diagnosis of the run sees the GPU under-fed
    result = treat(start, runner, TreatOptions(time_budget_s=None), validate=lambda c: None)
    assert result["start"]["peak_mem_gb"] == pytest.approx(14.68)
    assert result["final_config"]["batch_size"] > 80
    assert not result["stopped_because"].startswith("no prescription left") or "ceiling" in result["stopped_because"]
    batches = [t["config_patch"].get("batch_size") for t in result["trials"] if t["kind"] == "composition"]
    # the probe: 90% of 79 GiB over the 0.67 GiB a sample measured at batch 22 (fixed taken as 0) is 106; its run
    # there gives the line through two batches, 0.44 GiB a sample + 5 GiB: 150, measured in the same round
    assert [s["batch_size"] for s in result["rounds"][0]["sizing"]] == [106, 150] and batches[0] == 150


def test_a_probe_that_runs_out_of_memory_is_bisected():
    """The memory readings promise batch 140, but the run runs out of memory from batch 25 on, whatever they say:
    after the first out-of-memory batch the memory a sample takes is bounded from below, after the second the next
    probe aims between what ran and what did not."""
    runner = MemoryRunner(fixed=2.0, per=0.5, total=80.0, oom_at=25, half=1000)
    result = run_fake(runner)
    # in round 1's sizing: 32 ran out of memory; a sample takes at least (80 - 4) / (32 - 4) GiB above batch 4,
    # which holds 4 + (72 - 4) // 2.71 = 29: out of memory again; bisected to (4 + 29) // 2 = 16, which ran
    sizing = [(s["batch_size"], s["status"]) for s in result["rounds"][0]["sizing"]]
    assert sizing == [(32, "oom"), (29, "oom"), (16, "ok")]
    sizes = [
        (t["config_patch"].get("batch_size"), t["outcome"]) for t in result["trials"] if t["kind"] == "composition"
    ]
    assert sizes == [(16, "kept")] and result["final_config"]["batch_size"] == 16
    assert "batch 16; out of memory at batch 29" in result["stopped_because"]


def test_no_probe_without_memory_facts():
    """CPU runs measure no peak memory: no batch probe is made up from the config."""
    result = run_fake(FakeRunner())
    assert not any(t["rule"] == "treat-batch-probe" for t in result["trials"])


def test_two_pairs_beyond_the_large_effect_are_adopted_but_not_kept():
    """1.5b on the H100: a change "kept" on 2 pairs whose interval was [0.81, 3.50]. Two pairs at x1.59 and
    x1.78 adopt the change (the ladder moves on), but its interval does not exclude no gain: not kept."""
    values = {4: [1000.0], 8: [1590.0, 1784.0]}
    calls = {4: 0, 8: 0}

    class Runner(FakeRunner):
        def __call__(self, c, diagnose, timeout, **_):
            self.calls.append((c, diagnose, timeout))
            seq = values[c.batch_size]
            v = seq[calls[c.batch_size] % len(seq)]
            calls[c.batch_size] += 1
            findings = [F("batch", 2, {"batch_size": 8})] if c.batch_size < 8 else []
            return {
                "status": "ok",
                "repeats": [{"real_tokens_per_s": v}],
                "metrics": {"real_tokens_per_s": v},
                "findings": findings if diagnose else None,
                "superseded": [],
            }

    result = run_fake(Runner(), max_trials=1)
    trial = result["trials"][0]
    assert trial["pairs"] == 2 and trial["ratios"] == pytest.approx([1.59, 1.784])
    assert trial["ci_low"] == pytest.approx(0.81, abs=0.01) and trial["ci_high"] == pytest.approx(3.50, abs=0.02)
    assert trial["outcome"] == "adopted" and result["final_config"]["batch_size"] == 8
    contrib = result["ladder"][1]["changes"][0]["contribution"]
    assert contrib["outcome"] == "undecided" and contrib["ci_low"] < 1
    # with room to ablate, the leave-one-out on two such pairs is not "kept" either
    calls.update({4: 0, 8: 0})
    result = run_fake(Runner(), max_trials=2)
    ablation = next(t for t in result["trials"] if t["kind"] == "ablation")
    assert ablation["pairs"] == 2 and ablation["outcome"] == "likely_gain"  # every pair a gain: likely, not kept
    assert result["final_config"]["batch_size"] == 8  # undecided changes stay


# --- issue 39: decisions that converge, the batch sized in round 1, each change's worth, calibration ------------


class ScriptedRunner(FakeRunner):
    """A run takes `run_s` of a fake clock; the candidate batch measures the next of `ratios` (cycling) over the
    current one; the diagnosis of batch 11 prescribes batch 41 (its rule expecting x1.3)."""

    def __init__(self, clock: dict, ratios: list[float], run_s: float = 25.0, **kw):
        super().__init__(**kw)
        self.clock, self.ratios, self.run_s, self.n = clock, ratios, run_s, 0

    def __call__(self, c, diagnose, timeout, **_):
        self.calls.append((c, diagnose, timeout))
        self.clock["t"] += self.run_s
        v = 1000.0
        if c.batch_size == 41:
            v *= self.ratios[self.n % len(self.ratios)]
            self.n += 1
        findings = [F("batching-gpu-underfed", 2, {"batch_size": 41}, expected_gain={"throughput_x": 1.3})]
        return {
            "status": "ok",
            "repeats": [{"real_tokens_per_s": v}],
            "metrics": {"real_tokens_per_s": v},
            "findings": (findings if c.batch_size == 11 else []) if diagnose else None,
            "superseded": [],
        }


def test_a_gain_on_every_pair_is_adopted_as_likely_when_the_time_runs_out(monkeypatch):
    """The issue: batch 41 measured x1.14-1.31 on every pair it ran, yet the treatment ended at batch 11,
    "undecided (2 of 3 pairs): too little left to decide". 140 s at 25 s a run hold two pairs: the batch is
    adopted as a likely gain, with its evidence, never called kept or thrown away."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    runner = ScriptedRunner(clock, [1.14, 1.31])
    result = treat(BASE.replace(batch_size=11), runner, TreatOptions(time_budget_s=140), validate=lambda c: None)
    trial = result["trials"][0]
    assert trial["ratios"] == pytest.approx([1.14, 1.31]) and trial["ci_low"] < 1
    assert trial["outcome"] == "adopted" and trial["why"].startswith("2 pair(s) measured before the time ran out")
    assert "likely gain: all 2 pairs above x1.02 (a 25% chance with no effect)" in trial["why"]
    assert result["final_config"]["batch_size"] == 41
    contrib = result["ladder"][1]["changes"][0]["contribution"]
    assert contrib["outcome"] == "likely_gain" and contrib["how"].startswith("the composition, adopted as a likely")
    # the same pairs with one below 1 are not a lean: nothing is adopted
    clock["t"] = 0.0
    mixed = treat(
        BASE.replace(batch_size=11),
        ScriptedRunner(clock, [1.14, 0.97]),
        TreatOptions(time_budget_s=140),
        lambda c: None,
    )
    assert mixed["trials"][0]["outcome"] == "undecided" and mixed["final_config"]["batch_size"] == 11


def test_one_pair_far_beyond_noise_is_adopted_when_no_second_fits(monkeypatch):
    """On two H200s (2026-11-27) qwen2-vl-2b's ten changes measured x10.6 on the one pair the budget held, and the
    treatment ended at its start config. 80 s at 25 s a run hold one pair: x10 is adopted as a likely gain (not
    shown), x2 decides nothing. The result is still its declaration (the one pair's interval is open: null)."""
    from vlmdoctor.documents import TreatResult, as_document
    from vlmdoctor.files import json_text

    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    result = treat(
        BASE.replace(batch_size=11), ScriptedRunner(clock, [10.0]), TreatOptions(time_budget_s=80), lambda c: None
    )
    trial = result["trials"][0]
    assert trial["pairs"] == 1 and trial["outcome"] == "adopted" and trial["decided_by"] == "one pair"
    assert trial["why"].startswith("1 pair at x10.00, beyond 3x up: no time for a second")
    assert result["final_config"]["batch_size"] == 41 and result["ladder"][1]["speedup"] == pytest.approx(10.0)
    as_document(json.loads(json_text(result)), TreatResult, "treat.json")
    clock["t"] = 0.0
    small = treat(
        BASE.replace(batch_size=11), ScriptedRunner(clock, [2.0]), TreatOptions(time_budget_s=80), lambda c: None
    )
    assert small["trials"][0]["outcome"] == "undecided" and small["final_config"]["batch_size"] == 11


class SizedRunner(MemoryRunner):
    """Round 1 composes bf16 weights (x8, more memory a sample in this fake: activations of a faster step kept) with
    the batch rule's batch 11; the memory of the composition's own family allows more."""

    def __init__(self, clock: dict, **kw):
        super().__init__(fixed=4.0, per=1.6, total=80.0, half=20, **kw)
        self.clock = clock

    def __call__(self, c, diagnose, timeout, **_):
        self.clock["t"] += 25.0
        rep = super().__call__(c, diagnose, timeout)
        if rep["status"] == "ok":
            x = 8.0 if c.weight_dtype == "bf16" else 1.0
            rep["repeats"][0]["real_tokens_per_s"] *= x
            rep["metrics"]["real_tokens_per_s"] *= x
            if diagnose and c.weight_dtype == "fp32":
                rep["findings"] = [
                    F("bf16", 1, {"weight_dtype": "bf16"}, expected_gain={"throughput_x": 8.0}),
                    F("batch", 2, {"batch_size": 11}, expected_gain={"throughput_x": 1.5}),
                ]
        return rep


def test_the_batch_is_sized_in_round_1_from_the_compositions_own_memory(monkeypatch):
    """Round 1's composition runs once at the rules' batch 11; its family's memory (21.6 GiB there: at most 1.96 GiB
    a sample, fixed taken as 0) allows 0.9 x 80 / 1.96 = 36: the comparison pairs batch 36, in round 1, and the
    change that set the batch says it was sized. The old flow measured batch 11 in round 1 and the larger batch a
    round later."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    runner = SizedRunner(clock)
    result = treat(BASE.replace(batch_size=4), runner, TreatOptions(time_budget_s=600), validate=lambda c: None)
    r1 = result["rounds"][0]
    assert [(s["batch_size"], s["status"]) for s in r1["sizing"]] == [(11, "ok"), (36, "ok")]
    first = result["trials"][0]
    assert first["config_patch"] == {"weight_dtype": "bf16", "batch_size": 36} and first["outcome"] == "kept"
    batch = next(c for c in result["ladder"][1]["changes"] if c["rule"] == "batch")
    assert batch["sized"]["from"] == 11 and batch["sized"]["to"] == 36
    visits = [v["state"] for v in result["states"]]
    assert visits[:4] == ["start", "compose", "size", "compare"] and visits[-1] == "ablate"
    size = next(v for v in result["states"] if v["state"] == "size")
    assert size["runs"] == 2 and size["spent_s"] == pytest.approx(50.0)


def test_the_state_machine_says_where_the_budget_went_and_why_it_stopped(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    monkeypatch.setattr(treat_ablation, "TWO_ROUNDS_S", math.inf)  # the fake runs measure no arms in one process
    runner = FakeRunner()

    def timed(c, d, timeout, **_):
        clock["t"] += 40.0
        return runner(c, d, timeout)

    result = treat(BASE, timed, TreatOptions(time_budget_s=900), validate=lambda c: None)
    states = result["states"]
    assert [v["state"] for v in states] == [
        "start",
        "compose",
        "compare",
        "compose",
        "compare",
        "compose",
        "rediagnose",
        "compose",
        "ablate",
    ]
    assert all(a["next"] == b["state"] for a, b in zip(states, states[1:])) and states[-1]["next"] == "done"
    spent = result["budget"]["spent_s"]
    assert sum(spent.values()) == pytest.approx(result["wall_s"])
    assert sum(v["runs"] for v in states) == len(runner.calls)
    assert spent["compare"] == pytest.approx(400.0) and spent["ablate"] == pytest.approx(360.0)
    assert result["budget"]["reserved_for_ablation_s"] == pytest.approx(0.25 * 900)
    assert result["stop_reason"] == "nothing_left"
    # each way to stop has its code
    assert run_fake(FakeRunner(), max_trials=2)["stop_reason"] == "max_trials"
    failed = treat(BASE, lambda c, d, t, **_: {"status": "oom", "error": {"message": "OOM"}}, TreatOptions())
    assert failed["stop_reason"] == "start_failed" and [v["state"] for v in failed["states"]] == ["start"]


def test_a_later_round_that_does_not_fit_beside_the_ablations_reserve_is_not_started(monkeypatch):
    """With 300 s at 40 s a run, round 2 (three pairs, 5 runs) would leave nothing for the ablation: the treatment
    stops composing and ablates round 1's changes instead, and says why (where no round in one process fits either:
    tests/test_in_process_arms.py has the round that does)."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    monkeypatch.setattr(treat_module, "TWO_ROUNDS_S", math.inf)
    runner = FakeRunner()

    def timed(c, d, timeout, **_):
        clock["t"] += 40.0
        return runner(c, d, timeout)

    result = treat(BASE, timed, TreatOptions(time_budget_s=400), validate=lambda c: None)
    assert len(result["rounds"]) == 1 and result["stop_reason"] == "time_budget"
    assert "does not fit beside the" in result["stopped_because"]
    assert result["final_ablation"]["trials"]  # the reserve was spent on each change's worth


def test_the_treat_result_with_states_budget_and_calibration_is_its_declaration(monkeypatch):
    from vlmdoctor.documents import TreatResult, as_document

    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])
    result = treat(
        BASE.replace(batch_size=4), SizedRunner(clock), TreatOptions(time_budget_s=600), validate=lambda c: None
    )
    doc = as_document(json.loads(json.dumps(result)), TreatResult, "treat.json")
    assert doc.stop_reason == result["stop_reason"] and doc.states[0].state == "start"
    assert doc.budget.spent_s["size"] == pytest.approx(50.0)
    row = next(r for r in doc.calibration if r.kind == "composition")
    assert row.expected_x == pytest.approx(8.0 * 1.5) and row.measured_x == pytest.approx(result["trials"][0]["ratio"])
    assert doc.trials[0].expected_x == pytest.approx(12.0) and doc.trials[0].decided_by
    assert [s.state for s in doc.states] == [v["state"] for v in result["states"]]


def _memory_seen(rates: dict[int, float], fixed: float, per: float, total: float):
    """A MemoryModel that observed a run of each batch at its rate, peak memory fixed + per x batch of `total`."""
    from vlmdoctor.doctor.treat_batch import MemoryModel

    m = MemoryModel()
    for b, r in rates.items():
        rep = {
            "status": "ok",
            "repeats": [{"real_tokens_per_s": r}],
            "metrics": {"real_tokens_per_s": r, "peak_mem_gb": fixed + per * b, "device_mem_total_gb": total},
        }
        m.observe(BASE.replace(batch_size=b), rep)
    return m


def test_a_batch_whose_throughput_stopped_rising_is_not_raised_further():
    """Memory leaves room for batch 560 (0.1 GiB a sample: checkpointing kept), but throughput is saturated: batch
    64 runs 1.02x batch 32. The sizing stops there instead of running a batch 4x larger, whose steps take 4x as
    long; where it still rises, the next step goes on (capped at 4x the largest batch measured)."""
    flat = _memory_seen({16: 900.0, 32: 1000.0, 64: 1020.0}, 5.0, 0.1, 80.0)
    target, how = flat.ceiling(BASE.replace(batch_size=64))
    assert target == 64 and "1.02x from batch 32 to 64: saturated" in how
    rising = _memory_seen({16: 700.0, 32: 1000.0, 64: 1300.0}, 5.0, 0.1, 80.0)
    assert rising.ceiling(BASE.replace(batch_size=64))[0] == 256  # (72 - 5) / 0.1 = 670, at most 4 x 64


def test_a_measured_batch_that_ran_faster_is_not_dropped_by_the_saturation_cap():
    """Four H200s, llava-siglip2-0.5b: batches 32, 64 and 128 ran at once; 32 to 64 rose less than 10%, and the cap
    at 64 left the measured, faster 128 out. The cap is the fastest measured batch past where the rise stopped; a
    larger batch that ran slower is still left out, and nothing is raised past the measured batches."""
    faster = _memory_seen({32: 133_000.0, 64: 142_000.0, 128: 150_000.0}, 3.5, 0.72, 139.8)
    target, how = faster.ceiling(BASE.replace(batch_size=32))
    assert target == 128 and "batch 128 measured faster still" in how  # memory alone holds 169
    slower = _memory_seen({32: 133_000.0, 64: 142_000.0, 128: 139_000.0}, 3.5, 0.72, 139.8)
    target, how = slower.ceiling(BASE.replace(batch_size=32))
    assert target == 64 and "faster still" not in how


def test_an_ablation_expects_a_per_sample_cost_at_the_final_batch_and_a_per_step_one_as_diagnosed(monkeypatch):
    """Two H200s, qwen2-vl-2b: the loader's wait read at batch 4 expected x1.25 of the workers; their ablation at
    batch 52 measured x3.14, x3.24. A cost of each sample (`gain.per: sample`) is moved to the final batch over
    the final step; a cost of each step keeps the estimate of the config that was diagnosed."""
    from vlmdoctor.doctor.treat_trials import final_config_x
    from vlmdoctor.documents import TreatResult, as_document

    per_sample = {"saves_ms_per_step": 0.1, "share_of_step": 0.1, "throughput_x": 1 / 0.9, "per": "sample"}
    per_step = {"saves_ms_per_step": 0.05, "share_of_step": 0.05, "throughput_x": 1 / 0.95, "per": "step"}

    diagnosis = fake_diagnosis

    def with_gains(c):
        findings, superseded = diagnosis(c)
        for f in findings:
            f["expected_gain"] = {"pad": per_sample, "fused-adamw": per_step}.get(f["id"], {"throughput_x": 1.5})
        return findings, superseded

    monkeypatch.setitem(globals(), "fake_diagnosis", with_gains)
    result = run_fake(FakeRunner())
    doc = as_document(result, TreatResult, "treat.json")  # `expected_at` is declared
    final_rung = [r for r in result["ladder"] if r.get("rule")][-1]
    start_b, final_b = BASE.batch_size, RunConfig.from_dict(result["final_config"]).batch_size
    assert final_b == 4 * start_b  # the batch grew: the per-sample cost with it
    ablated = {t.rule: t for t in doc.trials if t.kind == "ablation"}
    moved = 1 + 0.1 * final_b / start_b / final_rung["step_ms"]
    assert ablated["pad"].expected_x == pytest.approx(moved) and ablated["pad"].expected_at == "final"
    assert ablated["fused-adamw"].expected_x == pytest.approx(1 / 0.95) and ablated["fused-adamw"].expected_at is None
    # the calibration rows carry the moved estimate
    cal = {(r["kind"], r["rule"]): r for r in result["calibration"]}
    assert cal[("ablation", "pad")]["expected_x"] == pytest.approx(moved)
    # without the batches or the final step, nothing is moved
    assert final_config_x({"expected_gain": per_sample}, None, 16, 1.0) == pytest.approx(1 / 0.9)
    assert final_config_x({"expected_gain": per_sample}, 4, 16, None) == pytest.approx(1 / 0.9)
    # where the rule says which part each sample costs (`gain.grows_ms`: the loader's least step, not a stall), only
    # that part is moved; never more than the saving itself
    grows = per_sample | {"grows_ms_per_step": 0.02}
    assert final_config_x({"expected_gain": grows}, 4, 16, 1.0) == pytest.approx(1 + 0.02 * 4)
    assert final_config_x({"expected_gain": grows | {"grows_ms_per_step": 0.0}}, 4, 16, 1.0) == pytest.approx(1.0)
    # GPU work (`per: gpu`) stays its share of the GPU's time: over a final step the GPU is busy 97% of, the
    # recompute's 15% of the GPU's work adds 0.15/0.85 of that; without the final busy share, the start's estimate
    on_gpu = per_step | {"per": "gpu", "share_of_gpu": 0.15}
    assert final_config_x({"expected_gain": on_gpu}, 4, 152, 470.0, 0.97) == pytest.approx(1 + 0.15 / 0.85 * 0.97)
    assert final_config_x({"expected_gain": on_gpu}, 4, 152, 470.0, None) == pytest.approx(1 / 0.95)
    assert final_config_x({"expected_gain": per_step}, 4, 152, 470.0, 0.97) == pytest.approx(1 / 0.95)


def test_an_ablation_whose_rule_says_what_undoing_costs_is_expected_from_the_final_trace(monkeypatch):
    """One H200, llava-siglip2-0.5b at batch 152: checkpointing's recompute, carried from the start's share of the GPU's
    work, said x1.16-1.18; turning it back on measured x1.27-1.30, the LLM's forward run again. The shipped rule says
    what undoing its fix costs (`gain.undo_ms`: the LLM's forward), read in the final config's own trace; a rule that
    says nothing keeps `final_config_x`."""
    from vlmdoctor.documents import TreatResult, as_document

    diagnosis = fake_diagnosis

    def with_checkpointing(c):
        findings, superseded = diagnosis(c)
        if c.gradient_checkpointing:
            gain = {"saves_ms_per_step": 2.0, "share_of_step": 0.01, "throughput_x": 1 / 0.99, "per": "gpu"}
            findings.append(F("system-checkpoint-recompute", 5, {"gradient_checkpointing": False}, expected_gain=gain))
        return findings, superseded

    class Traced(FakeRunner):  # a diagnosed run's facts: its traced step and the LLM's forward in it
        def __call__(self, c, diagnose, timeout, **kw):
            report = super().__call__(c, diagnose, timeout, **kw)
            if diagnose and report["status"] == "ok":
                report["facts"] = {"step.ms": 400.0, "part.llm.forward_ms": 100.0 if c.batch_size >= 8 else 5.0}
            return report

    monkeypatch.setitem(globals(), "fake_diagnosis", with_checkpointing)
    result = run_fake(Traced())
    doc = as_document(result, TreatResult, "treat.json")  # `expected_at: final_trace` is declared
    ablated = {t.rule: t for t in doc.trials if t.kind == "ablation"}
    assert ablated["system-checkpoint-recompute"].expected_x == pytest.approx(1 + 100.0 / 400.0)
    assert ablated["system-checkpoint-recompute"].expected_at == "final_trace"
    assert ablated["fused-adamw"].expected_at is None  # its rule (a test's) says nothing of undoing
    cal = {(r["kind"], r["rule"]): r for r in result["calibration"]}
    assert cal[("ablation", "system-checkpoint-recompute")]["expected_x"] == pytest.approx(1.25)
    # without the final trace's facts, the estimate as diagnosed (per: gpu, but no share of the GPU kept: x1/0.99)
    plain = as_document(run_fake(FakeRunner()), TreatResult, "treat.json")
    (t,) = [t for t in plain.trials if t.kind == "ablation" and t.rule == "system-checkpoint-recompute"]
    assert t.expected_x == pytest.approx(1 / 0.99) and t.expected_at is None
