"""The memory wall: what holds the peak, the saver that buys the batch, and the one FusedCE trade.

On real H100 traces with allocations recorded (fixtures/mem_h100/): llava-siglip2-0.5b stage 2 with
plain cross entropy at batch 40 (65.4 of 79.2 GiB, the logits the largest holder) and with FusedCE at
batch 16 (11.6 GiB).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import yaml

from vlmdoctor.doctor.rules import RULES_DIR, diagnose, load_rules
from vlmdoctor.trace.facts import analyze, merge_measured
from vlmdoctor.trace.families.memory_live import HOLDER_FACTS, live_at_peak

MEM = Path(__file__).resolve().parents[1] / "fixtures" / "mem_h100"
RULES, _ = load_rules()
WALL, SPARE = "wall_plain_ce_b40", "spare_fce_b16"


@cache
def facts(name: str) -> dict:
    f = analyze(MEM / f"{name}.pt.trace.json.gz")["files"][0]["facts"]
    return merge_measured(f, json.loads((MEM / f"{name}.report.json").read_text()))


def findings(f: dict) -> dict[str, dict]:
    d = diagnose(f, RULES)
    return {x["id"]: x for x in d["findings"] + d["superseded"]}


def test_the_live_blocks_at_the_peak_add_up_to_the_peak_and_name_the_logits():
    f = facts(WALL)
    held = sum(f[name] for name in HOLDER_FACTS.values())
    assert held == pytest.approx(f["memory.live.peak_gb"]) == pytest.approx(f["memory.peak_allocated_gb"])
    assert f["memory.live.largest"] == "the LM head's logits and the loss"
    assert 38 < f["memory.live.logits_gb"] < 41 and 0.55 < f["memory.live.logits_frac"] < 0.65
    assert 3 < f["memory.live.persistent_gb"] < 5  # bf16 weights, grads and AdamW state of ~0.9B parameters
    spare = facts(SPARE)
    assert spare["memory.live.logits_gb"] < 0.1 and spare["memory.live.largest"] == "the LLM's activations"


def test_replaying_the_events_keeps_what_is_alive_at_the_largest_total():
    # (ts, tid, addr, bytes, total): a block freed before the peak is not alive at it; one allocated after is not
    ev = [(0, 0, 1, 10.0, 110.0), (1, 0, 2, 30.0, 140.0), (2, 0, 1, -10.0, 130.0), (3, 0, 3, 5.0, 135.0)]
    ev += [(4, 0, 4, 20.0, 155.0), (5, 0, 99, -50.0, 105.0), (6, 0, 5, 60.0, 150.0)]
    peak, rows = live_at_peak(ev)
    assert peak == 155.0 and rows == [1, 3, 4]  # addr 2, 3, 4; addr 99 was allocated before the window
    assert live_at_peak([]) == (0.0, [])


def test_at_the_wall_the_logits_are_named_and_fusedce_buys_the_batch():
    found = findings(facts(WALL))
    f = found["batching-memory-wall-logits"]
    assert f["config_patch"]["liger_fused_linear_cross_entropy"] is True
    # 0.9 x 79.2 GiB less 3.8 persistent, over (65.4 - 3.8 - 0.97 x 39.2) / 40 GiB a sample: batch 114; on the
    # H100 batch 112 ran with FusedCE and 144 ran out of memory (docs/benchmarks.md)
    assert 100 <= f["config_patch"]["batch_size"] <= 120
    text = " ".join(f["evidence"])
    assert "logits" in text and "GiB" in text and "batch 40" in text
    assert f["expected_gain"]["throughput_x"] > 1.1
    assert "fusion-fusedce-stage2" not in found


def test_with_memory_to_spare_fusedce_off_is_prescribed_and_the_wall_rule_is_silent():
    found = findings(facts(SPARE))
    assert "fusion-fusedce-stage2" in found and "batching-memory-wall-logits" not in found


@pytest.mark.parametrize("peak_gb", [12.0, 30.0, 45.0, 55.0, 62.0, 70.0])
@pytest.mark.parametrize("logits_gb", [1.0, 10.0, 30.0])
def test_the_fusedce_trade_is_decided_once_by_memory(peak_gb, logits_gb):
    """Across peaks and logits sizes: with FusedCE on, fusedce-stage2 fires exactly where the logits it avoids
    would still leave room (the wall rule would not fire on the plain-CE config); never both ways at once."""
    spare = dict(facts(SPARE))
    wall = dict(facts(WALL))
    rules = {r.id: r for r in RULES}
    bpe = rules["fusion-fusedce-stage2"].constants["LOGIT_BYTES"]["value"]
    elements = logits_gb * 2**30 / bpe
    on = {**spare, "memory.live.peak_gb": peak_gb, "loss.fce_logits_elements": elements}
    # the same run with FusedCE off: its logits live at the peak
    off = {
        **wall,
        "memory.live.peak_gb": peak_gb + logits_gb,
        "memory.live.logits_gb": logits_gb,
        "memory.live.logits_frac": logits_gb / (peak_gb + logits_gb),
        "memory.live.persistent_gb": spare["memory.live.persistent_gb"],
    }
    turn_off = "fusion-fusedce-stage2" in findings(on)
    at_wall = "batching-memory-wall-logits" in findings(off)
    big_logits = (
        off["memory.live.logits_frac"] > rules["batching-memory-wall-logits"].constants["MIN_LOGITS_FRAC"]["value"]
    )
    if big_logits:
        assert turn_off != at_wall, (peak_gb, logits_gb)
    else:
        assert not at_wall


def test_both_sides_of_the_trade_read_the_same_memory_model():
    def constants(rid: str) -> dict:
        return yaml.safe_load((RULES_DIR / f"{rid}.yaml").read_text())["constants"]

    wall, off = constants("batching-memory-wall-logits"), constants("fusion-fusedce-stage2")
    for k in ("HEADROOM", "MIN_GROWTH"):
        assert wall[k]["value"] == off[k]["value"], k


def test_an_out_of_memory_batch_bounds_the_memory_a_sample_takes_from_below():
    """The readings of qwen2-vl-2b's composition on an H200 (2026-11-28, 139.8 GiB): batches 11 and 22 read 1.41
    GiB a sample and promise batch 81, which ran out of memory. The card filled between 22 and 81 means at least
    (139.8 - 41.7) / 59 = 1.66 GiB a sample: batch 72 (one GPU measured batch 73 at 124.4 GiB, 89%), where the
    middle of 22 and 81 (51) peaked at 82.9 GiB, 59%. A second out-of-memory batch falls back to the middle."""
    from vlmdoctor.doctor.treat_batch import MemoryModel
    from vlmdoctor.run.config import RunConfig

    m, cfg = MemoryModel(), RunConfig()
    for b, peak in ((11, 26.15), (22, 41.68)):
        m.observe(
            cfg.replace(batch_size=b), {"status": "ok", "metrics": {"peak_mem_gb": peak, "device_mem_total_gb": 139.8}}
        )
    assert m.ceiling(cfg.replace(batch_size=22))[0] == 81
    for _ in range(4):  # one batch on four GPUs at once is one out-of-memory batch
        m.observe(cfg.replace(batch_size=81), {"status": "oom"})
    target, how = m.ceiling(cfg.replace(batch_size=22))
    assert target == 72 and "at least 1.66 GiB a sample above batch 22" in how
    m.observe(cfg.replace(batch_size=72), {"status": "oom"})
    assert m.ceiling(cfg.replace(batch_size=22))[0] == (22 + 72) // 2


def _read(m, cfg, b: int, peak: float, rate: float | None = None) -> None:
    rep = {"status": "ok", "metrics": {"peak_mem_gb": peak, "device_mem_total_gb": 139.8}}
    if rate is not None:
        rep["metrics"]["real_tokens_per_s"] = rate
        rep["repeats"] = [{"real_tokens_per_s": rate}]
    m.observe(cfg.replace(batch_size=b), rep)


@pytest.mark.parametrize("order", [(11, 52, 80), (80, 52, 11)])
def test_a_batch_at_the_wall_that_runs_slower_counts_as_out_of_memory(order):
    """qwen2-vl-2b's composition on two H200s (2026-11-28, 139.8 GiB): batch 52 peaked at 91.7 GiB and ran 34,933
    real tokens/s; batch 80 peaked at 135.5 (97%) and ran 11,255, its steps 3.6x as long. Batch 80 is at the wall:
    out of memory for the model (whatever order the runs came in), and the ceiling is the line below it, 73 (one GPU
    of that host measured 73 at 124.4 GiB, 34,898 tokens/s)."""
    from vlmdoctor.doctor.treat_batch import MemoryModel
    from vlmdoctor.run.config import RunConfig

    m, cfg = MemoryModel(), RunConfig()
    readings = {11: (26.15, None), 52: (91.73, 34_933.0), 80: (135.46, 11_255.0)}
    for b in order:
        _read(m, cfg, b, *readings[b])
    assert m.at_wall(cfg.replace(batch_size=80)) and not m.at_wall(cfg.replace(batch_size=52))
    assert m.oom[next(iter(m.points))] == 80
    target, how = m.ceiling(cfg.replace(batch_size=52))
    assert target == 73 and "batch 80 at the memory wall" in how


def test_the_wall_says_the_allocators_retries_where_the_run_counted_them():
    """A run's `alloc_retries` (the caching allocator's retries in its timed steps) goes with the wall's words: the
    slowdown's likely cause, measured where the run report has it."""
    from vlmdoctor.doctor.treat_batch import MemoryModel
    from vlmdoctor.run.config import RunConfig

    m, cfg = MemoryModel(), RunConfig()
    _read(m, cfg, 52, 91.73, 34_933.0)
    m.observe(
        cfg.replace(batch_size=80),
        {
            "status": "ok",
            "repeats": [{"real_tokens_per_s": 11_255.0}],
            "metrics": {
                "peak_mem_gb": 135.46,
                "device_mem_total_gb": 139.8,
                "alloc_retries": 30,
                "real_tokens_per_s": 11_255.0,
            },
        },
    )
    assert "30 allocator retries in its timed steps" in m.ceiling(cfg.replace(batch_size=52))[1]


def test_a_batch_near_the_wall_that_runs_faster_and_a_slower_one_below_it_are_not_at_the_wall():
    """Batch 80 at 135.5 GiB ran 34,068 tokens/s on another two-H200 host (2026-11-27): faster than batch 52, so it
    is kept. A larger batch that runs slower below PROBE_HEADROOM of the card is the saturation check's, not the
    wall's (runs side by side differ by a few percent)."""
    from vlmdoctor.doctor.treat_batch import MemoryModel
    from vlmdoctor.run.config import RunConfig

    m, cfg = MemoryModel(), RunConfig()
    _read(m, cfg, 52, 91.73, 33_000.0)
    _read(m, cfg, 80, 135.46, 34_068.0)
    assert not m.at_wall(cfg.replace(batch_size=80)) and not m.oom
    m2 = MemoryModel()
    _read(m2, cfg, 22, 41.8, 30_000.0)
    _read(m2, cfg, 52, 91.73, 20_000.0)
    assert not m2.at_wall(cfg.replace(batch_size=52)) and not m2.oom
