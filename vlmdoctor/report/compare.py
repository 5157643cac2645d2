"""`vlmdoctor compare A.json B.json`: what changed between two runs, and where the time went.

The headline numbers say whether B is faster; the kernel classes, GPU idle causes, findings
and config knobs say why, which is what one needs before keeping or reverting a change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import PurePath
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from vlmdoctor.documents import Comparison, Env, Finding, RunReport, as_document, as_report
from vlmdoctor.errors import UsageError
from vlmdoctor.report.text import esc
from vlmdoctor.run import throughput
from vlmdoctor.run.config import knob_table

MODEL_KEYS = ("model", "vision", "llm", "projector", "pixel_shuffle")
ENV_KEYS = ("gpu", "driver", "torch", "transformers")


#: a report as loaded (its dict, every key kept) or as declared
Report = RunReport | dict[str, Any]


def shown(value: Any) -> str:
    """A knob's or a field's value as a reader writes it: none for a missing one, a list as its items."""
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(shown(v) for v in value) or "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={shown(v)}" for k, v in value.items()) or "none"
    return str(value)


def _differences(a: dict[str, Any], b: dict[str, Any], keys: Iterable[str]) -> list[str]:
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def _field_differences(a: Any, b: Any, names: Iterable[str], say: Callable[[Any], str] = repr) -> list[str]:
    """`name: a -> b` for each field of two declared parts that differs (gate's lines: repr; compare's: shown)."""
    return [f"{n}: {say(getattr(a, n))} -> {say(getattr(b, n))}" for n in names if getattr(a, n) != getattr(b, n)]


def model_differences(a: Report, b: Report, say: Callable[[Any], str] = repr) -> list[str]:
    """Model architecture and training stage: what makes two throughputs different quantities."""
    return _field_differences(as_report(a).knobs, as_report(b).knobs, (*MODEL_KEYS, "stage"), say)


def world_size(report: Report) -> int:
    """How many ranks measured the report (1 for a one-process run)."""
    d = as_report(report).distributed
    return d.world_size if d else 1


def ranks_note(a: Report, b: Report, labels: Sequence[str] = ("A", "B")) -> str | None:
    """A different number of ranks, named: throughput is then the job's, and one-to-N is scaling.

    When A ran on one GPU in one process and B is the same config on N ranks, the note gives B's
    scaling efficiency against A: B's global tokens/s / (N x A's tokens/s).
    """
    ra, rb = as_report(a), as_report(b)
    na, nb = world_size(ra), world_size(rb)
    if na == nb:
        return None
    pa, pb = ra.knobs.parallel or "none", rb.knobs.parallel or "none"
    text = (
        f"different number of ranks: {labels[0]} {na} ({pa}), {labels[1]} {nb} ({pb}); tokens/s is each job's "
        "global throughput, ms/step the slowest rank's"
    )
    if na == 1 and pa == "none":
        one, job, n, name = ra, rb, nb, labels[1]
    elif nb == 1 and pb == "none":
        one, job, n, name = rb, ra, na, labels[0]
    else:
        return text
    t_one = one.metrics.real_tokens_per_s if one.metrics else None
    t_job = job.metrics.real_tokens_per_s if job.metrics else None
    if t_one and t_job:
        sc = throughput.scaling(
            t_job,
            n,
            t_one,
            "compared",
            {
                f"{name}'s": job.throughput.unstable_reason if job.throughput else None,
                "one-GPU run's": one.throughput.unstable_reason if one.throughput else None,
            },
        )
        if sc["doubts"]:
            text += (
                f"; no scaling efficiency of {name}: {'; '.join(sc['doubts'])} (it read {sc['efficiency'] * 100:.0f}%)"
            )
        else:
            text += f"; scaling efficiency of {name}: {sc['efficiency'] * 100:.0f}%"
    return text


def slowest_rank(report: Report) -> dict[str, Any] | None:
    """The slowest rank of a multi-rank report: its rank, median step and the imbalance over the fastest."""
    d = as_report(report).distributed
    g = d.global_ if d else None
    if g is None:
        return None
    return {"rank": g.slowest_rank, "step_ms": g.slowest_step_ms, "imbalance": g.step_imbalance}


def env_differences(a: Report, b: Report, say: Callable[[Any], str] = repr) -> list[str]:
    return _field_differences(as_report(a).env or Env(), as_report(b).env or Env(), ENV_KEYS, say)


#: (report metric, label, higher is better)
METRICS: tuple[tuple[str, str, bool], ...] = (
    ("real_tokens_per_s", "real tokens/s", True),
    ("loss_tokens_per_s", "loss tokens/s", True),
    ("step_ms", "ms/step (median)", False),
    ("mfu", "MFU", True),
    ("peak_mem_gb", "peak memory (GiB)", False),
    ("pad_fraction", "pad fraction", False),
)
#: a CPU run's memory row, in place of the device's
HOST_RSS = ("host_peak_rss_gb", "host peak RSS (GiB)", False)
#: a relative change smaller than this is reported as "same": single runs do not resolve less
SAME_WITHIN = 0.01


def _rel(a: float | None, b: float | None) -> float | None:
    return (b - a) / abs(a) if a is not None and b is not None and a != 0 else None


def _verdict(a: float | None, b: float | None, higher_is_better: bool) -> str:
    if a is None or b is None:
        return "n/a"
    rel = _rel(a, b)
    if b == a or (rel is not None and abs(rel) < SAME_WITHIN):
        return "same"
    return "better" if (b > a) == higher_is_better else "worse"


def _metric_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    ma, mb = as_report(a).metrics, as_report(b).metrics
    rows = []
    metrics = METRICS
    if getattr(ma, "peak_mem_gb", None) is None and getattr(mb, "peak_mem_gb", None) is None:
        # CPU runs: no device memory; the process's resident memory is what they measured
        metrics = tuple(HOST_RSS if key == "peak_mem_gb" else m for m in METRICS for key in [m[0]])
    for key, label, higher in metrics:
        va, vb = getattr(ma, key, None), getattr(mb, key, None)
        if key == "real_tokens_per_s":  # the one estimator, also for reports written before it
            va, vb = throughput.headline(a), throughput.headline(b)
        rows.append(
            {
                "key": key,
                "label": label,
                "a": va,
                "b": vb,
                "delta": vb - va if va is not None and vb is not None else None,
                "rel": _rel(va, vb),
                "higher_is_better": higher,
                "verdict": _verdict(va, vb, higher),
            }
        )
    return rows


def _facts(report: RunReport) -> dict[str, Any] | None:
    f = report.facts
    return f if f and "trace.error" not in f else None


def _per_step_rows(fa: dict[str, Any], fb: dict[str, Any], prefix: str, name: str) -> list[dict[str, Any]]:
    """`<prefix>.<name>.ms` facts of both runs (0 where one run has none), biggest change first."""

    def names(f: dict[str, Any]) -> set[str]:
        return {k.split(".")[1] for k in f if k.startswith(prefix + ".") and k.endswith(".ms") and k.count(".") == 2}

    rows = []
    for n in names(fa) | names(fb):
        ma, mb = fa.get(f"{prefix}.{n}.ms", 0.0), fb.get(f"{prefix}.{n}.ms", 0.0)
        rows.append({name: n, "a_ms": ma, "b_ms": mb, "delta_ms": mb - ma, "rel": _rel(ma, mb)})
    return sorted(rows, key=lambda r: (-abs(r["delta_ms"]), r[name]))


def _finding_summary(f: Finding) -> dict[str, Any]:
    return {"id": f.id, "title": f.title, "severity": f.severity, "layer": f.layer}


def _config_rows(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Differing knobs in layer order (0: run settings such as steps), as --help lists them."""
    table = knob_table()
    layer = {row["name"]: row["layer"] for row in table}
    position = {row["name"]: i for i, row in enumerate(table)}
    keys = sorted(
        (k for k in set(a) | set(b) if a.get(k) != b.get(k)),
        key=lambda k: (layer.get(k, 0), position.get(k, len(table)), k),
    )
    return [{"knob": k, "layer": layer.get(k, 0), "a": a.get(k), "b": b.get(k)} for k in keys]


