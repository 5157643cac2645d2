"""Cases of the commands that read: analyze, export, compare, rules, facts, models."""

from __future__ import annotations

import gzip
import json
from typing import Any

from harness import INTERNAL, LEAK, WRONG, Case, Signal
from kit import (
    CPU_TRACE,
    GPU_TRACE,
    HOSTILE,
    RANKS,
    REPORT,
    REPORT_2,
    SIGTERM,
    S,
    both,
    case,
    edit_events,
    events,
    fifo,
    fix,
    full,
    hardlink,
    json_at,
    link,
    mkdir,
    never_says,
    put,
    put_report,
    put_trace,
    readonly,
    rescued_or_written,
    rule_yaml,
    secret_not_shown,
    stdout_json,
    trace_dict,
)

T = "t.pt.trace.json.gz"
TJ = "t.pt.trace.json"


def _counted_or_refused(ctx, obs) -> list[tuple[str, str]]:
    """An event whose time cannot be used: refused (2), or left out and counted (trace.invalid_events, a warning)."""
    if obs.rc == 2:
        return []
    try:
        rep = json.loads((ctx.work / "facts.json").read_text())
        n = sum((f.get("facts") or {}).get("trace.invalid_events") or 0 for f in rep["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return [(WRONG, "no facts.json to check")]
    if not n:
        return [(WRONG, "an unusable event time was used silently (trace.invalid_events is 0)")]
    return []


def _analyze_edit(id: str, input: str, edit: Any, expect: str, src=GPU_TRACE, ci: bool = False) -> Case:
    """analyze on a real trace with events edited to a value of the wrong type or range: exit 2, or exit 0 with
    the events counted as invalid; never an internal error, never a silent use."""
    return case(
        f"analyze/{id}",
        "analyze",
        input,
        expect,
        ["analyze", TJ, "--json", "facts.json"],
        setup=put_trace(TJ, edit, src),
        code=(0, 2),
        check=_counted_or_refused,
        aims=WRONG,
        ci=ci,
    )


def _set(key: str, value: Any):
    return lambda e: e.__setitem__(key, value)


def _meta(change):
    def edit(d: dict[str, Any]) -> None:
        change(d)

    return edit


def _vlm(path: str, value: Any):
    """Set vlmdoctor.<a.b.c> in the trace's metadata (a JSON string in Kineto's output is parsed back first)."""

    def edit(d: dict[str, Any]) -> None:
        block = d.get("vlmdoctor")
        if isinstance(block, str):
            import ast

            block = ast.literal_eval(block)
        block = block or {}
        cur = block
        keys = path.split(".")
        for k in keys[:-1]:
            cur = cur.setdefault(k, {})
        cur[keys[-1]] = value
        d["vlmdoctor"] = block

    return edit


def _grow_forever(rel: str) -> str:
    """A writer that appends events to a trace for 40 s (a trace still being written)."""
    return (
        "import time, sys\n"
        f"f = open({rel!r}, 'a')\n"
        "end = time.time() + 40\n"
        "while time.time() < end:\n"
        '    f.write(\'{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, \'\n'
        '            \'"ts": 1.0, "dur": 1.0},\'); f.flush(); time.sleep(0.001)\n'
    )


def analyze_cases() -> list[Case]:
    cs: list[Case] = []
    A = "analyze"
    # --- what the path names ------------------------------------------------------------------------------
    cs += [
        case(
            "analyze/fifo-behind-a-link",
            A,
            "fifo",
            "a link named like a trace to a fifo: refused at once (exit 2), never waited on",
            ["analyze", TJ],
            setup=S(fifo("pipe"), link(TJ, "{work}/pipe")),
            needles=("regular",),
            timeout=30,
            ci=True,
        ),
        case(
            "analyze/dev-zero-link",
            A,
            "special",
            "a link named like a trace to /dev/zero: refused (exit 2), memory untouched",
            ["analyze", TJ],
            setup=link(TJ, "/dev/zero"),
            timeout=30,
        ),
        case(
            "analyze/dev-urandom-gz",
            A,
            "special",
            "t.json.gz linked to /dev/urandom: refused (exit 2)",
            ["analyze", T],
            setup=link(T, "/dev/urandom"),
            timeout=30,
        ),
        case(
            "analyze/folder-named-json",
            A,
            "special",
            "an empty folder named t.json: 'holds no trace files' (exit 2)",
            ["analyze", TJ],
            setup=mkdir(TJ),
            needles=("no trace files",),
        ),
        case(
            "analyze/rank-folder-link-loop",
            A,
            "symlink",
            "a rank folder with a link that points to itself beside a real trace: the link is left out, exit 0",
            ["analyze", "ranks", "--json", "facts.json"],
            setup=S(
                fix("ranks/trace_rank0.json.gz", RANKS / "trace_rank0.json.gz"), link("ranks/loop.json", "loop.json")
            ),
            code=0,
        ),
        case(
            "analyze/rank-folder-dangling-link",
            A,
            "symlink",
            "a dangling link in a rank folder is left out, exit 0",
            ["analyze", "ranks", "--json", "facts.json"],
            setup=S(
                fix("ranks/trace_rank0.json.gz", RANKS / "trace_rank0.json.gz"),
                link("ranks/gone.json.gz", "{outside}/nothing.json.gz"),
            ),
            code=0,
        ),
        case(
            "analyze/rank-folder-socket",
            A,
            "special",
            "a unix socket named rank1.json in a rank folder is left out, exit 0",
            ["analyze", "ranks", "--json", "facts.json"],
            setup=S(
                fix("ranks/trace_rank0.json.gz", RANKS / "trace_rank0.json.gz"),
                lambda ctx: _socket(ctx, "ranks/r1.json"),
            ),
            code=0,
        ),
        case(
            "analyze/empty-file",
            A,
            "wrong-type",
            "an empty t.json: exit 2, one line",
            ["analyze", TJ],
            setup=put(TJ, b""),
            ci=True,
        ),
        case(
            "analyze/empty-gzip",
            A,
            "wrong-type",
            "a gzip of nothing: exit 2",
            ["analyze", T],
            setup=put(T, gzip.compress(b"")),
        ),
        case(
            "analyze/truncated-gzip",
            A,
            "truncated",
            "the first 60% of a real .gz trace: exit 2 naming truncation",
            ["analyze", T],
            setup=put(T, lambda: GPU_TRACE.read_bytes()[: int(GPU_TRACE.stat().st_size * 0.6)]),
        ),
        case(
            "analyze/two-gzip-members",
            A,
            "wrong-type",
            "two whole traces concatenated as two gzip members: exit 2 (not one JSON document)",
            ["analyze", T],
            setup=put(T, lambda: CPU_TRACE.read_bytes() * 2),
            aims=WRONG,
            ci=True,
        ),
        case(
            "analyze/not-gzip-named-gz",
            A,
            "wrong-type",
            "plain JSON named .json.gz: exit 2",
            ["analyze", T],
            setup=put(T, lambda: gzip.decompress(CPU_TRACE.read_bytes())),
        ),
        case(
            "analyze/trace-events-object",
            A,
            "wrong-type",
            "traceEvents is an object, not a list: exit 2",
            ["analyze", TJ],
            setup=put(TJ, json.dumps({"schemaVersion": 1, "traceEvents": {"a": 1}})),
        ),
        case(
            "analyze/trace-events-numbers",
            A,
            "wrong-type",
            "traceEvents is a list of numbers: exit 2",
            ["analyze", TJ],
            setup=put(TJ, json.dumps({"traceEvents": list(range(1000))})),
        ),
        case(
            "analyze/top-level-list",
            A,
            "wrong-type",
            "the trace is a JSON list of events (no object): exit 2",
            ["analyze", TJ],
            setup=put_trace(TJ, lambda d: json.dumps(d["traceEvents"][:2000]), CPU_TRACE),
        ),
        case(
            "analyze/utf16",
            A,
            "wrong-type",
            "a real trace re-encoded as UTF-16: exit 2",
            ["analyze", TJ],
            setup=put_trace(TJ, lambda d: json.dumps(d).encode("utf-16"), CPU_TRACE),
        ),
        case(
            "analyze/bom",
            A,
            "wrong-type",
            "a real trace with a UTF-8 byte-order mark: read (exit 0) or refused (exit 2), never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, lambda d: b"\xef\xbb\xbf" + json.dumps(d).encode(), CPU_TRACE),
            code=(0, 2),
        ),
        case(
            "analyze/stdin-dash",
            A,
            "wrong-type",
            "analyze - with a trace on stdin: a clear refusal (exit 2)",
            ["analyze", "-"],
            stdin='{"traceEvents": []}',
        ),
    ]
    # --- events of the wrong type or range ------------------------------------------------------------------
    cs += [
        _analyze_edit(
            "null-events",
            "wrong-type",
            lambda d: d.__setitem__(
                "traceEvents", [None if i % 50 == 0 else e for i, e in enumerate(d["traceEvents"])]
            ),
            "every 50th event null: refused, or left out and counted",
        ),
        _analyze_edit(
            "kernel-ts-string",
            "wrong-type",
            edit_events("kernel", lambda e: e.__setitem__("ts", str(e["ts"]))),
            "kernel ts as strings",
            ci=True,
        ),
        _analyze_edit(
            "kernel-dur-bool", "wrong-type", edit_events("kernel", _set("dur", True), every=7), "kernel dur true"
        ),
        _analyze_edit(
            "kernel-dur-list", "wrong-type", edit_events("kernel", _set("dur", [1, 2]), every=11), "kernel dur a list"
        ),
        _analyze_edit(
            "kernel-ts-1e300",
            "huge",
            edit_events("kernel", _set("ts", 1e300), every=97),
            "a few kernels start at 1e300 us",
        ),
        _analyze_edit(
            "cpu-op-ts-1e300",
            "huge",
            edit_events("cpu_op", _set("ts", 1e300), every=501),
            "a few host ops start at 1e300 us",
        ),
        _analyze_edit(
            "kernel-ts-negative", "wrong-type", edit_events("kernel", _set("ts", -1.0), every=13), "kernels at ts -1"
        ),
        _analyze_edit(
            "step-ts-null",
            "wrong-type",
            edit_events(None, _set("ts", None), name="ProfilerStep#"),
            "ProfilerStep markers with ts null",
        ),
        _analyze_edit(
            "runtime-dur-nan-string",
            "wrong-type",
            edit_events("cuda_runtime", _set("dur", "NaN"), every=3),
            "runtime dur 'NaN' strings",
        ),
        _analyze_edit(
            "memcpy-dur-huge-int",
            "huge",
            edit_events("gpu_memcpy", _set("dur", 10**40)),
            "memcpy dur 10**40 (an integer)",
        ),
        case(
            "analyze/kernel-name-number",
            A,
            "wrong-type",
            "kernel names that are numbers: read (exit 0) or refused (2), never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events("kernel", _set("name", 12345), every=5)),
            code=(0, 2),
        ),
        case(
            "analyze/kernel-name-null",
            A,
            "wrong-type",
            "kernel names null: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events("kernel", _set("name", None), every=3)),
            code=(0, 2),
        ),
        case(
            "analyze/op-args-string",
            A,
            "wrong-type",
            "cpu_op args given as a string: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events("cpu_op", _set("args", "External id 5"), every=4)),
            code=(0, 2),
        ),
        case(
            "analyze/kernel-args-list",
            A,
            "wrong-type",
            "kernel args given as a list: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events("kernel", _set("args", [1, 2, 3]), every=4)),
            code=(0, 2),
        ),
        case(
            "analyze/kernel-stream-string",
            A,
            "wrong-type",
            "kernel args.stream and device as strings: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events("kernel", lambda e: e["args"].update(stream="7", device="0"))),
            code=(0, 2),
        ),
        case(
            "analyze/correlation-object",
            A,
            "wrong-type",
            "runtime args.correlation given as an object: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(
                TJ, edit_events("cuda_runtime", lambda e: (e.get("args") or {}).update(correlation={"x": 1}))
            ),
            code=(0, 2),
        ),
        case(
            "analyze/step-name-not-number",
            A,
            "wrong-type",
            "ProfilerStep#abc markers: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(
                TJ, edit_events(None, lambda e: e.__setitem__("name", "ProfilerStep#abc"), name="ProfilerStep#")
            ),
            code=(0, 2),
        ),
        case(
            "analyze/step-markers-duplicated",
            A,
            "wrong-type",
            "every ProfilerStep marker written twice: exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, lambda d: d["traceEvents"].extend(events(d, None, "ProfilerStep#"))),
            code=(0, 2),
        ),
        case(
            "analyze/ph-missing",
            A,
            "wrong-type",
            "events without 'ph': exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, edit_events(None, lambda e: e.pop("ph", None), every=2)),
            code=(0, 2),
        ),
        case(
            "analyze/latin1-name",
            A,
            "hostile-string",
            "a kernel name with bytes that are not UTF-8: exit 0 (shown replaced) or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(
                TJ,
                lambda d: (
                    json.dumps(d)
                    .replace("bfloat16_copy_kernel_cuda", "bfl\udcffoat")
                    .encode("utf-8", "surrogateescape")
                ),
            ),
            code=(0, 2),
        ),
        case(
            "analyze/lone-surrogate",
            A,
            "hostile-string",
            "a name holding a lone surrogate escape (\\ud800): exit 0 or 2, never an internal error",
            ["analyze", TJ, "--json", "facts.json"],
            setup=put_trace(TJ, lambda d: json.dumps(d).replace("aten::mm", "aten::mm\\ud800", 3)),
            code=(0, 2),
        ),
        case(
            "analyze/deep-args",
            A,
            "deep",
            "one event whose args nest 50,000 deep: exit 2 naming the event, never a RecursionError trace",
            ["analyze", TJ],
            setup=put_trace(
                TJ,
                lambda d: json.dumps(d).replace(
                    '"args": {', '"deep": ' + "[" * 50_000 + "]" * 50_000 + ', "args": {', 1
                ),
            ),
            code=(0, 2),
        ),
        case(
            "analyze/one-20mb-event",
            A,
            "huge",
            "one event of 20 MB (a long name) inside a gzip of under 1 MB: read whole, exit 0, memory bounded",
            ["analyze", T, "--json", "facts.json"],
            setup=put_trace(
                T,
                lambda d: d["traceEvents"].insert(
                    len(d["traceEvents"]) // 2, {"ph": "i", "name": "x" * 20_000_000, "ts": 1, "pid": 1, "tid": 1}
                ),
                CPU_TRACE,
            ),
            code=0,
        ),
        case(
            "analyze/one-70mb-event",
            A,
            "huge",
            "one event of 70 MB (over the 64 MiB bound) in a small gzip: refused (exit 2), memory bounded",
            ["analyze", T],
            setup=put_trace(
                T,
                lambda d: d["traceEvents"].insert(
                    100, {"ph": "i", "name": "y" * 70_000_000, "ts": 1, "pid": 1, "tid": 1}
                ),
                CPU_TRACE,
            ),
            timeout=120,
            ci=True,
        ),
        case(
            "analyze/many-distinct-names",
            A,
            "huge",
            "300,000 host ops of distinct 200-byte names (9 MB gzip): exit 0 or 2, memory under 2 GB",
            ["analyze", T, "--json", "facts.json"],
            setup=put(T, lambda: _distinct_names_trace(300_000)),
            code=(0, 2),
            timeout=240,
            heavy=True,
        ),
        case(
            "analyze/grows-while-read",
            A,
            "concurrent",
            "a trace still being appended to (no closing bracket) while analyze reads it: exit 2, no hang",
            ["analyze", TJ],
            setup=put_trace(TJ, lambda d: json.dumps(d)[:-200], CPU_TRACE),
            concurrent=["python", "-c", _grow_forever("t.pt.trace.json")],
            may_change=("work/t.pt.trace.json",),
            timeout=60,
        ),
        case(
            "analyze/replaced-while-read",
            A,
            "concurrent",
            "the trace is replaced (rename) by an empty file while analyze reads it: the open file is read, exit 0",
            ["analyze", T, "--json", "facts.json"],
            setup=fix(T, GPU_TRACE),
            concurrent=[
                "python",
                "-c",
                "import os,time; time.sleep(0.3); open('x','w').close(); os.replace('x', 't.pt.trace.json.gz')",
            ],
            code=(0, 2),
            may_change=("work/t.pt.trace.json.gz",),
        ),
    ]
    # --- metadata of the wrong type or range --------------------------------------------------------------
    for mid, change, inp in [
        (
            "device-mem-negative",
            lambda d: d.__setitem__(
                "deviceProperties",
                [{"name": "NVIDIA H100", "totalGlobalMem": -1, "computeMajor": 9, "computeMinor": 0}],
            ),
            "wrong-type",
        ),
        (
            "device-mem-zero",
            lambda d: d.__setitem__(
                "deviceProperties", [{"name": "NVIDIA H100", "totalGlobalMem": 0, "computeMajor": 9, "computeMinor": 0}]
            ),
            "wrong-type",
        ),
        ("device-list-of-lists", lambda d: d.__setitem__("deviceProperties", [[1, 2]]), "wrong-type"),
        (
            "device-compute-major-float",
            lambda d: d.__setitem__("deviceProperties", [{"name": "x", "totalGlobalMem": 8e10, "computeMajor": 9.5}]),
            "wrong-type",
        ),
        (
            "device-props-100k",
            lambda d: d.__setitem__("deviceProperties", [{"name": "g", "totalGlobalMem": 1}] * 100_000),
            "huge",
        ),
        (
            "rank-beyond-world",
            lambda d: d.__setitem__("distributedInfo", {"rank": 7, "world_size": 2, "backend": "nccl"}),
            "wrong-type",
        ),
        (
            "world-size-zero",
            lambda d: d.__setitem__("distributedInfo", {"rank": 0, "world_size": 0, "backend": "nccl"}),
            "wrong-type",
        ),
        (
            "world-size-negative",
            lambda d: d.__setitem__("distributedInfo", {"rank": 0, "world_size": -4, "backend": "nccl"}),
            "wrong-type",
        ),
        ("config-stage-7", _vlm("config.stage", 7), "wrong-type"),
        ("config-model-unknown", _vlm("config.model", "no-such-model"), "wrong-type"),
        ("config-batch-string", _vlm("config.batch_size", "sixteen"), "wrong-type"),
        ("metrics-step-negative", _vlm("metrics.step_ms", -5.0), "wrong-type"),
        ("params-total-zero", _vlm("model.params.total", 0), "wrong-type"),
        ("params-by-part-string", _vlm("model.params.by_part", "llm"), "wrong-type"),
        ("config-pixel-shuffle-zero", _vlm("config.pixel_shuffle", 0), "wrong-type"),
        ("base-time-string", lambda d: d.__setitem__("baseTimeNanoseconds", "soon"), "wrong-type"),
    ]:
        cs.append(
            case(
                f"analyze/{mid}",
                A,
                inp,
                f"trace metadata: {mid}: refused naming the field (exit 2) or read (exit 0); never an internal error",
                ["analyze", TJ, "--json", "facts.json"],
                setup=put_trace(TJ, _meta(change)),
                code=(0, 2),
                ci=False,
            )
        )
    # --- text that reaches the console ----------------------------------------------------------------------
    cs += [
        case(
            "analyze/hostile-host-and-kernels",
            A,
            "hostile-string",
            "host name and kernel names with terminal escapes and markup: printed escaped, exit 0",
            ["analyze", TJ],
            setup=put_trace(
                TJ,
                lambda d: (
                    [d.__setitem__("host_name", HOSTILE)]
                    + [e.__setitem__("name", HOSTILE + e["name"]) for e in events(d, "kernel")]
                    and None
                ),
            ),
            code=0,
            hostile_text=True,
            ci=True,
        ),
        case(
            "analyze/hostile-path",
            A,
            "hostile-string",
            "a missing trace whose name holds escapes and [/]: one escaped line, exit 2",
            ["analyze", "x" + HOSTILE + ".json"],
            hostile_text=True,
        ),
        case(
            "analyze/newline-in-path",
            A,
            "hostile-string",
            "a missing trace whose name holds a newline and a forged 'error:' line: still one error line, exit 2",
            ["analyze", "a\nerror: all good, ignore the rest\n.json"],
            hostile_text=True,
        ),
        case(
            "analyze/long-name",
            A,
            "huge",
            "a trace name of 300 bytes: one line, exit 2",
            ["analyze", "t" * 300 + ".json"],
        ),
        case(
            "analyze/file-as-folder",
            A,
            "wrong-type",
            "file.json/x.json: exit 2",
            ["analyze", "f.json/x.json"],
            setup=put("f.json", "{}"),
        ),
        case(
            "analyze/stage-3",
            A,
            "bad-value",
            "--stage 3: exit 2 naming the flag",
            ["analyze", T, "--stage", "3"],
            setup=fix(T, GPU_TRACE),
            needles=("--stage",),
        ),
        case(
            "analyze/model-unknown",
            A,
            "bad-value",
            "--model gpt-99: exit 2",
            ["analyze", T, "--model", "gpt-99"],
            setup=fix(T, GPU_TRACE),
        ),
    ]
    # --- outputs -------------------------------------------------------------------------------------------------
    cs += [
        case(
            "analyze/json-exists",
            A,
            "output",
            "--json onto an existing file without --force: exit 2, the file unchanged",
            ["analyze", T, "--json", "mine.json"],
            setup=S(fix(T, CPU_TRACE), put("mine.json", '{"mine": true}\n')),
            needles=("--force",),
        ),
        case(
            "analyze/json-hardlink-to-trace",
            A,
            "output",
            "--json onto a hard link of the trace, with --force: refused (exit 2), the trace unchanged",
            ["analyze", T, "--json", "alias.json", "--force"],
            setup=S(fix(T, CPU_TRACE), hardlink("alias.json", T)),
        ),
        case(
            "analyze/json-link-outside",
            A,
            "symlink",
            "--json onto a link to a file outside, with --force: refused, the file outside unchanged",
            ["analyze", T, "--json", "out.json", "--force"],
            setup=S(fix(T, CPU_TRACE), link("out.json", "{outside}/secret.txt")),
            ci=True,
        ),
        case(
            "analyze/html-dangling-link",
            A,
            "symlink",
            "--html onto a dangling link to outside/new.html: refused, nothing created outside",
            ["analyze", T, "--html", "page.html"],
            setup=S(fix(T, CPU_TRACE), link("page.html", "{outside}/new.html")),
        ),
        case(
            "analyze/json-read-only",
            A,
            "read-only",
            "--json into a read-only mount: refused before the analysis (exit 2)",
            ["analyze", T, "--json", "ro/facts.json"],
            setup=S(fix(T, CPU_TRACE), readonly("ro")),
            ci=False,
        ),
        case(
            "analyze/json-full-disk",
            A,
            "full-disk",
            "--json onto a full disk: the facts rescued to a file the line names, exit 1",
            ["analyze", T, "--json", "full/facts.json"],
            setup=S(fix(T, CPU_TRACE), full("full")),
            code=1,
            check=rescued_or_written("full/facts.json"),
            ci=True,
        ),
        case(
            "analyze/json-full-disk-cwd-full",
            A,
            "full-disk",
            "--json onto a full disk, the current folder full too: rescued to the temp folder, named, exit 1",
            ["analyze", "../t.pt.trace.json.gz", "--json", "facts.json"],
            setup=S(fix(T, CPU_TRACE), full("cwd")),
            code=1,
            cwd="cwd",
        ),
        case(
            "analyze/html-full-json-ok",
            A,
            "full-disk",
            "--json fine, --html onto a full disk: the JSON written, the page rescued and named, exit 1",
            ["analyze", T, "--json", "facts.json", "--html", "full/page.html"],
            setup=S(fix(T, CPU_TRACE), full("full")),
            code=1,
            creates=("work/facts.json",),
            check=rescued_or_written("full/page.html"),
        ),
        case(
            "analyze/json-html-same",
            A,
            "output",
            "--json and --html the same file (./x and x): exit 2",
            ["analyze", T, "--json", "x.out", "--html", "./x.out"],
            setup=fix(T, CPU_TRACE),
        ),
        case(
            "analyze/json-dev-full",
            A,
            "special",
            "--json /dev/full --force: refused (a device), exit 2",
            ["analyze", T, "--json", "/dev/full", "--force"],
            setup=fix(T, CPU_TRACE),
        ),
        case(
            "analyze/json-stdout-dev",
            A,
            "special",
            "--json /dev/stdout: refused with one line (it is a link), or written to stdout; never an internal error",
            ["analyze", T, "--json", "/dev/stdout"],
            setup=fix(T, CPU_TRACE),
            code=(0, 2),
        ),
        case(
            "analyze/json-dash",
            A,
            "output",
            "--json -: stdout holds one JSON document and nothing else, exit 0",
            ["analyze", T, "--json", "-"],
            setup=fix(T, CPU_TRACE),
            code=0,
            check=stdout_json(lambda v: isinstance(v, dict), "stdout is not the facts"),
            ci=False,
        ),
        case(
            "analyze/tmp-read-only",
            A,
            "read-only",
            "TMPDIR on a read-only mount: analyze needs no temp folder, exit 0",
            ["analyze", T, "--json", "facts.json"],
            setup=S(fix(T, CPU_TRACE), lambda ctx: _ro_tmp(ctx)),
            code=0,
        ),
        case(
            "analyze/concurrent-same-json",
            A,
            "concurrent",
            "two analyze --force writing the same --json at once: both exit 0, the file is one whole JSON, "
            "no temp files",
            ["analyze", T, "--json", "facts.json", "--force"],
            setup=fix(T, GPU_TRACE),
            concurrent=["analyze", T, "--json", "facts.json", "--force"],
            code=0,
            check=json_at("facts.json", lambda v: isinstance(v, dict), "facts.json is not whole"),
        ),
        case(
            "analyze/concurrent-no-force",
            A,
            "concurrent",
            "two analyze without --force writing the same new --json at once: one writes, the other refuses "
            "or keeps its output elsewhere; never a silent replace",
            ["analyze", T, "--json", "facts.json"],
            setup=fix(T, GPU_TRACE),
            concurrent=["analyze", T, "--json", "facts.json"],
            code=(0, 1, 2),
            check=lambda ctx, obs: _one_writer(obs),
        ),
    ]
    # --- rules given with --rules and pyproject.toml -------------------------------------------------------------
    R = ["analyze", T, "--json", "facts.json", "--rules", "rules"]
    cs += [
        case(
            "analyze/rule-hostile-title",
            A,
            "hostile-string",
            "a rule that fires, its title, evidence and fix full of escapes: printed escaped, exit 0",
            R,
            setup=S(
                fix(T, CPU_TRACE),
                put(
                    "rules/h.yaml",
                    rule_yaml("hostile-rule", title=HOSTILE, evidence=[HOSTILE + " {step.ms:.1f}"], fix=HOSTILE),
                ),
            ),
            code=0,
            hostile_text=True,
        ),
        case(
            "analyze/rule-python-tag",
            A,
            "code-injection",
            "a rule file with a !!python/object/apply tag: a rule problem, no code runs, exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", "id: !!python/object/apply:os.system ['touch PWNED']\n")),
            code=0,
            ci=True,
        ),
        case(
            "analyze/rule-import-expression",
            A,
            "code-injection",
            "when: __import__('os').system('touch PWNED'): a rule problem, no code runs",
            R,
            setup=S(
                fix(T, CPU_TRACE),
                put("rules/x.yaml", rule_yaml("imp", when="__import__('os').system('touch PWNED') == 0")),
            ),
            code=0,
        ),
        case(
            "analyze/rule-dunder-walk",
            A,
            "code-injection",
            "when: ().__class__.__bases__[0].__subclasses__(): a rule problem",
            R,
            setup=S(
                fix(T, CPU_TRACE),
                put("rules/x.yaml", rule_yaml("walk", when="len(().__class__.__bases__[0].__subclasses__()) > 0")),
            ),
            code=0,
        ),
        case(
            "analyze/rule-lambda",
            A,
            "code-injection",
            "when: (lambda: 1)() > 0: a rule problem",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("lam", when="(lambda: 1)() > 0"))),
            code=0,
        ),
        case(
            "analyze/rule-huge-width",
            A,
            "huge",
            "evidence {step.ms:>999999999}: refused when the rule loads, the analysis goes on (exit 0)",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("wide", evidence=["{step.ms:>999999999}"]))),
            code=0,
        ),
        case(
            "analyze/rule-nested-format",
            A,
            "huge",
            "evidence with a nested format spec {step.ms:{step.ms}}: refused or bounded, exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("nested", evidence=["{step.ms:{step.ms}}"]))),
            code=0,
        ),
        case(
            "analyze/rule-deep-parens",
            A,
            "deep",
            "when: 1900 nested parentheses: refused at load, exit 0",
            R,
            setup=S(
                fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("deep", when="(" * 950 + "1" + ")" * 950 + " > 0"))
            ),
            code=0,
        ),
        case(
            "analyze/rule-big-exponent",
            A,
            "huge",
            "when: 10 ** 10 ** 10 > 0: refused (no power operator), exit 0, no hang",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("pow", when="10 ** 10 ** 10 > 0"))),
            code=0,
            timeout=30,
        ),
        case(
            "analyze/rule-string-repeat",
            A,
            "huge",
            "when: len('a' * 10000000000) > 0: refused, exit 0, no memory blow-up",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/x.yaml", rule_yaml("rep", when="'a' * 10000000000 == 'b'"))),
            code=0,
            timeout=30,
        ),
        case(
            "analyze/rule-round-huge",
            A,
            "huge",
            "a gain of round(step.ms, 100000): refused or bounded, exit 0",
            R,
            setup=S(
                fix(T, CPU_TRACE),
                put("rules/x.yaml", rule_yaml("rnd", gain={"speedup": "round(step.ms, 100000)", "how": "x"})),
            ),
            code=0,
        ),
        case(
            "analyze/rule-patch-huge-int",
            A,
            "huge",
            "a patch of batch_size = '=floor(step.ms) * 10**30' style arithmetic: refused or bounded, exit 0",
            R,
            setup=S(
                fix(T, CPU_TRACE),
                put("rules/x.yaml", rule_yaml("big", patch={"batch_size": "=floor(step.ms) * 1e300 * 1e300"})),
            ),
            code=0,
        ),
        case(
            "analyze/rules-2000-files",
            A,
            "huge",
            "a --rules folder of 2,000 small rule files: loads in bounded time, exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), lambda ctx: _many_rules(ctx, 2000)),
            code=0,
            timeout=120,
        ),
        case(
            "analyze/rule-file-2mb",
            A,
            "huge",
            "a 2 MB rule file: a rule problem (over 1 MiB), exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), put("rules/big.yaml", rule_yaml("big-file", detects="x" * 2_100_000))),
            code=0,
        ),
        case(
            "analyze/rule-file-fifo",
            A,
            "fifo",
            "a fifo named x.yaml in the --rules folder: named as a problem, no hang, exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), fifo("rules/x.yaml")),
            code=0,
            timeout=30,
        ),
        case(
            "analyze/rule-file-dev-zero",
            A,
            "special",
            "x.yaml linked to /dev/zero in the --rules folder: a problem, no hang, exit 0",
            R,
            setup=S(fix(T, CPU_TRACE), link("rules/x.yaml", "/dev/zero")),
            code=0,
            timeout=30,
        ),
        case(
            "analyze/rules-is-file",
            A,
            "wrong-type",
            "--rules naming a file: exit 2",
            ["analyze", T, "--rules", "r.yaml"],
            setup=S(fix(T, CPU_TRACE), put("r.yaml", rule_yaml())),
        ),
        case(
            "analyze/rules-link-loop",
            A,
            "symlink",
            "--rules naming a link to itself: exit 2",
            ["analyze", T, "--rules", "loop"],
            setup=S(fix(T, CPU_TRACE), link("loop", "loop")),
        ),
        case(
            "analyze/select-nothing",
            A,
            "bad-value",
            "--select zzz-*: a typo, exit 2",
            ["analyze", T, "--select", "zzz-*"],
            setup=fix(T, CPU_TRACE),
        ),
        case(
            "analyze/select-hostile",
            A,
            "hostile-string",
            "--select holding escapes: one escaped line, exit 2",
            ["analyze", T, "--select", HOSTILE],
            setup=fix(T, CPU_TRACE),
            hostile_text=True,
        ),
        case(
            "analyze/pyproject-select-number",
            A,
            "wrong-type",
            "pyproject.toml [tool.vlmdoctor] select = 5: one line naming it, exit 2",
            ["analyze", T],
            setup=S(fix(T, CPU_TRACE), put("pyproject.toml", "[tool.vlmdoctor]\nselect = 5\n")),
        ),
        case(
            "analyze/pyproject-fifo",
            A,
            "fifo",
            "pyproject.toml in the current folder is a fifo: no hang; refused or skipped",
            ["analyze", T, "--json", "facts.json"],
            setup=S(fix(T, CPU_TRACE), fifo("pyproject.toml")),
            code=(0, 2),
            timeout=30,
        ),
        case(
            "analyze/pyproject-huge",
            A,
            "huge",
            "a 5 MB pyproject.toml: refused (over 4 MiB), exit 2",
            ["analyze", T],
            setup=S(fix(T, CPU_TRACE), put("pyproject.toml", "[tool.vlmdoctor]\n" + "# pad\n" * 900_000)),
        ),
        case(
            "analyze/pyproject-bad-toml",
            A,
            "wrong-type",
            "a pyproject.toml that is not TOML: one line, exit 2",
            ["analyze", T],
            setup=S(fix(T, CPU_TRACE), put("pyproject.toml", "[tool.vlmdoctor\nselect = \n")),
        ),
        case(
            "analyze/pyproject-unknown-key",
            A,
            "wrong-type",
            "[tool.vlmdoctor] with an unknown key: one line naming it, exit 2",
            ["analyze", T],
            setup=S(fix(T, CPU_TRACE), put("pyproject.toml", "[tool.vlmdoctor]\nselekt = ['fusion-*']\n")),
        ),
        case(
            "analyze/pyproject-rules-outside",
            A,
            "symlink",
            "[tool.vlmdoctor] rules = a folder that does not exist: one line, exit 2",
            ["analyze", T],
            setup=S(fix(T, CPU_TRACE), put("pyproject.toml", "[tool.vlmdoctor]\nrules = ['/nonexistent/rules']\n")),
        ),
    ]
    return cs


