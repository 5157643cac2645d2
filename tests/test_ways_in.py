"""Three ways in, one report: vlmdoctor.Doctor in a loop, DoctorCallback in a Trainer, `vlmdoctor run -- script`.

Real tiny native VLMs (LLaVA: SigLIP + Qwen2; Qwen2-VL) trained on CPU; every trace is recorded by
torch.profiler in the test. Recorded runs are shared through module-scoped fixtures.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _browser import CHROMIUM, SKIP, check_in_browser
from _paste import blocks

from vlmdoctor.ci.gate import check_comparable, gate, validate_report
from vlmdoctor.cli import app
from vlmdoctor.doctor.advice import advise
from vlmdoctor.run import throughput
from vlmdoctor.run.config import RunConfig, knob_table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from train_llava_loop import batches, build_model  # noqa: E402
from train_qwen2vl_loop import batch as qwen2vl_example_batch  # noqa: E402
from train_qwen2vl_loop import build_model as build_qwen2vl  # noqa: E402

WINDOW = dict(warmup=1, steps=3, trace_steps=1)
PARTS = ("vision", "projector", "llm")


# --- tiny models and data ----------------------------------------------------------------------


def qwen2vl():
    torch.manual_seed(0)
    return build_qwen2vl()


def qwen2vl_batch(i: int, b: int = 2) -> dict[str, torch.Tensor]:
    """An 8x8-patch image (16 tokens after the 2x2 merge) and text of varying length, right-padded."""
    return qwen2vl_example_batch(i, b)


def freeze_tower(model) -> None:
    from vlmdoctor.run.parts import find_parts

    parts = find_parts(model)
    parts["vision"].requires_grad_(False)
    if "projector" in parts:  # Qwen2-VL's merger sits inside the tower and trains
        parts["projector"].requires_grad_(True)


def loop(model, data, doc, n: int, pass_batch: bool) -> list[float]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses = []
    for i in range(n):
        batch = data(i)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if doc is not None:
            doc.step(batch) if pass_batch else doc.step()
    return losses


def llava_data():
    it = batches(4)
    return lambda i: next(it)


# --- recorded runs (module scope: each trains once) -------------------------------------------


@pytest.fixture(scope="module")
def api_llava(tmp_path_factory):
    """Doctor in a loop, as a user runs it (not quiet): the report, its folder, and what was printed."""
    import vlmdoctor

    out = tmp_path_factory.mktemp("api_llava")
    model = build_model()
    freeze_tower(model)
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        with vlmdoctor.Doctor(model, out=out, **WINDOW) as doc:
            loop(model, llava_data(), doc, 8, pass_batch=True)
    return doc.report, out, printed.getvalue(), said.getvalue()


@pytest.fixture(scope="module")
def api_qwen2vl_hook(tmp_path_factory):
    """Qwen2-VL, the batch never passed: tokens come from the forward pre-hook."""
    import vlmdoctor

    out = tmp_path_factory.mktemp("api_qwen2vl")
    model = qwen2vl()
    freeze_tower(model)
    with vlmdoctor.Doctor(model, out=out, quiet=True, **WINDOW) as doc:
        loop(model, qwen2vl_batch, doc, 8, pass_batch=False)
    return doc.report, out


class _DS(torch.utils.data.Dataset):
    def __init__(self, make, n: int) -> None:
        self.items = [make(i) for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def _trainer_run(model, dataset, collate, out, quiet=True, **args):
    """A Trainer run with DoctorCallback; with quiet=False as a user sees it: tqdm's bar live, output kept.

    Returns the report, the Trainer's log_history, the logs a callback listed before DoctorCallback saw
    (where a `report_to` integration sits), and what was printed (stdout, stderr)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from vlmdoctor import DoctorCallback

    class Integration(TrainerCallback):  # stands for TensorBoard / wandb: called before user callbacks
        def __init__(self) -> None:
            self.seen: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.seen.append(dict(logs or {}))

    targs = TrainingArguments(
        output_dir=str(out / "hf"),
        max_steps=7,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=100,
        disable_tqdm=quiet,
        **args,
    )
    cb = DoctorCallback(out=out / "doctor", quiet=quiet, **WINDOW)
    integration = Integration()
    trainer = Trainer(
        model=model, args=targs, train_dataset=dataset, data_collator=collate, callbacks=[integration, cb]
    )
    printed, said = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(said):
        trainer.train()
    return cb.report, trainer.state.log_history, integration.seen, printed.getvalue(), said.getvalue()


