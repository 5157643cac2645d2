"""The pieces the probe's cases are made of: files to set up, traces and reports edited from real
recordings, small user scripts, and checks of what a command wrote."""

from __future__ import annotations

import copy
import functools
import gzip
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import CRASH, LOSS, ROOT, SECURITY, WRONG, Case, Ctx, Obs, Signal

FIX = ROOT / "fixtures"
GPU_TRACE = FIX / "traces" / "compile_s2.pt.trace.json.gz"  # a real H100 trace (0.5b, stage 2), 26,529 events
GPU_TRACE_2 = FIX / "traces" / "bf16_s1.pt.trace.json.gz"
CPU_TRACE = FIX / "user_cpu" / "llava_s2_plain.pt.trace.json.gz"  # a user's loop on a CPU, 11,749 events
RANKS = FIX / "dist_cpu" / "ddp"  # two ranks of one DDP job (CPU, gloo)
RANKS_OTHER = FIX / "dist_cpu" / "fsdp2"
REPORT = FIX / "traces" / "compile_s2.report.json"
REPORT_2 = FIX / "traces" / "default_s2.report.json"
REPORT_S1 = FIX / "traces" / "bf16_s1.report.json"
TINY_SCRIPT = ROOT / "examples" / "train_tiny_cpu.py"

