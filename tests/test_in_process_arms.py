"""Leave-one-out arms measured in one run's process (run/arms.py, run/switch.py) and what `treat` makes of them
(doctor/treat_ablation.py `in_process_contributions`): which knobs switch, a real run of the tiny preset measuring its
arms, an arm that fails, and a treatment that measures each change's own worth without a fresh run per arm."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.optim.adam as torch_adam

from vlmdoctor.doctor import treat as treat_module
from vlmdoctor.doctor.treat import TreatOptions, treat
from vlmdoctor.doctor.treat_ablation import IN_ONE_PROCESS, IN_PROCESS, IN_PROCESS_OPEN
from vlmdoctor.documents import TreatResult, as_document, read_report
from vlmdoctor.run import arms, switch
from vlmdoctor.run.arms import ARMS_ENV, MIN_ARMS_S, switch_patch, write_request
from vlmdoctor.run.config import RunConfig
from vlmdoctor.run.patient import build_patient
from vlmdoctor.run.runner import run_profile, train_step

TINY = RunConfig(
    model="tiny",
    device="cpu",
    steps=2,
    warmup=1,
    repeats=1,
    num_samples=64,
    autocast="off",
    batch_size=4,
    pad_to_multiple_of=64,
    lm_head_labeled_only=True,
)


# --- which knobs a run switches in its own process -------------------------------------------------------------


@pytest.mark.parametrize(
    ("arm", "patch"),
    [
        ({"batch_size": 2}, {"batch_size": 2}),
        (
            {"pad_to_multiple_of": 1, "sampler": "length_bucketed"},
            {"pad_to_multiple_of": 1, "sampler": "length_bucketed"},
        ),
        ({"lm_head_labeled_only": False}, {"lm_head_labeled_only": False}),
        ({"batch_size": 2, "warmup": 9}, {"batch_size": 2}),  # the measurement's knobs are not the training's
        ({"warmup": 9}, None),  # nothing of the training differs
        ({"weight_dtype": "bf16"}, None),  # the model would be built again
        ({"num_workers": 2, "pin_memory": True}, {"num_workers": 2, "pin_memory": True}),  # the loader's workers
        ({"batch_size": 2, "attention": "eager"}, None),  # one knob it cannot switch is enough to refuse
        ({"gradient_checkpointing": True}, None),
        ({"vision_no_grad": True}, {"vision_no_grad": True}),  # flags a step reads each time
        ({"fused_optimizer": True, "batch_size": 2}, {"fused_optimizer": True, "batch_size": 2}),
    ],
)
def test_an_arm_switches_loader_knobs_regional_compile_and_what_a_step_reads(arm, patch):
    assert switch_patch(TINY, TINY.replace(**arm)) == patch


def test_regional_compile_switches_off_a_whole_model_graph_does_not():
    regional = TINY.replace(compile="default", compile_regions=True)
    assert switch_patch(regional, TINY) == {"compile": "off"}
    assert switch_patch(TINY.replace(compile="default"), TINY) is None
    assert switch_patch(regional, TINY.replace(compile="default")) is None  # regions off, compile on: a new graph


@pytest.mark.parametrize(
    "other", [{"objective": "dpo", "lm_head_labeled_only": False}, {"grad_accum": 2}, {"packing": True}]
)
def test_runs_other_than_one_plain_loader_get_no_arms(other):
    run = TINY.replace(**other)
    assert switch_patch(run, run.replace(batch_size=2)) is None


def test_an_unreadable_request_asks_for_nothing(tmp_path, monkeypatch):
    bad = tmp_path / "arms.json"
    bad.write_text("{not json")
    monkeypatch.setenv(ARMS_ENV, str(bad))
    assert arms.read_request() is None
    monkeypatch.setenv(ARMS_ENV, str(write_request(tmp_path, {"without x": {"batch_size": 2}}, 12)))
    assert arms.read_request() == ({"without x": {"batch_size": 2}}, 12.0)


# --- a real run measures its arms -------------------------------------------------------------------------------


def test_a_run_measures_its_arms_in_pairs_after_its_own_numbers(tmp_path, monkeypatch):
    asked = {
        "without batch": {"batch_size": 2},
        "without pad": {"pad_to_multiple_of": 1},
        "without head": {"lm_head_labeled_only": False},
        "with workers": {"num_workers": 1, "pin_memory": True},  # an arm may add a change: a loader worker process
    }
    monkeypatch.setenv(ARMS_ENV, str(write_request(tmp_path, asked, 60)))
    monkeypatch.setattr(switch, "MAX_ROUNDS", 2)  # two rounds make pairs: the test suite's time
    report = run_profile(TINY)
    got = report["in_process"]
    assert report["status"] == "ok" and report["config"] == TINY.to_dict()  # the run's own config, as it ran
    assert got["rounds"] == 2 and len(got["final_tokens_per_s"]) == got["rounds"]
    for name, patch in asked.items():
        a = got["arms"][name]
        assert a["status"] == "ok" and a["patch"] == patch
        assert len(a["ratios"]) == len(a["tokens_per_s"]) == got["rounds"]
        # each pair: the round's window of the run's own config over the arm's window after it
        assert a["ratios"] == pytest.approx([f / t for f, t in zip(got["final_tokens_per_s"], a["tokens_per_s"])])
    doc = read_report(json.dumps(report).encode())  # the declared document holds it
    assert doc.in_process is not None and doc.in_process.arms["without batch"].patch == {"batch_size": 2}


def test_a_run_asked_for_no_arms_measures_none(monkeypatch):
    monkeypatch.delenv(ARMS_ENV, raising=False)
    assert "in_process" not in run_profile(TINY)


def test_an_arm_out_of_memory_ends_that_arm_and_leaves_the_run_as_it_was(monkeypatch):
    """An arm whose step runs out of memory is out of memory without the change; the other arms go on, and the
    patient's own loader is back where it was."""
    monkeypatch.setattr(switch, "MAX_ROUNDS", 2)
    p = build_patient(TINY, torch.device("cpu"))
    own = p.batches
    seen: list[bool] = []

    def step(pt):
        seen.append(pt.batches is own)
        # the first round: the run's window (1 + WINDOW_STEPS steps), then the first arm's untimed step fails
        if len(seen) == arms.WINDOW_STEPS + 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return train_step(pt)

    got = switch.measure(p, {"without batch": {"batch_size": 2}, "without pad": {"pad_to_multiple_of": 1}}, 60, step)
    assert got["arms"]["without batch"]["status"] == "oom" and got["arms"]["without batch"]["ratios"] == []
    assert got["arms"]["without pad"]["status"] == "ok" and len(got["arms"]["without pad"]["ratios"]) == got["rounds"]
    assert got["rounds"] == 2 and p.batches is own
    assert any(seen) and not all(seen)  # both the run's own batches and an arm's were stepped


