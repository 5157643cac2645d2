"""Text is text: names, paths and messages from traces, reports, rule files and the command line are shown
as written, never acted on. For every command and every console renderer, hostile strings (every C0
control character, clear-screen, window-title and OSC 8 hyperlink sequences, Rich markup, Unicode bidi
controls) go into trace names, model names, rule titles and evidence, report fields and paths; the
console output then holds no control character, no markup was interpreted (nor failed to parse), the
exit code is the documented one and every input is byte-identical afterwards. CSV cells that a
spreadsheet would run as formulas are neutralised.

The traces here are copies of recorded fixtures whose names the test rewrites (the hostile input);
nothing here is committed as a recording.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import re
from pathlib import Path
from xml.etree import ElementTree

import pytest
import yaml
from _badinput import REPORT, REPORT_1, invoke, snapshot
from rich.console import Console
from rich.table import Table
from rich.text import Text

from vlmdoctor.report import console as con
from vlmdoctor.report.text import SafeConsole, esc, plain

ROOT = Path(__file__).resolve().parents[1]
#: a user's GPU trace (H100, recorded by torch.profiler): host ops, kernels, findings with advice
USER_TRACE = ROOT / "fixtures" / "user_h100" / "llava_s1_plain.pt.trace.json.gz"
DDP = ROOT / "fixtures" / "dist_cpu" / "ddp"

C0 = "".join(chr(c) for c in range(32) if c not in (0, 10))  # NUL cannot be in a path; a newline is a newline
HOSTILE = {
    "clear": "clear\x1b[2J\x1b[Hscreen",
    "title": "title\x1b]0;pwned\x07",
    "osc8": "osc\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\",
    "close": "[/]",
    "bold": "[bold]KEEP[/bold]",
    "link": "[link=http://evil.example/]LINKED[/link]",
    "bidi": "bidi\u202eevil\u2066x\u2069",
    "c0": "c0:" + C0 + "\x7f\x9b",
    "emoji": ":red_circle:",
}
#: every class in one string (a path, a name)
EVERY = "".join(HOSTILE.values())
#: as much of it as one file name can hold (no NUL, no /; a folder path holds the rest, see hostile_dir)
NAME = EVERY.replace("\x00", "").replace("/", "")
#: what must never reach the console: C0 controls but the newline, DEL, C1 controls, bidi controls
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
SGR = re.compile(r"\x1b\[[0-9;]*m")  # rich's own colours on a terminal
#: report fields whose values are an enumeration the tools act on: left as they are
ENUMS = {"status", "kind", "severity", "schema_version", "outcome", "verdict", "audience", "type", "source", "per"}


def assert_shown_as_text(output: str) -> None:
    """No control character, no markup interpreted: each marker still stands after its literal tag."""
    raw = RAW.findall(output)
    assert not raw, sorted(set(raw))
    assert "internal error" not in output and "Traceback" not in output
    for marker, tag in (("KEEP", r"\[bold\]$"), ("LINKED", r"\[link=[^\]]*\]$")):  # interpreted, a tag is gone
        for m in re.finditer(marker, output):
            assert re.search(tag, output[: m.start()]), output[max(0, m.start() - 80) : m.end() + 20]
    assert "\U0001f534" not in output  # :red_circle: stays text


def poison(value, text: str = EVERY, key: str | None = None):
    """Every string of a report (but the enumerations the tools act on) with `text` appended."""
    if isinstance(value, dict):
        return {k: poison(v, text, k) for k, v in value.items()}
    if isinstance(value, list):
        return [poison(v, text, key) for v in value]
    if isinstance(value, str) and key not in ENUMS:
        return value + text
    return value


@pytest.fixture
def strict_markup(monkeypatch):
    """Markup that does not parse is a failure here: SafeConsole's fallback (shown as it is) must never be
    what keeps a command from crashing, every site escapes what it puts in markup. Wide consoles, so that
    no marker wraps."""

    def render_str(self, text, **kwargs):
        return Console.render_str(self, text, **kwargs)

    monkeypatch.setattr(SafeConsole, "render_str", render_str)
    monkeypatch.setenv("COLUMNS", "4000")


def wide() -> tuple[SafeConsole, io.StringIO]:
    buf = io.StringIO()
    return SafeConsole(file=buf, width=4000), buf


# --- the boundary ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", HOSTILE)
@pytest.mark.parametrize("how", ["markup", "escaped", "table", "text", "no-markup"])
@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_the_console_never_passes_a_control_character(name, how, terminal):
    """Whatever way text reaches a SafeConsole (unescaped markup included), control characters come out as
    visible escapes and no hyperlink is emitted; on a terminal only rich's own colours are escape codes."""
    buf = io.StringIO()
    c = SafeConsole(file=buf, width=4000, force_terminal=terminal, color_system="truecolor" if terminal else None)
    text = HOSTILE[name]
    if how == "markup":  # a site that forgot to escape: the boundary still holds
        c.print(f"[bold]x[/bold] {text}")
    elif how == "escaped":
        c.print(f"[bold]x[/bold] {esc(text)}")
    elif how == "table":
        t = Table("a", title=esc(text))
        t.add_row(esc(text))
        c.print(t)
    elif how == "text":
        c.print(Text(text, style="bold"))
    else:
        c.print(text, markup=False)
    out = SGR.sub("", buf.getvalue()) if terminal else buf.getvalue()
    assert not RAW.search(out), repr(out)
    assert "\x1b]" not in out  # no OSC: no window title, no hyperlink


