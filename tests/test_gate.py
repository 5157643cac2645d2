"""`vlmdoctor gate`: the verdict on real H100 reports, refusals of unusable input, the statistics,
the CI outputs, and one real pair of CPU runs of the same config that must pass."""

from __future__ import annotations

import copy
import json
import math
import random
import statistics
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vlmdoctor import SCHEMA_VERSION
from vlmdoctor.ci.gate import (
    check_comparable,
    check_findings,
    check_memory,
    check_throughput,
    gate,
    junit_xml,
    load_report,
    mann_whitney_u,
    markdown,
    paired_gate,
    run_current,
    slowdown_verdict,
)
from vlmdoctor.errors import EXIT_USAGE, UsageError

TRACES = Path(__file__).resolve().parent.parent / "fixtures" / "traces"


def fixture(name: str) -> dict:
    return load_report(str(TRACES / f"{name}.report.json"))


def write(tmp_path: Path, name: str, report: dict) -> str:
    p = tmp_path / name
    p.write_text(json.dumps(report))
    return str(p)


def check(result: dict, name: str) -> dict:
    return next(c for c in result["checks"] if c["name"] == name)


# --- the verdict on real H100 reports ----------------------------------------------------------


def test_real_slowdown_fails_on_throughput():
    base, cur = fixture("bf16_s2"), fixture("fp32_noautocast_s2")
    notes = check_comparable(base, cur, allow_env_change=False)  # same model, stage and machine
    assert any("weight_dtype" in n for n in notes)  # the knobs that differ are shown, not refused
    result = gate(base, cur, notes=notes)
    assert result["passed"] is False
    t = check(result, "throughput")
    assert t["passed"] is False and t["verdict"] == "fail"
    assert round(t["base_median"]) == 26909 and round(t["cur_median"]) == 4337
    assert t["ratio"] == pytest.approx(4336.604 / 26908.553, rel=1e-4)
    # old reports: one real_tokens_per_s per repeat, too few for a test, so the ranges decide
    assert (t["samples"], t["method"], t["n_base"], t["n_cur"], t["p"]) == (
        "per-repeat",
        "range-overlap",
        1,
        1,
        None,
    )
    assert "26,909 -> 4,337" in t["detail"] and "-83.9%" in t["detail"]
    assert result["summary"].startswith("FAILED") and "throughput" in result["summary"]
    assert check(result, "memory")["passed"]  # fp32 without autocast at B4 uses less memory
    assert check(result, "findings")["verdict"] == "skip"  # these reports were not diagnosed


def test_speedup_passes():
    result = gate(fixture("fp32_noautocast_s2"), fixture("bf16_s2"), max_memory_growth=10.0)
    assert result["passed"] and "no slowdown" in result["summary"]


@pytest.mark.parametrize("name", ["bf16_s2", "eager_s2", "healthy_1.5b_s2"])
def test_report_against_itself_passes(name):
    r = fixture(name)
    assert check_comparable(r, r, allow_env_change=False) == []
    result = gate(r, copy.deepcopy(r))
    assert result["passed"], result["summary"]
    assert result["summary"].startswith("PASSED")
    assert [c["name"] for c in result["checks"]] == ["throughput", "memory", "findings"]
    assert all(c["passed"] for c in result["checks"])
    assert check(result, "throughput")["ratio"] == 1.0


# --- comparability -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key,value",
    [("torch", "2.12.0+cu130"), ("transformers", "5.30.0"), ("liger_kernel", "0.9.0"), ("driver", "590.1")],
)
def test_software_upgrades_are_compared_and_named(key, value):
    """An upgrade of torch, transformers, liger-kernel or the driver is what a regression gate is for."""
    base = fixture("bf16_s2")
    cur = copy.deepcopy(base)
    cur["env"][key] = value
    notes = check_comparable(base, cur, allow_env_change=False)
    assert notes == [f"environment changed: {key}: {base['env'].get(key)!r} -> {value!r}"]
    result = gate(base, cur, notes=notes)
    assert result["passed"] and result["notes"] == notes
    assert key in markdown(result)


def test_warm_up_steps_added_until_the_steps_settled_are_not_a_config_change():
    """Both sides asked for 3 warm-up steps; one window waited 2 more for its steps to settle (`config.warmup`
    records the steps run). Seen on the CPU gate of a script: "config differs: warmup: 3 -> 5" on the same code."""
    base = copy.deepcopy(fixture("bf16_s2"))
    base["warmup"] = {"asked": 3, "steps": 3, "settle_steps": 0, "settled": True}
    cur = copy.deepcopy(base)
    cur["config"]["warmup"] = 5
    cur["warmup"] = {"asked": 3, "steps": 5, "settle_steps": 2, "settled": True}
    assert check_comparable(base, cur, allow_env_change=False) == []
    cur["warmup"]["asked"] = 5  # asked for: a knob that differs, and said
    assert check_comparable(base, cur, allow_env_change=False) == ["config differs: warmup: 3 -> 5"]
    del base["warmup"], cur["warmup"]  # reports without the block: the config as written
    assert check_comparable(base, cur, allow_env_change=False) == ["config differs: warmup: 3 -> 5"]