def test_an_arm_flips_the_towers_no_grad_and_adamws_kernel_for_its_windows_only(monkeypatch):
    """Each window's steps ran with its own tower no_grad and AdamW implementation (the fused kernel in the fused
    arm's windows only), and after the arms the optimizer's groups and step counts are the run's again."""
    monkeypatch.setattr(switch, "MAX_ROUNDS", 2)
    p = build_patient(TINY, torch.device("cpu"))
    train_step(p)  # the optimizer holds its state, as after the run's own windows
    own = [(g["fused"], g["foreach"]) for g in p.optimizer.param_groups]
    fused_calls: list[int] = []
    real_fused = torch_adam._fused_adam

    def spy(*args, **kwargs):
        fused_calls.append(1)
        return real_fused(*args, **kwargs)

    monkeypatch.setattr(torch_adam, "_fused_adam", spy)
    seen: set[tuple[bool, bool]] = set()

    def step(pt):
        before = len(fused_calls)
        out = train_step(pt)
        seen.add((pt.vlm.vision_no_grad, len(fused_calls) > before))
        return out

    asked = {"with fused": {"fused_optimizer": True}, "with no_grad": {"vision_no_grad": True}}
    got = switch.measure(p, asked, 60, step)
    assert all(a["status"] == "ok" and len(a["ratios"]) == got["rounds"] == 2 for a in got["arms"].values())
    assert seen == {(False, False), (False, True), (True, False)}  # the run's, the fused arm's, the no_grad arm's
    assert p.vlm.vision_no_grad is False and [(g["fused"], g["foreach"]) for g in p.optimizer.param_groups] == own
    counts = [s["step"] for s in p.optimizer.state.values()]
    assert counts and all(c.device.type == "cpu" and c.dtype == torch.float32 for c in counts)
    assert all(c.item() == counts[0].item() > 1 for c in counts)  # one count, carried on through every arm's steps
    n = len(fused_calls)
    train_step(p)
    assert len(fused_calls) == n  # the run's own optimizer again: foreach


