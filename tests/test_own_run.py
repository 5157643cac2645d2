"""The user's own training end to end, beyond one process: launchers and ranks (a real 2-process torchrun
on gloo), the overwrite rule of Doctor, the hint for a run shorter than its windows, tqdm-safe lines."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlmdoctor.errors import UsageError
from vlmdoctor.own.launchers import ENTRY, rank_command

ROOT = Path(__file__).resolve().parent.parent
DDP = ROOT / "examples" / "train_ddp.py"


# --- launchers: where each rank's script starts ---------------------------------------------------


def test_rank_command_puts_the_bootstrap_before_the_script(tmp_path):
    script = str(DDP)
    cases = {
        ("torchrun", "--standalone", "--nproc-per-node", "2", script, "--steps", "3"): (
            ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", ENTRY, script, "--steps", "3"]
        ),
        # an option's value that looks like a script is not taken for it; `=` forms pass through
        ("torchrun", "--nproc_per_node=2", "--rdzv-id", "train.py", script): (
            ["torchrun", "--nproc_per_node=2", "--rdzv-id", "train.py", "-m", ENTRY, script]
        ),
        ("python", "-m", "torch.distributed.run", "--nproc-per-node", "2", script): (
            ["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", ENTRY, script]
        ),
        ("torchrun", "--nproc-per-node", "2", "-m", "pkg.train", "--lr", "1"): (
            ["torchrun", "--nproc-per-node", "2", "-m", ENTRY, "-m", "pkg.train", "--lr", "1"]
        ),
        ("accelerate", "launch", "--num_processes", "2", script, "--x"): (
            ["accelerate", "launch", "--num_processes", "2", "-m", ENTRY, script, "--x"]
        ),
    }
    for given, want in cases.items():
        assert rank_command(list(given)) == want, given
    assert rank_command(["python", script]) is None  # one process: the plain bootstrap
    for bad, why in (
        (["torchrun", "--nproc-per-node", "2", str(tmp_path / "nope.py")], "no such script file"),
        (["torchrun", "--no-python", "--nproc-per-node", "2", "bash", "x.sh"], "not a Python script"),
        (["deepspeed", script], "does not follow yet"),
        (["mpirun", "-n", "2", "python", script], "does not follow yet"),
    ):
        with pytest.raises(UsageError, match=why):
            rank_command(bad)


def test_run_refuses_an_unreadable_launcher_line_before_writing(tmp_path, cli_runner):
    from vlmdoctor.cli import app

    r = cli_runner.invoke(app, ["run", "--out", str(tmp_path / "o"), "--", "torchrun", "--nproc-per-node"])
    assert r.exit_code == 2 and not (tmp_path / "o").exists()


# --- a real job of two ranks ----------------------------------------------------------------------


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "OMP_NUM_THREADS": "1"}


def _check_job(report: dict, out: Path, printed: str) -> None:
    """One report of the job: per-rank numbers, the job's over them, the rank folder analyzed across ranks."""
    d = report["distributed"]
    assert d["world_size"] == 2 and d["ranks_joined"] == 2 and not d["missing_ranks"]
    assert d["backend"] == "gloo" and report["config"]["world_size"] == 2
    ranks = d["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["status"] == "ok" for r in ranks)
    rep = report["repeats"][0]
    n = report["metrics"]["steps_per_repeat"]
    assert len(rep["step_ms"]) == n == ranks[0]["steps"] == ranks[1]["steps"]
    # the job's step is the slowest rank's; its tokens are both ranks'
    assert sum(rep["step_real_tokens"]) == ranks[0]["real_tokens"] + ranks[1]["real_tokens"]
    assert report["metrics"]["real_tokens_per_s"] == report["throughput"]["real_tokens_per_s"]
    assert report["metrics"]["real_tokens_per_s"] > max(r["real_tokens_per_s"] for r in ranks)
    tr = report["trace"]
    folder = Path(tr["dir"])
    assert sorted(p.name for p in folder.iterdir()) == [Path(p).name for p in tr["rank_paths"]]
    assert [Path(p).name.split("_rank")[1] for p in tr["rank_paths"]] == ["0.pt.trace.json.gz", "1.pt.trace.json.gz"]
    assert report["facts"]["dist.ranks"] == 2 and report["facts"]["dist.backend"] == "gloo"
    assert report["facts"]["dist.comm.all_reduce.count"] > 0  # DDP's gradient all-reduce, read from the traces
    assert not (out / "ranks").exists()  # the ranks' hand-over files are gone once joined
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".json", ".html")) == ["report.html", "report.json"]
    page = (out / "report.html").read_text()
    assert "Ranks: 2 processes (ddp, gloo)" in page and "Cross-rank" in page
    assert printed.count("vlmdoctor summary") == 1  # rank 0 alone prints
    assert "2 ranks: the job's numbers above" in " ".join(printed.split())
    # rank 0's progress line gives its own numbers as its own (the job's are the report's headline)
    assert "rank 0 alone " in " ".join(printed.split()) and "the job's numbers come with the report" in " ".join(
        printed.split()
    )