def test_a_different_gpu_model_is_refused_unless_allowed():
    base = fixture("bf16_s2")
    cur = copy.deepcopy(base)
    cur["env"]["gpu"] = "NVIDIA H200"
    with pytest.raises(UsageError) as e:
        check_comparable(base, cur, allow_env_change=False)
    assert e.value.exit_code == EXIT_USAGE
    assert "GPU" in e.value.message and "NVIDIA H200" in e.value.message and "--allow-env-change" in e.value.message
    notes = check_comparable(base, cur, allow_env_change=True)
    assert notes and notes[0].startswith("GPU changed (allowed): gpu:")


def test_different_stage_is_always_refused():
    with pytest.raises(UsageError, match=r"stage: 1 -> 2"):
        check_comparable(fixture("bf16_s1"), fixture("bf16_s2"), allow_env_change=True)


def test_different_model_is_always_refused():
    with pytest.raises(UsageError, match=r"model: '0.5b' -> '1.5b'"):
        check_comparable(fixture("healthy_s2"), fixture("healthy_1.5b_s2"), allow_env_change=True)


# --- unusable files ----------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.json")
    with pytest.raises(UsageError) as e:
        load_report(path)
    assert path in e.value.message and "no such file" in e.value.message
    assert e.value.exit_code == EXIT_USAGE


def test_truncated_json(tmp_path):
    text = (TRACES / "bf16_s2.report.json").read_text()
    path = tmp_path / "truncated.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(UsageError) as e:
        load_report(str(path))
    assert str(path) in e.value.message and "not valid JSON" in e.value.message


def test_future_schema_version(tmp_path):
    r = fixture("bf16_s2")
    r["schema_version"] = SCHEMA_VERSION + 1
    path = write(tmp_path, "future.json", r)
    with pytest.raises(UsageError) as e:
        load_report(path)
    assert path in e.value.message and "newer vlmdoctor" in e.value.message


@pytest.mark.parametrize("status", ["oom", "nan_loss", "error", "timeout"])
def test_failed_run_is_refused_naming_its_status(tmp_path, status):
    r = fixture("bf16_s2")
    r["status"] = status
    r["error"] = {"message": "CUDA out of memory"}
    if status == "oom":
        del r["metrics"]  # a real OOM report has no metrics; the status must be what is reported
    path = write(tmp_path, f"{status}.json", r)
    with pytest.raises(UsageError) as e:
        load_report(path)
    assert path in e.value.message and f"status {status}" in e.value.message


@pytest.mark.parametrize(
    "doc, needle",
    [
        ({"schema_version": 1, "kind": "treat", "ladder": []}, "treat result"),
        ({"schema_version": 1, "kind": "analysis", "files": []}, "analysis result"),
        ({"schema_version": 1, "status": "ok"}, "no config or metrics"),
        ({"config": {}, "metrics": {}}, "no schema_version"),
        ([1, 2, 3], "not a vlmdoctor profile report"),
    ],
)
def test_not_a_profile_report(tmp_path, doc, needle):
    path = write(tmp_path, "other.json", doc)
    with pytest.raises(UsageError) as e:
        load_report(path)
    assert path in e.value.message and needle in e.value.message


def test_manifest_is_not_a_report():
    with pytest.raises(UsageError, match="no schema_version"):
        load_report(str(TRACES / "manifest.json"))


# --- statistics --------------------------------------------------------------------------------


def test_mann_whitney_completely_separated():
    u, p = mann_whitney_u(list(range(1, 11)), list(range(11, 21)))
    assert u == 0
    assert p < 0.001
    # normal approximation with continuity correction: z = (50 - 0.5) / sqrt(100 * 21 / 12)
    assert p == pytest.approx(math.erfc((49.5 / math.sqrt(175)) / math.sqrt(2)), rel=1e-12)
    assert p == pytest.approx(1.8267e-4, rel=1e-3)
    assert mann_whitney_u(list(range(11, 21)), list(range(1, 11))) == (100, p)


def test_mann_whitney_identical_distributions():
    x = [float(v) for v in range(10)]
    assert mann_whitney_u(x, list(x)) == (50.0, 1.0)
    rng = random.Random(0)
    a = [rng.gauss(100, 5) for _ in range(30)]
    b = [v + rng.choice((-0.01, 0.01)) for v in reversed(a)]
    assert mann_whitney_u(a, b)[1] > 0.9
    assert mann_whitney_u([3.0] * 8, [3.0] * 8) == (32.0, 1.0)  # all tied: no evidence at all


def test_mann_whitney_scipy_documented_value():
    # scipy.stats.mannwhitneyu docs: males vs females, method="asymptotic" -> U=17, p=0.11134688653314041
    u, p = mann_whitney_u([19, 22, 16, 29, 24], [20, 11, 17, 12])
    assert u == 17
    assert p == pytest.approx(0.11134688653314041, rel=1e-9)


