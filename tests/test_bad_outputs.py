"""Every output option of every command, against every kind of bad target: refused up front with one
line and exit 2, nothing the user had touched (hash before and after), no leftovers; and when the
final write fails after the work (a full disk), the results are kept in a fallback file.

Nothing here touches a real system file: links and fifos are made in tmp_path.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
from pathlib import Path

import pytest
from _badinput import FAST, REPORT, REPORT_1, TRACE, assert_one_line, invoke, no_temp_files, snapshot

import vlmdoctor.files as files
from vlmdoctor.errors import UsageError

TINY = ["--model", "tiny", "--device", "cpu"]

#: (id, kind, file name, args given the target and tmp_path); kind: file (replaced with --force),
#: append (added to), folder (written into)
WRITERS = [
    ("profile --json", "file", "r.json", lambda t, d: ["profile", *FAST, "--json", t]),
    ("profile --html", "file", "r.html", lambda t, d: ["profile", *FAST, "--html", t]),
    ("profile --save-config", "file", "c.yaml", lambda t, d: ["profile", *FAST, "--save-config", t]),
    ("profile --trace-dir", "folder", "traces", lambda t, d: ["profile", *FAST, "--trace-dir", t]),
    ("analyze --json", "file", "a.json", lambda t, d: ["analyze", TRACE, "--json", t]),
    ("analyze --html", "file", "a.html", lambda t, d: ["analyze", TRACE, "--html", t]),
    ("treat --html", "file", "t.html", lambda t, d: ["treat", *TINY, "--html", t, "--out", d / "treated"]),
    ("treat --out", "folder", "treated", lambda t, d: ["treat", *TINY, "--out", t]),
    ("sweep --csv", "file", "s.csv", lambda t, d: ["sweep", "--set", "batch_size=1,2", "--csv", t]),
    ("sweep --jsonl", "append", "s.jsonl", lambda t, d: ["sweep", "--set", "batch_size=1,2", "--jsonl", t]),
    (
        "gate --junit",
        "file",
        "g.xml",
        lambda t, d: ["gate", "--baseline", REPORT, "--current", REPORT, "--junit", t],
    ),
    (
        "gate --json",
        "file",
        "g.json",
        lambda t, d: ["gate", "--baseline", REPORT, "--current", REPORT, "--json", t],
    ),
    ("compare --json", "file", "c.json", lambda t, d: ["compare", REPORT, REPORT, "--json", t]),
    ("export --chrome", "file", "e.json.gz", lambda t, d: ["export", TRACE, "--chrome", t]),
    ("export --hta-dir", "folder", "hta", lambda t, d: ["export", TRACE, "--hta-dir", t]),
]


def _victim(tmp_path: Path) -> Path:
    v = tmp_path / "precious.txt"
    v.write_text("the user's data\n")
    return v


def _symlink(tmp_path, name):  # the /dev/null class: a link to something that must not be replaced
    t = tmp_path / name
    t.symlink_to(_victim(tmp_path))
    return t, "symbolic link"


def _fifo(tmp_path, name):
    t = tmp_path / name
    os.mkfifo(t)
    return t, "fifo"


def _folder(tmp_path, name):
    t = tmp_path / name
    t.mkdir()
    (t / "inside.txt").write_text("kept\n")
    return t, "folder"


def _missing_parent(tmp_path, name):
    return tmp_path / "no" / "such" / name, "does not exist"


def _parent_is_file(tmp_path, name):
    (tmp_path / "plain").write_text("a file\n")
    return tmp_path / "plain" / name, "not a folder"


def _too_long(tmp_path, name):
    return tmp_path / ("x" * 300 + name), "longer than 255"


def _exists(tmp_path, name):
    t = tmp_path / name
    t.write_text("an earlier result\n")
    return t, "pass --force"


def _file_in_place(tmp_path, name):
    t = tmp_path / name
    t.write_text("a file where a folder should be\n")
    return t, "not a folder"


def _link_to_folder(tmp_path, name):
    (tmp_path / "real").mkdir()
    t = tmp_path / name
    t.symlink_to(tmp_path / "real")
    return t, "not a folder"


FILE_CASES = [_symlink, _fifo, _folder, _missing_parent, _parent_is_file, _too_long, _exists]
APPEND_CASES = [_symlink, _fifo, _folder, _missing_parent, _parent_is_file, _too_long]
FOLDER_CASES = [_file_in_place, _link_to_folder, _parent_is_file, _too_long]
CASES = [
    pytest.param((build, name), make, id=f"{wid}-{make.__name__.strip('_')}")
    for wid, kind, name, build in WRITERS
    for make in {"file": FILE_CASES, "append": APPEND_CASES, "folder": FOLDER_CASES}[kind]
]


@pytest.mark.parametrize("spec, make", CASES)
def test_bad_output_target_is_refused_before_the_work(tmp_path, monkeypatch, spec, make):
    build, name = spec
    monkeypatch.chdir(tmp_path)
    target, needle = make(tmp_path, name)
    args = build(target, tmp_path)
    if make is not _exists:
        args.append("--force")  # --force never replaces a link, device, fifo or folder
    before = snapshot(tmp_path)
    r = invoke(args)
    assert_one_line(r, 2, needle)
    assert snapshot(tmp_path) == before  # nothing created, replaced or left behind


def test_every_writing_command_has_force():
    import typer.main

    from vlmdoctor.cli import app

    cmd = typer.main.get_command(app)
    for name in ("profile", "analyze", "treat", "sweep", "gate", "compare", "export"):
        opts = {o for p in cmd.commands[name].params for o in p.opts}
        assert "--force" in opts, name


# --- the one writer -----------------------------------------------------------------------------------


def _full_disk(monkeypatch, fail_times: int = 1):
    """os.write fails with ENOSPC the first `fail_times` times (half the data written first)."""
    real = files._write_all
    state = {"left": fail_times}

    def fake(fd, data):
        if state["left"] > 0:
            state["left"] -= 1
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(files, "_write_all", fake)


def test_full_disk_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    t = tmp_path / "r.json"
    t.write_text("old\n")
    _full_disk(monkeypatch)
    with pytest.raises(files.WriteError, match="No space left"):
        files.write_text(t, "new content\n" * 100)
    assert t.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_interrupted_atomic_writer_leaves_nothing(tmp_path):
    t = tmp_path / "x.png"
    with pytest.raises(KeyboardInterrupt):
        with files.atomic_writer(t) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_save_keeps_the_content_in_a_fallback_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _full_disk(monkeypatch)
    msg = files.save(tmp_path / "r.json", '{"a": 1}\n', "report")
    rescued = Path(msg.split("saved to ")[1].split(" instead")[0])
    assert rescued.parent == tmp_path and json.loads(rescued.read_text()) == {"a": 1}
    assert not (tmp_path / "r.json").exists() and not no_temp_files(tmp_path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_numbers_are_written_as_null(tmp_path, value):
    t = tmp_path / "r.json"
    files.write_json({"status": "nan_loss", "metrics": {"final_loss": value, "losses": [1.0, value]}}, str(t))
    assert json.loads(t.read_text()) == {
        "status": "nan_loss",
        "metrics": {"final_loss": None, "losses": [1.0, None]},
    }
    assert "NaN" not in t.read_text() and "Infinity" not in t.read_text()


@pytest.mark.parametrize("make", [_symlink, _fifo, _folder])
def test_the_writer_itself_never_replaces_special_files(tmp_path, make):
    target, _ = make(tmp_path, "out.json")
    before = snapshot(tmp_path)
    with pytest.raises(UsageError):
        files.write_text(target, "x")
    assert snapshot(tmp_path) == before


# --- results are kept when the final write fails --------------------------------------------------------


def test_profile_keeps_the_measurement_when_the_disk_is_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    _full_disk(monkeypatch)
    r = invoke(["profile", *FAST, "--json", tmp_path / "out" / "r.json"])
    line = assert_one_line(r, 1, "No space left", "saved to")
    rescued = Path(line.split("saved to ")[1].split(" instead")[0])
    report = json.loads(rescued.read_text())
    assert report["status"] == "ok" and report["metrics"]["real_tokens_per_s"] > 0
    assert list((tmp_path / "out").iterdir()) == [] and not no_temp_files(tmp_path)


@pytest.mark.parametrize("flag", ["--junit", "--json"])
def test_gate_outputs_on_a_full_disk_leave_no_empty_file(tmp_path, monkeypatch, flag):
    monkeypatch.chdir(tmp_path)
    _full_disk(monkeypatch)
    target = tmp_path / "ci" / "out.txt"
    target.parent.mkdir()
    r = invoke(["gate", "--baseline", REPORT, "--current", REPORT, flag, target])
    assert_one_line(r, 1, "saved to")
    assert not target.exists() and not no_temp_files(tmp_path)


def test_gate_step_summary_in_a_missing_folder_is_a_warning(tmp_path):
    r = invoke(
        ["gate", "--baseline", REPORT, "--current", REPORT],
        env={"GITHUB_STEP_SUMMARY": str(tmp_path / "missing" / "summary.md")},
    )
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "step summary is skipped" in r.stderr


def test_update_baseline_refuses_another_model_or_stage_without_force(tmp_path):
    base = tmp_path / "base.json"
    base.write_text(REPORT.read_text())
    before = snapshot(tmp_path)
    r = invoke(["gate", "--baseline", base, "--current", REPORT_1, "--update-baseline"])
    assert_one_line(r, 2, "--force")
    assert snapshot(tmp_path) == before
    r = invoke(["gate", "--baseline", base, "--current", REPORT_1, "--update-baseline", "--force"])
    assert r.exit_code == 0, r.output
    assert json.loads(base.read_text())["config"]["stage"] == 1


def test_update_baseline_never_replaces_a_link(tmp_path):
    real = tmp_path / "real.json"
    real.write_text(REPORT.read_text())
    base = tmp_path / "base.json"
    base.symlink_to(real)
    before = snapshot(tmp_path)
    r = invoke(["gate", "--baseline", base, "--current", REPORT, "--update-baseline", "--force"])
    assert_one_line(r, 2, "symbolic link")
    assert snapshot(tmp_path) == before


# --- export --hta-dir --force removes only what it wrote, after the new export is complete ---------------


def _rank_file(folder: Path, name: str) -> None:
    with gzip.open(folder / name, "wt") as f:
        f.write('{"traceEvents": []}\n')


def test_hta_force_never_deletes_unrelated_archives(tmp_path):
    out = tmp_path / "hta"
    out.mkdir()
    _rank_file(out, "rank0.pt.trace.json.gz")
    (out / "backup.tar.gz").write_bytes(b"\x1f\x8bsomeone else's archive")
    before = snapshot(tmp_path)
    r = invoke(["export", TRACE, "--hta-dir", out, "--force"])
    assert_one_line(r, 2, "did not write", "backup.tar.gz")
    assert snapshot(tmp_path) == before


def test_hta_force_keeps_the_old_export_when_a_rank_fails(tmp_path):
    out = tmp_path / "hta"
    out.mkdir()
    _rank_file(out, "rank0.pt.trace.json.gz")
    _rank_file(out, "rank1.pt.trace.json.gz")
    cut = tmp_path / "cut.json"  # a trace whose events end mid-way: found only while writing it
    text = gzip.decompress(TRACE.read_bytes()).decode()
    cut.write_text(text[: len(text) // 2])
    before = snapshot(out)
    _ranks(tmp_path, cut)
    r = invoke(["export", tmp_path / "ranks", "--hta-dir", out, "--force"])
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert snapshot(out) == before and not no_temp_files(tmp_path)


def _ranks(tmp_path: Path, cut: Path) -> None:
    d = tmp_path / "ranks"
    d.mkdir()
    (d / "a.pt.trace.json").write_text(gzip.decompress(TRACE.read_bytes()).decode())
    cut.rename(d / "b.pt.trace.json")


def test_treat_outputs_on_a_full_disk_are_each_rescued(tmp_path, monkeypatch):
    """A recorded treatment (H100, bench/results) written while the disk is full: every file that fails
    is kept in a fallback file the message names; nothing half-written is left in the folder."""
    from _badinput import ROOT

    from vlmdoctor.report.treat_outputs import write_outputs

    recorded = ROOT / "bench" / "results" / "2026-11-23-h100" / "a" / "treat_0.5b_s2" / "treat.json"
    if not recorded.exists():
        pytest.skip("no recorded treatment in this checkout")
    monkeypatch.chdir(tmp_path)
    state = {"n": 0}
    real = files._write_all

    def every_other(fd, data):  # the target write fails, the fallback that follows it succeeds
        state["n"] += 1
        if state["n"] % 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data)

    monkeypatch.setattr(files, "_write_all", every_other)
    out = tmp_path / "treated"
    paths, failures = write_outputs(json.loads(recorded.read_text()), out)
    assert len(failures) == len(paths)
    for line in failures:
        assert "saved to" in line, failures
        rescued = Path(line.split("saved to ")[1].split(" instead")[0])
        assert rescued.exists() and rescued.stat().st_size > 0
    assert list(out.iterdir()) == [] and not no_temp_files(tmp_path)


def test_treat_out_folder_holding_a_link_where_a_result_goes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "treated"
    out.mkdir()
    (out / "treat.json").symlink_to(_victim(tmp_path))
    before = snapshot(tmp_path)
    r = invoke(["treat", *TINY, "--out", out, "--force"])
    assert_one_line(r, 2, "symbolic link")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "args",
    [
        [
            "profile",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no-diagnose",
            "--json",
            "{p}",
            "--html",
            "{p}",
        ],
        ["profile", "--model", "tiny", "--device", "cpu", "--json", "{p}", "--save-config", "./{p}"],
        ["gate", "--baseline", REPORT, "--current", REPORT, "--junit", "{p}", "--json", "{p}"],
        ["analyze", TRACE, "--json", "{p}", "--html", "{p}"],
        ["treat", "--model", "tiny", "--device", "cpu", "--json", "{p}", "--html", "{p}"],
        ["sweep", "--set", "batch_size=1,2", "--csv", "{p}", "--json", "{p}"],
    ],
)
def test_two_outputs_of_one_command_on_one_file_are_refused(tmp_path, monkeypatch, args):
    """Only the last write would survive: the other result would be lost without a word."""
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    r = invoke([str(a).replace("{p}", "out.dat") for a in args])
    assert_one_line(r, 2, "name the same file")
    assert snapshot(tmp_path) == before