def _pad_collate(items):
    n = max(len(x["input_ids"]) for x in items)

    def pad(t, v):
        return torch.cat([t, torch.full((n - len(t),), v, dtype=t.dtype)])

    return {
        "input_ids": torch.stack([pad(x["input_ids"], 0) for x in items]),
        "attention_mask": torch.stack([pad(x["attention_mask"], 0) for x in items]),
        "labels": torch.stack([pad(x["labels"], -100) for x in items]),
        "pixel_values": torch.stack([x["pixel_values"] for x in items]),
    }


@pytest.fixture(scope="module")
def trainer_llava(tmp_path_factory):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    out = tmp_path_factory.mktemp("trainer_llava")
    it = batches(1)
    ds = _DS(lambda i: {k: v[0] for k, v in next(it).items()}, 32)
    model = build_model()
    freeze_tower(model)
    report, history, seen, printed, said = _trainer_run(
        model,
        ds,
        _pad_collate,
        out,
        quiet=False,
        per_device_train_batch_size=4,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        gradient_accumulation_steps=1,
    )
    return report, out, printed, said, history, seen


@pytest.fixture(scope="module")
def trainer_qwen2vl(tmp_path_factory):
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")
    out = tmp_path_factory.mktemp("trainer_qwen2vl")
    ds = _DS(qwen2vl_batch, 16)  # each item already a batch of 2: the collator passes it through
    model = qwen2vl()
    freeze_tower(model)
    report = _trainer_run(
        model, ds, lambda items: items[0], out, per_device_train_batch_size=1, gradient_accumulation_steps=2
    )[0]
    return report, out


def _vlmdoctor(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vlmdoctor", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"},
    )


@pytest.fixture(scope="module")
def script_llava(tmp_path_factory):
    out = tmp_path_factory.mktemp("script") / "doctor"
    proc = _vlmdoctor(
        "run",
        "--out",
        str(out),
        "--warmup",
        "1",
        "--steps",
        "3",
        "--trace-steps",
        "1",
        "--stop-after-window",
        "--",
        "python",
        str(ROOT / "examples" / "train_llava_loop.py"),
        "--steps",
        "40",
    )
    return proc, out


@pytest.fixture(scope="module")
def script_qwen2vl(tmp_path_factory):
    out = tmp_path_factory.mktemp("script_qwen2vl") / "doctor"
    proc = _vlmdoctor(
        "run",
        "--out",
        str(out),
        "--warmup",
        "1",
        "--steps",
        "3",
        "--trace-steps",
        "1",
        "--stop-after-window",
        "--",
        "python",
        str(ROOT / "examples" / "train_qwen2vl_loop.py"),
        "--steps",
        "40",
    )
    return proc, out


# --- every way in gives the same kind of report ----------------------------------------------


def _check_report(report, source: str, model_class: str) -> None:
    validate_report(report, source)  # what gate and compare accept
    assert report["status"] == "ok"
    assert report["config"]["source"] == source
    assert report["config"]["model"] == model_class
    m = report["metrics"]
    assert m["real_tokens_per_s"] > 0 and m["loss_tokens_per_s"] > 0
    assert 0 < m["pad_fraction"] < 1  # the batches are right-padded to their longest row
    assert m["step_ms"] > 0 and m["step_ms_p10"] <= m["step_ms"] <= m["step_ms_p90"]
    rep = report["repeats"][0]
    assert len(rep["step_ms"]) == len(rep["step_real_tokens"]) == m["steps_per_repeat"] == 3
    assert Path(report["trace"]["path"]).is_file() and report["trace"]["path"].endswith(".json.gz")
    facts = report["facts"]
    assert "trace.error" not in facts, facts.get("trace.error")
    assert facts["trace.steps"] >= 1
    for part in PARTS:  # CPU op time attributed to each part, from the vlmdoctor::<part> ranges
        assert facts[f"cpu.part.{part}.forward_ms"] > 0, part
        assert facts[f"cpu.part.{part}.ms"] >= facts[f"cpu.part.{part}.forward_ms"]
    assert facts["cpu.part.llm.backward_ms"] > 0  # the LLM trains: its backward is attributed too
    assert "diagnosis" in report and isinstance(report["findings"], list)
    for f in report["findings"]:
        assert f["advice"]["lines"], f["id"]
    # FLOPs counted on a real step of the user's model; no peak for a CPU, and the report says so
    assert m["flops_per_step"] > 0 and report["flops"]["formula"] == "counted"
    assert m["mfu"] is None and m["mfu_reason"].startswith("no peak known for ")
    # the headline is the one estimator, with its spread and its stability verdict
    tp = report["throughput"]
    assert m["real_tokens_per_s"] == tp["real_tokens_per_s"]
    assert tp["real_tokens_per_s_p10"] <= m["real_tokens_per_s"] <= tp["real_tokens_per_s_p90"]
    assert isinstance(tp["stable"], bool) and (tp["stable"] or tp["unstable_reason"])
    # the split of one window (the traced one), shares summing to one with an explicit rest
    split = report["split"]
    assert split["window"] == "traced" and split["step_ms"] == facts["step.ms"]
    assert sum(r["share"] for r in split["rows"]) == pytest.approx(1.0)
    assert [r["part"] for r in split["rows"]][-1] == "other"


