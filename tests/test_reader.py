"""The trace reader: chunks decoded by msgspec give the tables the one-event-at-a-time reader gave,
on every layout of the JSON, in one process or several; and the analysis commands need no GPU stack.

The reference here is the reader the fast path replaced: `json` decodes the events and `_take`
turns each into table rows (tables.py keeps `_take` for the chunks msgspec's structs refuse).
The traces are real fixtures, written back in other JSON layouts.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from vlmdoctor.trace import facts as facts_mod
from vlmdoctor.trace import read, tables
from vlmdoctor.trace.read import SplitError, iter_batches, iter_events, split_points
from vlmdoctor.trace.tables import _Builder, _take, load_tables

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "fixtures" / "traces"
SOURCE = TRACES / "compile_s2.pt.trace.json.gz"  # a small real H100 trace: kernels, runtime, ops, steps
FIELDS = (
    *("meta", "steps", "gpu", "ops", "runtime", "shapes", "types", "memory", "recorded", "comm", "operands"),
    "invalid",
)


def _doc(thin: bool = True) -> dict:
    """The source trace; thin: every third timed event (all categories, a third of the time to test)."""
    with gzip.open(SOURCE, "rt") as f:
        doc = json.load(f)
    if thin:
        doc["traceEvents"] = [e for i, e in enumerate(doc["traceEvents"]) if i % 3 == 0 or e.get("ph") != "X"]
    return doc


def _reference(path: Path) -> tables.Tables:
    """The tables as the event-by-event reader made them: json's events through _take, in order."""
    b = _Builder()
    for ev in json.loads(path.read_bytes().decode("utf-8", "replace"))["traceEvents"]:
        _take(ev, b)
    return b.tables(path, read.read_metadata(path))


def _same(a, b, where: str = "") -> None:
    """Exactly equal: frames with their dtypes and category order, numbers bit for bit."""
    assert type(a) is type(b), where
    if isinstance(a, pd.DataFrame):
        pd.testing.assert_frame_equal(a, b, check_exact=True)
        for c in a.columns:
            if isinstance(a[c].dtype, pd.CategoricalDtype):
                assert list(a[c].cat.categories) == list(b[c].cat.categories), f"{where}.{c}"
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b), where
    else:
        assert a == b, where


def _same_tables(a: tables.Tables, b: tables.Tables) -> None:
    for k in FIELDS:
        _same(getattr(a, k), getattr(b, k), k)


def _write(path: Path, doc: dict, layout: str) -> Path:
    """The trace in one of the JSON layouts writers use; "tail" moves some top-level keys after traceEvents."""
    if layout == "tail":
        events = doc["traceEvents"]
        head = {k: v for k, v in doc.items() if k not in ("traceEvents", "traceName", "displayTimeUnit")}
        after = {k: doc[k] for k in ("traceName", "displayTimeUnit") if k in doc}
        text = json.dumps(head)[:-1] + ', "traceEvents": ' + json.dumps(events) + ", " + json.dumps(after)[1:]
    else:
        kw = {"indented": {"indent": 2}, "compact": {"separators": (",", ":")}, "one_line": {}}[layout]
        text = json.dumps(doc, **kw)
    path.write_text(text)
    return path


@pytest.mark.parametrize("layout", ["indented", "compact", "one_line", "tail"])
def test_every_layout_reads_as_the_event_by_event_reader_read_it(tmp_path, layout, monkeypatch):
    doc = _doc()
    p = _write(tmp_path / "t.json", doc, layout)
    monkeypatch.setattr(read, "BLOCK", 1 << 12)  # 4 KB reads: many events straddle a refill
    tail: dict = {}
    events = list(iter_events(p, block=1 << 12, tail=tail))
    assert events == doc["traceEvents"]
    keys = list(json.loads(p.read_text()))  # in the order written
    assert tail == {k: doc[k] for k in keys[keys.index("traceEvents") + 1 :]} and (layout != "tail" or tail)
    _same_tables(load_tables(p), _reference(p))


def test_gzip_and_plain_give_the_same_tables(tmp_path):
    plain = _write(tmp_path / "t.json", _doc(thin=False), "indented")
    a, b = load_tables(SOURCE), load_tables(plain)
    a.path = b.path
    _same_tables(a, b)
    _same_tables(b, _reference(plain))


