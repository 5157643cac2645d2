"""The rule engine and the shipped rules, on the real H100 traces under fixtures/traces/."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from vlmdoctor.cli import app
from vlmdoctor.doctor.rules import RULES_DIR, diagnose, gain_ratio, load_rules
from vlmdoctor.run.config import RunConfig
from vlmdoctor.trace.facts import analyze, merge_measured

TRACES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
RULES, PROBLEMS = load_rules()


@cache
def measured(name: str) -> dict:
    """Trace facts plus what the same run's report measured (padding, memory): what `profile` diagnoses."""
    facts = analyze(TRACES / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
    return merge_measured(facts, json.loads((TRACES / f"{name}.report.json").read_text()))


def fired(name: str) -> dict[str, dict]:
    return fired_on(measured(name))


def fired_on(facts: dict) -> dict[str, dict]:
    return {f["id"]: f for f in diagnose(facts, RULES)["findings"]}


def test_shipped_rules_load_cleanly():
    assert PROBLEMS == []
    assert {r.id for r in RULES} >= {"precision-fp32-gemms", "data-shape-churn", "fusion-fusedce-stage2"}
    for r in RULES:
        assert all(c["why"] for c in r.constants.values()), r.id  # thresholds say where they come from
        # a fix that lives only in the user's own loop (empty_cache in the step) has no knob of vlmdoctor's runs
        assert r.patch or r.id in USER_CODE_ONLY, r.id
        assert RunConfig().replace(**{k: v for k, v in r.patch.items() if not str(v).startswith("=")})


#: rules whose fix is a change to the user's loop that no knob of vlmdoctor's own runs expresses
USER_CODE_ONLY = {
    "system-allocator-churn",
    "system-launch-blocking",
    "system-dtoh-copies",
    "system-compile-host",
    "system-eval-in-step",
    "system-deterministic-algorithms",
    "system-ddp-find-unused",
}


# rule id -> (a fixture where it fires, a fixture where it does not)
CASES = {
    "precision-fp32-gemms": ("fp32_noautocast_s2", "bf16_s2"),
    "precision-autocast-casts": ("default_s2", "bf16_s2"),
    # busy 89% of the untraced step: the batch saturates the GPU (healthy_s2 idles 25% of its step)
    "batching-gpu-underfed": ("default_s2", "cache_s1"),
    "data-padding-waste": ("default_s2", "bf16_s2"),
    "data-shape-churn": ("default_s2", "bf16_s2"),
    "fusion-fusedce-stage2": ("liger_fce_s2", "bf16_s2"),
    "system-checkpoint-recompute": ("ckpt_s2", "bf16_s2"),
    "system-data-loader": ("ckpt_reentrant_s2", "healthy_s2"),
    "system-non-fused-optimizer": ("bf16_s2", "healthy_s2"),
    "fusion-fusedce-stage1": ("bf16_s1", "liger_fce_s1"),
    "fusion-liger-with-compile": ("liger_compile_s2", "compile_s2"),
    "precision-frozen-tower-graph": ("input_grads_s2", "bf16_s2"),
    "batching-host-bound": ("bf16_s2", "compile_s2"),
    "fusion-compile-launch-bound": ("healthy_1.5b_s2", "compile_s2"),
    "fusion-eager-attention": ("eager_s2", "bf16_s2"),
    # GEMM-bound (52% bf16 GEMMs, 72% busy) on an H100 vs the host-bound 0.5b step (tests/test_fp8.py: more)
    "fusion-lm-head-unlabeled": ("healthy_s2", "labeled_s2"),
    # packed rows through SDPA's dense block-diagonal mask; the padded healthy run also masks, but is not packed
    "fusion-packed-dense-mask": ("packed_s2", "healthy_s2"),
}

# rules that no H100 recording makes fire, because on this GPU the problem does not arise: each is
# tested firing on a real fixture's facts with the named facts changed to what the problem looks
# like, and not firing on the unchanged real fixture.
VARIATION_CASES = {
    # SDPA's flash backend has no kernel for the LLM's padded batches here ("No available kernel"),
    # so every recording runs the tower on cuDNN, which handles head dim 72 best.
    "fusion-head-dim": ("healthy_1.5b_s2", {"attention.backends": ["flash"]}),
    # host-bound steps hide sync gaps (17.5 syncs cost 0.2% of the step in sync_s2); a GPU-bound
    # step would show them as idle time
    "system-sync-calls": ("sync_s2", {"idle.sync.ms": 40.0, "idle.sync.loop_ms": 40.0}),
    # on this host caching paid (3.2 ms of copies vs a 6.2 ms tower forward); a slower link or a
    # bigger feature map would turn it around
    "system-vision-cache-h2d": ("cache_s1", {"memcpy.HtoD.ms": 8.0}),
    # tensorwise FP8 lost 19% at 1.5b on the H100 (bf16 GEMMs of 0.11 ms: the casts cost more than the
    # GEMMs saved); the rule waits for GEMMs 4x wider than any recorded here
    "precision-fp8-gemm": ("healthy_1.5b_s2", {"gemm.bf16_mean_ms": 0.62}),
    # packing on SDPA cost 8-20% on the H100, more than the 9-11% padding bucketing leaves in every
    # recording; the rule waits for padding well above that
    "data-packing": ("bf16_s2", {"data.pad_fraction": 0.3}),
    # empty_cache() in a held-out H200 loop: 533 cudaMalloc and 533 cudaFree calls in two steps
    "system-allocator-churn": ("bf16_s2", {"host.allocator_calls": 533.0, "idle.host.allocator.ms": 20.0}),
}


# rules whose fix another finding already covers:
# (fixture where it fires, the finding that supersedes it, a no-fire fixture)
SUPERSEDED_CASES = {
    # a launch-bound step gets compile first; Liger stays as the alternative `treat` also measures (cache_s1, whose
    # kernels queue 6.5 ms on the median, is paced by the GPU: there the fused norms are the finding itself)
    "fusion-unfused-norm-activation": ("eager_s2", "fusion-compile-launch-bound", "healthy_s2"),
    "precision-no-tf32": ("fp32_noautocast_s2", "precision-fp32-gemms", "bf16_s2"),
    "fusion-fp32-attention": ("fp32_noautocast_s2", "precision-fp32-gemms", "bf16_s2"),
    # graph breaks around Liger's kernels: 17.5% of the step in compile's host work; dropping Liger comes first
    "system-compile-host": ("liger_compile_s2", "fusion-liger-with-compile", "treated_s2"),
}


# rules of CPU-only runs: tested on CPU traces recorded in the test (tests/test_cpu_doctor.py)
CPU_CASES = {"precision-cpu-bf16-emulated"}

# rules over several ranks' traces together: tested on real 2-rank recordings (tests/test_dist_rules.py)
DIST_CASES = {
    "system-comm-exposed-fsdp",
    "system-comm-exposed-ddp",
    "batching-rank-token-imbalance",
    "system-fsdp-small-model",
    "system-ddp-near-memory",
    "system-accum-sync",
    "batching-sharded-batch",
}
# training-mode rules (LoRA, QLoRA, DPO): tested both ways on traces of the modes recorded on CPU in
# tests/test_mode_rules.py; their H100 traces are recorded by bench/modes15/record.sh
MODE_CASES = {
    "fusion-lora-tiny-gemms",
    "precision-qlora-dequant",
    "precision-dpo-reference-grad",
    "precision-dpo-reference-fp32",
    "system-dpo-reference-every-step",
}


# rules of the memory wall: tested both ways on the H100 traces with allocations (tests/test_memory_wall.py)
MEMORY_CASES = {"batching-memory-wall-logits"}

# rules of the corpus recorded on two H200s: fire on the run that plants their cause, silent on every other run
# (tests/test_corpus.py)
CORPUS_CASES = {
    "fusion-sdpa-math-fallback",
    "system-launch-blocking",
    "system-pageable-h2d",
    "system-dtoh-copies",
    "system-eval-in-step",
    "system-deterministic-algorithms",
    "precision-fp16-grad-scaler",
    "batching-moe-tokens-per-expert",
    "system-ddp-find-unused",
    "system-straggler-data-loader",
}


def test_every_rule_has_a_case():
    assert set(CASES) | set(SUPERSEDED_CASES) | set(VARIATION_CASES) | CPU_CASES | DIST_CASES | MODE_CASES | (
        MEMORY_CASES | CORPUS_CASES
    ) == {r.id for r in RULES}


@pytest.mark.parametrize("name", ["default_s2", "healthy_s2", "ckpt_s2", "bf16_s1", "compile_s2"])
def test_mode_rules_stay_quiet_on_runs_without_a_mode(name):
    """Full-training SFT runs on the H100: no adapters, no reference, no 4-bit base, so no mode finding."""
    f = measured(name)
    assert f["dpo.reference_count"] == 0 and f["qlora.dequant_count"] == 0
    assert not MODE_CASES & set(fired(name))


def test_cpu_rules_do_not_apply_to_gpu_traces():
    d = diagnose(measured("default_s2"), RULES)
    na = {n["id"]: n["why"] for n in d["not_applicable"]}
    for rid in CPU_CASES:
        assert "CPU-only" in na[rid] and rid not in [n["id"] for n in d["not_evaluated"]]


def test_compile_for_a_host_bound_step_supersedes_liger():
    """Compile and Liger fuse the same chains: where the step is launch-bound, compile is prescribed."""
    d = diagnose(measured("bf16_s2"), RULES)
    sup = {s["id"]: s["superseded_by"] for s in d["superseded"]}
    assert sup.get("fusion-unfused-norm-activation") == "batching-host-bound"
    host = next(f for f in d["findings"] if f["id"] == "batching-host-bound")
    assert host["config_patch"]["compile"] == "default" and host["config_patch"]["liger_rms_norm"] is False
    assert "aten::mm" in " ".join(host["evidence"])  # names the host ops


def test_compile_is_prescribed_for_a_launch_bound_step_that_keeps_the_gpu_busy():
    """healthy_1.5b_s2 keeps the GPU 72% busy (the host-bound rule stays quiet) with 2,405 launches per step."""
    d = diagnose(measured("healthy_1.5b_s2"), RULES)
    assert "batching-host-bound" not in {f["id"] for f in d["findings"]}
    f = next(f for f in d["findings"] if f["id"] == "fusion-compile-launch-bound")
    assert f["config_patch"]["compile"] == "default" and f["config_patch"]["warmup"] >= 10


@pytest.mark.parametrize("rule_id", sorted(VARIATION_CASES))
def test_rule_fires_on_the_problem_and_not_on_the_real_trace(rule_id):
    name, changes = VARIATION_CASES[rule_id]
    assert rule_id not in fired(name)
    ids = {f["id"] for f in diagnose({**measured(name), **changes}, RULES)["findings"]}
    assert rule_id in ids


@pytest.mark.parametrize("rule_id", sorted(SUPERSEDED_CASES))
def test_covered_rules_fire_as_superseded(rule_id):
    yes, by, no = SUPERSEDED_CASES[rule_id]
    d = diagnose(measured(yes), RULES)
    assert {"id": rule_id, "by": by} in [{"id": s["id"], "by": s["superseded_by"]} for s in d["superseded"]]
    d_no = diagnose(measured(no), RULES)
    assert rule_id not in {f["id"] for f in d_no["findings"] + d_no["superseded"]}


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires_and_does_not_fire_on_real_traces(rule_id):
    yes, no = CASES[rule_id]
    assert rule_id in fired(yes), (yes, sorted(fired(yes)))
    assert rule_id not in fired(no), (no, fired(no).get(rule_id, {}).get("evidence"))


def test_healthy_fixture_has_no_layer_1_findings():
    assert [f for f in fired("healthy_s2").values() if f["layer"] == 1] == []


def test_findings_are_ranked_by_gain_and_numbered_in_layer_order_with_evidence_patch_and_gain():
    findings = diagnose(measured("default_s2"), RULES)["findings"]
    ratios = [gain_ratio(f["expected_gain"]) for f in findings]
    assert None not in ratios and ratios == sorted(ratios, reverse=True)  # the biggest expected win first
    assert [f["rank"] for f in findings] == list(range(1, len(findings) + 1))
    applied = sorted(findings, key=lambda f: f["apply_order"])  # the layer stays the order of application
    assert [f["layer"] for f in applied] == sorted(f["layer"] for f in findings) and applied[0]["layer"] == 1
    assert findings[0]["layer"] != 1  # here the gains and the layers disagree: the test checks both orders
    churn = next(f for f in findings if f["id"] == "data-shape-churn")
    assert churn["config_patch"] == {"pad_to_multiple_of": 64}
    assert "4x387" in " ".join(churn["evidence"])  # numbers from the trace, not the config
    assert churn["expected_gain"]["saves_ms_per_step"] > 100
    batch = next(f for f in findings if f["id"] == "batching-gpu-underfed")
    assert batch["config_patch"]["batch_size"] > 4  # sized from measured memory per step


def test_fused_ce_rule_is_stage_aware():
    d = diagnose(measured("liger_fce_s1"), RULES)
    assert {"id": "fusion-fusedce-stage2", "why": "applies in stage 2 only"} in d["not_applicable"]


def test_missing_facts_mean_not_evaluated_not_fired(tmp_path):
    facts = analyze(TRACES / "default_s2.pt.trace.json.gz")["files"][0]["facts"]  # no report: no memory, no padding
    d = diagnose(facts, RULES)
    missing = {n["id"]: n["missing"] for n in d["not_evaluated"]}
    assert "batching-gpu-underfed" in missing and "data-padding-waste" in missing
    assert not any(f["id"] in missing for f in d["findings"])
    no_stage = {k: v for k, v in facts.items() if k != "run.stage"}
    assert {"id": "fusion-fusedce-stage2", "missing": ["run.stage"]} in diagnose(no_stage, RULES)["not_evaluated"]


def test_a_fix_covered_by_an_earlier_one_is_superseded():
    facts = {**measured("default_s2"), "gemm.fp32_share": 0.6, "kernels.gemm_fp32_simt.ms": 30.0}
    d = diagnose(facts, RULES)
    ids = [f["id"] for f in sorted(d["findings"], key=lambda f: f["apply_order"])]
    assert ids[0] == "precision-fp32-gemms"  # the larger estimated saving in layer 1
    assert {"id": "precision-autocast-casts", "by": "precision-fp32-gemms"} in [
        {"id": s["id"], "by": s["superseded_by"]} for s in d["superseded"]
    ]


# --- bad rule files ----------------------------------------------------------------------------------------

GOOD = """id: {id}
layer: 2
title: test rule
severity: low
when: gpu.busy_frac < LIMIT
constants: {{LIMIT: {{value: 0.9, why: test}}}}
evidence: ["busy {{gpu.busy_frac:pct}}"]
fix: do something
patch: {{batch_size: 8}}
"""


def _write(folder: Path, name: str, text: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            GOOD.format(id="x").replace("gpu.busy_frac < LIMIT", "gpu.busyness < LIMIT"),
            "unknown fact(s) gpu.busyness",
        ),
        (GOOD.format(id="x").replace("gpu.busy_frac < LIMIT", "gpu.busy_frac <"), "does not parse"),
        (
            GOOD.format(id="x").replace("gpu.busy_frac < LIMIT", "__import__('os').system('true')"),
            "only min, max",
        ),
        (GOOD.format(id="x").replace("layer: 2", "layer: 9"), "layer must be 1-5"),
        (GOOD.format(id="x").replace("batch_size", "batchsize"), "unknown knob(s) batchsize"),
        (GOOD.format(id="x").replace("< LIMIT", "< OTHER"), "undefined constant(s) OTHER"),
        ("id: [unclosed", "not valid YAML"),
    ],
)
def test_broken_rule_files_are_named_and_the_rest_still_run(tmp_path, text, needle):
    _write(tmp_path / "r", "bad.yaml", text)
    _write(tmp_path / "r", "good.yaml", GOOD.format(id="user-good"))
    rules, problems = load_rules(tmp_path / "r")
    assert len(problems) == 1 and "bad.yaml" in problems[0] and needle in problems[0], problems
    assert "user-good" in {r.id for r in rules} and len(rules) == len(RULES) + 1