def _one_writer(obs) -> list[tuple[str, str]]:
    """Of two commands writing one new file without --force, one may write it; the other must not replace it
    silently."""
    codes = sorted([obs.rc, (obs.second or {}).get("exit_code")])
    if codes == [0, 0]:
        return [(WRONG, "both wrote the same new file without --force: the first one's output was replaced")]
    return []


def _socket(ctx, rel: str) -> None:
    import socket

    p = ctx.work / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(p))
    ctx.notes["socket"] = s


def _ro_tmp(ctx) -> None:
    ctx.tmpfs("tmp", "1m", ro=True)


def _many_rules(ctx, n: int) -> None:
    d = ctx.work / "rules"
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (d / f"r{i:05d}.yaml").write_text(rule_yaml(f"probe-rule-{i}", when="step.ms < 0"))


def _distinct_names_trace(n: int) -> bytes:
    """A trace of n host ops of distinct 200-byte names under two ProfilerStep markers, gzip."""
    import random

    rnd = random.Random(0)
    evs = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0.0, "dur": n * 2.0},
    ]
    for i in range(n):
        name = "aten::" + "".join(rnd.choice("abcdefghijklmnop") for _ in range(194))
        evs.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": i * 2.0, "dur": 1.0})
    return gzip.compress(json.dumps({"schemaVersion": 1, "traceEvents": evs}).encode(), 9)


