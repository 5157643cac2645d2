"""One throughput estimator, its stability test and warm-up check, FLOPs of a user's model, the split of a step.

The estimator (run/throughput.py) is what every way in writes and every reader prints; these tests
check it on hand-made step lists (what the estimator does with one slow step is arithmetic), on a
real user-style loop under `vlmdoctor.Doctor` on the CPU, and through compare, gate and the HTML.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import pytest
import torch

from vlmdoctor.run import throughput
from vlmdoctor.trace.split import GPU_BASIS, step_split

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _steady(n: int = 20) -> tuple[list[float], list[int]]:
    """Step times within 3% of 100 ms, 4,000-4,400 tokens per step in proportion to them."""
    ms = [100.0 * (1 + 0.03 * ((i * 7) % 5 - 2) / 2) for i in range(n)]
    tok = [int(4000 + 100 * ((i * 3) % 5)) for i in range(n)]
    return [m * t / 4200 for m, t in zip(ms, tok)], tok


def test_the_estimator_is_the_median_of_the_per_step_rates():
    ms, tok = _steady()
    per_step = [t / (m / 1e3) for t, m in zip(tok, ms)]
    assert throughput.rate(tok, ms) == pytest.approx(statistics.median(per_step))
    # one 10x step: the window's tokens over its time drop by a third, the estimator by at most one rank
    slow = list(ms)
    slow[7] *= 10
    window = sum(tok) / (sum(slow) / 1e3)
    est = throughput.rate(tok, slow)
    assert window < 0.7 * throughput.rate(tok, ms)
    assert sorted(per_step)[len(per_step) // 2 - 1] <= est <= max(per_step)


def test_an_unstable_window_is_flagged_and_a_steady_one_is_not():
    ms, tok = _steady()
    steady = throughput.window_stats(ms, tok)
    assert steady["stable"] is True and steady["unstable_reason"] is None and steady["outliers"] == []
    assert steady["settled"] is True
    slow = list(ms)
    slow[7] *= 10  # one step ten times the others (a neighbour's burst)
    w = throughput.window_stats(slow, tok)
    assert w["stable"] is False
    assert [o["step"] for o in w["outliers"]] == [8] and w["outliers"][0]["x_median"] > 9
    assert "1 of 20 steps" in w["unstable_reason"] and "quieter machine" in w["advice"]
    # a wide spread without any single outlier is unstable too
    wide = [100.0 * (1 + 0.9 * (i % 2)) for i in range(20)]
    assert throughput.window_stats(wide, [4000] * 20)["stable"] is False
    # too few steps cannot show a spread
    assert throughput.window_stats(ms[:3], tok[:3])["stable"] is False


def test_batches_of_different_lengths_are_not_noise():
    """Steps that take longer because they hold more tokens are steady: the test is per token."""
    tok = [2000 if i % 2 else 6000 for i in range(20)]
    ms = [t / 40.0 for t in tok]  # 50 ms and 150 ms steps, the same rate
    w = throughput.window_stats(ms, tok)
    assert w["stable"] is True and w["real_tokens_per_s"] == pytest.approx(40_000)
    assert throughput.window_stats(ms)["stable"] is False  # without the tokens they would look unstable


def test_a_window_still_warming_up_is_said():
    tok = [4000] * 18
    falling = [300.0 - 10 * i if i < 12 else 180.0 for i in range(18)]
    w = throughput.window_stats(falling, tok)
    assert w["settled"] is False and "raise the warm-up" in w["settle_note"]
    assert throughput.window_stats(*_steady())["settled"] is True
    assert throughput.unsettled([3.0, 1.5, 1.0]) and not throughput.unsettled([5.0, 1.0, 1.1, 1.0])


# --- a user's own loop, on the CPU ----------------------------------------------------------------

V, D, B, L = 512, 64, 4, 32


class TinyLM(torch.nn.Module):
    """A user's own model: not one vlmdoctor knows, called with input_ids / attention_mask / labels."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.head = torch.nn.Linear(D, V, bias=False)
        self.config = type("Cfg", (), {"pad_token_id": 0})()

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return type("Out", (), {"loss": loss})()


@pytest.fixture(scope="module")
def user_report(tmp_path_factory):
    import vlmdoctor

    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = tmp_path_factory.mktemp("tiny_lm")
    with vlmdoctor.Doctor(model, out=out, quiet=True, warmup=1, steps=6, trace_steps=1) as doc:
        for _ in range(12):
            ids = torch.randint(1, V, (B, L))
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
            doc.step(batch)
    return doc.report