def test_api_loop_llava(api_llava):
    report, out = api_llava[:2]
    _check_report(report, "api", "LlavaForConditionalGeneration")
    assert json.loads((out / "report.json").read_text())["metrics"] == report["metrics"]
    assert report["data"]["tokens_from"] == "batch"
    assert report["config"]["stage"] == 2 and report["config"]["stage_source"] == "estimated"
    assert report["config"]["batch_size"] == 4


def test_api_qwen2vl_tokens_from_the_forward_hook(api_qwen2vl_hook):
    report, _ = api_qwen2vl_hook
    _check_report(report, "api", "Qwen2VLForConditionalGeneration")
    assert report["data"]["tokens_from"] == "forward hook"
    assert report["model"]["parts"] == {
        "projector": "PatchMerger",
        "vision": "Qwen2VisionTransformerPretrainedModel",
        "llm": "Qwen2VLTextModel",
    }
    # the merger runs inside the tower: its range nests in the vision range, and its time is counted once
    import gzip

    events = json.load(gzip.open(report["trace"]["path"], "rt"))["traceEvents"]
    spans = {
        p: [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == f"vlmdoctor::{p}" and "dur" in e]
        for p in ("vision", "projector")
    }
    assert spans["projector"] and all(
        any(vs <= ps and pe <= ve for vs, ve in spans["vision"]) for ps, pe in spans["projector"]
    )
    vision_range_ms = sum(e - s for s, e in spans["vision"]) / 1e3 / report["facts"]["trace.steps"]
    f = report["facts"]
    own = f["cpu.part.vision.forward_ms"] + f["cpu.part.projector.forward_ms"]
    assert own == pytest.approx(vision_range_ms, rel=1e-6)


def test_hook_counts_match_the_batch():
    """Tokens read by the hook equal those of the batch passed by hand (same data, same model)."""
    from vlmdoctor.own.recorder import Recorder
    from vlmdoctor.own.tokens import count_tokens

    model = build_model()
    rec = Recorder(model, warmup=0, steps=1)
    rec.attach()
    batch = next(batches(3))
    model(**batch)
    c = rec.tokens.pending[0]
    direct = count_tokens(batch)
    assert int(c["real"]) == int(direct["real"]) == int(batch["attention_mask"].sum())
    assert int(c["loss"]) == int((batch["labels"] != -100).sum())
    assert c["padded"] == batch["input_ids"].numel()
    no_mask = count_tokens({"input_ids": batch["input_ids"]}, pad_id=0)  # no mask: pad id decides
    assert int(no_mask["real"]) == int(direct["real"])


def test_trainer_callback_llava(trainer_llava):
    report, out = trainer_llava[:2]
    _check_report(report, "trainer", "LlavaForConditionalGeneration")
    cfg = report["config"]
    assert cfg["batch_size"] == 4 and cfg["sampler"] == "random" and cfg["num_workers"] == 0
    assert (out / "doctor" / "report.json").is_file()
    for f in report["findings"]:
        assert f["advice"]["audience"] == "trainer"
    padding = [f for f in report["findings"] if f["config_patch"].get("sampler") == "length_bucketed"]
    if padding:
        assert any("group_by_length" in x for x in padding[0]["advice"]["lines"])


