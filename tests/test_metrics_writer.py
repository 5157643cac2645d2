"""One metrics writer for every way in (run/metrics.py): the same timed steps give the same report numbers whether
vlmdoctor's runner or the user's loop (own/recorder.py) timed them, and a rate is computed nowhere else."""

from __future__ import annotations

import ast
import statistics
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from vlmdoctor.own import clock as own_clock
from vlmdoctor.own import rank_join, recorder
from vlmdoctor.own import report as own_report
from vlmdoctor.run import metrics, runner

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vlmdoctor"

#: one synthetic window: per optimizer step its wall ms, real / loss / padded tokens and loss
STEPS = [
    (31.0, 90, 40, 96, 2.50),
    (29.5, 70, 30, 96, 2.25),
    (44.0, 120, 64, 128, 2.00),
    (30.5, 96, 48, 96, 1.75),
    (33.0, 60, 20, 64, 1.50),
    (35.0, 110, 50, 128, 1.25),
]
#: the warm-up step before them (the user's loop times from the end of the step before)
WARMUP = (10.0, 8, 4, 8, 3.0)
FLOPS_PER_PADDED = 1e6  # whole numbers all the way, so both ways give the same floats
COUNTED_PADDED = 64
PEAK = 1e12


class Clock:
    """time.perf_counter / process_time that move only when a step says so: the same times on both ways in."""

    def __init__(self) -> None:
        self.t = 1000.0 + WARMUP[0] / 1e3

    def perf_counter(self) -> float:
        return self.t

    def process_time(self) -> float:
        return self.t / 2


def _runner_window(monkeypatch: pytest.MonkeyPatch) -> tuple[dict, metrics.Blocks]:
    """The steps through runner._window (train_step replaced by the steps' counts) and runner.summarize."""
    clock = Clock()
    monkeypatch.setattr(
        runner, "time", SimpleNamespace(perf_counter=clock.perf_counter, process_time=clock.process_time)
    )
    steps = iter(STEPS)

    def train_step(_p: object) -> tuple[torch.Tensor, dict]:
        ms, real, loss, padded, value = next(steps)
        clock.t += ms / 1e3
        return torch.tensor(value), {"real_tokens": real, "loss_tokens": loss, "padded_tokens": padded}

    monkeypatch.setattr(runner, "train_step", train_step)
    patient = SimpleNamespace(device=torch.device("cpu"), step_flops=lambda c: FLOPS_PER_PADDED * c["padded_tokens"])
    w = runner._window(patient, len(STEPS), PEAK, lambda *a: None, "timed")
    return w, runner.summarize([w], None, PEAK)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor, value: float):
        return SimpleNamespace(loss=self.emb(input_ids).sum() * 0 + value)


def _micro(real: int, loss: int, padded: int) -> dict[str, torch.Tensor]:
    """A one-row batch of `padded` positions, `real` of them tokens, `loss` of them labelled."""
    mask = torch.zeros(1, padded, dtype=torch.long)
    mask[0, :real] = 1
    labels = torch.full((1, padded), -100)
    labels[0, :loss] = 1
    return {"input_ids": torch.ones(1, padded, dtype=torch.long), "attention_mask": mask, "labels": labels}