def test_an_arm_whose_loader_cannot_hold_a_batch_is_an_error_not_a_hang():
    p = build_patient(TINY, torch.device("cpu"))
    got = switch.measure(p, {"without batch": {"batch_size": 1000}}, 30, train_step)
    assert got["arms"]["without batch"]["status"] == "error"
    assert "fewer than one batch" in got["arms"]["without batch"]["error"]


# --- what `treat` makes of them ---------------------------------------------------------------------------------

BASE = RunConfig(model="tiny", device="cpu", steps=2, warmup=0, repeats=1, num_samples=64, autocast="off")


def speed(c: RunConfig) -> float:
    """The fake world: batch 8 pays 60%, regional compile 40%, bf16 weights 10%, padding to 64 nothing."""
    v = 1000.0 * (1.6 if c.batch_size >= 8 else 1.0) * (1.4 if c.compile != "off" else 1.0)
    return v * (1.1 if c.weight_dtype == "bf16" else 1.0)


def finding(fid: str, layer: int, patch: dict) -> dict:
    return {"id": fid, "layer": layer, "title": fid, "config_patch": patch}


class ArmsRunner:
    """Runs faked from `speed`, with 1% noise; a run asked for in-process arms measures them in three rounds (an arm
    without compile runs out of memory: the final config's fused loss needs it)."""

    def __init__(self, noise: float = 0.01, speed_of=speed, loader_finding: bool = False, more: list | None = None):
        self.rng, self.noise = np.random.default_rng(0), noise
        self.speed, self.loader_finding = speed_of, loader_finding
        self.more = more or []  # findings added to the start's
        self.asked: list[tuple[RunConfig, dict, float]] = []
        self.lock = threading.Lock()  # --trial-gpus: the lanes' runs call at once

    def noisy(self, v: float) -> float:
        return v * float(np.exp(self.rng.normal(0, self.noise)))

    def __call__(self, c, diagnose, timeout, device=None, in_process=None, in_process_s=0.0):
        with self.lock:
            return self._run(c, diagnose, in_process, in_process_s)

    def _run(self, c, diagnose, in_process, in_process_s):
        v = self.noisy(self.speed(c))
        findings = []
        if self.loader_finding and c.batch_size >= 8 and c.num_workers == 0:  # the loader's wait shows at batch 8
            findings = [finding("loader", 5, {"num_workers": 4, "pin_memory": True})]
        if c.batch_size < 8:
            findings = [
                finding("bf16", 1, {"weight_dtype": "bf16"}),
                finding("batch", 2, {"batch_size": 8}),
                finding("pad", 3, {"pad_to_multiple_of": 64}),
                finding("compile", 4, {"compile": "default", "compile_regions": True, "warmup": 10}),
                *self.more,
            ]
        rep = {
            "status": "ok",
            "config": c.to_dict(),
            "repeats": [{"real_tokens_per_s": v}],
            "metrics": {"real_tokens_per_s": v, "step_ms": 1e3 / v, "mfu": None},
            "findings": findings if diagnose else None,
            "superseded": [] if diagnose else None,
        }
        if in_process:
            self.asked.append((c, in_process, in_process_s))
            finals = [self.noisy(self.speed(c)) for _ in range(3)]
            got = {}
            for name, patch in in_process.items():
                if patch.get("compile") == "off":
                    got[name] = {"patch": patch, "status": "oom", "tokens_per_s": [], "ratios": []}
                    continue
                arm = [self.noisy(self.speed(c.replace(**patch))) for _ in range(3)]
                got[name] = {
                    "patch": patch,
                    "status": "ok",
                    "tokens_per_s": arm,
                    "ratios": [f / a for f, a in zip(finals, arm)],
                }
            rep["in_process"] = {"rounds": 3, "window_steps": 2, "final_tokens_per_s": finals, "arms": got}
        return rep