def test_mann_whitney_tie_correction():
    # ranks of 1,1,2,2,3,3: 1.5,1.5,3.5,3.5,5.5,5.5 -> U1 = 6.5 - 6 = 0.5; mu = 4.5
    # variance with tie correction: 9/12 * (7 - 3 * (2**3 - 2) / (6 * 5)) = 4.8 (5.25 without)
    u, p = mann_whitney_u([1, 1, 2], [2, 3, 3])
    assert u == 0.5
    assert p == pytest.approx(math.erfc((4 - 0.5) / math.sqrt(4.8) / math.sqrt(2)), rel=1e-12)


def _with_steps(report: dict, tokens_per_s: list[list[float]], tokens: int = 1000) -> dict:
    """A copy whose repeats hold per-step samples with the given throughputs (new-style report)."""
    r = copy.deepcopy(report)
    r["repeats"] = [
        {
            "real_tokens_per_s": len(rep) * tokens / sum(tokens / v for v in rep),
            "step_real_tokens": [tokens] * len(rep),
            "step_ms": [tokens / v * 1000 for v in rep],
        }
        for rep in tokens_per_s
    ]
    return r


def test_throughput_uses_mann_whitney_on_per_step_samples():
    rng = random.Random(1)
    base = _with_steps(fixture("bf16_s2"), [[rng.gauss(1000, 10) for _ in range(10)] for _ in range(2)])
    slow = _with_steps(fixture("bf16_s2"), [[rng.gauss(900, 10) for _ in range(10)] for _ in range(2)])
    t = check_throughput(base, slow)
    assert (t["samples"], t["method"], t["n_base"], t["n_cur"]) == ("per-step", "mann-whitney", 20, 20)
    assert t["ratio"] == pytest.approx(0.9, abs=0.02)
    assert t["p"] < 1e-6 and not t["passed"] and "Mann-Whitney p=" in t["detail"]


def test_large_but_noisy_drop_is_not_a_regression():
    rng = random.Random(2)
    base = _with_steps(fixture("bf16_s2"), [[rng.uniform(500, 1500) for _ in range(10)]])
    noisy = _with_steps(fixture("bf16_s2"), [[v * 0.93 for v in (rng.uniform(500, 1500) for _ in range(10))]])
    t = check_throughput(base, noisy)
    assert t["method"] == "mann-whitney" and t["p"] >= 0.01
    assert t["passed"] and "not beyond noise" in t["detail"]


def test_small_significant_drop_is_within_the_threshold():
    base = _with_steps(fixture("bf16_s2"), [[1000 + i for i in range(10)]])
    cur = _with_steps(fixture("bf16_s2"), [[970 + i for i in range(10)]])
    t = check_throughput(base, cur)
    assert t["p"] < 0.01 and t["passed"] and "within the 5% allowed" in t["detail"]
    assert not check_throughput(base, cur, max_regression=0.02)["passed"]


def test_old_and_new_reports_fall_back_to_per_repeat_samples():
    old = fixture("bf16_s2")  # no step_real_tokens
    new = _with_steps(old, [[27000.0] * 10])
    t = check_throughput(old, new)
    assert t["samples"] == "per-repeat" and t["method"] == "range-overlap" and t["n_cur"] == 1


def test_overlapping_ranges_with_few_samples_pass():
    base = _with_steps(fixture("bf16_s2"), [[1000.0] * 3, [800.0] * 3, [1200.0] * 3])
    base["repeats"] = [{k: v for k, v in r.items() if k != "step_real_tokens"} for r in base["repeats"]]
    cur = copy.deepcopy(base)
    for r, v in zip(cur["repeats"], (850.0, 900.0, 1100.0)):
        r["real_tokens_per_s"] = v
    t = check_throughput(base, cur)
    assert t["ratio"] == pytest.approx(0.9) and t["method"] == "range-overlap"
    assert t["passed"] and "ranges overlap" in t["detail"]


# --- memory and findings -----------------------------------------------------------------------


def test_memory_growth():
    base = fixture("bf16_s2")
    cur = copy.deepcopy(base)
    cur["metrics"]["peak_mem_gb"] *= 1.2
    m = check_memory(base, cur)
    assert not m["passed"] and m["growth"] == pytest.approx(0.2) and "+20.0%" in m["detail"]
    result = gate(base, cur)
    assert not result["passed"] and "memory" in result["summary"] and check(result, "throughput")["passed"]
    cur["metrics"]["peak_mem_gb"] = base["metrics"]["peak_mem_gb"] * 1.05
    assert check_memory(base, cur)["passed"]


def test_memory_skipped_on_cpu():
    base = fixture("bf16_s2")
    cur = copy.deepcopy(base)
    base["metrics"]["peak_mem_gb"] = cur["metrics"]["peak_mem_gb"] = None
    m = check_memory(base, cur)
    assert m["passed"] and m["verdict"] == "skip" and "CPU" in m["detail"]