def _split(n: int, k: int) -> list[int]:
    """n tokens over k micro-batches."""
    return [n // k + n % k] + [n // k] * (k - 1)


def _api_report(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, micro: int, nograd: int) -> dict:
    """The steps through the user's loop: the forward hooks count the tokens, `micro` micro-batches per optimizer
    step (tokens per optimizer step), `nograd` forwards under no_grad per step (not training: not counted)."""
    clock = Clock()
    fake = SimpleNamespace(perf_counter=clock.perf_counter, process_time=clock.process_time, strftime=lambda *a: "t")
    monkeypatch.setattr(own_clock, "time", fake)
    monkeypatch.setattr(own_report, "time", fake)
    monkeypatch.setattr(own_report, "peak_of", lambda env: (PEAK, "test", None))
    model = Tiny().train()
    rec = recorder.Recorder(model, tmp_path, warmup=1, steps=len(STEPS), trace_steps=0)
    rec.attach()
    clock.t = 1000.0
    for ms, real, loss, padded, value in [WARMUP, *STEPS]:
        clock.t += ms / 1e3
        for _ in range(nograd):
            with torch.no_grad():
                model(**_micro(real, loss, padded), value=0.0)
        parts = list(zip(_split(real, micro), _split(loss, micro)))
        for i, (r, lo) in enumerate(parts):
            out = model(**_micro(r, lo, padded // micro), value=value if i == micro - 1 else 0.0)
        rec.step(loss=out.loss)
    rec.traced.flops.total, rec.traced.flops_padded = FLOPS_PER_PADDED * COUNTED_PADDED, COUNTED_PADDED  # as traced
    return rec.finish()


@pytest.mark.parametrize("micro, nograd", [(1, 0), (2, 1)])
def test_runner_and_loop_write_the_same_numbers_for_the_same_steps(monkeypatch, tmp_path, micro, nograd):
    w, own = _runner_window(monkeypatch)
    report = _api_report(monkeypatch, tmp_path, micro, nograd)
    assert report["status"] == "ok"
    rep = report["repeats"][0]
    assert rep["step_real_tokens"] == [s[1] for s in STEPS]  # per optimizer step, the no-grad forwards apart
    assert rep["nograd_forwards_per_step"] == nograd and rep["forwards_per_step"] == micro
    assert rep["step_ms"] == w["step_ms"] and rep["step_flops"] == w["step_flops"]
    user = metrics.Blocks(report["metrics"], report["stats"], report["throughput"])
    for blocks in (own, user):
        blocks.metrics.pop("host_peak_rss_gb")
    # the same keys and numbers: metrics and throughput whole; stats but for the spread of FLOP rates, which the
    # user's loop does not have (its FLOPs are counted on the traced steps, metrics.SPREAD_USER)
    assert user.metrics == own.metrics
    assert user.throughput == own.throughput
    assert set(own.stats) - set(user.stats) == {"model_tflops_per_s", "mfu"}
    assert user.stats == {k: v for k, v in own.stats.items() if k in user.stats}
    for k in metrics.RATES + ("pad_fraction",):  # the window's own numbers, its `repeats` entry
        assert rep[k] == w[k], k
    # and they are the estimator's: the median of each step's tokens over its time
    m = own.metrics
    assert m["real_tokens_per_s"] == pytest.approx(statistics.median(r / (ms / 1e3) for ms, r, *_ in STEPS))
    assert m["loss_tokens_per_s"] == pytest.approx(statistics.median(lo / (ms / 1e3) for ms, _, lo, *_ in STEPS))
    flops = [FLOPS_PER_PADDED * p / (ms / 1e3) for ms, _, _, p, _ in STEPS]
    assert m["mfu"] == pytest.approx(statistics.median(flops) / PEAK)
    assert m["pad_fraction"] == pytest.approx(1 - sum(s[1] for s in STEPS) / sum(s[3] for s in STEPS))
    assert m["step_ms"] == pytest.approx(statistics.median(s[0] for s in STEPS))
    assert (m["final_loss"], m["loss_finite"], m["repeats"], m["steps_per_repeat"]) == (1.25, True, 1, len(STEPS))


def test_a_job_of_ranks_is_the_writer_over_its_steps(monkeypatch, tmp_path):
    """rank_join: per step the slowest rank's time and all ranks' tokens, through the one writer."""
    monkeypatch.setenv("VLMDOCTOR_JOB", "test-job")
    report = _api_report(monkeypatch, tmp_path, 1, 0)
    other = {k: (dict(v) if isinstance(v, dict) else v) for k, v in report.items()}
    rep1 = dict(report["repeats"][0])
    rep1["step_ms"] = [ms * (1.3 if i % 2 else 0.8) for i, ms in enumerate(rep1["step_ms"])]
    rep1["step_real_tokens"] = [t + 10 for t in rep1["step_real_tokens"]]
    other["repeats"] = [rep1]
    rank_join.write_part(other, tmp_path, 1)
    rep0 = dict(report["repeats"][0])  # join replaces rank 0's steps by the job's
    job = rank_join.join(report, tmp_path, 2, wait_s=5)
    assert job["distributed"]["ranks_joined"] == 2
    ms = [max(a, b) for a, b in zip(rep0["step_ms"], rep1["step_ms"])]
    real = [a + b for a, b in zip(rep0["step_real_tokens"], rep1["step_real_tokens"])]
    m = job["metrics"]
    assert m["real_tokens_per_s"] == pytest.approx(statistics.median(t / (x / 1e3) for t, x in zip(real, ms)))
    assert m["real_tokens_per_s"] == job["throughput"]["real_tokens_per_s"]  # one headline
    assert m["real_tokens_per_s"] == job["distributed"]["global"]["real_tokens_per_s"]
    assert m["mfu"] == job["throughput"]["mfu"] and m["mfu"] is not None  # over both ranks' peak
    assert m["step_ms"] == statistics.median(ms) and list(job["stats"]) == ["step_ms"]
    assert job["repeats"][0]["step_real_tokens"] == real


# --- a rate has one writer --------------------------------------------------------------------------------------

#: where a report's rates are computed: the one writer, and the estimator it runs
WRITERS = {"vlmdoctor/run/metrics.py", "vlmdoctor/run/throughput.py"}
#: treat results (TreatResult rungs and arms, not a report's `metrics`): the median over an arm's runs of their
#: reports' headlines
OTHER_DOCUMENTS = {
    "vlmdoctor/doctor/treat.py",
    "vlmdoctor/doctor/treat_trials.py",
    "vlmdoctor/doctor/treat_ablation.py",
}


def _copied(value: ast.expr, key: str) -> bool:
    """`x["key"]`, `x.get("key")`, `x.key` or None: a number taken from where it was written, not computed."""
    if isinstance(value, ast.Constant):
        return value.value is None
    if isinstance(value, ast.Subscript):
        return isinstance(value.slice, ast.Constant) and value.slice.value == key
    if isinstance(value, ast.Attribute):
        return value.attr == key
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "get":
        return bool(value.args) and isinstance(value.args[0], ast.Constant) and value.args[0].value == key
    return False


def computed(source: str, key: str) -> list[str]:
    """Where `key` is given a value that is not a copy: a dict literal's `"key": value`, a keyword `key=value`
    (dict(), .update()), an assignment `x["key"] = value`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        values: list[ast.expr] = []
        if isinstance(node, ast.Dict):
            values = [v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant) and k.value == key]
        elif isinstance(node, ast.Call):
            values = [kw.value for kw in node.keywords if kw.arg == key]
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            values = [
                node.value
                for t in targets
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == key
            ]
        found += [f"line {v.lineno}: {ast.unparse(v)}" for v in values if v is not None and not _copied(v, key)]
    return found


def test_the_checker_sees_a_second_writer():
    """What the one-writer test looks for: the second writers this module replaced, and not the copies."""
    seconds = [
        'w = {"real_tokens_per_s": throughput.rate(real_steps, step_ms)}',  # api's window, before
        'm.update(real_tokens_per_s=est["real_tokens_per_s"] if real and any(real) else None)',  # rank_join's
        'out["real_tokens_per_s"] = statistics.median(tps)',  # distributed.combine's
    ]
    for line in seconds:
        assert computed(line, "real_tokens_per_s"), line
    copies = [
        'row = {"real_tokens_per_s": m.get("real_tokens_per_s")}',
        "g.update(real_tokens_per_s=m.real_tokens_per_s)",
    ]
    for line in copies:
        assert not computed(line, "real_tokens_per_s"), line


@pytest.mark.parametrize("key", metrics.RATES)
def test_a_rate_is_computed_only_by_the_one_writer(key):
    """Every other module copies the writer's number (`"real_tokens_per_s":` with a value read from a field of the
    same name); none computes it another way."""
    seen, elsewhere = set(), {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found = computed(path.read_text(), key)
        if found:
            seen.add(rel)
        if found and rel not in WRITERS | OTHER_DOCUMENTS:
            elsewhere[rel] = found
    assert not elsewhere, f"{key} computed outside run/metrics.py: {elsewhere}"
    assert "vlmdoctor/run/throughput.py" in seen  # the scan reads the estimator's own assignment


@pytest.mark.parametrize(("per_window", "want"), [((3, 0, 2), 5), ((3, None, 2), None), ((), None)])
def test_the_allocators_retries_are_summed_over_the_timed_windows(per_window, want):
    """`alloc_retries`: each window's count of the caching allocator's retries (runner._window, on a GPU), summed by
    the one writer; a window without it (a CPU run) leaves it unknown, not zero."""
    windows = [{"step_ms": [30.0, 31.0], "step_real_tokens": [90, 70], "alloc_retries": r} for r in per_window]
    if not per_window:
        windows = [{"step_ms": [30.0, 31.0], "step_real_tokens": [90, 70]}]
    assert metrics.write(windows, peak=None, device_total_gb=None, spread_of=()).metrics["alloc_retries"] == want