def test_treat_measures_each_change_in_one_process_and_runs_fresh_arms_only_for_the_rest():
    runner = ArmsRunner()
    result = treat(BASE, runner, TreatOptions(time_budget_s=None), validate=lambda c: None)
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    # the loader's batch and regional compile switch in one process; bf16 weights do not (the model is built again)
    (cfg, asked, seconds), *_ = runner.asked
    assert set(asked) == {"without batch", "without pad", "without compile"} and seconds > MIN_ARMS_S
    assert cfg.batch_size == 8 and cfg.compile_regions
    assert contrib["batch"]["how"] == IN_PROCESS and contrib["batch"]["outcome"] == "kept"
    assert contrib["batch"]["ratio"] == pytest.approx(1.6, rel=0.03) and contrib["batch"]["in_process"]
    assert contrib["compile"] == {
        "outcome": "kept",
        "how": IN_PROCESS,
        "why": "out of memory without it (in one process)",
        "in_process": True,
    }
    # padding measured nothing in one process: only a fresh-process arm may drop it, and one did
    ablated = [t["rule"] for t in result["trials"] if t["kind"] == "ablation"]
    assert sorted(ablated) == ["bf16", "pad"]
    assert contrib["pad"]["how"] == "leave-one-out ablation in the final config"
    assert contrib["bf16"]["ratio"] == pytest.approx(1.1, rel=0.03)
    # the composition's config was asked once its runs had measured its arms in two rounds: not again
    assert len(runner.asked) == 1


def six_switchable(c: RunConfig) -> float:
    """The fake world with three more changes that switch in one process, each worth 5%."""
    more = (c.num_workers >= 4) + c.lm_head_labeled_only + (c.sampler == "length_bucketed")
    return speed(c) * 1.05**more


MORE = [
    finding("loader", 5, {"num_workers": 4, "pin_memory": True}),
    finding("head", 4, {"lm_head_labeled_only": True}),
    finding("order", 3, {"sampler": "length_bucketed"}),
]


@pytest.mark.parametrize("gpus", [4, 1])
def test_runs_of_one_composition_on_several_gpus_measure_different_arms(monkeypatch, gpus):
    """Four H200s, llava-siglip2-0.5b: the three lanes' runs of the adopted composition each measured the same three
    arms (two out of memory at once), and the loader's workers and padding, which switch in one process too, were
    never measured. On --trial-gpus N the runs of one composition take its arms' groups of MAX_ARMS in turn; on one GPU
    a run measures the first MAX_ARMS, as before, and the rest go to the final ablation's fresh arms."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    runner = ArmsRunner(speed_of=six_switchable, more=MORE)
    cfg = replace(BASE, device="cuda")
    result = treat(cfg, runner, TreatOptions(time_budget_s=None, trial_gpus=gpus), validate=lambda c: None)
    switchable = {"without batch", "without pad", "without compile", "without loader", "without head", "without order"}
    asked = [set(a) for c, a, _ in runner.asked if c.batch_size == 8 and c.num_workers == 4]
    assert asked and all(len(a) <= arms.MAX_ARMS for a in asked)
    measured = {  # each arm the composition's runs measured: two pairs or more, or out of memory at once
        name
        for r in result["in_process"]
        for name, a in r["arms"].items()
        if len(a["ratios"]) >= 2 or a["status"] == "oom"
    }
    if gpus > 1:
        assert set().union(*asked) == switchable == measured and asked[0].isdisjoint(asked[1])
        assert {c["rule"]: c["contribution"]["how"] for c in result["ladder"][1]["changes"]}["head"] == IN_PROCESS
    else:
        assert len(asked) == 1 and len(asked[0]) == arms.MAX_ARMS and measured == asked[0]
    as_document(json.loads(json.dumps(result)), TreatResult, "treat.json")


def test_in_process_pairs_that_show_no_gain_never_drop_a_change_on_their_own():
    """With no time for a fresh-process arm, padding's in-process no-gain stays in the final config."""
    runner = ArmsRunner(noise=0.001)
    result = treat(BASE, runner, TreatOptions(time_budget_s=None, max_trials=2), validate=lambda c: None)
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    assert contrib["pad"]["how"] == IN_PROCESS_OPEN and contrib["pad"]["outcome"] == "no_gain"
    assert RunConfig.from_dict(result["final_config"]).pad_to_multiple_of == 64
    assert not result["ladder"][-1].get("dropped")


def test_no_arms_are_asked_where_the_run_limit_leaves_no_room_for_them():
    runner = ArmsRunner()
    treat(BASE, runner, TreatOptions(time_budget_s=None, trial_timeout_s=MIN_ARMS_S + 5), validate=lambda c: None)
    assert runner.asked == []
    runner = ArmsRunner()
    treat(BASE, runner, TreatOptions(time_budget_s=None, trial_timeout_s=600), validate=lambda c: None)
    assert [math.isclose(s, arms.ARMS_S) for _, _, s in runner.asked] == [True]