@pytest.mark.parametrize("name", HOSTILE)
def test_escaped_text_is_shown_as_written(name):
    c, buf = wide()
    c.print(f"[bold]{esc(HOSTILE[name])}[/bold]")
    assert buf.getvalue().rstrip("\n") == plain(HOSTILE[name])


def test_unparsable_markup_never_fails_the_print():
    """The safety net at the boundary: a site that forgot to escape prints the line as it is."""
    buf = io.StringIO()
    SafeConsole(file=buf, width=200).print("[bold]a[/bold] [/] b")
    assert buf.getvalue() == "[bold]a[/bold] [/] b\n"


# --- every renderer, every field of real reports ------------------------------------------------


@pytest.fixture(scope="module")
def analysis():
    """A user's GPU trace and a 2-rank DDP folder analyzed and diagnosed as `analyze` does (advice included)."""
    result = {}
    for name, path in (("user", USER_TRACE), ("ddp", DDP)):
        r = invoke(["analyze", path, "--json", "-"])
        assert r.exit_code == 0, r.output
        result[name] = json.loads(r.stdout)
    assert result["user"]["files"][0]["findings"] and "facts" in result["ddp"]["cross_rank"]
    return result


def own_report(analysis) -> dict:
    entry = analysis["user"]["files"][0]
    report = json.loads(REPORT.read_text())
    return {
        **report,
        "config": {"source": "api", "model": "LlavaForConditionalGeneration", "stage": 1, "stage_source": "given"},
        "model": {**report["model"], "class": "LlavaForConditionalGeneration", "parts": {"vision": "SiglipVision"}},
        "notes": ["a note"],
        "facts": entry["facts"],
        "diagnosis": entry["diagnosis"],
        "flops": {"formula": "counted"},
    }


def _treat_result() -> dict:
    from test_treat import FakeRunner, run_fake

    return run_fake(FakeRunner(fail={"compile": ("default", "oom")}), max_trials=4)