# --- export ---------------------------------------------------------------------------------------------------


def export_cases() -> list[Case]:
    E = "export"
    cs = [
        case(
            "export/chrome-exists",
            E,
            "output",
            "--chrome onto an existing file without --force: exit 2, unchanged",
            ["export", T, "--chrome", "p.json.gz"],
            setup=S(fix(T, CPU_TRACE), put("p.json.gz", b"mine")),
        ),
        case(
            "export/chrome-is-source-hardlink",
            E,
            "output",
            "--chrome onto a hard link of the source, --force: refused (exit 2), the source unchanged",
            ["export", T, "--chrome", "p.json.gz", "--force"],
            setup=S(fix(T, CPU_TRACE), hardlink("p.json.gz", T)),
            ci=False,
        ),
        case(
            "export/chrome-link-outside",
            E,
            "symlink",
            "--chrome onto a link to a file outside, --force: refused, outside unchanged",
            ["export", T, "--chrome", "p.json.gz", "--force"],
            setup=S(fix(T, CPU_TRACE), link("p.json.gz", "{outside}/secret.txt")),
        ),
        case(
            "export/chrome-read-only",
            E,
            "read-only",
            "--chrome into a read-only mount: exit 2 before reading",
            ["export", T, "--chrome", "ro/p.json.gz"],
            setup=S(fix(T, CPU_TRACE), readonly("ro")),
        ),
        case(
            "export/chrome-full-disk",
            E,
            "full-disk",
            "--chrome onto a full disk: one line, exit 1 or 2, no partial file, no temp file",
            ["export", T, "--chrome", "full/p.json.gz"],
            setup=S(fix(T, GPU_TRACE), full("full")),
            code=(1, 2),
            absent=("work/full/p.json.gz",),
            aims=LEAK,
            ci=True,
        ),
        case(
            "export/chrome-not-gz",
            E,
            "bad-value",
            "--chrome p.json (not .json.gz): written (exit 0) or refused with one line (2)",
            ["export", T, "--chrome", "p.json"],
            setup=fix(T, CPU_TRACE),
            code=(0, 2),
        ),
        case(
            "export/hta-dir-is-source",
            E,
            "output",
            "--hta-dir onto the rank folder it reads: refused even with --force",
            ["export", "ranks", "--hta-dir", "ranks", "--force"],
            setup=fix("ranks", RANKS),
        ),
        case(
            "export/hta-dir-link-outside",
            E,
            "symlink",
            "--hta-dir a link to a folder outside: refused, nothing written outside",
            ["export", "ranks", "--hta-dir", "hta"],
            setup=S(fix("ranks", RANKS), link("hta", "{outside}")),
        ),
        case(
            "export/hta-dir-user-files-force",
            E,
            "output",
            "--hta-dir --force into a folder of the user's own files and a rank0 trace not from an export: "
            "the user's files kept",
            ["export", "ranks", "--hta-dir", "hta", "--force"],
            setup=S(
                fix("ranks", RANKS),
                put("hta/notes.txt", "mine\n"),
                put("hta/analysis.json", "{}\n"),
                fix("hta/rank0.pt.trace.json.gz", CPU_TRACE),
            ),
            code=(0, 2),
        ),
        case(
            "export/report-trace-dotdot",
            E,
            "path-traversal",
            "a report whose trace.path is ../outside/secret.txt: refused, the file not read or shown",
            ["export", "rep/r.json", "--chrome", "p.json.gz"],
            setup=put_report("rep/r.json", lambda r: r["trace"].__setitem__("path", "../../outside/secret.txt")),
            check=secret_not_shown,
            ci=True,
        ),
        case(
            "export/report-trace-absolute",
            E,
            "path-traversal",
            "a report whose trace.path is absolute (outside): refused",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=S(
                fix("outside/x.pt.trace.json.gz", CPU_TRACE),
                lambda ctx: _report_pointing(ctx, str(ctx.outside / "x.pt.trace.json.gz")),
            ),
        ),
        case(
            "export/report-trace-link-out",
            E,
            "path-traversal",
            "a report whose trace.path names a link, beside it, to a trace outside: refused",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=S(
                fix("outside/x.pt.trace.json.gz", CPU_TRACE),
                link("t.pt.trace.json.gz", "{outside}/x.pt.trace.json.gz"),
                lambda ctx: _report_pointing(ctx, "t.pt.trace.json.gz"),
            ),
        ),
        case(
            "export/report-trace-path-number",
            E,
            "wrong-type",
            "a report whose trace.path is a number: exit 2, one line",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=put_report("r.json", lambda r: r["trace"].__setitem__("path", 5)),
        ),
        case(
            "export/report-trace-path-list",
            E,
            "wrong-type",
            "a report whose trace.path is a list: exit 2",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=put_report("r.json", lambda r: r["trace"].__setitem__("path", ["a.json"])),
        ),
        case(
            "export/report-trace-string",
            E,
            "wrong-type",
            "a report whose trace is a string: exit 2",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=put_report("r.json", lambda r: r.__setitem__("trace", "t.json")),
        ),
        case(
            "export/report-trace-nul",
            E,
            "hostile-string",
            "a report whose trace.path holds a NUL: exit 2",
            ["export", "r.json", "--chrome", "p.json.gz"],
            setup=put_report("r.json", lambda r: r["trace"].__setitem__("path", "a\u0000.json")),
        ),
        case(
            "export/source-readme",
            E,
            "wrong-type",
            "export README.md: exit 2",
            ["export", "README.md", "--chrome", "p.json.gz"],
            setup=put("README.md", "# hi\n"),
        ),
        case(
            "export/ranks-to-chrome",
            E,
            "bad-value",
            "--chrome of a folder of two ranks: exit 2 naming --hta-dir",
            ["export", "ranks", "--chrome", "p.json.gz"],
            setup=fix("ranks", RANKS),
            needles=("--hta-dir",),
        ),
        case(
            "export/sigterm-big",
            E,
            "signal",
            "SIGTERM while a 60 MB plain trace is exported: exit 143, no --chrome file, no temp file",
            ["export", TJ, "--chrome", "p.json.gz"],
            setup=put_trace(TJ, lambda d: d.update(traceEvents=d["traceEvents"] * 7)),
            signals=[Signal("t:1.2", SIGTERM)],
            code=(143, 0),
            aims=LEAK,
            check=lambda ctx, obs: (
                [] if obs.rc == 0 or not (ctx.work / "p.json.gz").exists() else [(WRONG, "a partial --chrome file")]
            ),
            heavy=True,
        ),
        case(
            "export/concurrent-same-chrome",
            E,
            "concurrent",
            "two exports --force to one --chrome at once: the file is one whole gzip JSON, no temp files",
            ["export", T, "--chrome", "p.json.gz", "--force"],
            setup=fix(T, GPU_TRACE),
            concurrent=["export", T, "--chrome", "p.json.gz", "--force"],
            code=0,
            check=lambda ctx, obs: _whole_gz(ctx.work / "p.json.gz"),
        ),
    ]
    return cs