@pytest.mark.parametrize("stray", [False, True], ids=["plain", "no-grad-forward"])
def test_tokens_are_counted_per_optimizer_step_not_per_forward(stray, tmp_path):
    """A no-grad forward added to every step (a stray evaluation) is not training: the tokens per step stay
    those of the training forward (the gate then sees the slowdown), and the extra forward is named."""
    import vlmdoctor

    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vlmdoctor.Doctor(model, out=tmp_path, quiet=True, warmup=1, steps=4, trace_steps=0) as doc:
        for _ in range(6):
            ids = torch.randint(1, V, (B, L))
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            if stray:
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
            doc.step()  # tokens from the forward hook
    window = doc.report["repeats"][0]
    assert window["step_real_tokens"] == [B * L] * 4 and window["forwards_per_step"] == 1
    assert window["nograd_forwards_per_step"] == (1 if stray else 0)
    assert any("under no_grad" in n for n in doc.report["notes"]) == stray


def test_a_user_model_has_flops_per_step_and_an_honest_null_mfu_on_cpu(user_report):
    r = user_report
    assert r["status"] == "ok"
    # the LM head's matmul: forward, input gradient, weight gradient (the embedding is a lookup, no FLOPs)
    assert r["metrics"]["flops_per_step"] == pytest.approx(3 * 2 * B * L * D * V)
    assert r["flops"]["formula"] == "counted" and r["flops"]["counted_step_flops"] == pytest.approx(6 * B * L * D * V)
    assert r["metrics"]["mfu"] is None
    assert r["metrics"]["mfu_reason"].startswith("no peak known for ")
    assert r["metrics"]["model_tflops_per_s"] > 0


def test_the_user_report_headline_is_the_estimator(user_report, tmp_path):
    from rich.console import Console

    from vlmdoctor.ci.gate import check_throughput
    from vlmdoctor.report.compare import compare
    from vlmdoctor.report.console import render_own
    from vlmdoctor.report.html import profile_html

    r = user_report
    rep = r["repeats"][0]
    est = throughput.rate(rep["step_real_tokens"], rep["step_ms"])
    assert r["metrics"]["real_tokens_per_s"] == est == r["throughput"]["real_tokens_per_s"]
    assert throughput.headline(r) == est
    other = copy.deepcopy(r)
    rows = {row["key"]: row for row in compare(r, other)["metrics"]}
    assert rows["real_tokens_per_s"]["a"] == rows["real_tokens_per_s"]["b"] == est
    g = check_throughput(r, other)
    assert g["base_median"] == pytest.approx(est) and g["cur_median"] == pytest.approx(est)
    assert f"{est:,.0f} -> {est:,.0f} real tokens/s" in g["detail"]
    page = profile_html(r)
    assert f"<td>{est:,.0f}</td>" in page.replace('<td class="num">', "<td>")
    console = Console(record=True, width=80)
    render_own(r, console)
    assert f"{est:,.0f} (p10-p90" in console.export_text()


def test_an_old_report_is_read_by_the_estimator():
    """A report written before the estimator (window tokens over window time): readers recompute it."""
    ms, tok = _steady()
    ms[3] *= 10
    old = {
        "metrics": {"real_tokens_per_s": sum(tok) / (sum(ms) / 1e3)},
        "repeats": [{"step_ms": ms, "step_real_tokens": tok}],
    }
    assert throughput.headline(old) == throughput.rate(tok, ms) > old["metrics"]["real_tokens_per_s"]


# --- the split of the traced step -------------------------------------------------------------------


def test_split_shares_sum_to_one_with_an_other_row():
    cpu = {"step.ms": 200.0, "cpu.part.vision.ms": 40.0, "cpu.part.llm.ms": 100.0, "cpu.loss.ms": 5.0}
    s = step_split(cpu | {"cpu.optimizer.ms": 15.0})
    assert s["window"] == "traced" and s["basis"] == "CPU op time" and s["step_ms"] == 200.0
    shares = {r["part"]: r["share"] for r in s["rows"]}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["other"] == pytest.approx(40 / 200) and shares["llm"] == pytest.approx(0.5)
    over = step_split({"step.ms": 100.0, "cpu.part.vision.ms": 80.0, "cpu.part.llm.ms": 70.0})
    assert sum(r["share"] for r in over["rows"]) == pytest.approx(1.0) and "more than" in over["note"]
    assert step_split({"step.ms": 100.0}) is None  # no part named: no split