def _has_none(labels: list[str], what: str) -> str:
    return f"{labels[0]} has no {what}" if len(labels) == 1 else f"neither {labels[0]} nor {labels[1]} has {what}"


def _describe(report: RunReport) -> dict[str, Any]:
    env, knobs = report.env or Env(), report.knobs
    return {
        "model": knobs.model,
        "stage": knobs.stage,
        "device": env.gpu or "CPU",
        "torch": env.torch,
        "created_at": report.created_at,
    }


def _run_notes(ra: RunReport, rb: RunReport, labels: Sequence[str]) -> list[str]:
    """What to know of each run before reading the difference: its ranks, the slowest one, an unstable or unsettled
    timed window."""
    la, lb = labels
    notes: list[str] = []
    ranks = ranks_note(ra, rb, labels)
    if ranks:
        notes.append(ranks)
    for label, r in ((la, ra), (lb, rb)):
        slow = slowest_rank(r)
        if slow and slow["step_ms"] is not None:
            notes.append(
                f"{label}: slowest of {world_size(r)} ranks is rank {slow['rank']} ({slow['step_ms']:,.1f} ms/step"
                + (f", {slow['imbalance'] * 100:.1f}% over the fastest)" if slow["imbalance"] is not None else ")")
            )

    for label, r in ((la, ra), (lb, rb)):
        tp = r.throughput
        if tp is not None and tp.stable is False:
            notes.append(f"{label}'s timed window is unstable ({tp.unstable_reason}): a difference may be noise")
        if tp is not None and tp.settled is False:
            notes.append(f"{label}'s timed window was still warming up: its tokens/s reads low")
    return notes