def test_trainer_callback_qwen2vl_grad_accum(trainer_qwen2vl):
    report, _ = trainer_qwen2vl
    _check_report(report, "trainer", "Qwen2VLForConditionalGeneration")
    assert report["config"]["grad_accum"] == 2
    assert report["repeats"][0]["forwards_per_step"] == 2  # both micro-batches counted in one step


def test_script_run_llava(script_llava):
    proc, out = script_llava
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    _check_report(report, "script", "LlavaForConditionalGeneration")
    log = (out / "script.log").read_text()
    assert "step 0 loss" in log and "step 0 loss" in proc.stdout  # passed through and kept
    assert "training done" not in log  # --stop-after-window stopped it
    assert "prescriptions" in proc.stdout or "no prescriptions" in proc.stdout
    ours = proc.stdout[proc.stdout.index("vlmdoctor: LlavaForConditionalGeneration") :]  # after the script's output
    assert max(len(line) for line in ours.splitlines() if str(out) not in line) <= 80  # long paths aside


def test_script_run_qwen2vl(script_qwen2vl):
    proc, out = script_qwen2vl
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    _check_report(report, "script", "Qwen2VLForConditionalGeneration")
    assert "step 0 loss" in (out / "script.log").read_text()


# --- what the user sees: progress lines, the end summary, the Trainer's logs, the HTML page ----------


def _way(request, way: str):
    """(report, folder, stdout, stderr) of one way in, as a user ran it."""
    if way == "api":
        return request.getfixturevalue("api_llava")[:4]
    if way == "trainer":
        report, out, printed, said = request.getfixturevalue("trainer_llava")[:4]
        return report, out / "doctor", printed, said
    proc, out = request.getfixturevalue("script_llava")
    return json.loads((out / "report.json").read_text()), out, proc.stdout, proc.stderr


@pytest.mark.parametrize("way", ["api", "trainer", "script"])
def test_progress_lines_and_the_end_summary(way, request):
    """One line at each window boundary, in order; the report; then the summary, last, whose numbers are the
    report's (the one estimator with its spread), its top finding the biggest expected win, and its paths real."""
    from vlmdoctor.report.html_sections import by_gain

    report, out, printed, said = _way(request, way)
    flat = " ".join((said + printed).split())  # wrapped to 80 columns; the script's output is all on stdout
    offset = 1 if way == "script" else 0  # `vlmdoctor run`: the first optimizer step only finds the model
    marks = [
        f"vlmdoctor: measuring LlavaForConditionalGeneration: warm-up step {1 + offset}, timed steps {2 + offset}-",
        f"vlmdoctor: warm-up done at step {1 + offset}; timed window: steps {2 + offset}-{4 + offset}",
        f"vlmdoctor: timed window done (steps {2 + offset}-{4 + offset}):",
        f"traced window: steps {5 + offset}-{7 + offset} (torch.profiler",
        f"vlmdoctor: traced window done at step {7 + offset}:",
        "vlmdoctor: report written",
    ]
    at = [flat.index(m) for m in marks]
    assert at == sorted(at)
    for line in said.replace("\r", "\n").splitlines():  # each line whole, never glued to tqdm's bar
        assert "vlmdoctor:" not in line or line.startswith("vlmdoctor:"), line
    # the summary comes last, after the report was printed
    assert printed.count("vlmdoctor summary") == 1
    assert printed.index("prescriptions") < printed.index("vlmdoctor summary")
    tail = " ".join(printed[printed.index("vlmdoctor summary") :].split())
    tp = report["throughput"]
    est = throughput.headline(report)
    assert f"real tokens/s {est:,.0f} (p10-p90 {tp['real_tokens_per_s_p10']:,.0f}-" in tail
    assert f"ms/step {report['metrics']['step_ms']:,.1f}" in tail
    assert "split of the traced step (CPU op time): vision" in tail
    if report["findings"]:
        top = by_gain(report["findings"])[0]
        first = next(x for x in top["advice"]["lines"] if not x.startswith(("import ", "from ")))
        assert f"1. {top['title']}" in tail and " ".join(first.split()) in tail
    for label, path in (("report:", out / "report.json"), ("HTML:", out / "report.html")):
        assert f"{label} {path}" in tail and path.is_file()
    assert f"trace: {report['trace']['path']}" in tail and Path(report["trace"]["path"]).is_file()
    assert "https://ui.perfetto.dev" in tail
    assert printed.rstrip().endswith("nothing is uploaded)")  # the last thing on the screen