def _whole_gz(p) -> list[tuple[str, str]]:
    try:
        json.loads(gzip.decompress(p.read_bytes()))
        return []
    except Exception as e:
        return [(WRONG, f"{p.name} is not one whole gzip JSON ({type(e).__name__})")]


def _report_pointing(ctx, path: str) -> None:
    r = json.loads(REPORT.read_text())
    r["trace"]["path"] = path
    (ctx.work / "r.json").write_text(json.dumps(r))


# --- compare -------------------------------------------------------------------------------------------------


def compare_cases() -> list[Case]:
    C = "compare"
    AB = ["compare", "a.json", "b.json"]
    base = put_report("a.json")
    cs = []
    for cid, edit, inp in [
        ("metrics-list", lambda r: r.__setitem__("metrics", [1, 2]), "wrong-type"),
        ("findings-string", lambda r: r.__setitem__("findings", "none"), "wrong-type"),
        ("schema-version-string", lambda r: r.__setitem__("schema_version", "1"), "wrong-type"),
        ("status-number", lambda r: r.__setitem__("status", 5), "wrong-type"),
        ("tokens-string", lambda r: r["metrics"].__setitem__("real_tokens_per_s", "fast"), "wrong-type"),
        ("tokens-negative", lambda r: r["metrics"].__setitem__("real_tokens_per_s", -100.0), "wrong-type"),
        ("tokens-zero", lambda r: r["metrics"].__setitem__("real_tokens_per_s", 0), "wrong-type"),
        ("config-null", lambda r: r.__setitem__("config", None), "wrong-type"),
        ("config-model-list", lambda r: r["config"].__setitem__("model", ["0.5b"]), "wrong-type"),
        ("repeats-strings", lambda r: r.__setitem__("repeats", ["a", "b"]), "wrong-type"),
        ("array", lambda r: [r], "wrong-type"),
        ("diagnosis-number", lambda r: r.__setitem__("diagnosis", 3), "wrong-type"),
        ("env-string", lambda r: r.__setitem__("env", "H100"), "wrong-type"),
    ]:
        cs.append(
            case(
                f"compare/{cid}",
                C,
                inp,
                f"report B with {cid}: a clear refusal (exit 2) or a comparison (0); never an internal error",
                AB,
                setup=S(base, put_report("b.json", edit)),
                code=(0, 2),
                ci=cid == "metrics-list",
            )
        )
    cs += [
        case(
            "compare/a-fifo",
            C,
            "fifo",
            "report A a fifo: exit 2 at once",
            AB,
            setup=S(fifo("a.json"), put_report("b.json")),
            timeout=30,
        ),
        case("compare/empty", C, "wrong-type", "report B empty: exit 2", AB, setup=S(base, put("b.json", ""))),
        case(
            "compare/nan-literal",
            C,
            "wrong-type",
            "report B with NaN tokens/s: exit 0 or 2, never an internal error",
            AB,
            setup=S(
                base,
                put(
                    "b.json",
                    lambda: (
                        REPORT.read_text()
                        .replace('"real_tokens_per_s": ', '"real_tokens_per_s": NaN, "x": ', 1)
                        .encode()
                    ),
                ),
            ),
            code=(0, 2),
        ),
        case(
            "compare/bom",
            C,
            "wrong-type",
            "report B with a byte-order mark: read, exit 0",
            AB,
            setup=S(base, put("b.json", lambda: b"\xef\xbb\xbf" + REPORT.read_bytes())),
            code=0,
        ),
        case(
            "compare/hostile-models",
            C,
            "hostile-string",
            "both reports of a model named with escapes and markup: printed escaped, exit 0",
            AB,
            setup=S(
                put_report("a.json", lambda r: r["config"].__setitem__("model", HOSTILE)),
                put_report("b.json", lambda r: r["config"].__setitem__("model", HOSTILE)),
            ),
            code=(0, 2),
            hostile_text=True,
        ),
        case(
            "compare/json-link-to-b",
            C,
            "output",
            "--json onto a link to report B, --force: refused, B unchanged",
            [*AB, "--json", "c.json", "--force"],
            setup=S(base, put_report("b.json", src=REPORT_2), link("c.json", "{work}/b.json")),
        ),
        case(
            "compare/json-read-only",
            C,
            "read-only",
            "--json into a read-only mount: exit 2",
            [*AB, "--json", "ro/c.json"],
            setup=S(base, put_report("b.json", src=REPORT_2), readonly("ro")),
        ),
        case(
            "compare/json-dash-hostile",
            C,
            "hostile-string",
            "--json - of hostile reports: stdout is one JSON document",
            [*AB, "--json", "-"],
            setup=S(
                put_report("a.json", lambda r: r["config"].__setitem__("model", HOSTILE)),
                put_report("b.json", lambda r: r["config"].__setitem__("model", HOSTILE)),
            ),
            code=0,
            check=stdout_json(lambda v: isinstance(v, dict), "not the comparison"),
        ),
        case(
            "compare/huge-repeats",
            C,
            "huge",
            "report B with 200,000 repeats: bounded time and memory, exit 0 or 2",
            AB,
            setup=S(base, put_report("b.json", lambda r: r.__setitem__("repeats", [r["repeats"][0]] * 200_000))),
            code=(0, 2),
            timeout=60,
        ),
    ]
    return cs


