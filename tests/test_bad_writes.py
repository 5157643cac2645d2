"""One writer for every output: an output that names one of the command's inputs is refused even with
--force (however the path is spelled, hard links too); torch's traces reach their final name only
complete; a trace that cannot be written never costs the measurement; `vlmdoctor run`'s script.log goes
through the writer; the rescue of a failed write tries the temp folder; Ctrl-C in `sweep` keeps the
finished rows.
"""

from __future__ import annotations

import csv
import errno
import gzip
import io
import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from _badinput import FAST, REPORT, TRACE, assert_one_line, invoke, no_temp_files, snapshot

import vlmdoctor.files as files
from vlmdoctor.errors import UsageError

SCRIPT = "import torch\nprint('never run')\n"


def _inputs(d: Path) -> None:
    """Every kind of input a command reads, in the current folder."""
    shutil.copy(TRACE, d / "t.pt.trace.json.gz")
    shutil.copy(REPORT, d / "a.json")
    shutil.copy(REPORT, d / "b.json")
    (d / "ranks").mkdir()
    shutil.copy(TRACE, d / "ranks" / "rank0.pt.trace.json.gz")
    (d / "c.yaml").write_text("model: tiny\ndevice: cpu\nsteps: 1\nwarmup: 0\n")
    (d / "grid.yaml").write_text("defaults: {model: tiny, device: cpu}\nruns: [{name: one}]\n")
    (d / "rules").mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "rules" / "precision-fp32-gemms.yaml", d / "rules" / "mine.yaml")
    (d / "kept.json").write_text(
        json.dumps({**json.loads(REPORT.read_text()), "trace": {"path": "t.pt.trace.json.gz"}})
    )
    (d / "train.py").write_text(SCRIPT)
    (d / "sub").mkdir()
    (d / "train.jsonl").write_text("{}\n")
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_text("{}\n")


#: (id, the input the output names, args with {out} for the output's spelling of it)
PAIRS = [
    ("analyze --json", "t.pt.trace.json.gz", ["analyze", "t.pt.trace.json.gz", "--json", "{out}"]),
    ("analyze --html", "t.pt.trace.json.gz", ["analyze", "t.pt.trace.json.gz", "--html", "{out}"]),
    ("analyze folder --json", "ranks/rank0.pt.trace.json.gz", ["analyze", "ranks", "--json", "{out}"]),
    ("compare --json A", "a.json", ["compare", "a.json", "b.json", "--json", "{out}"]),
    ("compare --json B", "b.json", ["compare", "a.json", "b.json", "--json", "{out}"]),
    ("gate --junit baseline", "a.json", ["gate", "--baseline", "a.json", "--current", "b.json", "--junit", "{out}"]),
    ("gate --json current", "b.json", ["gate", "--baseline", "a.json", "--current", "b.json", "--json", "{out}"]),
    ("profile --save-config", "c.yaml", ["profile", "--config", "c.yaml", "--save-config", "{out}"]),
    ("profile --json", "c.yaml", ["profile", "--config", "c.yaml", "--json", "{out}"]),
    ("profile --html rules", "rules/mine.yaml", ["profile", *FAST, "--rules", "rules", "--html", "{out}"]),
    ("profile --json data", "train.jsonl", ["profile", *FAST, "--data", "train.jsonl", "--json", "{out}"]),
    (
        "profile --html tokenizer",
        "tok/tokenizer.json",
        ["profile", *FAST, "--data", "train.jsonl", "--tokenizer", "tok", "--html", "{out}"],
    ),
    ("treat --json", "c.yaml", ["treat", "--config", "c.yaml", "--out", "tr", "--json", "{out}"]),
    ("treat --html", "c.yaml", ["treat", "--config", "c.yaml", "--out", "tr", "--html", "{out}"]),
    ("sweep --csv", "grid.yaml", ["sweep", "grid.yaml", "--csv", "{out}"]),
    ("sweep --jsonl", "grid.yaml", ["sweep", "grid.yaml", "--jsonl", "{out}"]),
    ("export --chrome", "t.pt.trace.json.gz", ["export", "t.pt.trace.json.gz", "--chrome", "{out}"]),
    (
        "export --json its trace",
        "t.pt.trace.json.gz",
        ["export", "kept.json", "--chrome", "e.json.gz", "--json", "{out}"],
    ),
    ("export --hta-dir", "ranks", ["export", "ranks", "--hta-dir", "{out}"]),
    ("rules list --json", "rules/mine.yaml", ["rules", "list", "--rules", "rules", "--json", "{out}"]),
    ("run --json", "train.py", ["run", "--out", "o", "--json", "{out}", "--", "python", "train.py"]),
    ("run --html", "train.py", ["run", "--out", "o", "--html", "{out}", "--", "python", "train.py"]),
]
#: ways to name the same file
SPELLINGS = {
    "same": lambda p, d: p,
    "dot": lambda p, d: "./" + p,
    "absolute": lambda p, d: str(d / p),
    "dotdot": lambda p, d: "sub/../" + p,
    "hard link": lambda p, d: _hard_link(d, p),
}


