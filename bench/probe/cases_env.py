"""Cases of the world around a command: its output piped to `head`, odd terminals and encodings, a memory limit,
rank folders of two jobs, grids that time out while traced, a trace of ten realistic megabytes."""

from __future__ import annotations

import gzip
import json

from harness import LEAK, WRONG, Case, Ctx, Obs
from kit import CPU_TRACE, GPU_TRACE, HOSTILE, RANKS, RANKS_OTHER, REPORT, S, case, fix, put, put_report

T = "t.pt.trace.json.gz"


def _quiet_pipe(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    """A reader that went away is not an error: no traceback, no 'Exception ignored' noise."""
    bad = [w for w in ("Traceback", "Exception ignored", "BrokenPipeError") if w in obs.stderr]
    return [(WRONG, f"stderr says {bad[0]!r} after the reader of stdout went away")] if bad else []


def _pipe(id: str, command: str, argv: list[str], setup=None, lines: int = 2, **kw) -> Case:
    return case(
        f"{command}/{id}",
        command,
        "closed-pipe",
        f"`vlmdoctor {' '.join(argv[:2])} ... | head -{lines}`: the command ends quietly when its reader goes "
        "(exit 0, or 141/-13 as for SIGPIPE), never a traceback",
        argv,
        setup=setup,
        stdout_lines=lines,
        code=(0, 141, -13, 120),
        check=_quiet_pipe,
        **kw,
    )


def pipe_cases() -> list[Case]:
    return [
        _pipe("head-of-table", "analyze", ["analyze", T], setup=fix(T, GPU_TRACE), ci=True),
        _pipe("head-of-json", "analyze", ["analyze", T, "--json", "-"], setup=fix(T, GPU_TRACE), lines=3),
        _pipe("head", "rules", ["rules", "list"], lines=1),
        _pipe("head-show", "rules", ["rules", "show", "batching-gpu-underfed"], lines=1),
        _pipe("head", "facts", ["facts"], lines=1),
        _pipe("head", "models", ["models"], lines=1),
        _pipe(
            "head",
            "compare",
            ["compare", "a.json", "b.json"],
            setup=S(put_report("a.json"), put_report("b.json")),
            lines=1,
        ),
        _pipe(
            "head",
            "gate",
            ["gate", "--baseline", "a.json", "--current", "b.json"],
            setup=S(put_report("a.json"), put_report("b.json")),
            lines=1,
        ),
        _pipe(
            "head-of-run",
            "run",
            ["run", "--out", "out", "--warmup", "1", "--steps", "2", "--trace-steps", "1", "--", "python", "train.py"],
            setup=put("train.py", _TRAIN_SHORT),
            lines=1,
            heavy=True,
        ),
        _pipe(
            "head-of-profile",
            "profile",
            ["profile", "--model", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1", "--json", "r.json"],
            lines=1,
            heavy=True,
        ),
    ]


_TRAIN_SHORT = """
import torch
m = torch.nn.Linear(8, 8)
o = torch.optim.SGD(m.parameters(), lr=0.1)
for i in range(12):
    m(torch.randn(4, 8)).pow(2).mean().backward()
    o.step()
    o.zero_grad()
    print("step", i, flush=True)
"""


def terminal_cases() -> list[Case]:
    A = ["analyze", T]
    out = []
    for cid, env in [
        ("columns-zero", {"COLUMNS": "0"}),
        ("columns-one", {"COLUMNS": "1"}),
        ("columns-garbage", {"COLUMNS": "wide", "LINES": "-3"}),
        ("term-dumb-no-color", {"TERM": "dumb", "NO_COLOR": "1"}),
        ("force-color", {"FORCE_COLOR": "1", "TERM": "xterm-256color"}),
        ("ascii-stdout", {"PYTHONIOENCODING": "ascii"}),
        ("c-locale", {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}),
    ]:
        out.append(
            case(
                f"analyze/{cid}",
                "analyze",
                "terminal",
                f"analyze with {' '.join(f'{k}={v}' for k, v in env.items())}: the table printed, exit 0",
                A,
                setup=fix(T, GPU_TRACE),
                env=env,
                code=0,
                ci=False,
            )
        )
    out.append(
        case(
            "analyze/ascii-stdout-hostile",
            "analyze",
            "terminal",
            "an ASCII-only stdout and kernel names full of non-ASCII: printed (replaced), exit 0, never a crash",
            A,
            setup=put(T, lambda: _hostile_gz()),
            env={"PYTHONIOENCODING": "ascii"},
            code=0,
            hostile_text=True,
        )
    )
    out.append(
        case(
            "compare/ascii-stdout",
            "compare",
            "terminal",
            "compare with an ASCII-only stdout and a model named in Chinese: exit 0, never a crash",
            ["compare", "a.json", "b.json"],
            setup=S(
                put_report("a.json", lambda r: r["config"].__setitem__("model", "模型-0.5b")),
                put_report("b.json", lambda r: r["config"].__setitem__("model", "模型-0.5b")),
            ),
            env={"PYTHONIOENCODING": "ascii"},
            code=(0, 2),
        )
    )
    out.append(
        case(
            "compare/surrogate-model",
            "compare",
            "hostile-string",
            "reports whose model name holds a lone surrogate escape (\\ud800): exit 0 or 2, never an internal error",
            ["compare", "a.json", "b.json"],
            setup=S(
                put("a.json", lambda: REPORT.read_text().replace('"model": "0.5b"', '"model": "x\\ud800"', 1).encode()),
                put("b.json", lambda: REPORT.read_text().replace('"model": "0.5b"', '"model": "x\\ud800"', 1).encode()),
            ),
            code=(0, 2),
        )
    )
    return out


def _hostile_gz() -> bytes:
    d = json.loads(gzip.decompress(GPU_TRACE.read_bytes()))
    for e in d["traceEvents"]:
        if e.get("cat") == "kernel":
            e["name"] = "核函数—" + HOSTILE + e["name"]
    return gzip.compress(json.dumps(d).encode(), 6)


def limit_cases() -> list[Case]:
    """A memory limit the run meets (ulimit -v, as a batch scheduler sets one)."""
    limited = (
        "import os, resource, sys; lim = int(sys.argv[1]) * 2**20; resource.setrlimit(resource.RLIMIT_AS, (lim, lim)); "
        "os.execv(sys.executable, [sys.executable, '-c', 'from vlmdoctor.cli import main; main()', *sys.argv[2:]])"
    )
    return [
        case(
            "profile/host-oom-ulimit",
            "profile",
            "oom",
            "a run that meets its memory limit (ulimit -v) in its steps: out of memory, exit 3, said in one line",
            [
                "python",
                "-c",
                limited,
                "1900",  # under the 2 GB every case is held to: the limit is met first
                "profile",
                "--model",
                "tiny",
                "--device",
                "cpu",
                "--steps",
                "2",
                "--warmup",
                "0",
                "--batch-size",
                "4096",
                "--no-diagnose",
                "--json",
                "r.json",
            ],
            code=3,
            check=lambda ctx, obs: (
                []
                if not (ctx.work / "r.json").exists()
                or json.loads((ctx.work / "r.json").read_text()).get("status") == "oom"
                else [(WRONG, "the report does not say oom")]
            ),
            heavy=True,
            timeout=180,
        ),
    ]


def rank_cases() -> list[Case]:
    return [
        case(
            "analyze/two-jobs-in-folder",
            "analyze",
            "wrong-type",
            "a rank folder holding rank 0 of a DDP job and rank 1 of an FSDP2 job: not joined, said, exit 0",
            ["analyze", "ranks", "--json", "facts.json"],
            setup=S(
                fix("ranks/trace_rank0.json.gz", RANKS / "trace_rank0.json.gz"),
                fix("ranks/trace_rank1.json.gz", RANKS_OTHER / "trace_rank1.json.gz"),
            ),
            code=(0, 2),
            check=lambda ctx, obs: (
                []
                if obs.rc == 2 or "skipped" in (ctx.work / "facts.json").read_text()
                else [(WRONG, "two jobs joined as one")]
            ),
        ),
        case(
            "analyze/big-realistic",
            "analyze",
            "huge",
            "a 9 MB gzip of a real trace's events repeated 40 times (1 million events, time-shifted): exit 0 or a "
            "clear refusal, under 2 GB",
            ["analyze", T, "--json", "facts.json"],
            setup=put(T, lambda: _realistic_big(40)),
            code=(0, 2),
            timeout=300,
            heavy=True,
        ),
    ]


def _realistic_big(times: int) -> bytes:
    d = json.loads(gzip.decompress(GPU_TRACE.read_bytes()))
    evs = d["traceEvents"]
    span = max(e.get("ts", 0) + e.get("dur", 0) for e in evs if isinstance(e.get("ts"), (int, float))) - min(
        e["ts"] for e in evs if isinstance(e.get("ts"), (int, float))
    )
    out = []
    for k in range(times):
        for e in evs:
            if isinstance(e.get("ts"), (int, float)):
                e = dict(e, ts=e["ts"] + k * (span + 1000.0))
                if str(e.get("name", "")).startswith("ProfilerStep#"):
                    e["name"] = f"ProfilerStep#{k * 10 + int(e['name'].split('#')[1])}"
            out.append(e)
    d["traceEvents"] = out
    return gzip.compress(json.dumps(d).encode(), 9)


def grid_cases() -> list[Case]:
    return [
        case(
            "sweep/timeout-while-traced",
            "sweep",
            "hang",
            "--diagnose --timeout 20 on a run of 150 steps: the row says timeout; no trace folder, no temp file left",
            [
                "sweep",
                "--set",
                "model=tiny",
                "--set",
                "device=cpu",
                "--set",
                "steps=150",
                "--set",
                "warmup=1",
                "--diagnose",
                "--timeout",
                "20",
                "--json",
                "t.json",
            ],
            code=(0, 1),
            check=lambda ctx, obs: (
                []
                if json.loads((ctx.work / "t.json").read_text())["runs"][0]["status"] == "timeout"
                else [(WRONG, "the row does not say timeout")]
            ),
            timeout=180,
            heavy=True,
            aims=LEAK,
        ),
        case(
            "sweep/set-hostile-model",
            "sweep",
            "hostile-string",
            "--set model=<escapes>: one escaped line, exit 2",
            ["sweep", "--set", "model=" + HOSTILE, "--set", "device=cpu"],
            hostile_text=True,
        ),
        case(
            "profile/hostile-model-flag",
            "profile",
            "hostile-string",
            "--model <escapes and markup>: one escaped line, exit 2",
            ["profile", "--model", HOSTILE],
            hostile_text=True,
        ),
        case(
            "analyze/cpu-trace-hostile-rule-folder",
            "analyze",
            "hostile-string",
            "a --rules folder named with escapes that does not exist: one escaped line, exit 2",
            ["analyze", "t.json.gz", "--rules", "r" + HOSTILE],
            setup=fix("t.json.gz", CPU_TRACE),
            hostile_text=True,
        ),
    ]


def all_env_cases() -> list[Case]:
    return [*pipe_cases(), *terminal_cases(), *limit_cases(), *rank_cases(), *grid_cases()]
