"""Every YAML input (a --config file, a rule file, a sweep grid, a --set value) goes through one bounded
loader: aliases and anchors, a key written twice, deep nesting, an oversized file and a number that does
not convert are each refused with one line naming the input and the line, never expanded or silently
resolved. The inputs are generated: bombs of several shapes, duplicates at several depths, nesting at
and past the bound."""

from __future__ import annotations

import pytest
from _badinput import FAST, assert_one_line, invoke, snapshot

from vlmdoctor.doctor.rules import load_rules
from vlmdoctor.errors import UsageError
from vlmdoctor.inputs import MAX_DEPTH, MAX_YAML_BYTES, parse_yaml

TINY = ["--model", "tiny", "--device", "cpu"]

RULE = """id: user-rule
layer: 2
title: a user's rule
severity: low
when: "gpu.busy_frac < LIMIT"
constants: {LIMIT: {value: 0.9, why: test}}
evidence: ["busy {gpu.busy_frac:pct}"]
fix: do something
patch: {batch_size: 8}
"""
GRID = "runs:\n  - name: a\n    set: {batch_size: 2}\n"
CONFIG = "batch_size: 2\nlr: 1.0e-5\n"


def _list_bomb(levels: int, width: int) -> str:
    """Billion laughs: each level a list of `width` aliases of the level below."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\n"


def _map_bomb(levels: int, width: int) -> str:
    """The same with mappings: each level a mapping of `width` keys, each an alias of the level below."""
    lines = ["m0: &m0 {x: lol}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{" + ", ".join(f"k{j}: *m{i - 1}" for j in range(width)) + "}")
    return "\n".join(lines) + "\n"


def _block_bomb(levels: int) -> str:
    """Block style: anchors on indented sequences."""
    out = ["b0: &b0\n  - lol\n  - lol\n"]
    for i in range(1, levels):
        out.append(f"b{i}: &b{i}\n  - *b{i - 1}\n  - *b{i - 1}\n")
    return "".join(out)


#: (name, YAML text placed before the input's own lines, what the refusal names)
ALIASES = [
    ("list-laughs", _list_bomb(9, 10), "&a0"),
    ("map-laughs", _map_bomb(8, 9), "&m0"),
    ("block-laughs", _block_bomb(30), "&b0"),
    ("merge-key", "base: &base {batch_size: 2}\nother:\n  <<: *base\n", "&base"),
    ("one-alias", "x: &v 1\ny: *v\n", "&v"),
    ("anchor-alone", "x: &v 1\n", "&v"),
    ("alias-undefined", "y: *nowhere\n", "*nowhere"),
]


def _input(kind: str, tmp_path, text: str):
    """Give `text` to vlmdoctor as the input kind: (the CLI result, or for rules the load problems)."""
    if kind == "config":
        f = tmp_path / "run.yaml"
        f.write_text(text)
        return invoke(["profile", "--config", f, *FAST])
    if kind == "grid":
        f = tmp_path / "grid.yaml"
        f.write_text(text)
        return invoke(["sweep", f])
    d = tmp_path / "rules"
    d.mkdir(exist_ok=True)
    (d / "user.yaml").write_text(text)
    return invoke(["rules", "list", "--rules", d])


def _refused(kind: str, result, *needles: str) -> None:
    """Exit 2 and one line naming the input (for a rule file: one `rule problem` line), no traceback."""
    if kind != "rules":
        assert_one_line(result, 2, *needles)
        return
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    lines = [x for x in result.stderr.splitlines() if x.startswith("rule problem:")]
    assert len(lines) == 1 and "user.yaml" in lines[0], result.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.mark.parametrize("kind", ["config", "grid", "rules"])
@pytest.mark.parametrize("name, bomb, needle", ALIASES, ids=[a[0] for a in ALIASES])
def test_aliases_and_anchors_are_refused_in_every_yaml_input(tmp_path, monkeypatch, kind, name, bomb, needle):
    monkeypatch.chdir(tmp_path)
    base = {"config": CONFIG, "grid": GRID, "rules": RULE}[kind]
    r = _input(kind, tmp_path, bomb + base)
    before = snapshot(tmp_path)
    _refused(kind, r, "line 1,", needle)
    assert snapshot(tmp_path) == before  # refused before any work: nothing written


def _nested_dup(depth: int, key: str, flow: bool) -> tuple[str, int]:
    """A mapping nested `depth` deep whose innermost level writes `key` twice; (text, line of the second)."""
    if flow:
        inner = f"{{{key}: 1, other: 2, {key}: 3}}"
        for i in range(depth - 1):
            inner = f"{{n{i}: {inner}}}"
        return f"extra: {inner}\n", 1
    lines = ["extra:"]
    for i in range(depth - 1):
        lines.append("  " * (i + 1) + f"n{i}:")
    pad = "  " * depth
    lines += [f"{pad}{key}: 1", f"{pad}other: 2", f"{pad}{key}: 3"]
    return "\n".join(lines) + "\n", len(lines)


@pytest.mark.parametrize("flow", [False, True], ids=["block", "flow"])
@pytest.mark.parametrize("depth", [1, 2, 5, 20])
def test_a_key_written_twice_is_refused_at_any_depth(depth, flow):
    text, line = _nested_dup(depth, "lr", flow)
    with pytest.raises(UsageError) as e:
        parse_yaml(text, "config run.yaml")
    msg = e.value.message
    assert msg.startswith("config run.yaml: ") and "'lr' is written twice" in msg and f"line {line}," in msg
    assert "\n" not in msg


@pytest.mark.parametrize(
    "kind, text, key, line",
    [
        ("config", "lr: 1.0e-5\nbatch_size: 2\nlr: 1.0e-3\n", "lr", 3),  # the probe's case: last-wins
        ("grid", "runs:\n  - name: a\n    set: {lr: 1.0e-5, lr: 2.0e-5}\n", "lr", 3),
        ("grid", "runs:\n  - name: a\nruns:\n  - name: b\n", "runs", 3),
        ("grid", "defaults:\n  batch_size: 2\n  batch_size: 4\nruns:\n  - name: a\n", "batch_size", 3),
        ("rules", RULE + 'when: "gpu.busy_frac > 2"\n', "when", 10),
        ("rules", RULE.replace("why: test}", "why: test, value: 0.1}"), "value", 6),
    ],
    ids=["config-top", "grid-set", "grid-top", "grid-defaults", "rule-top", "rule-constant"],
)
def test_duplicate_keys_in_each_input_name_the_key_and_line(tmp_path, monkeypatch, kind, text, key, line):
    monkeypatch.chdir(tmp_path)
    r = _input(kind, tmp_path, text)
    _refused(kind, r, f"'{key}' is written twice", f"line {line},")


@pytest.mark.parametrize("flow", [False, True], ids=["block", "flow"])
@pytest.mark.parametrize("depth", [MAX_DEPTH - 2, MAX_DEPTH + 1, 5000])
def test_nesting_is_bounded(depth, flow):
    if flow:
        text = "x: " + "[" * depth + "]" * depth + "\n"
    else:
        text = "".join("  " * i + "- \n" for i in range(depth))
    if depth < MAX_DEPTH:
        parse_yaml(text, "grid file g.yaml")  # within the bound: read
        return
    with pytest.raises(UsageError) as e:
        parse_yaml(text, "grid file g.yaml")
    assert e.value.message.startswith("grid file g.yaml: ") and "nested" in e.value.message


@pytest.mark.parametrize("kind", ["config", "grid"])
def test_deep_nesting_through_the_command(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    r = _input(kind, tmp_path, "lr: " + "[" * 10_000 + "]" * 10_000 + "\n")
    assert_one_line(r, 2, f"nested more than {MAX_DEPTH} deep")


@pytest.mark.parametrize("kind", ["config", "grid", "rules"])
def test_a_yaml_file_over_the_size_bound_is_refused_unread(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    r = _input(kind, tmp_path, "# " + "x" * MAX_YAML_BYTES + "\n")
    _refused(kind, r, "more than the 1 MiB")


@pytest.mark.parametrize("kind", ["config", "grid", "rules"])
def test_a_number_of_thousands_of_digits_is_a_clear_refusal(tmp_path, monkeypatch, kind):
    monkeypatch.chdir(tmp_path)
    base = {"config": CONFIG, "grid": GRID, "rules": RULE}[kind]
    r = _input(kind, tmp_path, "big: 1" + "0" * 5000 + "\n" + base)
    _refused(kind, r, "does not convert")


@pytest.mark.parametrize(
    "item, needle",
    [
        ("batch_size=&a 2", "&a"),
        ("batch_size=*a", "*a"),
        ("lr={a: 1, a: 2}", "'a' is written twice"),
        ("batch_size=" + "[" * 100 + "]" * 100, "nested"),
    ],
)
def test_set_values_go_through_the_same_loader(tmp_path, monkeypatch, item, needle):
    monkeypatch.chdir(tmp_path)
    assert_one_line(invoke(["treat", *TINY, "--set", item]), 2, "--set", needle)


def test_the_shipped_rules_and_grids_load_through_the_bounded_loader():
    """The bounds refuse nothing the project ships."""
    from pathlib import Path

    from vlmdoctor.ci.sweep import grid_rows

    rules, problems = load_rules()
    assert rules and problems == []
    root = Path(__file__).resolve().parents[1]
    grids = sorted((root / "bench" / "grids").glob("*.yaml"))
    assert grids
    for g in grids:
        assert isinstance(parse_yaml(g.read_text(), str(g)), dict)
    assert grid_rows(root / "bench" / "grids" / "issue2_0.5b.yaml")


def test_a_text_parsed_again_is_a_fresh_copy_and_its_error_names_each_place():
    """Parsed texts are kept (the rule folder is read at every diagnosis): each caller still gets a value of its own,
    and a text that does not parse says where it was read, each time."""
    text = "a: [1, 2]\nb: {c: 3}\n"
    first = parse_yaml(text, "config one")
    first["a"].append(9)
    first["b"]["c"] = 0
    assert parse_yaml(text, "config two") == {"a": [1, 2], "b": {"c": 3}}
    for where in ("file one", "file two"):
        with pytest.raises(UsageError, match=f"^{where}: does not parse"):
            parse_yaml("a: [1, 2\n", where)