def _hard_link(d: Path, p: str) -> str:
    if (d / p).is_dir():
        return str(d / p)  # a folder has no hard link: its real path then
    os.link(d / p, d / "other-name")
    return "other-name"


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("case", PAIRS, ids=[c[0] for c in PAIRS])
def test_an_output_that_names_an_input_is_refused_even_with_force(tmp_path, monkeypatch, case, spelling):
    _, target, args = case
    monkeypatch.chdir(tmp_path)
    _inputs(tmp_path)
    name = SPELLINGS[spelling](target, tmp_path)
    before = snapshot(tmp_path)
    force = [] if args[0] == "run" else ["--force"]  # run's --force goes before the command
    argv = [a.replace("{out}", name) for a in args]
    if args[0] == "run":
        argv.insert(1, "--force")
    r = invoke([*argv, *force])
    assert_one_line(r, 2, "never writes over what it reads")
    assert snapshot(tmp_path) == before  # every input byte-identical, nothing written


def test_an_output_beside_the_inputs_is_fine(tmp_path):
    """Only the input itself is protected: a new file in the input's folder is written as usual."""
    shutil.copy(REPORT, tmp_path / "a.json")
    r = invoke(["compare", tmp_path / "a.json", tmp_path / "a.json", "--json", tmp_path / "diff.json"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "diff.json").read_text())


# --- torch's traces through the writer ------------------------------------------------------------


def _export_json(path: str) -> None:
    """What torch's kineto export does: plain JSON to the name it is given, whatever that name."""
    with open(path, "w") as f:
        f.write('{"traceEvents": [')
        f.write(",".join(json.dumps({"name": "k", "ph": "X", "ts": i, "dur": 1}) for i in range(1000)))
        f.write("]}")


@pytest.mark.parametrize("name", ["t.pt.trace.json.gz", "t.pt.trace.json"])
def test_a_trace_reaches_its_final_name_only_complete(tmp_path, name):
    target = tmp_path / name
    seen = {}

    def export(path: str) -> None:
        seen["final existed while writing"] = target.exists()
        seen["beside"] = Path(path).parent == tmp_path
        _export_json(path)

    files.export_via(target, export)
    assert seen == {"final existed while writing": False, "beside": True}
    raw = gzip.decompress(target.read_bytes()) if name.endswith(".gz") else target.read_bytes()
    assert len(json.loads(raw)["traceEvents"]) == 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


@pytest.mark.parametrize(
    "failure", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("kineto"), KeyboardInterrupt()]
)
def test_a_trace_export_that_fails_leaves_nothing(tmp_path, failure):
    """A full disk, torch's own error, a signal handled as an exception: no half trace under any name."""
    target = tmp_path / "t.pt.trace.json.gz"
    target.write_bytes(b"an older trace")

    def export(path: str) -> None:
        with open(path, "w") as f:
            f.write('{"traceEvents": [')  # half written
        raise failure

    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else files.WriteError):
        files.export_via(target, export)
    assert target.read_bytes() == b"an older trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def _full_export(monkeypatch) -> None:
    """torch.profiler's export fails as on a full disk (half the file written first)."""
    from torch.profiler import profile

    def export(self, path, *a, **k):
        Path(path).write_text('{"traceEvents": [')
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(profile, "export_chrome_trace", export)