def test_new_high_finding_fails():
    base = fixture("eager_s2")
    cur = copy.deepcopy(base)
    cur["findings"].append({"id": "precision-fp32-gemms", "layer": 1, "severity": "high", "title": "FP32 GEMMs"})
    gone = cur["findings"].pop(1)["id"]
    f = check_findings(base, cur)
    assert not f["passed"] and f["failing"] == ["precision-fp32-gemms"] and f["gone"] == [gone]
    assert "precision-fp32-gemms (high)" in f["detail"] and gone in f["detail"]
    assert not gate(base, cur)["passed"]


def test_fail_on_threshold():
    base = fixture("eager_s2")
    cur = copy.deepcopy(base)
    cur["findings"].append({"id": "new-medium", "layer": 3, "severity": "medium", "title": "x"})
    assert check_findings(base, cur, fail_on="high")["passed"]
    assert "below the bar" in check_findings(base, cur, fail_on="high")["detail"]
    assert not check_findings(base, cur, fail_on="medium")["passed"]
    assert not check_findings(base, cur, fail_on="low")["passed"]
    with pytest.raises(UsageError, match="fail_on"):
        check_findings(base, cur, fail_on="critical")


def test_findings_between_real_diagnosed_reports():
    # eager_s2 -> sync_s2 on the H100: the data-loader and non-fused-optimizer findings went, autocast casts came
    f = check_findings(fixture("eager_s2"), fixture("sync_s2"), fail_on="medium")
    assert "precision-autocast-casts" in f["added"] and "system-data-loader" in f["gone"]
    assert not f["passed"]
    assert check_findings(fixture("eager_s2"), fixture("sync_s2"))["passed"]  # medium is below high


# --- CI outputs --------------------------------------------------------------------------------


def test_junit_xml_and_markdown():
    result = gate(fixture("bf16_s2"), fixture("fp32_noautocast_s2"))
    root = ET.fromstring(junit_xml(result))
    assert root.tag == "testsuite" and root.get("name") == "vlmdoctor-gate"
    assert root.get("tests") == "3" and root.get("failures") == "1"
    cases = {c.get("name"): c for c in root.iter("testcase")}
    assert set(cases) == {"throughput", "memory", "findings"}
    failure = cases["throughput"].find("failure")
    assert failure is not None and "4,337" in failure.get("message")
    assert cases["memory"].find("failure") is None
    assert cases["findings"].find("skipped") is not None
    md = markdown(result)
    assert "vlmdoctor gate FAILED" in md and "| `throughput` | `fail` |" in md and "| `memory` | `pass` |" in md

    ok = gate(fixture("bf16_s2"), fixture("bf16_s2"))
    assert "vlmdoctor gate passed" in markdown(ok)
    assert ET.fromstring(junit_xml(ok)).find(".//failure") is None


def test_report_text_in_the_step_summary_renders_as_text():
    """A model name, a note or a detail is input: in $GITHUB_STEP_SUMMARY it must not become a link, an image,
    HTML or a forged heading, nor break the table (rendered here by a CommonMark renderer with tables)."""
    from markdown_it import MarkdownIt

    hostile = "[ok](https://x.example) ![i](https://x.example/i.png) <img src=x onerror=1> | ## passed \n# passed ``"
    result = gate(fixture("bf16_s2"), fixture("bf16_s2"), notes=[hostile])
    result["model"] = hostile
    result["checks"][0]["detail"] = hostile
    html = MarkdownIt("commonmark").enable("table").render(markdown(result))
    assert "<a " not in html and "<img" not in html and "<h1>" not in html
    assert html.count("<h2>") == 1  # the verdict's own heading only
    assert all(row.count("<td>") == 3 for row in html.split("<tr>")[2:])  # every row still three cells


# --- a real pair of runs -----------------------------------------------------------------------

PROFILE = [
    "profile",
    "--model",
    "tiny",
    "--device",
    "cpu",
    "--steps",
    "6",
    "--warmup",
    "1",
    "--repeats",
    "2",
    "--num-samples",
    "64",
    "--autocast",
    "off",
    "--no-diagnose",
    "--quiet",
]


def _profile(path: Path) -> str:
    """A real run through the CLI, in this process (the gate's own runs, in fresh processes, are run_current's)."""
    from typer.testing import CliRunner

    from vlmdoctor.cli import app

    r = CliRunner().invoke(app, [*PROFILE, "--json", str(path)])
    assert r.exit_code == 0, r.output
    return str(path)


@pytest.fixture(scope="module")
def same_config_pair(tmp_path_factory):
    """Two real runs of one config, and the gate's verdict on them.

    The CPU of the test machine is shared: while a neighbour takes it, a whole run is really
    slower (measured here: 0.2x to 2.4x between back-to-back runs of one config, about 1 pair in
    10), and the gate rightly calls that a slowdown. So a pair measured under such a swing is
    measured again, at most twice; every attempt's verdict is kept for the failure message.
    """
    out = tmp_path_factory.mktemp("gate_runs")
    attempts = []
    for i in range(3):
        base = load_report(_profile(out / f"A{i}.json"))
        cur = load_report(_profile(out / f"B{i}.json"))
        result = gate(base, cur)
        attempts.append(check(result, "throughput")["detail"])
        if check(result, "throughput")["passed"]:
            break
    return base, cur, result, attempts


