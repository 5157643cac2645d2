"""Bad `--config` files (profile and treat): one line naming the file, exit 2, before anything is built."""

from __future__ import annotations

import json

import pytest
from _badinput import FAST, REPORT, assert_one_line, invoke, snapshot

TINY = ["--model", "tiny", "--device", "cpu"]


def _report(**changes) -> str:
    r = json.loads(REPORT.read_text())
    r.update(changes)
    return json.dumps(r)


CASES = [
    ("latin1.yaml", "lr: 1e-5\n# caf\xe9\n".encode("latin-1"), "not UTF-8"),
    ("binary.yaml", bytes(range(256)) * 4, "not UTF-8"),
    ("zero.yaml", b"0\n", "expected a mapping"),
    ("list.yaml", b"- 1\n- 2\n", "expected a mapping"),
    ("string.yaml", b"just words\n", "expected a mapping"),
    ("intkeys.yaml", b"1: 2\nlr: 1e-5\n", "unknown knob"),
    ("broken.yaml", b"lr: [1, 2\n", "does not parse"),
    ("broken.json", b'{"lr": 1e-5', "does not parse"),
    ("nan.json", b'{"lr": NaN}', "lr"),
    ("deep.json", b"[" * 100000 + b"]" * 100000, "config"),
    ("unknown.yaml", b"learning_rate: 0.1\n", "unknown knob"),
    ("types.yaml", b"batch_size: four\n", "batch_size"),
    ("boolint.yaml", b"steps: true\n", "steps"),
    ("strknob.yaml", b"sampler: 7\n", "sampler"),
    ("future.json", _report(schema_version=99).encode(), "newer vlmdoctor"),
    ("negative.json", _report(schema_version=-1).encode(), "schema_version"),
    ("badconfig.json", _report(config=[1, 2]).encode(), "expected a mapping"),
]


@pytest.mark.parametrize("command", ["profile", "treat"])
@pytest.mark.parametrize("name, content, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_config_file(tmp_path, monkeypatch, command, name, content, needle):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / name
    cfg.write_bytes(content)
    before = snapshot(tmp_path)
    r = invoke([command, "--config", cfg, *(FAST if command == "profile" else TINY)])
    assert_one_line(r, 2, needle)
    assert snapshot(tmp_path) == before


def _file(p):
    p.write_text("x")
    return p


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d / "missing.yaml", "no such file"),
        (lambda d: d, "is a folder"),
        (lambda d: d / ("c" * 300 + ".yaml"), "longer than 255"),
        (lambda d: _file(d / "f") / "c.yaml", "cannot read"),
    ],
)
def test_unusable_config_path(tmp_path, make, needle):
    r = invoke(["profile", "--config", make(tmp_path), *FAST])
    assert_one_line(r, 2, needle)


def test_an_empty_config_is_the_default(tmp_path):
    from vlmdoctor.run.config import RunConfig

    (tmp_path / "empty.yaml").write_text("")
    assert RunConfig.load(tmp_path / "empty.yaml") == RunConfig()


def test_a_fifo_is_refused_not_read_forever(tmp_path):
    import os

    fifo = tmp_path / "run.yaml"
    os.mkfifo(fifo)
    assert_one_line(invoke(["profile", "--config", fifo, *FAST]), 2, "not a regular file")
    assert_one_line(invoke(["gate", "--baseline", fifo, "--current", REPORT]), 2, "not a regular file")
    assert_one_line(invoke(["sweep", fifo]), 2, "not a regular file")


GRIDS = [
    ("rows-not-mappings", b"runs: [1, 2]\n", "each run must be a mapping"),
    ("set-not-mapping", b"runs: [{name: a, set: [1]}]\n", "each run must be a mapping"),
    ("stages-scalar", b"stages: 2\nruns: [{name: a}]\n", "'stages' must be a list"),
    ("row-stages-scalar", b"runs: [{name: a, stages: 2}]\n", "'stages' must be a list"),
    ("defaults-list", b"defaults: [1]\nruns: [{name: a}]\n", "'defaults' must be a mapping"),
    ("latin1", b"runs: [{name: caf\xe9}]\n", "not UTF-8"),
    ("bad-knob", b"runs: [{name: a, set: {lr: -1}}]\n", "lr"),
    ("no-runs", b"defaults: {}\n", "'runs'"),
    ("scalar", b"0\n", "'runs'"),
]


@pytest.mark.parametrize("name, content, needle", GRIDS, ids=[g[0] for g in GRIDS])
def test_bad_sweep_grid(tmp_path, monkeypatch, name, content, needle):
    monkeypatch.chdir(tmp_path)
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(content)
    before = snapshot(tmp_path)
    assert_one_line(invoke(["sweep", grid]), 2, needle)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "item, needle",
    [
        ("lr=[", "--set lr=["),
        ("batch_size", "expected knob=value"),
        ("nope=1", "unknown knob"),
        ("batch_size={a: 1}", "batch_size"),
    ],
)
def test_bad_set_values(tmp_path, monkeypatch, item, needle):
    monkeypatch.chdir(tmp_path)
    assert_one_line(invoke(["treat", *TINY, "--set", item]), 2, needle)


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "runs:\n  - {batch_size: 2}\n",
            "run 0: unknown key(s) batch_size",
        ),  # a knob outside `set` is not silently dropped
        ("runs:\n  - {set: {}}\nbogus: 1\n", "unknown key(s) bogus"),
        (
            "runs:\n  - {set: {model: '0.5b', device: auto}}\n",
            "no CUDA GPU",
        ),  # refused before any run, not a failed row
    ],
)
def test_sweep_grids_that_would_run_something_else_are_refused(tmp_path, text, needle):
    grid = tmp_path / "grid.yaml"
    grid.write_text(text)
    before = snapshot(tmp_path)
    r = invoke(["sweep", grid])
    assert_one_line(r, 2, needle)
    assert snapshot(tmp_path) == before