def test_odd_values_take_the_json_path_and_give_what_it_gave(tmp_path):
    """Values msgspec's typed structs refuse (numeric strings, NaN, null args, a bool thread) and names
    holding the text that separates events: every chunk still reads as the json reader read it."""
    doc = _doc()
    evs = doc["traceEvents"]
    ops = [i for i, e in enumerate(evs) if e.get("cat") == "cpu_op"]
    evs[ops[10]]["ts"] = str(evs[ops[10]]["ts"])  # float("123.5") is what the reader did
    evs[ops[20]]["dur"] = float("nan")
    evs[ops[30]]["args"] = None
    evs[ops[40]]["tid"] = True
    evs[ops[50]]["name"] = 'aten::odd},{"ph": "X", "cat": "cpu_op"}, {'
    evs[ops[60]]["args"] = {**(evs[ops[60]].get("args") or {}), "Input Dims": [[4, 8], [[1, 2], [3]]]}
    p = tmp_path / "odd.json"
    p.write_text(json.dumps(doc, indent=1, allow_nan=True))
    _same_tables(load_tables(p), _reference(p))


def test_an_event_larger_than_a_read_is_read_whole(tmp_path, monkeypatch):
    doc = _doc()
    doc["traceEvents"][100]["args"] = {**doc["traceEvents"][100].get("args", {}), "big": "x" * 300_000}
    p = tmp_path / "big_event.json"
    p.write_text(json.dumps(doc))
    monkeypatch.setattr(read, "BLOCK", 1 << 14)
    assert list(iter_events(p, block=1 << 14)) == doc["traceEvents"]
    _same_tables(load_tables(p), _reference(p))