RENDERERS = {
    "profile": lambda a, c: con.render(poison(json.loads(REPORT.read_text())), c),
    "profile-failed": lambda a, c: con.render(
        poison({**json.loads(REPORT.read_text()), "status": "error", "error": {"message": "boom"}}), c
    ),
    "findings": lambda a, c: con.render_findings(poison(a["user"]["files"][0]["diagnosis"]), c, plain),
    "facts": lambda a, c: con.render_facts(poison(a["user"]), c),
    "cross-rank": lambda a, c: con.render_cross_rank(poison(a["ddp"]["cross_rank"]), c),
    "own": lambda a, c: con.render_own(poison(own_report(a)), c),
    "rule-page": lambda a, c: con.render_rule_page(poison(_page()), c),
    "ladder": lambda a, c: con.render_ladder(poison(_treat_result()), c),
    "sweep": lambda a, c: con.render_sweep(poison([_row("ok"), _row("error")]), c),
    "compare": lambda a, c: _compare(a, c),
}


def _page() -> dict:
    from vlmdoctor.doctor.rules import load_rules, rule_page

    return rule_page(next(r for r in load_rules()[0] if r.id == "precision-fp32-gemms"))


def _row(status: str) -> dict:
    from vlmdoctor.ci.sweep import row

    report = json.loads(REPORT.read_text())
    return row("batch_size=8", {**report, "status": status, "error": {"message": "it failed"}})


def _compare(a, c) -> None:
    from vlmdoctor.report.compare import compare, render_compare

    entry = a["user"]["files"][0]
    base = {**json.loads(REPORT.read_text()), "facts": entry["facts"], "findings": entry["findings"]}
    other = {**json.loads(REPORT_1.read_text()), "facts": entry["facts"], "findings": []}
    result = compare(poison(base), poison(other), True, labels=("a" + EVERY, "b" + EVERY))
    render_compare(result, c)


@pytest.mark.usefixtures("strict_markup")
@pytest.mark.parametrize("renderer", RENDERERS)
def test_every_renderer_shows_report_text_as_text(analysis, renderer):
    c, buf = wide()
    RENDERERS[renderer](analysis, c)
    out = buf.getvalue()
    assert "KEEP" in out  # the hostile text did reach the console
    assert_shown_as_text(out)


TAGS = '<script>alert(1)</script><img src=x onerror=y>"&' + EVERY
HTML_PAGES = {
    "profile": lambda a: _html("profile_html", json.loads(REPORT.read_text())),
    "own": lambda a: _html("profile_html", own_report(a)),
    "analyze": lambda a: _html("analyze_html", a["user"]),
    "ranks": lambda a: _html("analyze_html", a["ddp"]),
    "treat": lambda a: _html("treat_html", _treat_result()),
}


def _html(name: str, doc: dict) -> str:
    from vlmdoctor.report import html

    return getattr(html, name)(poison(doc, TAGS))


@pytest.mark.parametrize("page", HTML_PAGES)
def test_every_html_page_escapes_every_report_field(analysis, page):
    """The HTML report was escaped already; checked here over every string field of each kind of page."""
    text = HTML_PAGES[page](analysis)
    assert "alert(1)" in text.replace("&lt;", "<")  # the hostile text did reach the page
    assert "<script>alert" not in text and "<img src=x" not in text


# --- every command, on hostile inputs -----------------------------------------------------------

strict = pytest.mark.usefixtures("strict_markup")


def hostile_dir(root: Path, name: str = "") -> Path:
    """A folder whose path holds every class (a `/` splits it into two folders: `[` and `]`)."""
    d = root / ("in" + EVERY.replace("\x00", "") + name)
    d.mkdir(parents=True)
    return d


def hostile_rules(root: Path, when: str = "step.ms > 0") -> tuple[Path, str]:
    d = hostile_dir(root, "rules")
    rid = "user-" + EVERY
    rule = {
        "id": rid,
        "layer": 2,
        "title": "title " + EVERY,
        "severity": "low",
        "detects": "detects " + EVERY,
        "when": when,
        "constants": {"LIMIT": {"value": 1, "why": "why " + EVERY}},
        "evidence": ["seen " + EVERY + " {step.ms}"],
        "fix": "fix " + EVERY,
        "patch": {"batch_size": 8},
        "sources": ["source " + EVERY],
    }
    (d / "hostile.yaml").write_text(yaml.safe_dump(rule))
    return d, rid