def test_a_target_read_through_facts_the_start_trace_partly_lacks_is_not_separable():
    """qwen2-vl-2b on one H200: the start trace held loss.head_rows_frac, the adopted one neither it nor
    cpu.lm_head.ms, so the labeled-rows head had no measured target; planned from the start trace, it gets an arm."""
    from vlmdoctor.doctor.treat_attribution import unseparable

    changes = [{"rule": "fusion-lm-head-unlabeled"}, {"rule": "system-data-loader"}, {"rule": "no-such-rule"}]
    start = {"facts": {"loss.head_rows_frac": 0.3, "data.loss_token_frac": 0.3, "idle.data_loader.ms": 40.0}}
    assert unseparable(start, changes) == {"fusion-lm-head-unlabeled", "no-such-rule"}
    every = {**start["facts"], "cpu.lm_head.ms": 2.0, "flops.lm_head_tflop_per_step": 1.0}
    assert unseparable({"facts": every}, changes) == {"no-such-rule"}
    both = [{"rule": "batching-gpu-underfed"}, {"rule": "batching-host-bound"}, {"rule": "system-data-loader"}]
    assert unseparable(start, both) >= {"batching-gpu-underfed", "batching-host-bound"}  # one target, read by both


def test_an_arm_short_of_pairs_goes_first_in_a_round(monkeypatch):
    """The time may end inside a round: the arm with the fewest pairs runs first (on one H200 the arm without the
    batch, slow in its first window, was passed over in round 2 while the compile arm ran). A window in which dynamo
    compiled a graph gives no pair."""
    order: list[str] = []

    def arm_window(p, a, own, step):
        order.append(a.name)
        return 50.0, a.name == "a" and order.count("a") == 1  # a's first window compiled a graph

    monkeypatch.setattr(switch, "_window", lambda p, batches, step: (100.0, False))
    monkeypatch.setattr(switch, "_arm_window", arm_window)
    monkeypatch.setattr(switch, "_batches", lambda p, patch: None)
    monkeypatch.setattr(switch, "_release", lambda p: None)

    class P:
        batches = None

    got = switch.measure(P(), {"b": {"batch_size": 2}, "a": {"batch_size": 3}}, 60, train_step)
    assert order[:4] == ["b", "a", "a", "b"]
    assert got["arms"]["a"]["recompiled"] == 1 and len(got["arms"]["a"]["ratios"]) == got["rounds"] - 1
    assert got["arms"]["b"]["ratios"] == [2.0] * got["rounds"]


def treat_on_a_clock(monkeypatch, runner: ArmsRunner, budget: float, **opts) -> dict:
    """A treatment whose runs take 40 s each, and the seconds of their in-process arms after."""
    clock = {"t": 0.0}
    monkeypatch.setattr(time, "time", lambda: clock["t"])

    def timed(c, d, timeout, device=None, in_process=None, in_process_s=0.0):
        clock["t"] += 40.0 + (in_process_s if in_process else 0.0)
        return runner(c, d, timeout, device, in_process, in_process_s)

    return treat(BASE, timed, TreatOptions(time_budget_s=budget, **opts), validate=lambda c: None)


def test_a_final_ablation_short_of_time_measures_the_switchable_changes_in_one_run(monkeypatch):
    """Two H200s, qwen2-vl-2b: 185 s were left for the final ablation, and two fresh arms at about 90 s a run gave
    one pair each. Where fresh pairs do not fit every change, the changes whose removal switches in one process
    (here padding and regional compile, which round 1's runs, asked for one arm, did not measure) are arms of one
    run of the final config first; the time after it goes to a fresh arm (bf16 weights). With time for fresh pairs
    the final config is not asked again (the test above)."""
    monkeypatch.setattr(treat_module, "MAX_ARMS", 1)
    runner = ArmsRunner()
    result = treat_on_a_clock(monkeypatch, runner, 420)
    assert [(cfg.batch_size, sorted(asked)) for cfg, asked, _ in runner.asked] == [
        (8, ["without batch"]),  # round 1's composition
        (8, ["without compile", "without pad"]),  # the final ablation's run
    ]
    contrib = {c["rule"]: c["contribution"] for c in result["ladder"][1]["changes"]}
    assert contrib["compile"]["how"] == IN_PROCESS and contrib["compile"]["why"].startswith("out of memory")
    assert contrib["pad"]["how"] == IN_PROCESS_OPEN and contrib["pad"]["pairs"] == 3  # only kept, never dropped
    assert contrib["batch"]["how"] == IN_PROCESS and contrib["batch"]["outcome"] == "kept"
    assert [t["rule"] for t in result["trials"] if t["kind"] == "ablation"] == ["bf16"]
    ablate = next(v for v in result["states"] if v["state"] == "ablate")
    assert ablate["runs"] == 2 and result["wall_s"] <= 420
    assert len(result["in_process"]) == 2  # round 1's run and the ablation's, both of the final config
    as_document(json.loads(json.dumps(result)), TreatResult, "treat.json")
    # a run limit that leaves fewer than two rounds of windows after a 40-s run: the final config is not asked again
    runner = ArmsRunner()
    treat_on_a_clock(monkeypatch, runner, 420, trial_timeout_s=40 + arms.ARMS_MARGIN_S + arms.TWO_ROUNDS_S - 1)
    assert [sorted(asked) for _, asked, _ in runner.asked] == [["without batch"]]