def test_the_trainer_logs_hold_the_metrics(trainer_llava):
    """log_history, and a callback listed before DoctorCallback (where report_to integrations sit), see them."""
    report, _, printed, _, history, seen = trainer_llava
    entries = [e for e in history if "vlmdoctor/real_tokens_per_s" in e]
    assert len(entries) == 1
    m = report["metrics"]
    e = entries[0]
    assert e["vlmdoctor/real_tokens_per_s"] == m["real_tokens_per_s"] and e["vlmdoctor/step_ms"] == m["step_ms"]
    assert e["vlmdoctor/findings"] == len(report["findings"]) and e["step"] == 1 + 3 + 2 + 1
    assert "vlmdoctor/mfu" not in e and m["mfu"] is None  # no peak for a CPU: left out, not logged as None
    assert all(isinstance(v, float) for k, v in e.items() if k.startswith("vlmdoctor/"))
    assert any(s.get("vlmdoctor/real_tokens_per_s") == m["real_tokens_per_s"] for s in seen)
    assert "'vlmdoctor/real_tokens_per_s'" in printed  # the Trainer's own log line shows them too


def test_the_html_page_speaks_of_the_users_run(api_llava, trainer_llava):
    """The user's model, parts and split; the fixes in their terms; the top one on the first screen; CPU facts
    instead of empty GPU sections; nothing of vlmdoctor's zoo."""
    import html as html_lib

    for report, folder, audience in (
        (api_llava[0], api_llava[1], "loop"),
        (trainer_llava[0], trainer_llava[1] / "doctor", "trainer"),
    ):
        page = (folder / "report.html").read_text()
        assert page.startswith("<!DOCTYPE html>") and "<script" not in page.lower()
        title = page[page.index("<h1>") : page.index("</h1>")]
        assert (
            "LlavaForConditionalGeneration" in title
            and ("your loop" if audience == "loop" else "your Trainer") in title
        )
        for zoo in ("vlmdoctor profile", "image tokens", "knobs changed from the default", "partial analysis"):
            assert zoo not in page, zoo
        for part, cls in report["model"]["parts"].items():
            assert f"<code>{cls}</code>" in page and f"{part} {cls}" in page
        assert 'aria-label="split of the step"' in page
        for row in report["split"]["rows"]:
            assert f"{row['part']}: {row['ms']:,.1f} ms" in page
        assert "Where the CPU time went" in page and "Matmuls by dtype" in page and "dtype casts" in page
        assert "GPU time by kernel class" not in page and "GPU busy and idle" not in page
        first = page.index("<h2>")
        top = by_gain_top(report)
        assert page.index('<div class="top">') < first and html_lib.escape(top["advice"]["lines"][0]) in page[:first]
        for f in report["findings"]:
            assert html_lib.escape("\n".join(f["advice"]["lines"])) in page
        want = "in your Trainer script:" if audience == "trainer" else "in your loop:"
        assert want in page


def by_gain_top(report):
    from vlmdoctor.report.html_sections import by_gain

    return by_gain(report["findings"])[0]


@pytest.mark.skipif(CHROMIUM is None, reason=SKIP)
def test_the_own_page_renders_in_headless_chromium(trainer_llava, tmp_path):
    page = (trainer_llava[1] / "doctor" / "report.html").read_text()
    check_in_browser(page, tmp_path, "own-trainer")


# --- gate, compare, export and HTML read these reports -------------------------------------