@pytest.fixture(scope="module")
def hostile_trace(tmp_path_factory) -> Path:
    """A copy of a recorded user trace whose kernel and host-op names end in every hostile class."""
    root = tmp_path_factory.mktemp("trace")
    with gzip.open(USER_TRACE, "rt") as f:
        doc = json.load(f)
    for ev in doc["traceEvents"]:
        if ev.get("cat") in ("kernel", "cpu_op", "cuda_runtime") and "name" in ev:
            ev["name"] = ev["name"] + " " + EVERY
    path = hostile_dir(root) / ("t" + NAME + ".pt.trace.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    return path


def run_clean(args: list, inputs: list[Path], code: int | tuple = 0) -> str:
    """The command's exit code, inputs untouched, and its whole console output shown as text. A wide
    console: what is checked is the text, not where a line of a long hostile path happens to wrap (which
    moves with the length of the test's temp folder)."""
    before = {p: snapshot(p) if p.is_dir() else p.read_bytes() for p in inputs}
    from vlmdoctor import cli

    widths = cli.out._width, cli.err._width
    cli.out.width = cli.err.width = 1000
    try:
        r = invoke(args)
    finally:
        cli.out._width, cli.err._width = widths
    out = r.output + (r.stderr or "")
    assert r.exit_code in ((code,) if isinstance(code, int) else code), out
    assert {p: snapshot(p) if p.is_dir() else p.read_bytes() for p in inputs} == before
    assert_shown_as_text(out)
    return out


@strict
def test_analyze_a_hostile_trace_with_hostile_rules(tmp_path, hostile_trace):
    rules, _ = hostile_rules(tmp_path)
    out = run_clean(["analyze", hostile_trace, "--rules", rules], [hostile_trace, rules])
    assert "[bold]KEEP[/bold]" in out and "[link=http://evil.example/]LINKED" in out
    assert plain(hostile_trace.name) in out  # the path, shown as text


@strict
@pytest.mark.parametrize("sub", ["list", "show"])
def test_rules_list_and_show_a_hostile_rule(tmp_path, sub):
    rules, rid = hostile_rules(tmp_path)
    args = ["rules", "list", "--rules", rules] if sub == "list" else ["rules", "show", rid, "--rules", rules]
    out = run_clean(args, [rules])
    assert "KEEP" in out


@pytest.fixture(scope="module")
def hostile_reports(tmp_path_factory, analysis) -> tuple[Path, Path]:
    root = hostile_dir(tmp_path_factory.mktemp("reports"))
    entry = analysis["user"]["files"][0]
    paths = []
    for i, src in enumerate((REPORT, REPORT_1)):
        report = json.loads(src.read_text())
        report |= {"findings": entry["findings"] if i else [], "facts": entry["facts"], "notes": ["n"]}
        p = root / f"r{i}{NAME}.json"
        p.write_text(json.dumps(poison(report)))
        paths.append(p)
    return paths[0], paths[1]


@strict
def test_compare_hostile_reports(hostile_reports):
    a, b = hostile_reports
    out = run_clean(["compare", a, b, "--allow-different"], [a, b])
    assert "KEEP" in out


@strict
def test_gate_on_hostile_reports_says_its_verdict_and_writes_its_files(tmp_path, hostile_reports, analysis):
    """The probe's case: a `[/` in a report field crashed the table after PASSED; now the verdict, the
    JUnit and the JSON all come out, and the console shows the fields (new findings, versions) as text."""
    a, _ = hostile_reports
    current = json.loads(a.read_text())
    current["findings"] = poison(analysis["user"]["files"][0]["findings"])
    current["env"]["torch"] = "2.99" + EVERY
    b = a.parent / ("current" + NAME + ".json")
    b.write_text(json.dumps(current))
    junit, verdict = tmp_path / "g.xml", tmp_path / "g.json"
    args = ["gate", "--baseline", a, "--current", b, "--fail-on", "low", "--junit", junit, "--json", verdict]
    out = run_clean(args, [a, b], 1)
    result = json.loads(verdict.read_text())
    assert not result["passed"] and "FAILED" in out and "KEEP" in out
    ElementTree.fromstring(junit.read_bytes())  # well-formed XML whatever the report held


@strict
def test_export_a_hostile_trace(tmp_path, hostile_trace):
    dest = hostile_dir(tmp_path, "out") / "e.json.gz"
    out = run_clean(["export", hostile_trace, "--chrome", dest], [hostile_trace])
    assert dest.exists() and plain(dest.name) in out


@strict
def test_sweep_with_hostile_run_names_neutralises_its_csv(tmp_path, monkeypatch):
    """Run names from a grid reach the console as text and the CSV as cells a spreadsheet will not run
    (the runs themselves are stood in for by a recorded report: the names are what is tested)."""
    import vlmdoctor.run.runner as runner

    recorded = json.loads(REPORT.read_text())
    monkeypatch.setattr(runner, "run_isolated", lambda cfg, **_: {**recorded, "config": cfg.to_dict()})
    names = ['=HYPERLINK("http://evil.example","x")', "+1+1", "-2", "@SUM(A1)", "\tTAB", "\rCR", EVERY]
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        yaml.safe_dump({"defaults": {"model": "tiny", "device": "cpu"}, "runs": [{"name": n} for n in names]})
    )
    table = tmp_path / "s.csv"
    out = run_clean(["sweep", grid, "--csv", table], [grid])
    assert "KEEP" in out
    cells = [r["name"] for r in csv.DictReader(io.StringIO(table.read_bytes().decode(), newline=""))]
    assert len(cells) == len(names)
    for cell, name in zip(cells, names):
        assert not cell.startswith(("=", "+", "-", "@", "\t", "\r")), cell
        assert cell.lstrip("'") == name  # the same text, quoted by the csv module where it must be