def test_duplicate_rule_id_is_reported(tmp_path):
    _write(tmp_path / "r", "dup.yaml", GOOD.format(id="data-shape-churn"))
    rules, problems = load_rules(tmp_path / "r")
    assert len(problems) == 1 and "already used by" in problems[0] and "dup.yaml" in problems[0]


def test_user_rules_fire_through_the_cli(tmp_path):
    _write(tmp_path / "r", "mine.yaml", GOOD.format(id="user-busy"))
    out = tmp_path / "a.json"
    r = CliRunner().invoke(
        app,
        [
            "analyze",
            str(TRACES / "healthy_s2.pt.trace.json.gz"),
            "--rules",
            str(tmp_path / "r"),
            "--json",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    findings = {f["id"]: f for f in json.loads(out.read_text())["files"][0]["findings"]}
    assert "user-busy" in findings
    assert findings["user-busy"]["evidence"][0].startswith("busy ") and findings["user-busy"]["config_patch"] == {
        "batch_size": 8
    }


def test_rules_list_and_show():
    r = CliRunner().invoke(app, ["rules", "list"])
    assert r.exit_code == 0 and "data-shape-churn" in r.output
    r = CliRunner().invoke(app, ["rules", "show", "fusion-fusedce-stage2"])
    assert r.exit_code == 0, r.output
    raw = yaml.safe_load((RULES_DIR / "fusion-fusedce-stage2.yaml").read_text())
    page = " ".join(r.output.split())  # a page, wrapped to the terminal: compare words, not lines
    for heading in (
        "What it detects",
        "Evidence it shows",
        "Fix",
        "Thresholds and where they come from",
        "Sources",
    ):
        assert heading in r.output
    assert " ".join(raw["detects"].split()) in page and " ".join(raw["fix"].split()) in page
    for name, c in raw["constants"].items():  # every threshold with its value and where it comes from
        assert f"{name} = {c['value']}" in page and " ".join(str(c["why"]).split()) in page
    r = CliRunner().invoke(app, ["rules", "show", "nope"])
    assert r.exit_code == 2 and "no rule 'nope'" in r.output and len(r.output.strip().splitlines()) == 1
    # an id cut by a narrow table, or mistyped: one line with the closest ids, not a line of every id
    for given, meant in (
        ("precision-frozen-tower-gra…", "precision-frozen-tower-graph"),
        ("fusion-fusedce-stag2", "fusion-fusedce-stage2"),
    ):
        r = CliRunner().invoke(app, ["rules", "show", given])
        assert r.exit_code == 2 and "did you mean" in r.output and meant in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1 and "system-sync-calls" not in r.output


def test_profile_report_holds_findings(tmp_path):
    out = tmp_path / "r.json"
    r = CliRunner().invoke(
        app,
        [
            "profile",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--autocast",
            "off",
            "--json",
            str(out),
            "--quiet",
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["trace"]["path"] is None  # the temporary trace is gone
    ids = [f["id"] for f in report["findings"]]
    assert "data-padding-waste" in ids  # measured padding of random batches, on CPU too
    assert all(
        {"id", "layer", "severity", "evidence", "fix", "config_patch", "expected_gain"} <= f.keys()
        for f in report["findings"]
    )


def test_batching_gain_is_a_throughput_factor():
    f = fired("default_s2")["batching-gpu-underfed"]
    g, b = f["expected_gain"], f["config_patch"]["batch_size"]
    assert g["saves_ms_per_step"] is None
    busy = measured("default_s2")["measured.gpu.busy_frac"]
    assert g["throughput_x"] == pytest.approx(min(b / 4, 1 / busy))  # the formula written in the rule file


def test_packing_is_prescribed_without_flex():
    """FlexAttention made packed rows slower on the H100 (32,498 vs 47,718 tokens/s on SDPA): the
    packing fix does not switch the attention path, on a GPU run or a CPU one."""
    padded = {**measured("bf16_s2"), "data.pad_fraction": 0.3}
    assert fired_on(padded)["data-packing"]["config_patch"] == {"packing": True}
    cpu = {k: v for k, v in padded.items() if k != "device.name"}
    assert fired_on(cpu)["data-packing"]["config_patch"] == {"packing": True}


def test_packed_dense_mask_rule_is_measured_and_estimates_the_skipped_blocks():
    """It fires from the measured mask and attention time; config.packing alone does not make it fire."""
    facts = measured("packed_s2")
    f = fired("packed_s2")["fusion-packed-dense-mask"]
    # unpacked, bucketed batches padded to 64: measured x1.09 over the packed rows on SDPA, where flex lost
    assert f["config_patch"] == {"packing": False, "sampler": "length_bucketed", "pad_to_multiple_of": 64}
    att = facts["attention.llm.forward_ms"] + facts["attention.llm.backward_ms"]
    rows, batch = facts["shapes.rows_per_micro_batch"], facts["config.batch_size"]
    assert rows < batch
    assert f["expected_gain"]["saves_ms_per_step"] == pytest.approx(att * (1 - rows / batch))
    # packed, but the attention kernels barely show: no finding
    quiet = {**facts, "attention.kernel_share": 0.05}
    assert "fusion-packed-dense-mask" not in {x["id"] for x in diagnose(quiet, RULES)["findings"]}
    # packed, but no dense mask (a flex run has no SDPA calls in the LLM)
    flexed = {k: v for k, v in facts.items() if k != "attention.llm.dense_mask_share"}
    d = diagnose(flexed, RULES)
    assert "fusion-packed-dense-mask" not in {x["id"] for x in d["findings"]}


def test_busy_share_is_taken_over_the_untraced_step():
    # the profiler lengthens the traced step with host overhead, not the kernels: a run's own report gives the
    # untraced step, and the busy share over it is what the batch rule reads
    traced = analyze(TRACES / "sync_compile_s2.pt.trace.json.gz")["files"][0]["facts"]
    f = measured("sync_compile_s2")
    step = json.loads((TRACES / "sync_compile_s2.report.json").read_text())["metrics"]["step_ms"]
    assert f["gpu.busy_frac"] == pytest.approx(traced["gpu.busy_frac"])  # the trace's fact is left as it was
    assert f["measured.gpu.busy_frac"] == pytest.approx(traced["gpu.busy_ms"] / step)
    assert f["measured.gpu.busy_frac"] > 1.5 * f["gpu.busy_frac"]  # 177 ms untraced, 337 ms traced


def test_batch_is_sized_from_live_tensors_not_the_allocator_pool():
    f = measured("sync_compile_s2")
    assert f["measured.memory.peak_reserved_gb"] > f["measured.memory.peak_allocated_gb"]
    b = fired_on(f)["batching-gpu-underfed"]["config_patch"]["batch_size"]
    assert b == min(8 * 8, max(16, math.floor(8 * 0.7 / f["measured.memory.peak_allocated_frac"])))
    pool = {
        **f,
        "measured.memory.peak_allocated_frac": f["measured.memory.peak_reserved_frac"],
        "measured.memory.peak_allocated_gb": f["measured.memory.peak_reserved_gb"],
    }
    assert fired_on(pool)["batching-gpu-underfed"]["config_patch"]["batch_size"] < b
    busy = {**f, "measured.gpu.busy_frac": 0.9}
    assert "batching-gpu-underfed" not in fired_on(busy)


TREATED = ("treated_s2", "treated_s1", "treated_1.5b_s2")


@pytest.mark.parametrize("name", TREATED)
def test_the_final_configs_of_the_h100_ladders_are_diagnosed_healthy(name):
    """What `treat` ended on (docs/treat.md): the GPU saturated, memory under the batch rule's headroom, and
    no rule fires, so a treatment that re-diagnoses it stops there."""
    f = measured(name)
    assert f["measured.gpu.busy_frac"] >= 0.85 and f["measured.memory.peak_allocated_frac"] < 0.7
    d = diagnose(f, RULES)
    assert d["findings"] == [], [x["id"] for x in d["findings"]]


def test_the_treated_loss_runs_as_fused_triton_kernels_not_eager_softmax():
    """Regional compilation compiles the LM head and its loss as one region: the treated trace holds
    Inductor's fused log-softmax + cast + NLL kernels, where the eager labeled-head run holds aten's."""
    import gzip
    import re

    def kernels(name: str) -> list[str]:
        with gzip.open(TRACES / f"{name}.pt.trace.json.gz", "rt") as fh:
            return [e["name"] for e in json.load(fh)["traceEvents"] if e.get("cat") == "kernel"]

    treated, eager = kernels("treated_s2"), kernels("labeled_s2")
    assert not any("cunn_SoftMax" in k for k in treated) and any("cunn_SoftMax" in k for k in eager)
    assert any(re.match(r"triton_\w+_fused_.*log_softmax.*nll_loss", k) for k in treated)


def test_launch_bound_is_said_only_where_kernels_do_not_queue():
    """The launch-bound title is checked against the fact that would contradict it: kernels that wait milliseconds
    between launch and start are paced by the GPU. Without that fact the finding says it assumed it."""
    facts = measured("healthy_1.5b_s2")
    assert "fusion-compile-launch-bound" in {f["id"] for f in diagnose(facts, RULES)["findings"]}
    queued = {**facts, "launch.delay_us_median": 4700.0}  # a held-out H200 step: busy 82%, kernels queued 4.7 ms
    assert "fusion-compile-launch-bound" not in {f["id"] for f in diagnose(queued, RULES)["findings"]}
    unknown = {k: v for k, v in facts.items() if k != "launch.delay_us_median"}
    f = next(f for f in diagnose(unknown, RULES)["findings"] if f["id"] == "fusion-compile-launch-bound")
    assert any(e.startswith("not measured: launch.delay_us_median") for e in f["evidence"]), f["evidence"]


def test_the_loaders_finding_says_which_part_of_its_wait_grows_with_the_batch():
    """fixtures/traces/default_s2 (H100, no loader workers): the loader's calls took 50.1 ms in one traced step and
    9.0 ms in the other. The finding's saving is the mean wait (what workers would hide at this batch); the part
    each sample costs, the one `treat` moves to a larger batch, is the wait of the step that had least of it."""
    facts = measured("default_s2")
    g = fired_on(facts)["system-data-loader"]["expected_gain"]
    assert g["per"] == "sample"
    assert g["saves_ms_per_step"] == pytest.approx(facts["idle.data_loader.ms"])
    assert g["grows_ms_per_step"] == pytest.approx(facts["idle.data_loader.least_ms"])
    assert 8.0 < g["grows_ms_per_step"] < 10.0 < 25.0 < g["saves_ms_per_step"]


def test_what_undoing_checkpointing_costs_is_read_in_a_trace_without_it():
    """fixtures/traces/bf16_s2 and ckpt_s2 (H100, batch 16, bf16 weights) differ in checkpointing alone. With it on,
    the GPU is busy longer by its recompute (13.6 ms against 13.7 ms of recompute kernels); read in the trace without
    it, the rule's `gain.undo_ms` is the LLM's forward that checkpointing would run again, never less than that
    recompute, and nothing where the trace lacks the LLM's forward."""
    from vlmdoctor.doctor.rules import undo_ms

    rule = next(r for r in RULES if r.id == "system-checkpoint-recompute")
    off, on = measured("bf16_s2"), measured("ckpt_s2")
    assert off["recompute.ms"] == 0 and on["recompute.ms"] > 10
    assert on["gpu.busy_ms"] - off["gpu.busy_ms"] == pytest.approx(on["recompute.ms"], rel=0.05)
    assert undo_ms(rule, off) == pytest.approx(off["part.llm.forward_ms"])
    assert on["recompute.ms"] <= undo_ms(rule, off) < off["gpu.busy_ms"]
    assert undo_ms(rule, {k: v for k, v in off.items() if k != "part.llm.forward_ms"}) is None
    assert undo_ms(next(r for r in RULES if r.id == "system-data-loader"), off) is None  # it declares none


def test_the_recompute_finding_keeps_its_share_of_the_gpus_work():
    """fixtures/traces/ckpt_s2 (H100, batch 16, host-bound): the recompute is 13.7 ms, 4% of the traced step but 15%
    of the GPU's busy time. The step share is its worth in this config; the GPU share (`gain.per: gpu`) is what
    `treat` carries to a GPU-bound final config, where checkpointing back on measured x1.28-1.29."""
    facts = measured("ckpt_s2")
    g = fired_on(facts)["system-checkpoint-recompute"]["expected_gain"]
    assert g["per"] == "gpu"
    assert g["share_of_gpu"] == pytest.approx(facts["recompute.ms"] / facts["gpu.busy_ms"])
    assert g["share_of_gpu"] == pytest.approx(facts["recompute.share"])
    assert g["share_of_step"] < 0.05 < 0.10 < g["share_of_gpu"] < 0.20
    # a rule whose saving is a cost of each step keeps no GPU share
    assert all(
        "share_of_gpu" not in f["expected_gain"]
        for i, f in fired_on(facts).items()
        if i != "system-checkpoint-recompute"
    )