def test_parts_read_by_several_processes_join_into_the_whole(tmp_path, monkeypatch):
    p = _write(tmp_path / "t.json", _doc(), "indented")
    spans = split_points(p, 3)
    assert len(spans) == 3 and spans[-1][1] is None
    n = sum(len(ev) for span in spans for _, ev, _ in iter_batches(p, span=span))
    assert n == sum(1 for _ in iter_events(p))
    monkeypatch.setattr(tables, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(tables, "idle_cores", lambda: 4)  # whatever else the machine runs
    _same_tables(load_tables(p, workers=3), _reference(p))


def test_a_cut_inside_a_string_is_caught_and_the_file_read_whole(tmp_path, monkeypatch):
    """A name full of `},{` at the middle of the file: the split lands inside it, that part does not
    decode as whole events, and the file is read in one pass instead, to the same tables."""
    doc = _doc()
    evs = doc["traceEvents"]
    evs[len(evs) // 2]["name"] = "},{" * 400_000  # a third of the file, from its middle on
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    spans = split_points(p, 2)
    text = p.read_bytes()
    start = text.index(b"},{},{")
    assert start < spans[0][1] < start + 1_200_000  # the cut falls inside the name
    with pytest.raises(SplitError):
        for span in spans:
            for _ in iter_batches(p, span=span):
                pass
    monkeypatch.setattr(tables, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(tables, "idle_cores", lambda: 4)  # whatever else the machine runs
    _same_tables(load_tables(p, workers=2), _reference(p))


def test_a_rank_folder_analyzed_in_parallel_equals_the_serial_analysis(monkeypatch):
    folder = ROOT / "fixtures" / "dist_cpu" / "ddp"
    serial = facts_mod.analyze(folder, workers=1)
    monkeypatch.setattr(facts_mod, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(facts_mod, "cpus", lambda: 2)
    _same(facts_mod.analyze(folder, workers=2), serial)


def test_soft_parts_meet_without_a_gap_or_an_overlap_wherever_the_cut_falls(tmp_path):
    """A soft span's end and the next one's start are found by two readers from the same offset: wherever
    that offset falls (inside a name, a number, the separator), the parts hold every event once, in order."""
    doc = _doc()
    doc["traceEvents"] = doc["traceEvents"][:400]
    for layout in ("indented", "compact"):
        p = _write(tmp_path / f"{layout}.json", doc, layout)
        size = p.stat().st_size
        for at in [*range(size // 2, size // 2 + 300, 5), size // 3]:
            spans = [read.Span(-1, at, exact=False), read.Span(at, None, exact=False)]
            got = [e for s in spans for _, evs, _ in iter_batches(p, span=s, block=1 << 14) for e in evs]
            assert got == doc["traceEvents"], (layout, at)


def test_a_gzip_trace_read_in_parts_joins_into_the_whole(tmp_path, monkeypatch):
    """A .gz trace is split like a plain one, at offsets of its inflated text (from gzip's trailer): the
    parts join into the tables one process reads."""
    plain = _write(tmp_path / "t.json", _doc(), "indented")
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(plain.read_bytes()))
    assert read.json_size(p) == plain.stat().st_size
    spans = split_points(p, 3)
    assert [s.exact for s in spans] == [False] * 3 and spans[0].start == -1 and spans[-1].end is None
    monkeypatch.setattr(read, "BLOCK", 1 << 14)  # parts of a small file: reads smaller than a part
    assert sum(len(ev) for s in spans for _, ev, _ in iter_batches(p, span=s)) == sum(1 for _ in iter_events(p))
    monkeypatch.setattr(tables, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(tables, "idle_cores", lambda: 4)  # whatever else the machine runs
    assert tables._read_parts(p, 3) is not None  # read in parts, not whole after a failed part
    _same_tables(load_tables(p, workers=3), load_tables(p))
    monkeypatch.setattr(tables, "idle_cores", lambda: 1)  # a busy machine: one process reads it all
    assert tables._read_parts(p, 3) is None


def test_a_gzip_part_cut_inside_a_string_is_caught_and_the_file_read_whole(tmp_path, monkeypatch):
    doc = _doc()
    evs = doc["traceEvents"]
    evs[len(evs) // 2]["name"] = "},{" * 400_000
    p = tmp_path / "t.json.gz"
    p.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(SplitError):
        for span in split_points(p, 2):
            for _ in iter_batches(p, span=span):
                pass
    monkeypatch.setattr(tables, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(tables, "idle_cores", lambda: 4)  # whatever else the machine runs
    assert tables._read_parts(p, 2) is None
    _same_tables(load_tables(p, workers=2), load_tables(p))


def test_a_gzip_rank_folder_counts_its_inflated_size(monkeypatch):
    """Whether a rank folder is worth a process per file is decided on its JSON text, not on its gzip
    size (a fifteenth of it): ranks of a few MB of .gz each are analyzed side by side."""
    folder = ROOT / "fixtures" / "dist_cpu" / "ddp"
    files = read.trace_files(folder)
    on_disk, text = sum(f.stat().st_size for f in files), sum(map(read.json_size, files))
    assert text > 5 * on_disk
    pooled = []
    monkeypatch.setattr(facts_mod, "PARALLEL_MIN_BYTES", (on_disk + text) // 2)
    monkeypatch.setattr(facts_mod, "cpus", lambda: 2)
    monkeypatch.setattr(
        facts_mod, "run_pool", lambda calls, limit: pooled.append(limit) or [c[0](*c[1]) for c in calls]
    )
    facts_mod.analyze(folder, workers=2)
    assert pooled == [2]


def test_the_pool_keeps_the_order_and_raises_the_first_error():
    from vlmdoctor.trace.worker import run_pool

    calls = [(pow, (2, k)) for k in range(5)]
    assert run_pool(calls, 3) == [1, 2, 4, 8, 16]
    assert run_pool(calls, 1) == [1, 2, 4, 8, 16]
    with pytest.raises(ZeroDivisionError):
        run_pool([(pow, (2, 1)), (divmod, (1, 0)), (pow, (2, 3))], 2)


_EVENT = {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 2.0, "pid": 1, "tid": 1}


@pytest.mark.parametrize(
    "head",
    [
        '{"note": "see \\"traceEvents\\": [the decoy]", ',  # the bytes inside a string
        '{"nested": {"traceEvents": [{"name": "decoy"}]}, ',  # a key of a nested object
        '{"list": [{"traceEvents": []}], ',  # inside a list
        '{"deviceProperties": [], ',  # the plain layout, as a control
    ],
    ids=["in-a-string", "nested-key", "in-a-list", "plain"],
)
@pytest.mark.parametrize("escaped", [False, True], ids=["key", "escaped-key"])
def test_the_events_are_the_top_level_list_every_json_reader_sees(tmp_path, head, escaped):
    """One top-level key reader: the events and the metadata are what json.load sees, whatever bytes spell
    'traceEvents' before the real key, and however the real key is spelled."""
    key = '"trace\\u0045vents"' if escaped else '"traceEvents"'
    text = head + key + ": [" + json.dumps(_EVENT) + '], "traceName": "t"}'
    path = tmp_path / "t.json"
    path.write_text(text)
    whole = json.loads(text)
    assert list(iter_events(path)) == whole["traceEvents"]
    meta = read.read_metadata(path)
    assert meta == {k: v for k, v in whole.items() if k not in ("traceEvents", "traceName")}


def test_a_trace_whose_only_traceevents_is_nested_has_no_events(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"nested": {"traceEvents": [{"name": "decoy"}]}, "other": 1}')
    with pytest.raises(read.TraceError, match="top-level 'traceEvents'"):
        list(iter_events(path))


def test_a_link_inside_a_rank_folder_is_not_followed(tmp_path):
    """A rank folder's files are read, a link in it is not: its target (anything on the machine) is never
    opened, so no error can echo its first bytes."""
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET not a trace")
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "rank1.pt.trace.json").symlink_to(secret)
    with pytest.raises(read.TraceError, match="not followed") as e:
        read.trace_files(ranks)
    assert "TOPSECRET" not in str(e.value)
    (ranks / "rank0.pt.trace.json").write_text('{"traceEvents": []}')
    assert read.trace_files(ranks) == [ranks / "rank0.pt.trace.json"]