def test_gate_and_compare_two_reports_of_the_same_script(api_llava, script_llava, tmp_path, cli_runner):
    report_a, out_a = api_llava[:2]
    _, out_b = script_llava
    b = json.loads((out_b / "report.json").read_text())
    notes = check_comparable(report_a, b, allow_env_change=False)
    assert any("source" in n for n in notes)
    verdict = gate(report_a, b)
    assert {c["name"] for c in verdict["checks"]} == {"throughput", "memory", "findings"}
    a, b_path = str(out_a / "report.json"), str(out_b / "report.json")
    r = cli_runner.invoke(app, ["gate", "--baseline", a, "--current", b_path, "--max-regression", "0.99"])
    assert r.exit_code == 0, r.output
    r = cli_runner.invoke(app, ["gate", "--baseline", a, "--current", b_path])  # judged: pass or fail, not refused
    assert r.exit_code in (0, 1) and "throughput" in r.output, r.output
    r = cli_runner.invoke(app, ["compare", str(out_a / "report.json"), str(out_b / "report.json")])
    assert r.exit_code == 0, r.output
    r = cli_runner.invoke(app, ["gate", "--baseline", str(out_a / "report.json")])  # cannot re-run the user's loop
    assert r.exit_code == 2 and "--current" in r.output


def test_gate_refuses_different_models(api_llava, api_qwen2vl_hook):
    import vlmdoctor.errors as errors

    with pytest.raises(errors.UsageError, match="different things"):
        check_comparable(api_llava[0], api_qwen2vl_hook[0])


def test_export_and_html_read_a_user_report(api_llava, tmp_path, cli_runner):
    from vlmdoctor.report.html import profile_html

    report, out = api_llava[:2]
    r = cli_runner.invoke(app, ["export", str(out / "report.json"), "--chrome", str(tmp_path / "t.json.gz")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "t.json.gz").stat().st_size > 0
    page = profile_html(report)
    assert "LlavaForConditionalGeneration" in page


# --- the user's training comes first ------------------------------------------------------


def test_internal_errors_do_not_stop_the_loop(tmp_path, monkeypatch, capsys):
    import vlmdoctor
    from vlmdoctor.own.recorder import Recorder

    def broken(*_a, **_k):
        raise KeyError("vlmdoctor bug")

    monkeypatch.setattr(Recorder, "_step", broken)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with vlmdoctor.Doctor(model, out=tmp_path, quiet=True, warmup=0, steps=2) as doc:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            doc.step()
    assert "measurement switched off, training goes on" in capsys.readouterr().err
    assert doc.report["status"] == "error"  # nothing was measured, and the report says so


def test_user_exceptions_pass_through_unchanged(tmp_path):
    import vlmdoctor

    class Mine(Exception):
        pass

    with pytest.raises(Mine, match="from the user"):
        with vlmdoctor.Doctor(torch.nn.Linear(2, 2), out=tmp_path, quiet=True):
            raise Mine("from the user")


def test_loop_shorter_than_the_window(tmp_path):
    import vlmdoctor

    model = build_model()
    with vlmdoctor.Doctor(model, out=tmp_path, quiet=True, warmup=5, steps=20) as doc:
        loop(model, llava_data(), doc, 3, pass_batch=True)
    r = doc.report
    assert r["status"] == "ok" and r["metrics"]["steps_per_repeat"] == 2  # steps 2..3, the first left out
    assert any("fewer than" in n for n in r["notes"]) and "trace" not in r


# --- `vlmdoctor run`: bad input -------------------------------------------------------------

PLAIN = """
import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range({steps}):
    ids = torch.randint(1, 50, (4, 8))
    model(ids.float()).sum().backward()
    opt.step(); opt.zero_grad()
    print("step", i, flush=True)
{tail}
"""


def _script(tmp_path: Path, steps: int, tail: str = "") -> Path:
    p = tmp_path / "train.py"
    p.write_text(textwrap.dedent(PLAIN.format(steps=steps, tail=tail)))
    return p


def test_run_missing_script(tmp_path, cli_runner):
    r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--", "python", str(tmp_path / "nope.py")])
    assert r.exit_code == 2 and "no such script file" in r.output
    r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--", str(tmp_path / "nope.py")])
    assert r.exit_code == 2
    for cmd in (["torchrun", "--nproc-per-node", "2", "train.py"], ["python", "-c", "print(1)"], []):
        r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--", *cmd])
        assert r.exit_code == 2, (cmd, r.output)
    assert not (tmp_path / "o").exists()  # refused before anything was written


@pytest.mark.parametrize("case", ["fails", pytest.param("exits_3", marks=pytest.mark.slow), "no_step", "short"])
def test_run_bad_scripts(case, tmp_path, cli_runner):
    # "fails" fails after the windows were measured (1 + 2 timed + 2 + 1 traced, after the first step)
    steps, tail = {
        "fails": (8, "raise RuntimeError('boom in the user script')"),
        "exits_3": (3, "sys.exit(3)"),
        "no_step": (0, "print('no training here')"),
        "short": (4, ""),
    }[case]
    window = ["1", "2", "1"] if case == "fails" else ["5", "20", "2"]
    script = _script(tmp_path, steps, tail)
    out = tmp_path / "doc"
    r = cli_runner.invoke(
        app,
        [
            "run",
            "--out",
            str(out),
            "--warmup",
            window[0],
            "--steps",
            window[1],
            "--trace-steps",
            window[2],
            "--",
            "python",
            str(script),
        ],
    )
    proc = subprocess.CompletedProcess([], r.exit_code, r.stdout, r.stderr)
    log = (out / "script.log").read_text()
    if case in ("fails", "exits_3"):
        assert proc.returncode == 1
        assert "failed (exit code" in proc.stderr and "script.log" in proc.stderr
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "error" and report["error"]["exit_code"] == (1 if case == "fails" else 3)
        assert "step 2" in log and ("boom in the user script" in log if case == "fails" else True)
        if case == "fails":  # what was measured before the failure is kept, and diagnosed
            assert report["metrics"]["steps_per_repeat"] == 2 and "facts" in report and "diagnosis" in report
    elif case == "no_step":
        assert proc.returncode == 1 and "never called an optimizer step" in proc.stderr
        assert "no training here" in log
    else:  # 4 optimizer steps: steps 2..4 measured, said so; no tokens in a plain MLP's input, said so
        assert proc.returncode == 0, proc.stderr
        report = json.loads((out / "report.json").read_text())
        assert report["status"] == "ok" and report["metrics"]["steps_per_repeat"] == 2
        assert any("fewer than" in n for n in report["notes"])
        assert any("no tokens seen" in n for n in report["notes"])
        assert "fewer than" in proc.stdout


def test_run_refuses_to_overwrite_a_report(tmp_path, cli_runner):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "report.json").write_text("{}")
    script = _script(tmp_path, 1)
    r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--", "python", str(script)])
    assert r.exit_code == 2 and "--force" in r.output
    assert (tmp_path / "o" / "report.json").read_text() == "{}"