#: the fastest real run (CPU, tiny preset)
FAST = ["--model", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0"]
#: escape sequences a hostile name carries: clear screen, window title, a hidden hyperlink, bidi override
HOSTILE = "\x1b[2J\x1b]0;PWNED-TITLE\x07\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\\u202egnp.exe[/][bold]"

SIGINT, SIGTERM, SIGHUP, SIGKILL = signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGKILL


def case(id: str, command: str, input: str, expect: str, argv: list[str], **kw: Any) -> Case:
    return Case(id=id, command=command, input=input, expect=expect, argv=argv, **kw)


# --- setting files up -------------------------------------------------------------------------------------------

Step = Callable[[Ctx], None]


def S(*steps: Step) -> Step:
    def setup(ctx: Ctx) -> None:
        for s in steps:
            s(ctx)

    return setup


def _p(ctx: Ctx, rel: str) -> Path:
    if rel.startswith("outside/"):
        return ctx.outside / rel[len("outside/") :]
    if rel.startswith("tmp/"):
        return ctx.tmp / rel[len("tmp/") :]
    return ctx.work / rel


def put(rel: str, content: str | bytes | Callable[[], bytes]) -> Step:
    def step(ctx: Ctx) -> None:
        p = _p(ctx, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = content() if callable(content) else content
        p.write_bytes(data.encode() if isinstance(data, str) else data)

    return step


def fix(rel: str, src: Path) -> Step:
    def step(ctx: Ctx) -> None:
        p = _p(ctx, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, p)
        else:
            shutil.copyfile(src, p)

    return step


def fifo(rel: str) -> Step:
    def step(ctx: Ctx) -> None:
        p = _p(ctx, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)

    return step


def link(rel: str, target: str) -> Step:
    """A symbolic link at rel to target ('{outside}', '{work}' expand)."""

    def step(ctx: Ctx) -> None:
        p = _p(ctx, rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target.format(outside=ctx.outside, work=ctx.work, tmp=ctx.tmp), p)

    return step


def hardlink(rel: str, target: str) -> Step:
    def step(ctx: Ctx) -> None:
        os.link(_p(ctx, target), _p(ctx, rel))

    return step


def mkdir(rel: str) -> Step:
    def step(ctx: Ctx) -> None:
        _p(ctx, rel).mkdir(parents=True, exist_ok=True)

    return step


def full(rel: str, size: str = "256k", leave: int = 0, then: Step | None = None) -> Step:
    """A full disk at rel: a tmpfs of `size`, filled up to `leave` bytes (after `then` put its files)."""

    def step(ctx: Ctx) -> None:
        where = ctx.tmpfs(rel, size)
        if then is not None:
            then(ctx)
        ctx.fill(where, leave)

    return step


def small_disk(rel: str, size: str) -> Step:
    def step(ctx: Ctx) -> None:
        ctx.tmpfs(rel, size)

    return step


def readonly(rel: str, then: Step | None = None) -> Step:
    """A read-only mount at rel, holding what `then` put there first."""

    def step(ctx: Ctx) -> None:
        where = ctx.tmpfs(rel, "4m")
        if then is not None:
            then(ctx)
        ctx.remount_ro(where)

    return step


# --- traces and reports edited from real recordings ----------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _loaded(path: Path) -> dict[str, Any]:
    with gzip.open(path) as f:
        return json.load(f)


def trace_dict(src: Path = GPU_TRACE) -> dict[str, Any]:
    return copy.deepcopy(_loaded(src))


def put_trace(rel: str, edit: Callable[[dict[str, Any]], Any] | None = None, src: Path = GPU_TRACE) -> Step:
    """A real trace, edited, at rel (.gz compressed when rel says so)."""

    def make() -> bytes:
        d = trace_dict(src)
        if edit is not None:
            got = edit(d)
            d = d if got is None else got
        text = d if isinstance(d, (bytes, str)) else json.dumps(d)
        raw = text.encode() if isinstance(text, str) else text
        return gzip.compress(raw, 6) if rel.endswith(".gz") else raw

    return put(rel, make)


def events(d: dict[str, Any], cat: str | None = None, name: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in d["traceEvents"]
        if (cat is None or e.get("cat") == cat) and (name is None or str(e.get("name", "")).startswith(name))
    ]


def edit_events(cat: str | None, change: Callable[[dict[str, Any]], Any], name: str | None = None, every: int = 1):
    def edit(d: dict[str, Any]) -> None:
        for i, e in enumerate(events(d, cat, name)):
            if i % every == 0:
                change(e)

    return edit


def report_dict(src: Path = REPORT) -> dict[str, Any]:
    return json.loads(src.read_text())


def put_report(rel: str, edit: Callable[[dict[str, Any]], Any] | None = None, src: Path = REPORT) -> Step:
    def make() -> bytes:
        d = report_dict(src)
        if edit is not None:
            got = edit(d)
            d = d if got is None else got
        return (d if isinstance(d, str) else json.dumps(d)).encode()

    return put(rel, make)


def rule_yaml(rid: str = "probe-rule", when: str = "step.ms > 0", **fields: Any) -> str:
    """A rule file in the shipped rules' shape (one rule a file), with `fields` over the defaults."""
    import yaml

    rule = {
        "id": rid,
        "layer": 4,
        "title": "probe rule",
        "severity": "low",
        "detects": "nothing real",
        "when": when,
        "evidence": ["a probe rule fired"],
        "fix": "nothing to do",
        "patch": {},
        "gain": {"how": "none"},
        "sources": ["the probe"],
    }
    rule.update(fields)
    return yaml.safe_dump(rule, sort_keys=False, allow_unicode=True)


# --- checks -----------------------------------------------------------------------------------------------------


def json_at(rel: str, test: Callable[[Any], Any], what: str, cls: str = WRONG) -> Callable[[Ctx, Obs], list]:
    """The file at rel parses as JSON and `test(value)` holds."""

    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        p = _p(ctx, rel)
        try:
            value = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            return [(LOSS if cls == LOSS else WRONG, f"{rel} is not readable JSON ({type(e).__name__})")]
        try:
            ok = test(value)
        except Exception as e:
            ok, what2 = False, f"{what} ({type(e).__name__}: {e})"
            return [(cls, what2)]
        return [] if ok else [(cls, what)]

    return check


def stdout_json(test: Callable[[Any], Any], what: str) -> Callable[[Ctx, Obs], list]:
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        try:
            value = json.loads(obs.stdout)
        except ValueError:
            return [(WRONG, "stdout is not one JSON document")]
        return [] if test(value) else [(WRONG, what)]

    return check


def says(*words: str, cls: str = WRONG) -> Callable[[Ctx, Obs], list]:
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        return [(cls, f"the output does not say {w!r}") for w in words if w.lower() not in obs.out.lower()]

    return check


def never_says(*words: str, cls: str = WRONG) -> Callable[[Ctx, Obs], list]:
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        return [(cls, f"the output says {w!r}") for w in words if w in obs.out]

    return check


def both(*checks: Callable[[Ctx, Obs], list]) -> Callable[[Ctx, Obs], list]:
    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        return [d for c in checks for d in c(ctx, obs)]

    return check


def script_never_ran(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    """The user script marks its start in work/STARTED: a refusal must come before it."""
    return [(WRONG, "the training script started before the refusal")] if (ctx.work / "STARTED").exists() else []


def rescued_or_written(rel: str) -> Callable[[Ctx, Obs], list]:
    """The output at rel is there, or a rescue file the output names holds it."""

    def check(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
        if _p(ctx, rel).exists():
            return []
        import re

        for m in re.finditer(r"(\S*vlmdoctor-rescued-\S+?)(?=[\s);,]|$)", obs.out):
            if Path(m.group(1).rstrip(".")).exists() or (ctx.work / m.group(1).rstrip(".")).exists():
                return []
        return [(LOSS, f"{rel} is neither written nor rescued to a file the output names")]

    return check


def no_user_crash(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    return [] if "USER-OK" in obs.stdout else [(CRASH, "the loop did not finish with its own results")]


def secret_not_shown(ctx: Ctx, obs: Obs) -> list[tuple[str, str]]:
    return [(SECURITY, "the content of a file outside was shown")] if "private notes" in obs.out else []


__all__ = [
    "CRASH",
    "LOSS",
    "SECURITY",
    "WRONG",
    "Signal",
    "case",
]