@pytest.mark.parametrize("workers_x", [1.15, 1.0])
def test_a_later_round_with_no_room_for_fresh_pairs_is_measured_in_one_run(monkeypatch, workers_x):
    """qwen2-vl-2b on one H200: the adopted config waited on the loader, and the round that would add workers (three
    fresh pairs) did not fit. Its composition switches in one process: one run of the adopted config measures it as
    an arm, and it is adopted only where its pairs show the gain."""

    def loader_speed(c: RunConfig) -> float:
        return speed(c) * (workers_x if c.num_workers >= 4 else 1.0)

    runner = ArmsRunner(speed_of=loader_speed, loader_finding=True)
    result = treat_on_a_clock(monkeypatch, runner, 350)
    assert [v["state"] for v in result["states"]][-4:] == ["compose", "one_process", "compose", "ablate"]
    (cfg, asked, _), *_ = runner.asked[1:]  # the adopted config's run, asked for the composition as an arm
    assert (cfg.batch_size, cfg.num_workers) == (8, 0) and asked == {
        "composition": {"num_workers": 4, "pin_memory": True}
    }
    rnd = result["rounds"][1]
    trial = result["trials"][rnd["compositions"][0] - 1]
    assert rnd["in_one_process"] and trial["in_process"] and trial["pairs"] == 3
    assert trial["ratio"] == pytest.approx(workers_x, rel=0.03)
    final = RunConfig.from_dict(result["final_config"])
    if workers_x > 1:
        assert trial["outcome"] == "kept" and rnd["adopted"] == "composition" and final.num_workers == 4
        rung = result["ladder"][-1]
        assert rung["in_process"] and rung["speedup"] == pytest.approx(result["ladder"][1]["speedup"] * trial["ratio"])
        assert rung["changes"][0]["contribution"]["how"] == IN_ONE_PROCESS
    else:  # three pairs about x1.0: not shown, not adopted (in one process a lean is not enough)
        assert trial["outcome"] not in ("kept", "likely_gain") and rnd["adopted"] is None and final.num_workers == 0
        assert len(result["ladder"]) == 2
    as_document(json.loads(json.dumps(result)), TreatResult, "treat.json")  # the declared document holds it
    if workers_x > 1:  # the reports say which rung and trial were measured in one process
        from rich.console import Console

        from vlmdoctor.report.console import render_ladder
        from vlmdoctor.report.html import treat_html

        console = Console(width=80, record=True)
        render_ladder(result, console)
        text = console.export_text()
        assert "#p: adopted on pairs of windows in one run" in text and "\n2p " in text
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "adopted on pairs of windows in one process" in treat_html(result)


def test_the_reports_say_which_pairs_were_measured_in_one_process():
    from rich.console import Console

    from vlmdoctor.report.console import render_ladder
    from vlmdoctor.report.html import treat_html

    result = treat(BASE, ArmsRunner(), TreatOptions(time_budget_s=None), validate=lambda c: None)
    console = Console(width=80, record=True)
    render_ladder(result, console)
    text = console.export_text()
    assert "p: pairs measured in one process" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    row = next(line for line in text.splitlines() if line.split()[1:2] == ["batch"])
    assert " 3p " in row  # batch: three pairs in one process
    page = treat_html(result)
    assert "3 pair(s) in one process" in page and "out of memory without it (in one process)" in page