def test_two_runs_of_the_same_config_pass(same_config_pair):
    base, cur, result, attempts = same_config_pair
    assert check_comparable(base, cur, allow_env_change=False) == []
    t = check(result, "throughput")
    assert (t["samples"], t["method"], t["n_base"], t["n_cur"]) == ("per-step", "mann-whitney", 12, 12)
    assert t["passed"], attempts
    assert check(result, "memory")["verdict"] == "skip"  # CPU: no peak memory
    assert check(result, "findings")["verdict"] == "skip"  # --no-diagnose
    assert result["passed"], result["summary"]


def test_run_current_remeasures_the_baseline_config(same_config_pair):
    base = same_config_pair[0]
    cur = run_current(base, diagnose=False, timeout=300)
    assert cur["config"] == base["config"] and cur["status"] == "ok"
    assert check_comparable(base, cur, allow_env_change=False) == []
    assert check(gate(base, cur), "throughput")["n_cur"] == 12


# --- the paired gate: baseline re-measured in the same job ---------------------------------------


@pytest.mark.parametrize(
    "ratios,outcome",
    [
        ([0.85, 0.86, 0.84], "slower"),
        ([1.0, 1.01, 0.99], "pass"),  # within the 5% allowed, confidently
        ([0.97, 0.972, 0.968], "pass"),  # slower, but surely less than allowed
        ([0.90, 1.05, 0.80], "undecided"),  # could be either: more pairs
    ],
)
def test_slowdown_verdict_classes(ratios, outcome):
    assert slowdown_verdict(ratios, 0.05)["outcome"] == outcome
    assert slowdown_verdict(ratios, 0.05, final=True)["outcome"] == ("pass" if outcome == "undecided" else outcome)


#: the noise of one run's value on the 2-core CI machine at load 8-13, measured by
#: bench/gate_cpu/measure.py (docs/ci.md, "Measured"): one thread a side, a run valued at its median
#: step's CPU-time throughput. 54 same-config pairs had log ratios of sd 0.080, i.e. about 5.5% a
#: run: 5% jitter, a level wandering 1% a run, and one run in 14 5-15% slower (a neighbour
#: thrashing the shared caches)
MEASURED_NOISE = {"jitter": 0.05, "walk": 0.01, "burst_p": 0.07, "burst": (0.85, 0.95)}


def _ci_host(rng, jitter, walk, burst_p, burst):
    """Synthetic runs on the CI machine: multiplicative jitter per run, a wandering level, bursts."""
    state = {"level": 0.0}

    def measure(true):
        state["level"] += rng.normal(0, walk)
        v = true * math.exp(state["level"] + rng.normal(0, jitter))
        if rng.random() < burst_p:
            v *= rng.uniform(*burst)
        return {"status": "ok", "repeats": [{"real_tokens_per_s": v}]}

    return measure


def _simulate_gate(
    slowdown: float,
    trials: int,
    seed: int,
    noise: dict = MEASURED_NOISE,
    extend_pairs: int = 32,
    stats: dict | None = None,
) -> float:
    """Share of gates that fail, each on fresh synthetic paired runs, judged as paired_gate judges
    (max_pairs 16, extended up to `extend_pairs` while the ratio points to a slowdown)."""
    import numpy as np

    from vlmdoctor.doctor.decide import PairedOptions, interleaved

    rng = np.random.default_rng(seed)
    fails = extended = 0
    for _ in range(trials):
        m = _ci_host(rng, **noise)
        r = interleaved(
            {"b": lambda m=m: m(1000.0), "c": lambda m=m: m(1000.0 * (1 - slowdown))},
            "b",
            PairedOptions(min_pairs=3, max_pairs=max(16, extend_pairs)),
            judge=lambda x, final: slowdown_verdict(x, 0.05, 0.98, final, max_pairs=16),
        )
        fails += r["decisions"]["c"]["outcome"] == "slower"
        extended += r["rounds"] > 16
    if stats is not None:
        stats["extended"] = extended / trials
    return fails / trials


def test_paired_gate_rarely_alarms_on_the_same_config_under_ci_load():
    # the target is 0 false alarms in 10 gates: at 1.6% a gate (simulated, 5,000 gates: 1.58%
    # without the extension, 1.56% with it) that is the 85% case; at the 3% per-run noise of
    # quieter hours 0.4%
    stats: dict = {}
    assert _simulate_gate(0.0, 600, seed=11, stats=stats) <= 0.02
    assert stats["extended"] < 0.02  # a same config rarely points to a slowdown at 16 pairs (0.4%)


