"""Bad traces: every way a trace can be unreadable, hostile or wrong is refused with one line (exit 2) or
read with its bad events counted and named, never a hang, a blow-up of memory or a silently wrong number.

Each class is generated from one recorded trace (fixtures/user_h100/llava_s1_plain: a real H100 training
trace of 2 steps, small enough to rewrite per case) or from the recorded rank folders of fixtures/dist_cpu:
fifos, one large event at every offset around a read, invalid durations of each kind in each kind of event,
wrong-typed metadata at each field the facts read, gzip bombs of several shapes, rank folders of two jobs.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _badinput import ROOT, assert_one_line, invoke

from vlmdoctor.errors import UsageError
from vlmdoctor.trace import read, tables
from vlmdoctor.trace.facts import analyze
from vlmdoctor.trace.read import iter_events
from vlmdoctor.trace.tables import _Builder, _take, load_tables

SOURCE = ROOT / "fixtures" / "user_h100" / "llava_s1_plain.pt.trace.json.gz"
DIST = ROOT / "fixtures" / "dist_cpu"


@pytest.fixture(scope="module")
def recorded() -> dict:
    with gzip.open(SOURCE, "rt") as f:
        return json.load(f)


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc, allow_nan=True))
    return path


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail (not hang) when the body blocks: a read of a fifo never returns."""

    def _stop(*_):
        raise TimeoutError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, _stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --- only regular files: a fifo named like a trace is refused at once -----------------------------------


@pytest.mark.parametrize("name", ["t.json", "t.json.gz", "rank0.pt.trace.json"])
@pytest.mark.parametrize("command", ["analyze", "export"])
def test_a_fifo_named_like_a_trace_is_refused_at_once(tmp_path, name, command):
    fifo = tmp_path / name
    os.mkfifo(fifo)
    args = ["analyze", fifo] if command == "analyze" else ["export", fifo, "--chrome", tmp_path / "o.json.gz"]
    with deadline(30):
        r = invoke(args)
    assert_one_line(r, 2, name, "not a regular file")
    assert not (tmp_path / "o.json.gz").exists()