def test_split_of_a_recorded_gpu_trace_and_the_gain_uses_the_same_step():
    """A trace recorded on one H100 80GB (fixtures/traces/bf16_s2): GPU kernel time by part."""
    from vlmdoctor.doctor.rules import diagnose, load_rules
    from vlmdoctor.trace.facts import analyze

    facts = analyze(FIXTURES / "traces" / "bf16_s2.pt.trace.json.gz")["files"][0]["facts"]
    s = step_split(facts)
    assert s["basis"] == GPU_BASIS and s["step_ms"] == facts["step.ms"]
    assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0)
    rows = {r["part"]: r["ms"] for r in s["rows"]}
    assert set(rows) >= {"vision", "projector", "llm", "other kernels", "communication", "GPU idle"}
    # idle is a part of its own, not hidden in a rest labelled kernel time
    assert rows["GPU idle"] == pytest.approx(facts["gpu.idle_ms"]) and "other" not in rows
    rules, problems = load_rules()
    findings = diagnose(facts, rules, problems)["findings"]
    gains = [f["expected_gain"] for f in findings if f["expected_gain"]["share_of_step"]]
    assert gains, "this trace has a finding with a time saving"
    for g in gains:  # the saving and the step it is a share of come from the same (traced) window
        assert g["window"] == "traced" and g["step_ms"] == facts["step.ms"]
        assert g["share_of_step"] == pytest.approx(g["saves_ms_per_step"] / g["step_ms"])


def test_a_recorded_profile_report_prints_the_estimator_everywhere():
    """A profile report recorded on one H100 80GB: console, compare and HTML print the same tokens/s."""
    import json

    from rich.console import Console

    from vlmdoctor.report.compare import compare
    from vlmdoctor.report.console import render
    from vlmdoctor.report.html import profile_html

    r = json.loads((FIXTURES / "traces" / "treated_s2.report.json").read_text())
    ms, tok = throughput.report_steps(r)
    est = throughput.rate(tok, ms)
    assert throughput.headline(r) == est
    rows = {row["key"]: row for row in compare(r, copy.deepcopy(r))["metrics"]}
    assert rows["real_tokens_per_s"]["a"] == est
    assert f"{est:,.0f}" in profile_html(r)
    console = Console(record=True, width=120)
    render(r, console)
    assert f"{est:,.0f}" in console.export_text()


def _recorded(model, steps: int, no_grad_forward: bool = False):
    """`steps` training steps of `model` under torch.profiler (record_shapes), and the profiler, stopped."""
    from torch.profiler import profile

    with profile(record_shapes=True) as prof:
        for _ in range(steps):
            ids = torch.randint(1, V, (B, L))
            model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
            if no_grad_forward:  # a stray evaluation forward inside the step: counted as executed
                with torch.no_grad():
                    model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    return prof


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flops_are_counted_from_the_recorded_ops_of_eager_and_compiled_models(compiled):
    """Forward (2*B*L*D*V) and backward (twice that: the head's input and weight gradients) per step, from the
    recorded shapes after the window; a compiled model's graphs run the same aten matmuls (aot_eager)."""
    from vlmdoctor.run.flopcount import StepFlops

    model = torch.compile(TinyLM(), backend="aot_eager") if compiled else TinyLM()
    _recorded(model, 1)  # the warm-up: a compilation traces the ops too, and the window comes after it
    counter = StepFlops()
    counter.count(_recorded(model, 2), steps=2)
    assert counter.total == pytest.approx(6 * B * L * D * V)


def test_a_no_grad_forward_in_the_step_is_counted_not_fatal():
    """torch's FlopCounterMode raised on a no-grad forward inside the counted step (and so ended the user's
    training); the recorded ops count it as the executed forward it is."""
    from vlmdoctor.run.flopcount import StepFlops

    counter = StepFlops()
    counter.count(_recorded(TinyLM(), 1, no_grad_forward=True), steps=1)
    assert counter.total == pytest.approx(8 * B * L * D * V)


def test_attention_flops_hold_grouped_query_shapes():
    """Fewer key/value heads than query heads (torch's own formula refused them): 2*B*Hq*Sq*Sk*(D+Dv)."""
    from vlmdoctor.run.flopcount import Op, count

    q, kv = [2, 8, 16, 32], [2, 2, 16, 32]
    fwd = Op("aten::scaled_dot_product_attention", [q, kv, kv, [], []], [], 0.0, 10.0, 1)
    inner = Op("aten::_scaled_dot_product_flash_attention_for_cpu", [q, kv, kv], [], 1.0, 9.0, 1)
    bwd = Op("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [q, q, kv, kv], [], 20.0, 30.0, 2)
    total, n, unknown = count([fwd, inner, bwd])
    assert (n, unknown) == (2, 0)  # the backend op inside the outer op is the same work
    assert total == 3 * 2.0 * 2 * 8 * 16 * 16 * (32 + 32)