def test_a_full_trace_dir_keeps_the_measurement(tmp_path, monkeypatch):
    """The probe's case: `--trace-dir` on a full disk said `metrics: null`. Now the metrics are kept, the
    report says the trace was lost, and the command exits 1 (an asked-for output is missing)."""
    _full_export(monkeypatch)
    traces, out = tmp_path / "traces", tmp_path / "r.json"
    args = ["profile", "--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--autocast", "off"]
    r = invoke([*args, "--trace-steps", "1", "--trace-dir", traces, "--json", out, "--quiet"])
    assert_one_line(r, 1, "trace could not be written", "No space left", "measurement is kept")
    report = json.loads(out.read_text())
    assert report["status"] == "ok" and report["metrics"]["real_tokens_per_s"] > 0
    assert report["trace"]["path"] is None and "No space left" in report["trace"]["lost"]
    assert any("trace could not be written" in w for w in report["warnings"])
    assert not list(traces.iterdir()) if traces.exists() else True  # no half trace, no temp file


def _loop(doc, model, n: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        doc.step()


def test_doctor_keeps_the_measurement_when_its_trace_cannot_be_written(tmp_path, monkeypatch):
    import vlmdoctor

    _full_export(monkeypatch)
    model = torch.nn.Linear(4, 1)
    with vlmdoctor.Doctor(model, out=tmp_path, quiet=True, warmup=0, steps=2, trace_steps=1) as doc:
        _loop(doc, model, 5)
    report = doc.report
    assert report["status"] == "ok" and report["metrics"]["step_ms"] > 0
    assert report["trace"]["path"] is None and "No space left" in report["trace"]["lost"]
    assert any("trace could not be written" in n for n in report["notes"])
    assert [p.name for p in (tmp_path / "trace").iterdir()] == []
    assert json.loads((tmp_path / "report.json").read_text())["metrics"]["step_ms"] > 0


def test_doctor_never_writes_its_trace_through_a_link(tmp_path):
    import vlmdoctor

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "trace").symlink_to(elsewhere)
    model = torch.nn.Linear(4, 1)
    with vlmdoctor.Doctor(model, out=out, quiet=True, warmup=0, steps=2, trace_steps=1) as doc:
        _loop(doc, model, 5)
    assert doc.report["metrics"]["step_ms"] > 0 and "not a folder" in doc.report["trace"]["lost"]
    assert list(elsewhere.iterdir()) == []


# --- vlmdoctor run's script.log -----------------------------------------------------------------------


def _log_link(out: Path) -> None:
    (out / "script.log").symlink_to(out.parent / "precious.txt")


def _log_fifo(out: Path) -> None:
    os.mkfifo(out / "script.log")


def _log_exists(out: Path) -> None:
    (out / "script.log").write_text("the last run's log\n")


def _trace_link(out: Path) -> None:
    (out / "trace").symlink_to(out.parent)


@pytest.mark.parametrize(
    "make, force, needle",
    [
        (_log_link, True, "symbolic link"),
        (_log_fifo, True, "fifo"),
        (_log_exists, False, "--force"),
        (_trace_link, True, "not a folder"),
    ],
    ids=["log-link", "log-fifo", "log-exists", "trace-link"],
)
def test_run_checks_its_log_and_trace_folder_before_the_script_starts(tmp_path, make, force, needle):
    """`run` opened OUT/script.log with open(): through a link, over an old log. Now the same rule as every
    output, checked before the script starts (nothing runs, nothing is touched; a fifo does not block)."""
    (tmp_path / "precious.txt").write_text("the user's data\n")
    out = tmp_path / "o"
    out.mkdir()
    make(out)
    (tmp_path / "train.py").write_text(SCRIPT)
    before = snapshot(tmp_path)
    r = invoke(["run", "--out", out, *(["--force"] if force else []), "--", "python", tmp_path / "train.py"])
    assert_one_line(r, 2, needle)
    assert snapshot(tmp_path) == before


def test_open_log_appends_to_a_regular_file_only(tmp_path):
    log = tmp_path / "script.log"
    log.write_text("old\n")
    with files.open_log(log) as f:  # replaced (the overwrite rule was checked before), then appended to
        f.write(b"new\n")
    assert log.read_text() == "new\n"
    for make in (lambda p: p.symlink_to(tmp_path / "x"), os.mkfifo, lambda p: p.mkdir()):
        p = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        make(p)
        t0 = time.monotonic()
        with pytest.raises(UsageError):
            files.open_log(p)
        assert time.monotonic() - t0 < 5  # a fifo is refused, not waited on
    assert not (tmp_path / "x").exists()


# --- the rescue --------------------------------------------------------------------------------------