def test_paired_gate_catches_10_and_15_percent_slowdowns_under_ci_load():
    # 5,000 simulated gates at -10%: 96.1% caught stopping at 16 pairs, 99.3% with the extension to
    # 32 (3.3% of the gates extended); 92.5% of -8% slowdowns (81.5% without)
    assert _simulate_gate(0.10, 600, seed=12) >= 0.99
    assert _simulate_gate(0.15, 100, seed=13) == 1.0


def test_the_extension_is_what_catches_the_slow_tail_of_10_percent_slowdowns():
    stats: dict = {}
    with_ext = _simulate_gate(0.08, 400, seed=15, stats=stats)
    without = _simulate_gate(0.08, 400, seed=15, extend_pairs=16)
    assert with_ext > without + 0.05 and 0.03 < stats["extended"] < 0.3


def test_at_the_noisier_hour_the_extension_holds_false_alarms_and_recovers_most_misses():
    """The noisiest stretch of v6 on the CI host (three gate streams and the neighbours' suites): its
    first 47 same-config pairs had log ratios of sd 0.111, about 7.5% a run (all 115: sd 0.094).
    2,000 simulated gates: false alarms 1.9% stopping at 16 pairs, 2.1% with the extension; -10%
    caught 73.4% -> 94.1% (23% of them extended): not the 99% target."""
    noisy = MEASURED_NOISE | {"jitter": 0.075}
    assert _simulate_gate(0.0, 400, seed=16, noise=noisy) <= 0.03
    assert _simulate_gate(0.10, 200, seed=17, noise=noisy) >= 0.90
    assert _simulate_gate(0.10, 200, seed=17, noise=noisy, extend_pairs=16) <= 0.85


def test_a_gate_pointing_to_a_slowdown_at_max_pairs_measures_on():
    """The miss measured on the CI host: 16 pairs at x0.92, 98% interval below 1, 99.5% not. At
    max_pairs the ratio is below the threshold: another pair, not a pass; at a ratio within the
    allowed it passes there; past max_pairs the slower bound is at EXTENDED_CONFIDENCE."""
    from vlmdoctor.ci.gate import EXTENDED_CONFIDENCE

    wide = [0.808, 1.048, 0.862, 0.982] * 4  # x0.92, log ratios of sd 0.10
    v = slowdown_verdict(wide, 0.05, max_pairs=16)
    assert v["ratio"] < 0.95 and v["outcome"] == "undecided" and not v["extended"]
    assert slowdown_verdict(wide, 0.05)["outcome"] == "undecided"  # the plain verdict: pass at final
    ok = [r * 1.06 for r in wide]  # the same spread around x0.98: within the allowed at 16 pairs
    assert slowdown_verdict(ok, 0.05, max_pairs=16)["outcome"] == "pass"
    longer = slowdown_verdict(wide * 2, 0.05, max_pairs=16)
    assert longer["extended"] and longer["slower_confidence"] == EXTENDED_CONFIDENCE
    assert longer["outcome"] == "slower"
    assert slowdown_verdict(wide, 0.05, max_pairs=16, final=True)["outcome"] == "pass"


def test_paired_gate_extends_past_max_pairs_only_while_the_ratio_points_to_a_slowdown():
    import itertools

    wide = itertools.cycle([0.808, 1.048, 0.862, 0.982])
    r = paired_gate(lambda: _ok(1000.0), lambda: _ok(1000.0 * next(wide)))
    t = check(r, "throughput")
    assert not r["passed"] and 16 < t["pairs"] <= 32 and t["extended"] and t["extend_pairs"] == 32
    wide2 = itertools.cycle([0.808, 1.048, 0.862, 0.982])
    r = paired_gate(lambda: _ok(1000.0), lambda: _ok(1000.0 * next(wide2)), extend_pairs=16)
    t = check(r, "throughput")
    assert r["passed"] and t["pairs"] == 16 and not t["extended"]
    assert "not shown to be slower" in t["detail"]
    near = itertools.cycle([0.87, 1.13, 0.92, 1.08])  # x0.995, as wide: undecided at 16, nothing to extend
    r = paired_gate(lambda: _ok(1000.0), lambda: _ok(1000.0 * next(near)))
    t = check(r, "throughput")
    assert r["passed"] and t["pairs"] == 16 and not t["extended"]


def test_wall_time_noise_of_the_loaded_host_is_beyond_any_gate():
    """Why the CPU gate runs one thread a side and judges CPU time: the wall time of the same config on
    two threads swung 13,176 -> 545 -> 207 real tokens/s on that machine (one run of three a
    10-25x collapse). On that noise the same paired rule alarms on the same config as often as it
    catches a 10% slowdown: it cannot tell them apart."""
    wall = {"jitter": 0.3, "walk": 0.2, "burst_p": 0.3, "burst": (0.04, 0.5)}
    assert _simulate_gate(0.10, 200, seed=14, noise=wall) < 0.10  # 4.5% caught
    assert _simulate_gate(0.0, 200, seed=14, noise=wall) > 0.01  # 2.5% false alarms