# --- advice: a patch in the user's terms --------------------------------------------------


def test_advice_trainer_and_loop():
    t = advise(
        {
            "weight_dtype": "bf16",
            "gradient_checkpointing": False,
            "sampler": "length_bucketed",
            "fused_optimizer": True,
            "num_workers": 4,
            "pin_memory": True,
            "compile": "default",
            "batch_size": 16,
        },
        "trainer",
    )
    for line in (
        "from_pretrained(..., dtype=torch.bfloat16)",
        "checkpointing=False",  # gradient_ or (transformers 5) activation_checkpointing
        "group_by_length",
        'optim="adamw_torch_fused"',
        "dataloader_num_workers=4",
        "dataloader_pin_memory=True",
        "torch_compile=True",
        "per_device_train_batch_size=16",
    ):
        assert any(line in x for x in t), line
    lp = advise(
        {
            "weight_dtype": "bf16",
            "gradient_checkpointing": False,
            "fused_optimizer": True,
            "num_workers": 4,
            "vision_no_grad": True,
        },
        "loop",
    )
    for line in (
        "model.to(torch.bfloat16)",
        "_checkpointing_disable()",
        "fused=True",
        "num_workers=4",
        "torch.no_grad()",
    ):
        assert any(line in x for x in lp), line
    liger = advise({"liger_rms_norm": True, "liger_swiglu": True}, "trainer")
    assert "use_liger_kernel=True" in liger
    assert any("liger_kernel_config=" in x and "'rms_norm': True" in x for x in liger)
    lines = advise({"liger_rms_norm": True}, "loop", {"llm": "Qwen2Model"})
    assert "apply_liger_kernel_to_qwen2(" in lines and "    rms_norm=True," in lines