def test_the_rescue_tries_the_temp_folder_when_the_current_one_fails_too(tmp_path, monkeypatch):
    """The disk of the target and of the current folder is full: the content goes to the temp folder, and
    the current folder keeps no empty placeholder."""
    here, temp = tmp_path / "here", tmp_path / "temp"
    here.mkdir()
    temp.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    real, calls = files._write_all, []

    def full_here(fd, data):
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        if not calls[-1].startswith(str(temp)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(files, "_write_all", full_here)
    msg = files.save(here / "r.json", '{"a": 1}\n', "report")
    rescued = Path(msg.split("saved to ")[1].split(" instead")[0])
    assert rescued.parent == temp and json.loads(rescued.read_text()) == {"a": 1}
    assert list(here.iterdir()) == [] and not no_temp_files(tmp_path)
    assert len(calls) == 3  # the target, the current folder, the temp folder


def test_nothing_rescued_anywhere_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_all", full)
    msg = files.save(tmp_path / "r.json", "x", "report")
    assert "could not be saved anywhere else" in msg and list(tmp_path.iterdir()) == []


# --- sweep and Ctrl-C --------------------------------------------------------------------------------


@pytest.mark.parametrize("outputs", [["--csv", "s.csv"], ["--json", "s.json"]])
def test_ctrl_c_in_sweep_keeps_the_finished_rows(tmp_path, monkeypatch, outputs):
    """Two runs finished, the third interrupted: their rows are written (not only with --jsonl), exit 130.
    The runs are stood in for by a recorded report (what is tested is what happens to the rows)."""
    import vlmdoctor.run.runner as runner

    monkeypatch.chdir(tmp_path)
    recorded = json.loads(REPORT.read_text())
    done = []

    def run_isolated(cfg, **_):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(cfg)
        return {**recorded, "config": cfg.to_dict()}

    monkeypatch.setattr(runner, "run_isolated", run_isolated)
    r = invoke(["sweep", "--set", "batch_size=1,2,4", "--set", "model=tiny", "--set", "device=cpu", *outputs])
    assert r.exit_code == 130, r.output
    assert "2 of 3 run(s) finished" in r.stderr
    text = (tmp_path / outputs[1]).read_text()
    if outputs[0] == "--csv":
        rows = list(csv.DictReader(io.StringIO(text)))
    else:
        rows = json.loads(text)["runs"]
    assert [r["name"] for r in rows] == ["batch_size=1, model=tiny, device=cpu", "batch_size=2, model=tiny, device=cpu"]


@pytest.mark.parametrize("umask", [0o077, 0o002, 0o022])
def test_every_output_honours_the_umask(tmp_path, umask):
    """An output is an ordinary new file: its mode is what the user's umask gives one (a private 077 stays
    private), through each of the writers."""
    old = os.umask(umask)
    try:
        files.write_bytes(tmp_path / "a.json", b"{}")
        with files.atomic_writer(tmp_path / "b.json") as f:
            f.write(b"{}")
        files.append_text(tmp_path / "c.log", "x")
        files.export_via(tmp_path / "d.json", lambda p: Path(p).write_text("{}"))
    finally:
        os.umask(old)
    for name in ("a.json", "b.json", "c.log", "d.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


@pytest.mark.parametrize(
    "flag, value, said",
    [
        ("--json", "", "an empty path"),
        ("--html", "", "an empty path"),
        ("--html", "-", "cannot go to standard output"),
        ("--json", "out/", "names a folder"),
        ("--html", "out/", "names a folder"),
        ("--json", ".", "names a folder"),
    ],
    ids=["json-empty", "html-empty", "html-dash", "json-slash", "html-slash", "json-dot"],
)
def test_one_output_path_policy(flag, value, said, tmp_path, monkeypatch):
    """`-` is standard output where an output can go there and refused elsewhere (never a file named '-'); an
    empty path or a folder's name is refused in one line, before any work, and nothing is written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    before = snapshot(tmp_path)
    r = invoke(["analyze", TRACE, flag, value])
    assert_one_line(r, 2, said)
    assert snapshot(tmp_path) == before


def test_an_error_line_stays_readable_whatever_the_input_holds(tmp_path):
    """A path of a megabyte in the one error line: its middle is left out and the line says so."""
    r = invoke(["analyze", "x" * 1_000_000 + ".json"])
    line = assert_one_line(r, 2, "characters left out")
    assert len(line) < 1000