def _ok(v: float, mem: float | None = None) -> dict:
    rep = copy.deepcopy(fixture("bf16_s2"))
    rep["repeats"] = [{"real_tokens_per_s": v}]
    rep["metrics"]["peak_mem_gb"] = mem if mem is not None else rep["metrics"]["peak_mem_gb"]
    return rep


def test_paired_gate_fails_a_real_slowdown_and_passes_noise():
    import itertools

    slow = itertools.cycle([0.84, 0.86, 0.85, 0.83])
    result = paired_gate(lambda: _ok(1000.0), lambda: _ok(1000.0 * next(slow)))
    t = check(result, "throughput")
    assert not result["passed"] and t["verdict"] == "fail" and t["pairs"] == 3
    assert "paired" in t["detail"] and t["ci_high"] < 1 and "-15" in t["detail"]
    assert result["remeasured"] and result["notes"] == []
    same = itertools.cycle([1.01, 0.99, 1.0, 1.005])
    ok = paired_gate(lambda: _ok(1000.0), lambda: _ok(1000.0 * next(same)))
    assert ok["passed"] and "within the 5% allowed" in check(ok, "throughput")["detail"]


def test_paired_gate_alternates_the_order_of_the_sides():
    order = []
    paired_gate(lambda: (order.append("B"), _ok(1000.0))[1], lambda: (order.append("C"), _ok(1000.0))[1])
    assert order[:6] == ["B", "C", "C", "B", "B", "C"]


def test_paired_gate_memory_and_a_failed_side():
    result = paired_gate(lambda: _ok(1000.0, 10.0), lambda: _ok(1000.0, 12.0))
    assert not check(result, "memory")["passed"]
    with pytest.raises(UsageError, match="current run did not finish cleanly"):
        paired_gate(lambda: _ok(1000.0), lambda: {"status": "oom", "error": {"message": "CUDA out of memory"}})


@pytest.mark.slow
def test_remeasure_on_cpu_passes_the_same_config(tmp_path):
    """Real paired runs of one config on this machine: the gate must pass (about a minute)."""
    from vlmdoctor.ci.gate import remeasure

    base = load_report(_profile(tmp_path / "base.json"))
    result = remeasure(base, timeout=300, diagnose=False, max_pairs=4)
    assert result["passed"], result["summary"]
    assert check(result, "throughput")["pairs"] >= 3


# --- CPU baselines: the CPU is the hardware -----------------------------------------------------


@pytest.mark.parametrize("key,value", [("torch", "2.14.0+cpu"), ("transformers", "5.30.0"), ("liger_kernel", "0.9.0")])
def test_cpu_baseline_across_software_upgrades_is_compared_and_named(same_config_pair, key, value):
    base, cur = same_config_pair[0], copy.deepcopy(same_config_pair[1])
    assert base["env"]["device_type"] == "cpu" and base["env"]["cpu_model"]  # recorded by the run itself
    cur["env"][key] = value
    notes = check_comparable(base, cur, allow_env_change=False)
    assert notes == [f"environment changed: {key}: {base['env'][key]!r} -> {value!r}"]


@pytest.mark.parametrize("key,value", [("cpu_model", "AMD EPYC 9654 96-Core Processor"), ("cpu_count", 64)])
def test_cpu_baseline_from_another_cpu_is_refused_unless_allowed(same_config_pair, key, value):
    base, cur = same_config_pair[0], copy.deepcopy(same_config_pair[1])
    cur["env"][key] = value
    with pytest.raises(UsageError) as e:
        check_comparable(base, cur, allow_env_change=False)
    assert "different CPUs" in e.value.message and str(value) in e.value.message and e.value.exit_code == EXIT_USAGE
    assert check_comparable(base, cur, allow_env_change=True)[0].startswith(f"CPU changed (allowed): {key}:")


def test_cpu_baseline_without_a_cpu_model_is_compared_with_a_note(same_config_pair):
    base, cur = copy.deepcopy(same_config_pair[0]), same_config_pair[1]
    del base["env"]["cpu_model"]  # a report from before the CPU model was recorded
    notes = check_comparable(base, cur, allow_env_change=False)
    assert len(notes) == 1 and "could not be checked" in notes[0]


def test_cpu_baseline_against_a_gpu_run_is_refused(same_config_pair):
    cur = copy.deepcopy(fixture("bf16_s2"))
    cur["config"] = same_config_pair[0]["config"]
    with pytest.raises(UsageError, match="different GPU models"):
        check_comparable(same_config_pair[0], cur, allow_env_change=False)


# --- the paired gate's measurement --------------------------------------------------------------