@pytest.mark.parametrize("audience", ["trainer", "loop"])
def test_advice_covers_every_knob_and_every_rule(audience):
    """No knob (and no shipped rule's patch) leaves the user without a line to write, or crashes."""
    from vlmdoctor.doctor.rules import load_rules

    own = {"warmup", "steps", "repeats"}
    sample = RunConfig().to_dict()
    for row in knob_table():
        if row["layer"] == 0:
            continue
        for value in {sample[row["name"]], *(row.get("choices") or ())}:
            lines = advise({row["name"]: value}, audience, {"llm": "Qwen2Model"})
            assert lines and all(isinstance(x, str) and x for x in lines), row["name"]
            assert max(map(len, lines)) <= 74, lines  # printed whole, indented, in 80 columns
            for block in blocks(lines):  # Python to paste: code, or a comment for what is not code
                ast.parse(textwrap.dedent(block))
    rules, _ = load_rules()
    for rule in rules:
        patch = {k: v for k, v in rule.patch.items() if not (isinstance(v, str) and v.startswith("="))}
        patch = patch or {k: 8 for k in rule.patch}
        if set(patch) - own:
            assert advise(patch, audience), rule.id


def test_regional_compile_is_said_as_block_compiles():
    """compile + compile_regions (the compile rules' patch): each block compiled in place, no whole-model line."""
    for audience in ("loop", "trainer"):
        lines = advise({"compile": "max-autotune", "compile_regions": True, "liger_rope": False}, audience)
        assert "    block.compile(mode='max-autotune')" in lines
        assert not [x for x in lines if "torch.compile(model" in x or x == "torch_compile=True"]
    assert "torch_compile=False  # the blocks are compiled already" in advise(
        {"compile": "default", "compile_regions": True}, "trainer"
    )
    assert advise({"compile": "default"}, "loop") == ["model = torch.compile(model)"]


def test_guess_sampler_reads_the_lengths_inside_batches():
    from vlmdoctor.own.tokens import guess_sampler

    lengths = [(i * 37) % 200 + 20 for i in range(64)]  # a spread of lengths, in no order
    random_batches = [lengths[i : i + 8] for i in range(0, 64, 8)]
    s = sorted(lengths)
    bucketed = [s[i : i + 8] for i in range(0, 64, 8)]
    assert guess_sampler(random_batches) == "random"
    assert guess_sampler(bucketed) == "length_bucketed"
    assert guess_sampler([[10, 10], [10, 10], [10, 10], [10, 10]]) is None  # one length: nothing to say
    assert guess_sampler([[5, 9]]) is None  # too little data


def test_run_json_to_stdout(tmp_path, cli_runner):
    script = _script(tmp_path, 6)
    r = cli_runner.invoke(
        app,
        [
            "run",
            "--out",
            str(tmp_path / "o"),
            "--warmup",
            "1",
            "--steps",
            "2",
            "--trace-steps",
            "1",
            "--json",
            "-",
            "--html",
            str(tmp_path / "r.html"),
            "--",
            "python",
            str(script),
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)  # stdout is the report alone; the script's output went to stderr
    assert report["config"]["source"] == "script" and "step 0" in r.stderr
    assert "<html" in (tmp_path / "r.html").read_text().lower()


def test_run_reports_at_the_window_end_and_the_script_goes_on(tmp_path, cli_runner):
    script = _script(tmp_path, 10, "print('script finished', flush=True)")
    out = tmp_path / "o"
    r = cli_runner.invoke(
        app,
        [
            "run",
            "--out",
            str(out),
            "--warmup",
            "1",
            "--steps",
            "2",
            "--trace-steps",
            "1",
            "--",
            "python",
            str(script),
        ],
    )
    assert r.exit_code == 0, r.output
    text = r.stdout
    # 1 + 2 timed + 2 + 1 traced steps after the first optimizer step: the report comes at step 6 of 0..9
    before = text[: text.index("\nstep 7\n")]  # the script's own line (vlmdoctor's lines say "at step 7")
    assert "the script goes on, unmeasured" in " ".join(before.split())  # lines are wrapped to 80 columns
    assert text.index("\nstep 7\n") < text.index("script finished")
    report = json.loads((out / "report.json").read_text())
    assert report["script"]["exit_code"] == 0 and report["diagnosed_while_running"]
    assert text.count("vlmdoctor: Sequential (script)") == 1  # the report is printed once, not again at the end
