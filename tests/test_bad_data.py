"""Bad `--data` files: a bad record is named by its line and, with --bad-records skip, skipped and
counted, whatever is wrong with it (bad JSON, bad bytes, an image that does not decode); a path that
is no data file at all is one line, exit 2."""

from __future__ import annotations

import json

import pytest
from _badinput import FAST, assert_one_line, invoke
from conftest import good_record, write_jsonl

from vlmdoctor.errors import UsageError
from vlmdoctor.run.data import LlavaFile

BAD_LINES = [
    ("latin-1 bytes", "latin1"),
    ("bad JSON", "{not json"),
    ("not an object", "[1, 2]"),
    ("missing image", json.dumps({"conversations": []})),
    ("undecodable image", "broken-image"),
    ("deep nesting", "[" * 100000 + "]" * 100000),
]


def _file(llava_dir, bad: str):
    (llava_dir / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    good = [json.dumps(good_record(f"images/img{k}.png", k)) for k in range(4)]
    path = llava_dir / "train.jsonl"
    if bad == "latin1":
        raw = "\n".join(good[:2]).encode() + b'\n{"image": "caf\xe9"}\n' + "\n".join(good[2:]).encode() + b"\n"
        path.write_bytes(raw)
        return path
    line = json.dumps(good_record("images/broken.png", 9)) if bad == "broken-image" else bad
    write_jsonl(path, [*good[:2], line, *good[2:]])
    return path


@pytest.mark.parametrize("name, bad", BAD_LINES, ids=[n for n, _ in BAD_LINES])
def test_a_bad_record_stops_with_its_line_or_is_skipped_and_counted(llava_dir, tokenizer_dir, tiny_spec, name, bad):
    path = _file(llava_dir, bad)
    with pytest.raises(UsageError, match=r"line 3: .*--bad-records skip"):
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="stop")
    ds = LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="skip")
    assert ds.stats.records == 5 and ds.stats.skipped == 1 and len(ds) == 4
    assert "line 3" in ds.stats.problems[0]


def test_a_json_list_with_a_bad_byte_in_a_record_is_a_bad_record(llava_dir, tokenizer_dir, tiny_spec):
    good = [json.dumps(good_record(f"images/img{k}.png", k)).encode() for k in range(3)]
    path = llava_dir / "train.json"
    path.write_bytes(
        b"[\n" + b",\n".join([good[0], b'{"image": "caf\xe9.png", "conversations": []}', *good[1:]]) + b"\n]\n"
    )
    with pytest.raises(UsageError, match=r"record 1: not UTF-8"):
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec)
    ds = LlavaFile(str(path), str(tokenizer_dir), tiny_spec, bad_records="skip")
    assert ds.stats.skipped == 1 and len(ds) == 3


def test_a_bad_byte_outside_any_record_names_its_line(llava_dir, tokenizer_dir, tiny_spec):
    path = llava_dir / "train.json"
    path.write_bytes(b'[\n{"image": "a.png"}\n\xe9]\n')
    with pytest.raises(UsageError, match=r"line 3"):
        LlavaFile(str(path), str(tokenizer_dir), tiny_spec)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: d, "is a folder"),
        (lambda d: d / "missing.jsonl", "no such file"),
        (lambda d: d / ("d" * 300 + ".jsonl"), "longer than 255"),
    ],
)
def test_a_data_path_that_is_no_file(tmp_path, tokenizer_dir, make, needle):
    r = invoke(["profile", *FAST, "--data", make(tmp_path), "--tokenizer", tokenizer_dir])
    assert_one_line(r, 2, "--data", needle)


def test_skipped_records_are_said_on_the_console(llava_dir, tokenizer_dir, monkeypatch):
    monkeypatch.chdir(llava_dir)
    path = _file(llava_dir, "{not json")
    r = invoke(
        [
            "profile",
            *FAST,
            "--data",
            path,
            "--tokenizer",
            tokenizer_dir,
            "--bad-records",
            "skip",
            "--batch-size",
            "2",
            "--lr",
            "0.001",
            "--seed",
            "3",
        ]
    )
    assert r.exit_code == 0, r.output
    flat = " ".join(r.stdout.split())
    assert "1 of 5 records skipped" in flat
    assert "lr=0.001" in flat and "seed=3" in flat and "data=" in flat  # knobs the user set are listed