def test_a_run_is_valued_at_its_median_step_so_a_burst_does_not_move_it():
    from vlmdoctor.doctor.decide import step_throughput, throughput

    rng = random.Random(5)
    for _ in range(50):
        tokens = [rng.randint(300, 900) for _ in range(15)]
        ms = [t / 10.0 * rng.uniform(0.97, 1.03) for t in tokens]  # 10,000 tokens/s
        burst = list(ms)
        for i in rng.sample(range(15), 4):  # a neighbour takes the CPU for 4 of 15 steps: 5-30x slower
            burst[i] *= rng.uniform(5, 30)
        rep = {
            "status": "ok",
            "repeats": [
                {
                    "step_real_tokens": tokens[i : i + 5],
                    "step_ms": burst[i : i + 5],
                    "real_tokens_per_s": sum(tokens[i : i + 5]) / sum(burst[i : i + 5]) * 1000,
                }
                for i in (0, 5, 10)
            ],
        }
        assert step_throughput(rep) == pytest.approx(10_000, rel=0.04)
        # the old headline, the median of the windows' tokens over their time, saw the burst; the one estimator
        # (the median of the per-step rates) is what every reader of a report now takes
        assert statistics.median(r["real_tokens_per_s"] for r in rep["repeats"]) < 9_000
        assert throughput(rep) == step_throughput(rep)
    assert step_throughput({"status": "oom"}) is None
    assert step_throughput({"status": "ok", "repeats": [{"real_tokens_per_s": 5.0}]}) == 5.0  # old reports


@pytest.mark.parametrize(
    "base_device,threads,expected", [("cpu", 1, "1"), ("cpu", 2, "2"), ("cpu", 0, None), ("cuda", 1, None)]
)
def test_remeasure_pins_cpu_threads_on_both_sides(monkeypatch, base_device, threads, expected):
    import vlmdoctor.run.runner as runner
    from vlmdoctor.ci.gate import remeasure

    seen = []

    def fake(cfg, timeout=None, diagnose=True, rules_dirs=None, env=None, python=None, own_cwd=False):
        assert own_cwd == bool(python)  # the baseline's install is not shadowed by the checkout we stand in
        seen.append((python, dict(env or {}), diagnose))
        return _ok(1000.0)

    monkeypatch.setattr(runner, "run_isolated", fake)
    base = copy.deepcopy(fixture("bf16_s2"))
    base["config"]["device"] = base_device
    result = remeasure(base, "/opt/old/bin/python", {"PYTHONPATH": "/src/old"}, cpu_threads=threads)
    assert result["passed"] and len(seen) == 6
    for _python, env, diagnose in seen:
        assert env.get("OMP_NUM_THREADS") == expected and env.get("MKL_NUM_THREADS") == expected
        assert not diagnose  # the baseline has no diagnosis: nothing to compare findings with
    assert [p for p, _, _ in seen].count("/opt/old/bin/python") == 3
    assert all(e.get("PYTHONPATH") == "/src/old" for p, e, _ in seen if p) and not any(
        "PYTHONPATH" in e for p, e, _ in seen if not p
    )
    assert any("--cpu-threads" in n for n in result["notes"]) == (expected is not None)


def test_a_slowdown_needs_the_median_pair_beyond_the_threshold():
    """Five pairs of twelve at -15% (a neighbour's job in a few current runs) with the rest at -4%:
    the mean is -9% and its interval is below 1, but the typical pair is within the 5% allowed."""
    ratios = [0.96, 0.85] * 5 + [0.96, 0.96]
    v = slowdown_verdict(ratios, 0.05)
    assert v["ci_high"] < 1 and v["ratio"] < 0.95 and v["median_ratio"] == pytest.approx(0.96)
    assert v["outcome"] == "undecided" and slowdown_verdict(ratios, 0.05, final=True)["outcome"] == "pass"
    assert slowdown_verdict([0.86, 0.85] * 6, 0.05)["outcome"] == "slower"


def test_gate_json_carries_the_verdict_pairs_and_ratios(tmp_path, monkeypatch):
    """`gate --remeasure-baseline --json`: exit 1 on a slowdown, and the file says why."""
    import itertools

    from typer.testing import CliRunner

    import vlmdoctor.ci.gate as gate_module
    from vlmdoctor.cli import app

    slow = itertools.cycle([0.84, 0.86, 0.85, 0.83])
    monkeypatch.setattr(
        gate_module,
        "remeasure",
        lambda base, *a, **kw: paired_gate(
            lambda: _ok(1000.0),
            lambda: _ok(1000.0 * next(slow)),
            **{k: v for k, v in kw.items() if k not in ("cpu_threads", "baseline_cwd", "current_command", "launcher")},
        ),
    )
    base = write(tmp_path, "base.json", fixture("bf16_s2"))
    out = tmp_path / "verdict.json"
    r = CliRunner().invoke(app, ["gate", "--baseline", base, "--remeasure-baseline", "--json", str(out)])
    assert r.exit_code == 1, r.output
    verdict = json.loads(out.read_text())
    t = check(verdict, "throughput")
    assert verdict["passed"] is False and verdict["remeasured"] and t["verdict"] == "fail"
    assert t["pairs"] == 3 and [round(x, 2) for x in t["ratios"]] == [0.84, 0.86, 0.85]
    assert t["ratio"] < 0.9 and t["ci_high"] < 1 and len(t["base_values"]) == len(t["cur_values"]) == 3
    assert "reports" not in verdict  # the runs' full reports stay out of the verdict file