@strict
def test_run_says_hostile_paths_as_text(tmp_path):
    """`vlmdoctor run`'s own lines (where the log is, why nothing was measured) name the user's paths."""
    folder = hostile_dir(tmp_path, "run")
    script = folder / ("train" + NAME + ".py")
    script.write_text("print('no optimizer step here')\n")
    out = run_clean(["run", "--out", folder / "out", "--", "python", script], [script], 1)
    assert "never called an optimizer step" in out and plain(str(folder / "out" / "script.log")) in out


@pytest.mark.slow  # the renderers' test above holds the same class (a profile report, its findings) fast
@strict
def test_profile_shows_hostile_rules_and_paths_as_text(tmp_path):
    """A real CPU run diagnosed with a hostile rule that fires, its trace kept in a hostile folder."""
    rules, _ = hostile_rules(tmp_path)
    traces = hostile_dir(tmp_path, "traces")
    args = ["profile", "--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--trace-steps", "1"]
    args += ["--autocast", "off", "--batch-size", "1", "--num-samples", "8"]
    out = run_clean([*args, "--rules", rules, "--trace-dir", traces], [rules])
    assert "[bold]KEEP[/bold]" in out and plain(str(traces)) in out


@strict
def test_doctor_prints_a_hostile_model_name_as_text(tmp_path, capsys):
    """`Doctor` (and so `vlmdoctor run` and the callback, which share its report and console)."""
    import torch

    import vlmdoctor

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(x)

    Net.__name__ = "Net" + EVERY  # a model class whose name holds every hostile class
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = hostile_dir(tmp_path, "doctor")
    with vlmdoctor.Doctor(model, out=out, warmup=0, steps=2, trace_steps=1) as doc:
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            doc.step()
    captured = capsys.readouterr()
    assert doc.report["model"]["class"] == Net.__name__
    assert "KEEP" in captured.out
    assert_shown_as_text(captured.out + captured.err)