def _findings_diff(ra: RunReport, rb: RunReport, la: str, lb: str, notes: list[str]) -> dict[str, Any] | None:
    """The findings new in B, gone from A and kept; None (and a note that says why) when a report has no diagnosis."""
    if ra.findings is not None and rb.findings is not None:
        ia = {f.id: f for f in ra.findings}
        ib = {f.id: f for f in rb.findings}
        return {
            "added": [_finding_summary(f) for i, f in ib.items() if i not in ia],
            "gone": [_finding_summary(f) for i, f in ia.items() if i not in ib],
            "kept": [i for i in ib if i in ia],
        }
    missing = [lbl for lbl, r in ((la, ra), (lb, rb)) if r.findings is None]
    notes.append("findings not compared: " + _has_none(missing, "diagnosis"))
    return None


def compare(
    a: dict[str, Any], b: dict[str, Any], allow_different: bool = False, labels: Sequence[str] = ("A", "B")
) -> dict[str, Any]:
    """Side-by-side numbers and causes of two profile reports (A is the reference), read through their declaration
    (documents.RunReport); `a` and `b` as loaded (gate.load_report)."""
    la, lb = labels
    ra, rb = as_report(a, la), as_report(b, lb)
    notes: list[str] = []
    diffs = model_differences(ra, rb, shown)
    if diffs and not allow_different:
        raise UsageError(
            f"{la} and {lb} are different models or stages ("
            + "; ".join(diffs)
            + "); their numbers are not comparable. Pass --allow-different to compare anyway"
        )
    notes += [f"different model or stage (allowed): {d}" for d in diffs]
    notes += [f"different environment: {d}" for d in env_differences(ra, rb, shown)]
    notes += _run_notes(ra, rb, labels)

    fa, fb = _facts(ra), _facts(rb)
    kernels = gpu = None
    if fa and fb:
        kernels = _per_step_rows(fa, fb, "kernels", "class")
        gpu = {
            key: {"a": fa.get(key), "b": fb.get(key)}
            for key in ("step.ms", "gpu.busy_frac", "gpu.busy_ms", "gpu.idle_ms")
        }
        gpu["idle"] = _per_step_rows(fa, fb, "idle", "cause")
    else:
        missing = [lbl for lbl, f in ((la, fa), (lb, fb)) if not f]
        notes.append(
            "kernel classes and GPU idle causes need trace facts in both reports; "
            + _has_none(missing, "trace facts")
            + " (profiled with --no-diagnose, or the trace failed)"
        )

    findings = _findings_diff(ra, rb, la, lb, notes)

    return {
        "labels": [la, lb],
        "a": _describe(ra),
        "b": _describe(rb),
        "notes": notes,
        "metrics": _metric_rows(a, b),
        "kernels": kernels,
        "gpu": gpu,
        "findings": findings,
        "config": _config_rows(ra.config or {}, rb.config or {}),
        "ranks": {
            "a": world_size(ra),
            "b": world_size(rb),
            "slowest_a": slowest_rank(ra),
            "slowest_b": slowest_rank(rb),
        },
    }


# --- rendering --------------------------------------------------------------------------------

_COLOR = {"better": "green", "worse": "red", "same": "dim", "n/a": "dim"}


def _num(key: str, v: Any) -> str:
    if v is None:
        return "n/a"
    if key == "mfu":
        return f"{v * 100:.2f} %"
    if key == "pad_fraction":
        return f"{v * 100:.1f} %"
    if key.endswith("tokens_per_s"):
        return f"{v:,.0f}"
    if key in ("peak_mem_gb", "host_peak_rss_gb"):
        return f"{v:.2f}"
    return f"{v:,.1f}"


def _delta(key: str, d: float | None) -> str:
    if d is None:
        return ""
    if key in ("mfu", "pad_fraction"):
        return f"{d * 100:+.2f} pt"
    if key.endswith("tokens_per_s"):
        return f"{d:+,.0f}"
    return f"{d:+,.2f}" if key in ("peak_mem_gb", "host_peak_rss_gb") else f"{d:+,.1f}"


def _pct(rel: float | None, a: float | None = None, b: float | None = None) -> str:
    if rel is not None:
        return f"{rel * 100:+.1f}%"
    return "new" if a == 0 and b else ""