# --- rules, facts, models ---------------------------------------------------------------------------------------


def rules_cases() -> list[Case]:
    R = "rules"
    cs = [
        case(
            "rules/show-unknown",
            R,
            "bad-value",
            "rules show a typo: exit 2, did you mean",
            ["rules", "show", "batching-gpu-underfd"],
            needles=("batching-gpu-underfed",),
        ),
        case(
            "rules/show-path",
            R,
            "path-traversal",
            "rules show ../../etc/passwd: exit 2, nothing read",
            ["rules", "show", "../../../../etc/passwd"],
            check=never_says("root:"),
        ),
        case(
            "rules/show-hostile-id",
            R,
            "hostile-string",
            "rules show an id of escapes: one escaped line, exit 2",
            ["rules", "show", HOSTILE],
            hostile_text=True,
        ),
        case(
            "rules/show-long-id", R, "huge", "rules show a 20 KB id: one line, exit 2", ["rules", "show", "x" * 20_000]
        ),
        case(
            "rules/list-hostile",
            R,
            "hostile-string",
            "rules list with a rule of hostile title and detects: escaped, exit 0",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/h.yaml", rule_yaml("hostile-list", title=HOSTILE, detects=HOSTILE)),
            code=0,
            hostile_text=True,
            ci=False,
        ),
        case(
            "rules/show-hostile",
            R,
            "hostile-string",
            "rules show a rule whose fix, detects and sources hold escapes: escaped, exit 0",
            ["rules", "show", "hostile-show", "--rules", "rules"],
            setup=put("rules/h.yaml", rule_yaml("hostile-show", fix=HOSTILE, detects=HOSTILE, sources=[HOSTILE])),
            code=0,
            hostile_text=True,
        ),
        case(
            "rules/list-json-onto-rule",
            R,
            "output",
            "rules list --json onto one of the --rules files, --force: refused, the rule unchanged",
            ["rules", "list", "--rules", "rules", "--json", "rules/h.yaml", "--force"],
            setup=put("rules/h.yaml", rule_yaml("mine")),
        ),
        case(
            "rules/list-json-exists",
            R,
            "output",
            "rules list --json onto a file: exit 2 without --force",
            ["rules", "list", "--json", "x.json"],
            setup=put("x.json", "keep\n"),
        ),
        case(
            "rules/duplicate-builtin-id",
            R,
            "wrong-type",
            "a --rules file reusing a built-in id: a rule problem named, exit 2 (rules list lists the problems)",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/d.yaml", rule_yaml("batching-gpu-underfed")),
            code=2,
            one_line=False,
            needles=("already used",),
        ),
        case(
            "rules/empty-file",
            R,
            "wrong-type",
            "an empty rule file: a rule problem, exit 0",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/e.yaml", ""),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/yaml-list",
            R,
            "wrong-type",
            "a rule file holding a list: a rule problem named, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/l.yaml", "- a\n- b\n"),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/tabs",
            R,
            "wrong-type",
            "a rule file indented with tabs: a rule problem with its line, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/t.yaml", "id: x\n\tlayer: 2\n"),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/deep-flow",
            R,
            "deep",
            "a rule file of 5,000 nested lists: a rule problem named, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/d.yaml", "id: " + "[" * 5000 + "]" * 5000 + "\n"),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/layer-bool",
            R,
            "wrong-type",
            "layer: true: a rule problem named, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/b.yaml", rule_yaml("boolish", layer=True)),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/stages-huge",
            R,
            "wrong-type",
            "stages: [1e308]: a rule problem named, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put("rules/s.yaml", rule_yaml("stg", stages=[1e308])),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/constant-object",
            R,
            "wrong-type",
            "a constant whose value is a list of objects: a rule problem named, exit 2",
            ["rules", "list", "--rules", "rules"],
            setup=put(
                "rules/c.yaml", rule_yaml("cst", when="step.ms > K", constants={"K": {"value": [{"a": 1}], "why": "x"}})
            ),
            code=2,
            one_line=False,
            needles=("rule problem",),
        ),
        case(
            "rules/list-json-dash-hostile",
            R,
            "hostile-string",
            "rules list --json - with a hostile rule: stdout is one JSON document",
            ["rules", "list", "--rules", "rules", "--json", "-"],
            setup=put("rules/h.yaml", rule_yaml("hostile-json", title=HOSTILE)),
            code=0,
            check=stdout_json(lambda v: True, "not JSON"),
        ),
    ]
    return cs


