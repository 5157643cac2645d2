"""The second probe's families (2026-11-27): classes the first probe did not hold.

- **observer** (heavy): every script of tests/corpus/ run plain and under a way in (`vlmdoctor run`,
  `Doctor`, `DoctorCallback`, `run -- torchrun`), under windows that end early, late or never, and
  environments a user sets (warnings as errors, more threads, a hash seed, a narrow terminal, interpreter
  options): the losses bit for bit, the files and the exit code must be the plain run's
  (`observe_driver.py`); a defect is a change of the user's training. `run --stop-after-window` must stop.
- **settings**: `[tool.vlmdoctor]` in every TOML spelling, under each command that reads it, with a
  parent folder's table that must not apply instead; a pyproject.toml that is not TOML.
- **trace key**: the bytes `"traceEvents"` before the real key (in a string, a nested object, a list), an
  escaped real key: the events are the top-level list, as every JSON reader sees it.
- **output paths**: `-`, an empty path, a folder's name, for each output of each command.
- **report fields**: values that parse but break a verdict (all-zero step times, no tokens, negative sizes,
  a wrong recorded window), as baseline and as current, in `gate` and `compare`.
- **step summary**: report text that is Markdown or HTML (links, images, headings, a table's pipe) reaching
  `$GITHUB_STEP_SUMMARY`.
- **modes**: outputs under a private and a shared umask.
- **links in a rank folder**, **events written twice**, **an error line of a megabyte**, **a closed stdout**.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from harness import CHANGE, INTERNAL, SECURITY, WRONG, Case, Ctx, Obs
from kit import CPU_TRACE, RANKS, S, case, fix, put, put_report, says

HERE = Path(__file__).resolve().parent
T = "t.pt.trace.json.gz"

# --- observer ---------------------------------------------------------------------------------------------------

#: corpus scripts and the ways in that apply to each (the Trainer's is the callback, DDP runs under torchrun)
SCRIPTS = {
    "loop_dropout_seeded.py": ("run", "doctor"),
    "loop_unseeded.py": ("run", "doctor"),
    "loop_no_grad_eval.py": ("run", "doctor"),
    "loop_numpy_workers.py": ("run", "doctor"),
    "loop_custom_sampler.py": ("run", "doctor"),
    "loop_bare_except.py": ("run", "doctor"),
    "loop_atexit_checkpoint.py": ("run", "doctor"),
    "loop_background_thread.py": ("run", "doctor"),
    "loop_compiled.py": ("run", "doctor"),
    "loop_own_profiler.py": ("run", "doctor"),
    "loop_lora.py": ("run", "doctor"),
    "trainer_eval_accum.py": ("run", "callback"),
    "ddp_gloo.py": ("run", "doctor"),
}
#: (name, window, environment, interpreter options): each applies to the plain run and the watched one alike
VARIANTS = [
    ("w121", [1, 2, 1], {}, []),
    ("w0", [0, 1, 1], {}, []),  # the window opens at the first step
    ("wlong", [5, 40, 2], {}, []),  # longer than the script: the window never closes
    ("warn", [1, 2, 1], {"PYTHONWARNINGS": "error::DeprecationWarning"}, []),  # warnings as errors
    ("seed", [1, 2, 1], {"OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "7"}, []),  # more threads, a hash seed
]
#: the case's folder names are kept short: a DataLoader worker's socket lives in TMPDIR, inside the case's
#: folder, and a Unix socket's path may not exceed 107 bytes (a longer name failed the user's script, plain too)


def _changed(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    line = next((x for x in obs.stdout.splitlines() if x.startswith("USER-")), "no verdict (the driver failed)")
    return [] if line == "USER-OK" else [(CHANGE, line[:300])]


def _observer(script: str, way: str, variant: str, window: list[int], env: dict, flags: list[str]) -> Case:
    spec = {"script": script, "way": way, "window": window, "flags": flags}
    if script == "ddp_gloo.py":
        spec["ranks"] = 2
    name = script.removesuffix(".py")
    return case(
        f"obs/{name}/{way}/{variant}",
        "run" if way.startswith("run") else "callback" if way == "callback" else "api",
        "observer",
        "the script's losses (bit for bit), files and exit code are the plain run's"
        if way != "run-stop"
        else "--stop-after-window stops the script after the window, exit 0, the report written",
        ["python", "observe_driver.py", json.dumps(spec)],
        setup=fix("observe_driver.py", HERE / "observe_driver.py"),
        kind="python",
        code=0,
        env=env,
        check=_changed,
        heavy=True,
        timeout=600,
        temp_ok=("*",),  # the scripts' own DataLoader workers and compilers use TMPDIR, plain too
        aims=CHANGE,
        ci=(script, way, variant) == ("loop_dropout_seeded.py", "doctor", "w121"),  # the class's test in CI
    )


def observer_cases() -> list[Case]:
    out = []
    for script, ways in SCRIPTS.items():
        for way in ways:
            for variant, window, env, flags in VARIANTS:
                out.append(_observer(script, way, variant, window, env, flags))
        if "run" in ways and script != "ddp_gloo.py":
            out.append(_observer(script, "run-stop", "stop", [1, 2, 1], {}, []))
    return out


# --- settings ---------------------------------------------------------------------------------------------------

SPELLINGS = {
    "spaces": '[ tool.vlmdoctor ]\nselect = ["no-such-rule-x"]\n',
    "quoted": '[tool."vlmdoctor"]\nselect = ["no-such-rule-x"]\n',
    "spaced-dots": '[ tool . vlmdoctor ]\nselect = ["no-such-rule-x"]\n',
    "dotted-keys": 'tool.vlmdoctor.select = ["no-such-rule-x"]\n',
    "inline": '[tool]\nvlmdoctor = { select = ["no-such-rule-x"] }\n',
    "dotted-in-tool": '[tool]\nvlmdoctor.select = ["no-such-rule-x"]\n',
    "quoted-key": '[tool.vlmdoctor]\n"select" = ["no-such-rule-x"]\n',
}
READERS = {  # commands that read the table, each with what it needs
    "analyze": (["analyze", T], fix(T, CPU_TRACE)),
    "gate": (["gate", "--baseline", "a.json", "--current", "b.json"], S(put_report("a.json"), put_report("b.json"))),
    "profile": (["profile", "--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"], None),
}


def settings_cases() -> list[Case]:
    out = []
    parent = put("pyproject.toml", '[tool.vlmdoctor]\nignore = ["low"]\n')  # must not stand in for the project's
    for spelling, text in SPELLINGS.items():
        for command, (argv, setup) in READERS.items():
            steps = [parent, put("proj/pyproject.toml", text)] + ([setup] if setup else [])
            argv = [a if a not in (T, "a.json", "b.json") else f"../{a}" for a in argv]
            out.append(
                case(
                    f"{command}/toml-{spelling}",
                    command,
                    "settings",
                    "the project's table, however TOML spells it, is read (its unknown rule id refused, exit 2); "
                    "the parent folder's table does not apply instead",
                    argv,
                    setup=S(*steps),
                    cwd="proj",
                    needles=("no-such-rule-x",),
                    aims=WRONG,
                )
            )
    for command, (argv, setup) in READERS.items():
        argv = [a if a not in (T, "a.json", "b.json") else f"../{a}" for a in argv]
        steps = [parent, put("proj/pyproject.toml", '[tool.vlmdoctor]\nselect = ["x"]\n'.encode("utf-16"))]
        out.append(
            case(
                f"{command}/toml-utf16",
                command,
                "settings",
                "a pyproject.toml that is not TOML is said (exit 2), never skipped for a parent's",
                argv,
                setup=S(*steps, *([setup] if setup else [])),
                cwd="proj",
                needles=("pyproject.toml",),
                aims=WRONG,
            )
        )
    return out


# --- the trace's top-level key ----------------------------------------------------------------------------------

DECOY = {"ph": "X", "cat": "kernel", "name": "DECOY_kernel", "ts": 1.0, "dur": 5.0, "pid": 0, "tid": 7}
DECOYS = {
    "in-a-string": lambda: {"note": 'a copy of "traceEvents": [' + json.dumps(DECOY) + "]"},
    "nested-key": lambda: {"nested": {"traceEvents": [DECOY]}},
    "in-a-list": lambda: {"list": [{"traceEvents": [DECOY]}]},
    "deep": lambda: {"a": {"b": {"c": {"traceEvents": [DECOY]}}}},
}


def _decoyed(decoy: str, escaped: bool):
    def make(ctx: Ctx) -> None:
        import gzip

        with gzip.open(CPU_TRACE, "rt") as f:
            real = json.load(f)
        head = json.dumps(DECOYS[decoy]())[1:-1]
        key = '"trace\\u0045vents"' if escaped else '"traceEvents"'
        rest = {k: v for k, v in real.items() if k != "traceEvents"}
        text = "{" + head + ", " + key + ": " + json.dumps(real["traceEvents"]) + ", " + json.dumps(rest)[1:]
        (ctx.work / "t.json").write_text(text)

    return make


def _no_decoy(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    return [(WRONG, "the decoy's kernel was read as an event")] if "DECOY" in obs.out else []


def trace_key_cases() -> list[Case]:
    out = []
    for decoy in DECOYS:
        for escaped in (False, True):
            for command, argv in (
                ("analyze", ["analyze", "t.json", "--json", "-"]),
                ("export", ["export", "t.json", "--chrome", "c.json.gz"]),
            ):
                out.append(
                    case(
                        f"{command}/top-key-{decoy}{'-escaped' if escaped else ''}",
                        command,
                        "trace-key",
                        "the events are the top-level traceEvents list: the decoy before it is not read",
                        argv,
                        setup=_decoyed(decoy, escaped),
                        code=0,
                        check=_no_decoy if command == "analyze" else _chrome_without_decoy,
                        creates=("work/c.json.gz",) if command == "export" else (),
                        aims=WRONG,
                    )
                )
    return out


def _chrome_without_decoy(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    import gzip

    p = ctx.work / "c.json.gz"
    if not p.exists():
        return []
    with gzip.open(p, "rt") as f:
        events = json.load(f).get("traceEvents") or []
    return [(WRONG, "the export holds the decoy as an event")] if any("DECOY" in str(e) for e in events) else []


# --- output paths -----------------------------------------------------------------------------------------------

WRITERS = {  # command, its argv before the output flag, setup, the outputs it has
    "analyze": (["analyze", T], fix(T, CPU_TRACE), ("--json", "--html")),
    "compare": (["compare", "a.json", "b.json"], S(put_report("a.json"), put_report("b.json")), ("--json",)),
    "gate": (
        ["gate", "--baseline", "a.json", "--current", "b.json"],
        S(put_report("a.json"), put_report("b.json")),
        ("--json", "--junit"),
    ),
    "export": (["export", T], fix(T, CPU_TRACE), ("--chrome",)),
}
PATHS = {"empty": ("", "an empty path"), "slash": ("out/", "names a folder"), "dot": (".", "names a folder")}


def path_cases() -> list[Case]:
    out = []
    for command, (argv, setup, flags) in WRITERS.items():
        for flag in flags:
            values = dict(PATHS)
            if flag != "--json":
                values["dash"] = ("-", "cannot go to standard output")
            for name, (value, needle) in values.items():
                out.append(
                    case(
                        f"{command}/path-{flag.strip('-')}-{name}",
                        command,
                        "output",
                        f"{flag} {value!r}: refused in one line before the work (exit 2), nothing written",
                        [*argv, flag, value],
                        setup=S(setup, put("out/keep.txt", "the user's")),
                        needles=(needle,),
                        absent=("work/-", "work/out.json", "work/.json"),
                        aims=WRONG,
                    )
                )
    return out


# --- report fields --------------------------------------------------------------------------------------------

FIELDS = {
    "step-ms-all-zero": (lambda r: r["repeats"][0].update(step_ms=[0.0] * len(r["repeats"][0]["step_ms"])), "zero"),
    "tokens-all-zero": (
        lambda r: r["repeats"][0].update(step_real_tokens=[0] * len(r["repeats"][0]["step_ms"])),
        "zero",
    ),
    "peak-mem-negative": (lambda r: r["metrics"].update(peak_mem_gb=-2.0), "negative"),
    "step-ms-negative": (lambda r: r["metrics"].update(step_ms=-1.0), "negative"),
    "warmup-string": (lambda r: r.update(script={"command": ["python", "t.py"], "warmup": "five"}), "script.warmup"),
}


def field_cases() -> list[Case]:
    out = []
    for name, (edit, needle) in FIELDS.items():
        for side in ("baseline", "current"):
            bad, good = ("a.json", "b.json") if side == "baseline" else ("b.json", "a.json")
            for command, argv in (
                ("gate", ["gate", "--baseline", "a.json", "--current", "b.json"]),
                ("compare", ["compare", "a.json", "b.json"]),
            ):
                out.append(
                    case(
                        f"{command}/field-{name}-{side}",
                        command,
                        "report-field",
                        "a field that parses but breaks the verdict is refused, naming it (exit 2)",
                        argv,
                        setup=S(put_report(bad, edit), put_report(good)),
                        needles=(needle,),
                        aims=WRONG,
                    )
                )
    return out


# --- the step summary -------------------------------------------------------------------------------------------

MARKDOWN = {
    "link": "[passed](https://evil.example)",
    "image": "![x](https://evil.example/x.png)",
    "html": "<img src=x onerror=alert(1)><script>1</script>",
    "heading": "\n## vlmdoctor gate passed\n",
    "pipe": "a | b | c",
}


def _summary_is_text(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    from markdown_it import MarkdownIt

    p = ctx.work / "summary.md"
    if not p.exists():
        return [(WRONG, "no step summary written")]
    html = MarkdownIt("commonmark").enable("table").render(p.read_text())
    bad = [w for w in ("<a ", "<img", "<script") if w in html]
    if bad or html.count("<h2>") != 1:
        return [(SECURITY, f"report text rendered as Markdown or HTML in the step summary: {bad or 'a heading'}")]
    return []


def summary_cases() -> list[Case]:
    out = []
    for name, text in MARKDOWN.items():
        out.append(
            case(
                f"gate/summary-{name}",
                "gate",
                "hostile-string",
                "report text in $GITHUB_STEP_SUMMARY renders as that text: no link, image, HTML or heading",
                ["gate", "--baseline", "a.json", "--current", "b.json"],
                # the current report's torch version holds the text: the gate names the change in a note
                setup=S(put_report("a.json"), put_report("b.json", lambda r, t=text: r["env"].update(torch=t))),
                env={"GITHUB_STEP_SUMMARY": "{work}/summary.md"},
                code=(0, 1, 2),
                check=_summary_is_text,
                aims=SECURITY,
            )
        )
    return out


# --- modes, links, copies, long errors, a closed stdout ----------------------------------------------------------


def _mode_is(rel: str, mask: int):
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        p = ctx.work / rel
        if not p.exists():
            return [(WRONG, f"{rel} not written")]
        mode = stat.S_IMODE(p.stat().st_mode)
        return [] if mode == 0o666 & ~mask else [(SECURITY, f"{rel} has mode {oct(mode)} under umask {oct(mask)}")]

    return check


def _umask_argv(mask: int, argv: list[str]) -> list[str]:
    """`vlmdoctor ARGV` in a process whose umask is `mask`, as a user's shell would set it."""
    code = f"import os, sys; os.umask({mask}); from vlmdoctor.cli import main; sys.argv[0] = 'vlmdoctor'; main()"
    return ["python", "-c", code, *argv]