def _short(text: Any, width: int = 28) -> str:
    s = shown(text)
    return s if len(s) <= width else s[: width - 1] + "\u2026"


def column_labels(labels: Sequence[str]) -> tuple[str, str]:
    """Column heads for two reports: their labels without the file name both share (two runs' report.json
    are headed by their folders, `before` and `after`), else the labels."""
    pa, pb = (PurePath(x) for x in labels)
    if pa.name == pb.name and len(pa.parts) > 1 and len(pb.parts) > 1 and pa.parent != pb.parent:
        return str(pa.parent), str(pb.parent)
    return labels[0], labels[1]


def render_compare(result: Comparison | dict[str, Any], console: Console) -> None:
    """Tables sized for a terminal: the headline metrics first, the explanations after."""
    c = as_document(result, Comparison, "comparison") if isinstance(result, dict) else result
    for label, side in zip(c.labels, (c.a, c.b)):  # file names: shown as text in headers and titles
        console.print(
            f"[bold]{esc(label)}[/bold]: {esc(side.model)} stage {esc(side.stage)} on {esc(side.device)}, "
            f"torch {esc(side.torch)}" + (f", {esc(side.created_at)}" if side.created_at else ""),
            highlight=False,
        )
    for n in c.notes:
        console.print(f"[yellow]note:[/yellow] {esc(n)}", highlight=False)
    la, lb = (esc(_short(x, 20)) for x in column_labels(c.labels))

    t = Table(title=f"{la} -> {lb}", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, just in (
        ("metric", "left"),
        (la, "right"),
        (lb, "right"),
        ("change", "right"),
        ("%", "right"),
        ("", "left"),
    ):
        t.add_column(col, justify=just, no_wrap=col != "metric")
    for r in c.metrics:
        color = _COLOR[r.verdict]
        t.add_row(
            esc(r.label),
            _num(r.key, r.a),
            _num(r.key, r.b),
            _delta(r.key, r.delta),
            _pct(r.rel),
            f"[{color}]{esc(r.verdict)}[/{color}]",
        )
    console.print(t)

    gpu = c.gpu
    if gpu is not None:
        busy = gpu["gpu.busy_frac"]
        if busy["a"] is not None and busy["b"] is not None:
            console.print(
                f"GPU busy: {busy['a'] * 100:.0f}% -> {busy['b'] * 100:.0f}% of the traced step "
                f"({_num('step_ms', gpu['step.ms']['a'])} -> {_num('step_ms', gpu['step.ms']['b'])} ms)"
            )
        _ms_table(console, "GPU idle by host cause (ms per step)", "cause", gpu["idle"], la, lb, limit=8)
    if c.kernels is not None:
        _ms_table(console, "kernel classes (GPU ms per step, biggest change first)", "class", c.kernels, la, lb)

    f = c.findings
    if f is not None:
        if not f.added and not f.gone:
            console.print(f"findings: the same in both ({len(f.kept)})")
        for word, rows, color in (("new in " + lb, f.added, "red"), ("gone in " + lb, f.gone, "green")):
            for x in rows:
                console.print(
                    f"[{color}]{word}:[/{color}] {esc(x.id)} ({esc(x.severity)}): {esc(x.title)}", highlight=False
                )

    if c.config:
        t = Table(
            title="config knobs that differ", header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False
        )
        for col in ("layer", "knob", la, lb):
            t.add_column(col, justify="right" if col == "layer" else "left", no_wrap=col in ("layer", "knob"))
        for r in c.config:
            t.add_row(esc(r.layer or ""), esc(r.knob), esc(_short(r.a)), esc(_short(r.b)))
        console.print(t)
    else:
        console.print("config: identical")


def _ms_table(
    console: Console, title: str, name: str, rows: list[dict[str, Any]], la: str, lb: str, limit: int = 12
) -> None:
    kept = [r for r in rows if abs(r["a_ms"]) >= 0.05 or abs(r["b_ms"]) >= 0.05][:limit]
    if not kept:
        return
    t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col in (name, la, lb, "change", "%"):
        t.add_column(col, justify="left" if col == name else "right", no_wrap=True)
    for r in kept:
        color = "red" if r["delta_ms"] > 0 else "green" if r["delta_ms"] < 0 else "dim"
        t.add_row(
            esc(r[name]),
            f"{r['a_ms']:,.1f}",
            f"{r['b_ms']:,.1f}",
            f"[{color}]{r['delta_ms']:+,.1f}[/{color}]",
            _pct(r["rel"], r["a_ms"], r["b_ms"]),
        )
    console.print(t)
    if len(rows) > len(kept):
        console.print(f"[dim]({len(rows) - len(kept)} more with smaller changes)[/dim]")