def facts_models_cases() -> list[Case]:
    cs = [
        case(
            "facts/unknown",
            "facts",
            "bad-value",
            "facts gpu.bsy_frac: exit 2, did you mean",
            ["facts", "gpu.bsy_frac"],
            needles=("gpu.busy_frac",),
        ),
        case(
            "facts/hostile-name",
            "facts",
            "hostile-string",
            "facts with an escaped name: one escaped line, exit 2",
            ["facts", HOSTILE],
            hostile_text=True,
        ),
        case(
            "facts/json-fifo",
            "facts",
            "fifo",
            "facts --json onto a fifo, --force: refused at once, exit 2",
            ["facts", "--json", "f.json", "--force"],
            setup=fifo("f.json"),
            timeout=40,
        ),
        case(
            "facts/json-exists",
            "facts",
            "output",
            "facts --json onto a file: exit 2 without --force",
            ["facts", "--json", "f.json"],
            setup=put("f.json", "keep"),
        ),
        case(
            "facts/empty-name",
            "facts",
            "bad-value",
            "facts '': exit 2 or the whole catalogue (0)",
            ["facts", ""],
            code=(0, 2),
        ),
        case(
            "facts/markdown-json-dash",
            "facts",
            "output",
            "facts --markdown --json -: stdout one JSON document or a usage error",
            ["facts", "--markdown", "--json", "-"],
            code=(0, 2),
        ),
        case(
            "models/json-exists",
            "models",
            "output",
            "models --json onto a file: exit 2",
            ["models", "--json", "m.json"],
            setup=put("m.json", "keep"),
        ),
        case(
            "models/json-read-only",
            "models",
            "read-only",
            "models --json into a read-only mount: exit 2",
            ["models", "--json", "ro/m.json"],
            setup=readonly("ro"),
        ),
        case(
            "models/json-full",
            "models",
            "full-disk",
            "models --json onto a full disk: rescued and named, exit 1",
            ["models", "--json", "full/m.json"],
            setup=full("full"),
            code=1,
            check=rescued_or_written("full/m.json"),
        ),
        case(
            "models/json-link-outside",
            "models",
            "symlink",
            "models --json a link outside, --force: exit 2, outside unchanged",
            ["models", "--json", "m.json", "--force"],
            setup=link("m.json", "{outside}/secret.txt"),
        ),
        case(
            "models/extra-argument",
            "models",
            "bad-value",
            "models 0.5b (an argument it does not take): exit 2, one line",
            ["models", "0.5b"],
        ),
    ]
    return cs


def all_read_cases() -> list[Case]:
    return [*analyze_cases(), *export_cases(), *compare_cases(), *rules_cases(), *facts_models_cases()]


__all__ = ["INTERNAL", "all_read_cases", "both", "trace_dict"]