def misc_cases() -> list[Case]:
    out = []
    for mask in (0o077, 0o002):
        for command, argv, setup, rel in (
            ("analyze", ["analyze", T, "--json", "r.json"], fix(T, CPU_TRACE), "r.json"),
            (
                "compare",
                ["compare", "a.json", "b.json", "--json", "r.json"],
                S(put_report("a.json"), put_report("b.json")),
                "r.json",
            ),
            ("export", ["export", T, "--chrome", "c.json.gz"], fix(T, CPU_TRACE), "c.json.gz"),
            (
                "gate",
                ["gate", "--baseline", "a.json", "--current", "b.json", "--junit", "j.xml"],
                S(put_report("a.json"), put_report("b.json")),
                "j.xml",
            ),
        ):
            out.append(
                case(
                    f"{command}/umask-{mask:03o}",
                    command,
                    "output",
                    "an output gets the mode the user's umask gives a new file",
                    _umask_argv(mask, argv),
                    setup=setup,
                    kind="python",
                    code=(0, 1),
                    check=_mode_is(rel, mask),
                    aims=SECURITY,
                )
            )

    def ranks_with_link(ctx: Ctx) -> None:
        import shutil

        shutil.copytree(RANKS, ctx.work / "ranks")
        (ctx.work / "ranks" / "rank9.pt.trace.json").symlink_to(ctx.outside / "secret.txt")

    for command, argv in (("analyze", ["analyze", "ranks"]), ("export", ["export", "ranks", "--hta-dir", "h"])):
        out.append(
            case(
                f"{command}/rank-folder-link",
                command,
                "symlink",
                "a link inside a rank folder is not followed: its target is never read or echoed",
                argv,
                setup=ranks_with_link,
                code=(0, 2),
                check=lambda ctx, obs: [(SECURITY, "the link's target was read")] if "private notes" in obs.out else [],
                aims=SECURITY,
            )
        )

    def doubled(ctx: Ctx) -> None:
        import gzip

        with gzip.open(CPU_TRACE, "rt") as f:
            d = json.load(f)
        d["traceEvents"] = d["traceEvents"] + [dict(e) for e in d["traceEvents"] if e.get("ph") == "X"]
        (ctx.work / "t.json").write_text(json.dumps(d))

    out.append(
        case(
            "analyze/events-twice",
            "analyze",
            "duplicate",
            "a trace whose events are written twice is read once, and says so",
            ["analyze", "t.json"],
            setup=doubled,
            code=0,
            check=says("the same event twice"),
            aims=WRONG,
        )
    )
    long = "x" * 120_000  # one argument's most on Linux is 128 KiB
    for command, argv in (
        ("analyze", ["analyze", long + ".json"]),
        ("compare", ["compare", long + ".json", "b.json"]),
        ("gate", ["gate", "--baseline", long + ".json", "--current", "b.json"]),
        ("export", ["export", long + ".json", "--chrome", "c.json.gz"]),
        ("profile", ["profile", "--config", long + ".yaml"]),
    ):
        out.append(
            case(
                f"{command}/error-of-a-megabyte",
                command,
                "huge",
                "an error line stays readable (its middle left out, said), exit 2",
                argv,
                setup=put_report("b.json"),
                check=lambda ctx, obs: (
                    [(WRONG, "an error line over 2,000 characters")]
                    if any(len(x) > 2000 for x in obs.stderr.splitlines() if "error" in x)
                    else []
                ),
                aims=WRONG,
            )
        )
    closed = (
        "import os, sys; os.close(1); from vlmdoctor.cli import main; sys.argv = ['vlmdoctor', *sys.argv[1:]]; main()"
    )
    for command, argv, setup in (
        ("analyze", ["analyze", T], fix(T, CPU_TRACE)),
        ("rules", ["rules", "list"], None),
        ("facts", ["facts"], None),
        ("models", ["models"], None),
        ("compare", ["compare", "a.json", "b.json"], S(put_report("a.json"), put_report("b.json"))),
        (
            "gate",
            ["gate", "--baseline", "a.json", "--current", "b.json"],
            S(put_report("a.json"), put_report("b.json")),
        ),
    ):
        out.append(
            case(
                f"{command}/stdout-closed",
                command,
                "closed-pipe",
                "with stdout closed the command does its work and ends without an internal error",
                ["python", "-c", closed, *argv],
                setup=setup,
                kind="python",
                code=(0, 1, 120),
                aims=INTERNAL,
            )
        )
    return out


def all_observer_cases() -> list[Case]:
    return [
        *observer_cases(),
        *settings_cases(),
        *trace_key_cases(),
        *path_cases(),
        *field_cases(),
        *summary_cases(),
        *misc_cases(),
    ]


if __name__ == "__main__":
    cs = all_observer_cases()
    print(len(cs), "cases;", sum(c.heavy for c in cs), "heavy")