def test_a_fifo_in_a_rank_folder_is_left_out(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(DIST / "ddp" / "trace_rank0.json.gz", folder / "trace_rank0.json.gz")
    os.mkfifo(folder / "trace_rank1.json.gz")
    with deadline(60):
        r = invoke(["analyze", folder, "--json", tmp_path / "a.json"])
    assert r.exit_code == 0, r.output
    assert [Path(f["file"]).name for f in json.loads((tmp_path / "a.json").read_text())["files"]] == [
        "trace_rank0.json.gz"
    ]


def test_a_report_whose_trace_is_a_fifo_is_refused(tmp_path):
    report = json.loads((ROOT / "fixtures" / "traces" / "bf16_s2.report.json").read_text())
    report["trace"]["path"] = "t.pt.trace.json.gz"
    (tmp_path / "r.json").write_text(json.dumps(report))
    os.mkfifo(tmp_path / "t.pt.trace.json.gz")
    with deadline(30):
        r = invoke(["export", tmp_path / "r.json", "--chrome", tmp_path / "o.json.gz"])
    assert_one_line(r, 2, "not a regular file")


# --- one large event anywhere: read whole, whatever read it straddles ----------------------------------


def _with_big_event(recorded: dict, shift: int, size: int, filler: str) -> dict:
    """The recorded trace's first events, one of them carrying `size` characters of `filler`, shifted by
    `shift` bytes (a longer name before it) against the reads."""
    doc = {k: v for k, v in recorded.items() if k != "traceEvents"}
    events = copy.deepcopy([e for e in recorded["traceEvents"] if e.get("ph") == "X"][:40])
    events[5]["name"] += "s" * shift
    big = events[20]
    big["args"] = {**(big.get("args") or {}), "blob": (filler * (size // len(filler) + 1))[:size]}
    doc["traceEvents"] = events
    return doc


def _reference(path: Path) -> tables.Tables:
    """The tables as the event-by-event reader builds them from json's whole-file decode."""
    b = _Builder()
    for ev in json.loads(path.read_text())["traceEvents"]:
        _take(ev, b)
    return b.tables(path, read.read_metadata(path))


BLOCK = 1 << 10


@pytest.mark.parametrize("filler", ["x", '"},{"ph": "X"}, {', "},{"], ids=["plain", "json-like", "cut-like"])
@pytest.mark.parametrize(
    "size",
    [BLOCK // 2, BLOCK - 7, BLOCK, 3 * BLOCK + 1, 9 * BLOCK, 40 * BLOCK],
    ids=["half", "block-7", "block", "3-blocks", "over-slow-after", "over-stream-ahead"],
)
def test_an_event_of_any_size_across_any_read_is_read_whole(tmp_path, monkeypatch, recorded, size, filler):
    """Reads of BLOCK bytes (SLOW_AFTER blocks before the event-by-event reader, STREAM_AHEAD of it buffered,
    both lowered here): the large event starts at every offset of a read, and the file reads as json reads it."""
    monkeypatch.setattr(read, "BLOCK", BLOCK)
    monkeypatch.setattr(read, "STREAM_AHEAD", 4 * BLOCK)
    for shift in range(0, BLOCK + 1, 61):
        doc = _with_big_event(recorded, shift, size, filler)
        p = _write(tmp_path / "t.json", doc)
        assert list(iter_events(p, block=BLOCK)) == doc["traceEvents"], (size, shift)
    t = load_tables(p)
    ref = _reference(p)
    assert len(t.ops) == len(ref.ops) and len(t.gpu) == len(ref.gpu) and t.invalid == ref.invalid == {}


def test_an_event_larger_than_the_bound_is_refused_with_its_number(tmp_path, monkeypatch, recorded):
    monkeypatch.setattr(read, "BLOCK", BLOCK)
    monkeypatch.setattr(read, "STREAM_AHEAD", 4 * BLOCK)
    monkeypatch.setattr(read, "MAX_EVENT_BYTES", 64 * BLOCK)
    p = _write(tmp_path / "t.json", _with_big_event(recorded, 0, 100 * BLOCK, "},{"))
    with pytest.raises(UsageError, match="event 21 is not whole within"):
        list(iter_events(p, block=BLOCK))


def test_the_probe_shape_reads_with_the_real_buffer_sizes(tmp_path, recorded):
    """A valid trace whose one 3 MB event holds `},{` (so no cut inside it decodes): refused as truncated before."""
    p = _write(tmp_path / "t.json", _with_big_event(recorded, 0, 3_000_000, "},{"))
    r = invoke(["analyze", p, "--json", tmp_path / "a.json"])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a.json").read_text())["files"][0]["facts"]["trace.invalid_events"] == 0


# --- durations: invalid ones counted and named, never used -------------------------------------------------

#: how a duration can be unusable: (name, a change to the event, the word the warning uses)
BAD_TIMES = [
    ("missing dur", lambda e: e.pop("dur"), "no ts or dur"),
    ("missing ts", lambda e: e.pop("ts"), "no ts or dur"),
    ("null dur", lambda e: e.update(dur=None), "no ts or dur"),
    ("NaN", lambda e: e.update(dur=float("nan")), "NaN or infinite"),
    ("infinite", lambda e: e.update(dur=float("inf")), "NaN or infinite"),
    ("1e400 (inf in JSON)", lambda e: e.update(dur=1e400), "NaN or infinite"),
    ("negative", lambda e: e.update(dur=-5.0), "negative"),
    ("1e300", lambda e: e.update(dur=1e300), "over 24 h"),
    ("two days", lambda e: e.update(dur=2 * 86_400e6), "over 24 h"),
]
#: which event: (name, how to find it in the recorded trace, the kind the warning names)
WHICH = [
    ("kernel", lambda e: e.get("cat") == "kernel", "GPU events"),
    ("memcpy", lambda e: e.get("cat") == "gpu_memcpy", "GPU events"),
    ("cpu op", lambda e: e.get("cat") == "cpu_op" and e["name"].startswith("aten::"), "host ops"),
    ("runtime call", lambda e: e.get("cat") == "cuda_runtime", "host ops"),
    ("step marker", lambda e: str(e.get("name", "")).startswith("ProfilerStep#"), "ProfilerStep markers"),
]


def _replaced(recorded: dict, i: int, event: dict | None) -> dict:
    """The recorded trace with event i replaced (None: left out); the other events shared, not copied."""
    events = recorded["traceEvents"]
    return {**recorded, "traceEvents": events[:i] + ([event] if event is not None else []) + events[i + 1 :]}


def _index(recorded: dict, pick) -> int:
    return next(k for k, e in enumerate(recorded["traceEvents"]) if e.get("ph") == "X" and pick(e))


@pytest.fixture(scope="module")
def without(recorded, tmp_path_factory):
    """The facts of the recorded trace with one event of each kind left out: what the analysis must give
    when that event's time is unusable."""
    out = {}
    for name, pick, _ in WHICH:
        i = _index(recorded, pick)
        p = _write(tmp_path_factory.mktemp("without") / "t.json", _replaced(recorded, i, None))
        out[name] = (i, analyze(p)["files"][0]["facts"])
    return out


def _same_facts(a: dict, b: dict) -> None:
    skip = {"trace.invalid_events", "trace.warnings", "trace.partial"}
    assert set(a) - skip == set(b) - skip
    for k in set(a) - skip:
        assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), k


def _cases() -> list:
    """Every kind of bad time in every kind of event; the default run takes each bad time once (the kinds of
    event in turn) and each kind of event at least once, the rest run with -m slow."""
    out = []
    for i, (bad, change, word) in enumerate(BAD_TIMES):
        for j, (which, pick, kind) in enumerate(WHICH):
            marks = () if j == i % len(WHICH) else (pytest.mark.slow,)
            out.append(pytest.param(which, pick, kind, bad, change, word, marks=marks, id=f"{bad}-{which}"))
    return out


@pytest.mark.parametrize("which, pick, kind, bad, change, word", _cases())
def test_an_unusable_duration_is_counted_named_and_never_used(
    tmp_path, recorded, without, which, pick, kind, bad, change, word
):
    i, expected = without[which]
    event = dict(recorded["traceEvents"][i])
    change(event)
    facts = analyze(_write(tmp_path / "t.json", _replaced(recorded, i, event)))["files"][0]["facts"]
    assert facts["trace.invalid_events"] == 1
    warning = facts["trace.warnings"][0]
    assert kind in warning and word in warning and "left out" in warning
    _same_facts(facts, expected)  # every fact is the trace's without that event: GPU busy, steps, kernels


def test_a_kernel_longer_than_the_trace_is_left_out(tmp_path, recorded, without):
    i, expected = without["kernel"]
    event = {**recorded["traceEvents"][i], "dur": 3_600e6}  # an hour: under the absolute bound, longer than the trace
    facts = analyze(_write(tmp_path / "t.json", _replaced(recorded, i, event)))["files"][0]["facts"]
    assert facts["trace.invalid_events"] == 1 and "longer than the whole trace" in facts["trace.warnings"][0]
    _same_facts(facts, expected)


def test_the_warning_reaches_the_console_and_the_findings_are_unchanged(tmp_path, recorded):
    doc = copy.deepcopy(recorded)
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"][:3]
    for e, v in zip(kernels, (1e300, -1.0, float("nan"))):
        e["dur"] = v
    r = invoke(["analyze", _write(tmp_path / "bad.json", doc), "--json", tmp_path / "bad.out.json"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert r.stdout.count("unusable time") == 1 and "3 GPU events" in " ".join(r.stdout.split())
    drop = {id(k) for k in kernels}
    doc["traceEvents"] = [e for e in doc["traceEvents"] if id(e) not in drop]
    r = invoke(["analyze", _write(tmp_path / "ref.json", doc), "--json", tmp_path / "ref.out.json"])
    assert r.exit_code == 0, r.output
    found = [json.loads((tmp_path / n).read_text())["files"][0] for n in ("bad.out.json", "ref.out.json")]
    assert [f["id"] for f in found[0]["findings"]] == [f["id"] for f in found[1]["findings"]]
    assert [f["evidence"] for f in found[0]["findings"]] == [f["evidence"] for f in found[1]["findings"]]


# --- metadata: each field the facts read, of the wrong type --------------------------------------------

#: (where, the metadata change) for every field vlmdoctor reads
FIELDS = [
    ("deviceProperties", lambda m, v: m.update(deviceProperties=v)),
    ("deviceProperties[0]", lambda m, v: m["deviceProperties"].__setitem__(0, v)),
    ("deviceProperties[0].name", lambda m, v: m["deviceProperties"][0].update(name=v)),
    ("deviceProperties[0].totalGlobalMem", lambda m, v: m["deviceProperties"][0].update(totalGlobalMem=v)),
    ("deviceProperties[0].computeMajor", lambda m, v: m["deviceProperties"][0].update(computeMajor=v)),
    ("distributedInfo", lambda m, v: m.update(distributedInfo=v)),
    ("distributedInfo.rank", lambda m, v: m.setdefault("distributedInfo", {}).update(rank=v)),
    ("distributedInfo.world_size", lambda m, v: m.setdefault("distributedInfo", {}).update(world_size=v)),
    ("host_name", lambda m, v: m.update(host_name=v)),
    ("vlmdoctor", lambda m, v: m.update(vlmdoctor=v)),
    ("vlmdoctor.config", lambda m, v: m.setdefault("vlmdoctor", {}).update(config=v)),
    ("vlmdoctor.config.stage", lambda m, v: m.setdefault("vlmdoctor", {}).setdefault("config", {}).update(stage=v)),
    (
        "vlmdoctor.config.model",
        lambda m, v: m.setdefault("vlmdoctor", {}).setdefault("config", {}).update(model=v),
    ),
    ("vlmdoctor.env", lambda m, v: m.setdefault("vlmdoctor", {}).update(env=v)),
    (
        "vlmdoctor.env.cpu_matmul_gflops",
        lambda m, v: m.setdefault("vlmdoctor", {}).setdefault("env", {}).update(cpu_matmul_gflops=v),
    ),
    ("vlmdoctor.model", lambda m, v: m.setdefault("vlmdoctor", {}).update(model=v)),
    ("vlmdoctor.model.params", lambda m, v: m.setdefault("vlmdoctor", {}).setdefault("model", {}).update(params=v)),
    ("vlmdoctor.metrics", lambda m, v: m.setdefault("vlmdoctor", {}).update(metrics=v)),
    (
        "vlmdoctor.metrics.step_ms",
        lambda m, v: m.setdefault("vlmdoctor", {}).setdefault("metrics", {}).update(step_ms=v),
    ),
]
OBJECTS = {
    "deviceProperties[0]",
    "distributedInfo",
    "vlmdoctor",
    "vlmdoctor.config",
    "vlmdoctor.env",
    "vlmdoctor.model",
    "vlmdoctor.model.params",
}
BIG = "BIGINT"  # written as 5,000 digits
WRONG = ["text", [1, "a"], {"a": {}}, BIG, 2**70]


def _with_meta(recorded: dict, change, value) -> str:
    """The recorded trace with its metadata changed, as Kineto lays it out: the metadata first."""
    meta = copy.deepcopy({k: v for k, v in recorded.items() if k != "traceEvents"})
    change(meta, value)
    head = json.dumps(meta).replace(f'"{BIG}"', "9" * 5000)
    return head[:-1] + ', "traceEvents": ' + json.dumps(recorded["traceEvents"][:200]) + "}"


@pytest.mark.parametrize("field, change", FIELDS, ids=[f[0] for f in FIELDS])
def test_wrong_typed_metadata_is_a_clear_refusal(tmp_path, recorded, field, change):
    for value in WRONG:
        if value == "text" and (field.endswith((".name", "host_name")) or field == "vlmdoctor.config.model"):
            continue  # a string is what these hold
        if isinstance(value, dict) and field in OBJECTS:
            continue  # an object of unknown keys is an object with none of the keys read
        p = tmp_path / "t.json"
        p.write_text(_with_meta(recorded, change, value))
        r = invoke(["analyze", p])
        line = assert_one_line(r, 2, "t.json")
        assert "internal error" not in line
        if value != BIG:
            leaf = field.split(".")[-1].split("[")[0]
            assert leaf in line, (field, value, line)
        else:
            assert "does not convert" in line or "out of range" in line, line


def test_a_user_loops_own_config_of_any_types_is_still_read(tmp_path, recorded):
    """Knobs the facts do not compute with, and unknown stages, are kept as they are (a false refusal of a
    user's trace would be as bad as a crash)."""
    config = {"stage": None, "batch_size": "32", "lr": [1], "sampler": {"a": 1}, "trainer_args": {"x": None}}
    p = tmp_path / "t.json"
    p.write_text(_with_meta(recorded, lambda m, v: m.update(vlmdoctor={"config": v}), config))
    r = invoke(["analyze", p, "--json", tmp_path / "a.json"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert json.loads((tmp_path / "a.json").read_text())["files"][0]["facts"]["config.batch_size"] == "32"


# --- rank folders of two jobs: reported, not joined ----------------------------------------------------


def _retyped(src: Path, dst: Path, **info) -> None:
    """A recorded rank trace with its distributedInfo changed (as if another job wrote it)."""
    with gzip.open(src, "rt") as f:
        doc = json.load(f)
    doc["distributedInfo"] = {**doc["distributedInfo"], **info}
    with gzip.open(dst, "wt", compresslevel=1) as f:
        json.dump(doc, f)


_SLOW = (pytest.mark.slow,)
MIXES = [  # (first trace, second trace, its distributedInfo changed, what the refusal says); slow: more of a kind
    pytest.param(("ddp", 0), ("ddp_tokens", 1), {}, "not recorded at the same time", id="two recordings"),
    pytest.param(("ddp_loader", 0), ("ddp", 1), {}, "not recorded", marks=_SLOW, id="two recordings, other order"),
    pytest.param(("ddp", 0), ("fsdp2", 1), {}, "not recorded", marks=_SLOW, id="ddp and fsdp2"),
    pytest.param(("ddp", 0), ("ddp", 1), {"world_size": 4}, "jobs of 2 and 4 ranks", id="world sizes differ"),
    pytest.param(("ddp", 0), ("ddp", 1), {"rank": 5}, "rank 5, outside a job of 2", id="a rank outside the job"),
]


@pytest.mark.parametrize("a, b, info, needle", MIXES)
def test_a_folder_of_two_jobs_is_reported_and_not_joined(tmp_path, a, b, info, needle):
    folder = tmp_path / "ranks"
    folder.mkdir()
    shutil.copy(DIST / a[0] / f"trace_rank{a[1]}.json.gz", folder / f"trace_rank{a[1]}.json.gz")
    second = DIST / b[0] / f"trace_rank{b[1]}.json.gz"
    target = folder / f"trace_rank{info.get('rank', b[1])}.json.gz"
    _retyped(second, target, **info) if info else shutil.copy(second, target)
    r = invoke(["analyze", folder, "--json", tmp_path / "a.json"])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    out = json.loads((tmp_path / "a.json").read_text())
    assert needle in out["cross_rank"]["skipped"] and "not joined" in out["cross_rank"]["skipped"]
    assert "facts" not in out["cross_rank"] and len(out["files"]) == 2
    assert needle in " ".join(r.stdout.split())


def test_different_run_configs_are_not_one_job(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    for rank, batch in ((0, 4), (1, 8)):
        with gzip.open(DIST / "ddp" / f"trace_rank{rank}.json.gz", "rt") as f:
            doc = json.load(f)
        doc = {"vlmdoctor": {"config": {"model": "tiny", "batch_size": batch}}, **doc}  # before the events
        with gzip.open(folder / f"trace_rank{rank}.json.gz", "wt", compresslevel=1) as f:
            json.dump(doc, f)
    out = analyze(folder)
    assert "record different run configs" in out["cross_rank"]["skipped"]


def test_one_job_is_still_joined():
    assert "facts" in analyze(DIST / "ddp")["cross_rank"]


# --- a report's trace.path leads only next to the report ------------------------------------------------


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_a_report_does_not_lead_export_out_of_its_folder(tmp_path, how):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    trace = outside / "t.pt.trace.json.gz"
    shutil.copy(SOURCE, trace)
    home = tmp_path / "reports"
    home.mkdir()
    report = json.loads((ROOT / "fixtures" / "traces" / "bf16_s2.report.json").read_text())
    if how == "symlink":
        (home / "t.pt.trace.json.gz").symlink_to(trace)
        report["trace"]["path"] = "t.pt.trace.json.gz"
    else:
        report["trace"]["path"] = str(trace) if how == "absolute" else "../elsewhere/t.pt.trace.json.gz"
    (home / "r.json").write_text(json.dumps(report))
    r = invoke(["export", home / "r.json", "--chrome", tmp_path / "o.json.gz"])
    assert_one_line(r, 2, "r.json", "outside the report's folder")
    assert not (tmp_path / "o.json.gz").exists()


def test_a_report_next_to_its_trace_still_exports(tmp_path):
    shutil.copy(SOURCE, tmp_path / "t.pt.trace.json.gz")
    report = json.loads((ROOT / "fixtures" / "traces" / "bf16_s2.report.json").read_text())
    report["trace"]["path"] = "/somewhere/on/the/recording/machine/t.pt.trace.json.gz"  # found by its name, here
    (tmp_path / "r.json").write_text(json.dumps(report))
    r = invoke(["export", tmp_path / "r.json", "--chrome", tmp_path / "o.json.gz"])
    assert r.exit_code == 0, r.output


# --- gzip bombs: refused with memory bounded ----------------------------------------------------------------

BOMB = textwrap.dedent(
    """
    import gzip, resource, sys
    from pathlib import Path

    def bomb(path, head, unit, count, tail, size):
        block = gzip.compress(unit * count, compresslevel=9)  # gzip members, repeated: tiny on disk
        members = max(1, (size - 1000) // len(block))
        with open(path, "wb") as f:
            f.write(gzip.compress(head))
            for _ in range(members):
                f.write(block)
            f.write(gzip.compress(tail))

    H, T = b'{"traceEvents":[', b'{"ph":"X","cat":"kernel","name":"k","ts":1,"dur":1}]}'
    dims = b",".join([b"1"] * 200)
    SHAPES = {
        "kernels": (H, b'{"ph":"X","cat":"kernel","name":"k","ts":1000,"dur":1},', 20_000, T),
        "host ops": (H, b'{"ph":"X","cat":"cpu_op","name":"aten::add","tid":1,"ts":9,"dur":1},', 20_000, T),
        "instant events": (H, b'{"ph":"i","cat":"x","name":"k","ts":1000,"s":"t"},', 20_000, T),
        "shapes": (
            H,
            b'{"ph":"X","cat":"cpu_op","name":"aten::mm","tid":1,"ts":9,"dur":1,"args":{"Input Dims":[['
            + dims + b']]}},',
            2_000,
            T,
        ),
        "one event": (H + b'{"ph":"X","cat":"kernel","name":"', b"x" * 100_000, 10, b'","ts":1,"dur":1}]}'),
        "metadata": (b'{"pad": "', b"x" * 100_000, 10, b'", "traceEvents": [' + T),
    }
    from vlmdoctor.cli import describe_error
    from vlmdoctor.trace import read, tables
    from vlmdoctor.trace.facts import analyze

    size, floors = int(sys.argv[2]), sys.argv[3] == "low"
    if floors:  # the small files' allowances lowered, so that the bounds are met in a fraction of the time
        tables.MEMORY_FLOOR, read.GZIP_MIN_LIMIT = 64 * 2**20, 16 * 2**20
    for name, (head, unit, count, tail) in SHAPES.items():
        p = Path(sys.argv[1]) / (name.replace(" ", "_") + ".json.gz")
        bomb(p, head, unit, count, tail, size)
        try:
            analyze(p)
            print(name, "|", p.stat().st_size, "| read")
        except Exception as e:
            print(name, "|", p.stat().st_size, "|", describe_error(e))
    # VmHWM: this process's own peak. ru_maxrss would start at the forking parent's resident size (Linux keeps
    # the pre-exec high-water mark): under a pytest process that imported torch, 700 MB before any read
    hwm = [ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmHWM:")]
    print("peak", int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    """
)


def _bombs(tmp_path: Path, size: int, floors: str) -> tuple[dict[str, str], int]:
    """Each shape of bomb, of about `size` bytes on disk, analyzed in turn in a fresh process: its one-line
    refusals and its peak RSS (bytes)."""
    out = subprocess.run(
        [sys.executable, "-c", BOMB, str(tmp_path), str(size), floors], capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    peak = int(lines[-1].split()[1])
    return {ln.split(" | ")[0]: ln for ln in lines[:-1]}, peak


def test_gzip_bombs_are_refused_with_memory_bounded(tmp_path):
    """Small gzip files of huge repetitive traces (300 KB on disk, each shape inflates to 30 MB to 300 MB)
    are refused with one line, exit 2, while the process stays far under the memory the inflated trace would
    take. The allowances of small files are lowered to 64 MB (tables) and 16 MB (inflated) to keep this fast;
    the real ones are tested at 10 MB with -m slow."""
    result, peak = _bombs(tmp_path, 300_000, "low")
    assert set(result) == {"kernels", "host ops", "instant events", "shapes", "one event", "metadata"}
    for line in result.values():
        assert line.endswith(", 2)") and "internal error" not in line, line
    assert "gzip bomb" in result["instant events"] and "analysis would need more than" in result["kernels"]
    assert "analysis would need more than" in result["shapes"]  # the kept shapes weigh, not only the rows
    assert peak < 600 * 2**20, peak


@pytest.mark.slow
def test_ten_mb_gzip_bombs_stay_under_two_gb(tmp_path):
    """The target of issue 27: <= 2 GB RSS for any input of <= 10 MB compressed."""
    result, peak = _bombs(tmp_path, 10 * 2**20, "real")
    sizes = [int(line.split(" | ")[1]) for line in result.values()]
    assert max(sizes) <= 10 * 2**20 and all(", 2)" in line for line in result.values()), result
    assert peak <= 2 * 10**9, peak


# --- JSON of unexpected types to gate, compare, profile --config, export ---------------------------------


REPORT = ROOT / "fixtures" / "traces" / "bf16_s2.report.json"


def _report_with(text_change) -> str:
    return text_change(REPORT.read_text())


JSON_CASES = [
    ("a 5000-digit integer", lambda t: t.replace('"schema_version": 1', '"schema_version": ' + "1" * 5000, 1)),
    (
        "a 5000-digit metric",
        lambda t: t.replace('"real_tokens_per_s": ', '"real_tokens_per_s": ' + "9" * 5000 + ', "x": ', 1),
    ),  # fmt: skip
    ("nested 100 deep", lambda t: t[:-2] + ', "deep": ' + "[" * 100 + "]" * 100 + "}"),
    ("nested 100000 deep", lambda t: t[:-2] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("a string", lambda t: json.dumps("a report")),
    ("a number", lambda t: "5"),
]


@pytest.mark.parametrize("name, change", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_json_of_unexpected_types_is_one_line_exit_2(tmp_path, monkeypatch, name, change):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(_report_with(change))
    for args in (
        ["gate", "--baseline", REPORT, "--current", bad],
        ["gate", "--baseline", bad, "--current", REPORT],
        ["compare", REPORT, bad],
        ["profile", "--config", bad, "--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"],
    ):
        line = assert_one_line(invoke(args), 2, "bad.json")
        assert "internal error" not in line


def _leaves(value, path=()):
    if isinstance(value, dict) and value:
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        yield from _leaves(value[0], (*path, 0))
    if path:
        yield path


@pytest.mark.parametrize("every", [pytest.param(1, marks=pytest.mark.slow), 4], ids=["all", "every-4th"])
def test_every_nested_field_of_a_report_of_another_type_is_refused_or_ignored(tmp_path, every):
    """Every field of a recorded report, at any depth, replaced by a value of another type (one per field, in
    turn): gate reads it or refuses it with one line, never an internal error. The default run takes every
    fourth field (tests/test_bad_reports.py takes every top-level and metrics field with every wrong value)."""
    base = json.loads(REPORT.read_text())
    paths = sorted(set(_leaves(base)), key=str)
    wrong = [None, "text", -1, [], {}, [1, "a"], {"a": {}}, 1e308, True]
    bad = tmp_path / "bad.json"
    for i, p in enumerate(paths):
        if i % every:
            continue
        doc = copy.deepcopy(base)
        d = doc
        for k in p[:-1]:
            d = d[k]
        d[p[-1]] = wrong[i % len(wrong)]
        bad.write_text(json.dumps(doc))
        r = invoke(["gate", "--baseline", REPORT, "--current", bad])
        assert r.exit_code in (0, 1, 2), (p, r.output)
        assert "Traceback" not in r.output and "internal error" not in r.output, (p, r.output)
        if r.exit_code == 2:
            assert_one_line(r, 2)  # the file refused, or the two found not comparable


@pytest.fixture(scope="module")
def whole(recorded, tmp_path_factory) -> dict:
    return analyze(_write(tmp_path_factory.mktemp("whole") / "t.json", recorded))["files"][0]["facts"]


@pytest.mark.parametrize("which", ["kernel", "cpu op", "runtime call"])
def test_an_event_written_twice_is_counted_once_and_said(tmp_path, recorded, whole, which):
    """The same event twice (a trace concatenated with a part of itself) is one event: every fact is the
    trace's, and the copy is counted and named."""
    i = _index(recorded, next(p for w, p, _ in WHICH if w == which))
    events = recorded["traceEvents"]
    doubled = {**recorded, "traceEvents": events[: i + 1] + [dict(events[i])] + events[i + 1 :]}
    facts = analyze(_write(tmp_path / "t.json", doubled))["files"][0]["facts"]
    assert facts["trace.invalid_events"] == 1 and "the same event twice" in facts["trace.warnings"][0]
    _same_facts(facts, whole)