def test_vlmdoctor_run_follows_torchrun_two_ranks_one_report(tmp_path):
    """`vlmdoctor run -- torchrun ...` on a user's plain DDP script (gloo, 2 processes): every rank measured,
    rank 0 prints and writes one report of the job."""
    out = tmp_path / "doc"
    cmd = [sys.executable, "-m", "vlmdoctor", "run", "--out", str(out), "--warmup", "1", "--steps", "3"]
    cmd += ["--trace-steps", "1", "--stop-after-window", "--", sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node", "2", str(DDP), "--steps", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    _check_job(report, out, proc.stdout)
    assert report["config"]["source"] == "script" and report["config"]["parallel"] == "ddp"
    assert proc.stdout.count("vlmdoctor: stopped the script after the measured window") == 1
    assert "training done" not in proc.stdout  # every rank stopped after the window


@pytest.mark.slow
def test_doctor_on_every_rank_under_torchrun(tmp_path):
    """`vlmdoctor.Doctor` in the user's DDP loop, started by torchrun: the same one report."""
    out = tmp_path / "doc"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(DDP)]
    cmd += ["--steps", "12", "--api", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    _check_job(report, out, proc.stdout + proc.stderr)  # Doctor's progress lines go to stderr, its report to stdout
    assert report["config"]["source"] == "api"


@pytest.mark.slow
def test_vlmdoctor_run_follows_accelerate_launch(tmp_path):
    """accelerate launch (one CPU process here: its several-process CPU path needs MPI) through the same entry."""
    pytest.importorskip("accelerate")
    out = tmp_path / "doc"
    cmd = [sys.executable, "-m", "vlmdoctor", "run", "--out", str(out), "--warmup", "1", "--steps", "3"]
    cmd += ["--trace-steps", "1", "--stop-after-window", "--", sys.executable, "-m", "accelerate.commands.launch"]
    cmd += ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend"]
    cmd += ["no", str(ROOT / "examples" / "train_llava_loop.py"), "--steps", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["config"]["source"] == "script" and "diagnosis" in report


# --- Doctor follows the rule of `vlmdoctor run`: an earlier report stays unless force ------------


def _tiny_loop(doc, n: int) -> None:
    model = doc.rec.model if doc.rec.model is not None else torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        doc.step()


def test_doctor_refuses_an_existing_report_unless_force(tmp_path, capsys):
    import vlmdoctor

    (tmp_path / "report.json").write_text("{}")
    model = torch.nn.Linear(4, 1)
    with vlmdoctor.Doctor(model, out=tmp_path, warmup=0, steps=2, trace_steps=0) as doc:
        _tiny_loop(doc, 3)  # the training goes on, unmeasured
    err = capsys.readouterr().err
    assert " ".join(err.split()).count("report.json exists: this run is not measured (force=True replaces it") == 1
    assert (tmp_path / "report.json").read_text() == "{}" and doc.report is None
    assert not (tmp_path / "trace").exists()
    with vlmdoctor.Doctor(model, out=tmp_path, warmup=0, steps=2, trace_steps=0, force=True, quiet=True) as doc:
        _tiny_loop(doc, 3)
    assert json.loads((tmp_path / "report.json").read_text())["status"] == "ok"


def test_callback_refuses_an_existing_report_too(tmp_path):
    from vlmdoctor import DoctorCallback

    (tmp_path / "report.html").write_text("<p>mine</p>")
    cb = DoctorCallback(out=tmp_path, quiet=True)
    cb.on_train_begin(None, type("S", (), {"global_step": 0})(), None, model=torch.nn.Linear(2, 2))
    assert cb.doc is not None and cb.doc.refused and cb.report is None
    assert (tmp_path / "report.html").read_text() == "<p>mine</p>"


# --- a run shorter than its windows: which steps would fit -------------------------------------


def test_a_short_run_says_which_window_fits_and_that_window_does(tmp_path):
    """The hint's numbers, given back to Doctor on a run of the same length, give a diagnosed report."""
    import re

    import vlmdoctor

    ran = 12
    with vlmdoctor.Doctor(torch.nn.Linear(4, 1), out=tmp_path / "a", quiet=True) as doc:  # 5 + 20 + 4 asked
        _tiny_loop(doc, ran)
    hint = next(n for n in doc.report["notes"] if "to fit, use" in n)
    assert hint.startswith(f"the run had {ran} step(s), fewer than the windows need (5 warm-up + 20 timed")
    w, s, t = map(int, re.search(r"warmup=(\d+) steps=(\d+) trace_steps=(\d+)", hint).groups())
    with vlmdoctor.Doctor(torch.nn.Linear(4, 1), out=tmp_path / "b", warmup=w, steps=s, trace_steps=t, quiet=True) as d:
        _tiny_loop(d, ran)
    assert d.report["metrics"]["steps_per_repeat"] == s and d.report.get("trace", {}).get("path")
    assert not any("to fit" in n for n in d.report["notes"])


def test_the_hint_speaks_flags_for_vlmdoctor_run():
    from vlmdoctor.report.progress import fit_hint

    text = fit_hint(10, 5, 20, 2, flags=True, offset=1)  # the script made 11 optimizer steps
    assert text.startswith("the run had 11 step(s)") and "--warmup 2 --steps 4 --trace-steps 2" in text
    assert "train at least" in fit_hint(3, 5, 20, 2, flags=False)


# --- lines around a live tqdm bar -------------------------------------------------------------


def test_lines_go_around_a_live_tqdm_bar():
    from tqdm import tqdm

    from vlmdoctor.report.progress import live_bars, say

    buf = io.StringIO()
    assert not live_bars()
    with tqdm(total=10, file=buf, mininterval=0, ascii=True) as bar:
        bar.update(3)
        assert live_bars()
        say("timed window done", file=buf)
        bar.update(3)
    lines = buf.getvalue().replace("\r", "\n").splitlines()
    assert "vlmdoctor: timed window done" in lines  # on a line of its own, not glued to the bar
    assert lines.index("vlmdoctor: timed window done") < max(i for i, x in enumerate(lines) if "6/10" in x)
    plain = io.StringIO()
    with tqdm(total=2, file=plain, disable=True):
        assert not live_bars()  # a disabled bar is not drawn: lines are printed as they are


def test_metrics_go_with_the_next_log_when_no_trainer_is_at_hand():
    """Without the calling Trainer, on_log adds the metrics to the next log entry and its log_history row."""
    from vlmdoctor.own.callback import DoctorCallback, trainer_metrics

    report = {"metrics": {"real_tokens_per_s": 1234.5, "mfu": None, "step_ms": 80.0}, "findings": [{}, {}]}
    metrics = trainer_metrics(report)
    assert metrics == {"vlmdoctor/real_tokens_per_s": 1234.5, "vlmdoctor/step_ms": 80.0, "vlmdoctor/findings": 2.0}
    cb = DoctorCallback()
    cb.pending = metrics
    state = type("S", (), {"global_step": 9, "log_history": [{"loss": 6.2, "step": 9}]})()
    logs = {"loss": 6.2}
    cb.on_log(None, state, None, logs=logs)
    assert logs["vlmdoctor/real_tokens_per_s"] == 1234.5 and state.log_history[-1]["vlmdoctor/findings"] == 2.0
    assert cb.pending is None
