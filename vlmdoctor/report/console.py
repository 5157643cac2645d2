"""The console report: rich tables of metrics, facts, findings, ladders and sweeps.

Text is text. Names, paths and messages come from traces, reports, rule files and the command line, so
whatever they hold is shown, never acted on: every console vlmdoctor prints through is a `SafeConsole`
(control characters become visible escapes, no hyperlinks, markup that does not parse is shown as it is),
and data placed inside a markup string goes through `esc` (its `[` shown, not read as a style).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rich import box
from rich.console import Console
from rich.errors import MarkupError
from rich.padding import Padding
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from vlmdoctor import files
from vlmdoctor.run import throughput
from vlmdoctor.run.config import RunConfig, knob_table

#: what a terminal acts on instead of showing: C0 controls but the newline (ESC starts clear-screen, window
#: title and OSC 8 hyperlink sequences), DEL, C1 controls (CSI and OSC as one byte), and the Unicode bidi
#: controls that reorder what is shown
CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def plain(value: Any) -> str:
    """Any value as text a terminal only shows: each control character as its visible escape (\\x1b, \\u202e)."""
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))


#: a `[` with the backslashes before it, and whether Rich would read a tag there (rich.markup.RE_TAGS)
_BRACKET = re.compile(r"(\\*)\[")
_TAG_AT = re.compile(r"\[[a-z#/@][^[]*?]")


def _bracket(m: re.Match[str]) -> str:
    slashes = m.group(1)
    if _TAG_AT.match(m.string, m.end() - 1):  # a tag: each backslash doubled, and one to escape it (as escape())
        return slashes * 2 + "\\["
    return slashes + ("\\" if slashes else "") + "["  # Rich turns a plain backslash-bracket into a bracket


def esc(value: Any) -> str:
    """A value from a trace, report, rule or path, for a markup string: `plain`, and every `[` and backslash
    shown as written (rich.markup.escape leaves a backslash before a `[` that opens no tag to be eaten)."""
    text = _BRACKET.sub(_bracket, plain(value))
    tail = len(text) - len(text.rstrip("\\"))
    return text + "\\" * tail  # backslashes at the end must not escape the tag that follows


def _shown(segments: Iterable[Segment]) -> Iterator[Segment]:
    for seg in segments:
        if seg.control:  # rich's own cursor moves (progress bars), never text from an input
            yield seg
            continue
        style = seg.style.update_link(None) if seg.style is not None and seg.style.link else seg.style
        yield Segment(plain(seg.text) if CONTROL.search(seg.text) else seg.text, style)


class _Guarded:
    """A console's stream that printing can never fail on after the work: text its encoding cannot hold (an
    ASCII-only stdout) is shown replaced, and a reader that went away ends the printing, not the command."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeEncodeError:
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            return self._stream.write(text.encode(encoding, "replace").decode(encoding))
        except BrokenPipeError:
            files.reader_gone(self._stream)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            files.reader_gone(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class SafeConsole(Console):
    """The console every vlmdoctor command, `Doctor` and `vlmdoctor run` print through: the boundary where text
    from inputs meets the terminal. Control characters in any text become visible escapes, hyperlinks are
    dropped (vlmdoctor prints none), emoji codes stay text, and markup that does not parse is printed as it
    is, so that printing never fails after the work is done (nor does a stream that cannot encode a character,
    or a reader that went away: `_Guarded`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("emoji", False)
        super().__init__(*args, **kwargs)

    @property
    def file(self) -> Any:
        stream = Console.file.fget(self)  # type: ignore[attr-defined]  # sys.stdout as it is now, unless given
        guard = self.__dict__.get("_guard")
        if guard is None or guard._stream is not stream:  # one wrapper per stream, not one per write
            guard = self.__dict__["_guard"] = _Guarded(stream)
        return guard

    @file.setter
    def file(self, new_file: Any) -> None:
        Console.file.fset(self, new_file)  # type: ignore[attr-defined]

    def render_str(self, text: str, **kwargs: Any) -> Text:
        try:
            return super().render_str(text, **kwargs)
        except MarkupError:
            return super().render_str(text, **{**kwargs, "markup": False})

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        return super()._render_buffer(_shown(buffer))


def _fmt_small(v: float | None, unit: str = "", digits: int = 2) -> str:
    """A rate that may be far below one (a tiny model's TFLOP/s): its significant digits, never "0.00"."""
    if isinstance(v, float) and v != 0 and abs(v) < 1:
        return f"{v:.{digits}g}{unit}"
    return _fmt(v, unit, digits)


def _fmt(v: Any, unit: str = "", digits: int = 1) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:,.{digits}f}{unit}"
    return f"{esc(v)}{unit}"


def _changed_knobs(config: dict[str, Any]) -> list[str]:
    defaults = RunConfig().to_dict()
    layer = {row["name"]: row["layer"] for row in knob_table()}
    # the measurement window (steps, warmup, repeats) is shown in the table; model and stage in the title
    shown = {"model", "stage", "device", "steps", "warmup", "repeats"}
    return [f"{k}={v}" for k, v in config.items() if v != defaults.get(k) and k in layer and k not in shown]


def render(report: dict[str, Any], console: Console) -> None:
    cfg, env, model = report["config"], report.get("env", {}), report.get("model", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    title = f"vlmdoctor profile: {esc(cfg['model'])} stage {esc(cfg['stage'])} on {esc(where)}"
    changed = _changed_knobs(cfg)
    console.print(f"[bold]{title}[/bold]")
    console.print(
        f"model: {esc(model.get('vision'))} + {esc(model.get('projector'))} + {esc(model.get('llm'))}; "
        f"{esc(model.get('image_tokens'))} image tokens"
    )
    console.print(
        "knobs changed from the default: " + (esc(", ".join(changed)) if changed else "none (the default config)")
    )
    data = report.get("data") or {}
    if data.get("skipped"):
        console.print(
            f"[yellow]data: {esc(data['skipped'])} of {esc(data.get('records'))} records skipped[/yellow] "
            f"(--bad-records skip; the first: {esc((data.get('problems') or ['?'])[0])})",
            highlight=False,
        )
    for w in report.get("warnings") or []:
        console.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)
    if report["status"] not in ("ok", "nan_loss"):
        err = report.get("error", {})
        console.print(f"[bold red]{esc(report['status'])}[/bold red]: {esc(err.get('message'))}", highlight=False)
        if err.get("requested_gb") is not None:
            console.print(
                f"asked for {err['requested_gb']:.2f} GiB more; peak before failure "
                f"{_fmt(err.get('peak_mem_gb_before_failure'), ' GiB', 2)} of "
                f"{_fmt(err.get('device_mem_total_gb'), ' GiB', 1)}"
            )
        return
    m, stats = report["metrics"], report.get("stats", {})
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column(f"spread over {esc(m['repeats'])} repeat(s) x {esc(m['steps_per_repeat'])} steps", justify="right")

    def spread(key: str, unit: str = "", digits: int = 1) -> str:
        s = stats.get(key)
        if not s or s["n"] < 2:
            return ""
        return f"{_fmt(s['min'], unit, digits)} .. {_fmt(s['max'], unit, digits)}"

    tp = report.get("throughput") or {}
    t.add_row(
        "real tokens/s",
        _fmt(throughput.headline(report), "", 0),
        throughput.spread_text(tp) or spread("real_tokens_per_s", "", 0),
    )
    t.add_row("loss tokens/s", _fmt(m["loss_tokens_per_s"], "", 0), spread("loss_tokens_per_s", "", 0))
    t.add_row("pad fraction", _fmt(m["pad_fraction"] * 100, " %"), "")
    step = stats.get("step_ms", {})
    t.add_row(
        "ms/step (median)",
        _fmt(m["step_ms"], " ms"),
        f"p10 {_fmt(m['step_ms_p10'])} / p90 {_fmt(m['step_ms_p90'])} (n={esc(step.get('n'))})",
    )
    t.add_row(
        "MFU",
        _fmt(m["mfu"] * 100 if m["mfu"] is not None else None, " %"),
        spread("mfu", "", 3) if m["mfu"] is not None else esc(m.get("mfu_reason") or ""),
    )
    t.add_row("model TFLOP/s", _fmt_small(m["model_tflops_per_s"]), "")
    if m.get("peak_mem_gb") is not None:
        t.add_row(
            "peak memory allocated / reserved",
            f"{_fmt(m['peak_mem_gb'], ' GiB', 2)} / {_fmt(m['peak_mem_reserved_gb'], ' GiB', 2)}",
            f"of {_fmt(m['device_mem_total_gb'], ' GiB')}",
        )
    else:
        t.add_row("host peak RSS", _fmt(m["host_peak_rss_gb"], " GiB", 2), "")
    loss = m["final_loss"]
    t.add_row("final loss", _fmt(loss, "", 4) if m["loss_finite"] else f"[red]{esc(loss)} (not finite)[/red]", "")
    console.print(t)
    render_measurement_notes(report, console)
    if report.get("distributed"):
        render_ranks(report["distributed"], console)
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "transformers", "liger_kernel") if env.get(k))
    console.print(f"[dim]{esc(versions)}; driver {esc(env.get('driver') or 'n/a')}[/dim]", highlight=False)
    tr = report.get("trace")
    if tr and tr.get("lost"):  # the measurement above stands; the warning line says why the trace is gone
        console.print(f"trace: lost ({esc(tr['lost'])})", highlight=False)
    elif tr:
        traced = _ms(sorted(tr["traced_step_ms"])[len(tr["traced_step_ms"]) // 2] if tr["traced_step_ms"] else None)
        where = tr["path"] or "analyzed, not kept (--trace-dir DIR keeps it)"
        console.print(
            f"trace: {esc(where)} ({esc(tr['steps'])} steps; traced step {traced} ms vs untraced median "
            f"{_ms(m['step_ms'])} ms)",
            highlight=False,
        )
    if report["status"] == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")


def render_ranks(d: dict[str, Any], console: Console) -> None:
    """A multi-rank run: one row per rank, then the job's numbers (the table above is the job's)."""
    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("rank", "ms/step", "real tokens/s", "real tokens", "peak mem GiB", "host"):
        t.add_column(col, justify="left" if col == "host" else "right")
    g = d.get("global") or {}
    for r in d.get("ranks") or []:
        mark = " *" if r.get("rank") == g.get("slowest_rank") else ""
        t.add_row(
            f"{esc(r.get('rank'))}{mark}",
            _fmt(r.get("step_ms")),
            _fmt(r.get("real_tokens_per_s"), "", 0),
            esc(r.get("real_tokens")),
            _fmt(r.get("peak_mem_gb"), "", 2),
            esc(str(r.get("host", ""))[:20]),
        )
    console.print(t)
    line = (
        f"{esc(d.get('world_size'))} ranks ({esc(d.get('parallel'))}, {esc(d.get('backend'))}): the job's numbers "
        f"are the table's above, each row here one rank's own (* the slowest, rank {esc(g.get('slowest_rank'))}"
    )
    if g.get("step_imbalance") is not None:
        line += f", {g['step_imbalance'] * 100:.1f}% slower than the fastest"
    console.print(line + ")")
    sc = d.get("scaling")
    if sc and sc.get("doubts"):  # no number that cannot be one: what went wrong, and what to do
        console.print(
            "[bold yellow]scaling efficiency not measured:[/bold yellow] "
            + esc("; ".join(sc["doubts"]))
            + f" (it read {sc['efficiency'] * 100:.0f}%, {sc['speedup']:.2f}x one GPU's "
            f"{_fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s); {esc(sc.get('remedy') or '')}"
        )
    elif sc:
        console.print(
            f"scaling efficiency {sc['efficiency'] * 100:.0f}% ({sc['speedup']:.2f}x one GPU's "
            f"{_fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s, {esc(sc['source'])})"
        )
    if d.get("params_identical") is False:
        console.print("[bold red]the ranks' weights differ after the steps: gradients were not synchronised[/bold red]")


def render_models(rows: list[dict[str, Any]], console: Console) -> None:
    """One row per model, its kind and notes under the name, so that the table fits 80 columns.

    Native presets give vision/LLM pairs for layers, hidden, heads and head dim.
    """
    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("name", "params", "layers", "hidden", "heads", "head dim"):
        t.add_column(
            col,
            justify="left" if col == "name" else "right",
            no_wrap=col != "name",
            min_width=26 if col == "name" else None,
        )
    for r in rows:
        notes = esc(r["kind"]) + (f": {esc(r['notes'])}" if r.get("notes") else "")
        p = r["params"] / 1e6
        t.add_row(
            f"[bold]{esc(r['name'])}[/bold]\n[dim]{notes}[/dim]",
            f"{p:,.0f}M" if p >= 1000 else f"{p:,.1f}M",
            esc(r.get("layers", "")),
            esc(r.get("hidden", "")),
            esc(r.get("heads", "")),
            esc(r.get("head_dim", "")),
        )
    console.print(t)


def _ms(v: Any) -> str:
    return f"{v:,.1f}" if isinstance(v, (int, float)) else "n/a"


def straggler_cause(f: dict[str, Any]) -> str:
    """The straggler's cause in words, with the numbers that make it the cause."""
    cause = str(f["dist.straggler.cause"])
    grown = f.get("dist.straggler.accounts") or []
    if cause == "tokens":
        text = f"tokens ({f['dist.straggler.tokens_excess_frac'] * 100:+.0f}% over the others' mean)"
    elif cause == "gemm_work":
        text = (
            f"gemm work (its GEMMs ran {f['dist.straggler.gemm_excess_frac'] * 100:+.0f}% longer than the others': "
            "more or longer samples; record_shapes=True counts its tokens)"
        )
    elif cause.startswith(("busy.", "idle.")):
        text = next((f"{g['account']} grew {g['excess_ms']:,.1f} ms/step ({g['meaning']})" for g in grown), cause)
    else:
        text = cause.replace("_", " ")
    if cause not in ("balanced",) and grown and not cause.startswith(("busy.", "idle.")):
        text += "; accounts above the others': " + ", ".join(f"{g['account']} +{g['excess_ms']:,.1f} ms" for g in grown)
    return text


def render_accounts(acc: dict[str, Any], console: Console, top: int = 12) -> None:
    """The traced step's accounts, largest first, then the unattributed rest: every millisecond of the step."""
    t = Table(
        title=f"accounts of the traced step ({acc['step_ms']:,.1f} ms; per step)",
        show_header=True,
        header_style="bold",
    )
    for col, justify in (("account", "left"), ("ms", "right"), ("step", "right"), ("what", "left")):
        t.add_column(col, justify=justify)
    for r in acc["rows"][:top]:
        t.add_row(esc(r["account"]), _ms(r["ms"]), f"{r['share'] * 100:.0f}%", esc(r["meaning"]))
    rest = acc["rows"][top:]
    if rest:
        ms = sum(r["ms"] for r in rest)
        t.add_row(f"{len(rest)} more", _ms(ms), f"{ms / acc['step_ms'] * 100:.0f}%", "")
    t.add_row(
        "unattributed",
        _ms(acc["unattributed_ms"]),
        f"{acc['unattributed_share'] * 100:.0f}%",
        "GPU idle under no host event" if acc["unattributed_ms"] > 0 else "",
    )
    console.print(t)


def render_facts(result: dict[str, Any], console: Console) -> None:
    """Summary of `vlmdoctor analyze`: what the GPU did per step and why it waited."""
    for entry in result["files"]:
        f = entry["facts"]
        known = (
            ", ".join(f"{k.split('.')[1]} {esc(f[k])}" for k in ("run.model", "run.stage") if k in f)
            or "model and stage unknown"
        )
        console.print(
            f"[bold]{esc(entry['file'])}[/bold]: {esc(f['trace.steps'])} step(s), {known}"
            + ("" if f["trace.written_by_vlmdoctor"] else " (not written by vlmdoctor)")
        )
        notes = f.get("run.notes") or []
        for w in f.get("trace.warnings", []):
            console.print(f"[yellow]{'warning' if w in notes else 'partial'}:[/yellow] {esc(w)}", highlight=False)
        if not f["trace.written_by_vlmdoctor"]:  # a user's trace: say where each number's frame came from
            console.print(
                f"steps from {esc(f.get('trace.windows_from', 'n/a'))}; stage: "
                f"{esc(f.get('run.stage_source') or f.get('run.stage_estimate_why') or 'unknown')}; "
                f"model parts from: {esc(f.get('part.source', 'none'))}"
            )
            if "shapes.micro_batches_per_step.source" in f:
                console.print(
                    f"micro-batches per step: {f['shapes.micro_batches_per_step']:g} "
                    f"({esc(f['shapes.micro_batches_per_step.source'])})"
                )
        line = f"step {_ms(f['step.ms'])} ms"
        if "gpu.busy_frac" in f:
            line += (
                f"; GPU busy {f['gpu.busy_frac'] * 100:.0f}% ({_ms(f['gpu.busy_ms'])} ms), "
                f"idle {_ms(f['gpu.idle_ms'])} ms"
            )
        console.print(line)
        if "comm.ms" in f:
            console.print(comm_line(f, "comm.", entry.get("rank")))
        if "gpu.busy_frac" not in f:
            continue
        if entry.get("accounts"):
            render_accounts(entry["accounts"], console)
        t = Table(title="host work while the GPU waited (per step)", show_header=True, header_style="bold")
        t.add_column("innermost host op / runtime call")
        t.add_column("ms", justify="right")
        t.add_column("share of idle", justify="right")
        for row in f["idle.top_host_ops"][:6]:
            t.add_row(esc(str(row["op"])[:70]), _ms(row["ms"]), f"{row['share'] * 100:.0f}%")
        console.print(t)
        t = Table(title="kernel classes (per step)", show_header=True, header_style="bold")
        for col in ("class", "ms", "count", "share of GPU time"):
            t.add_column(col, justify="left" if col == "class" else "right")
        classes = sorted({k.split(".")[1] for k in f if k.startswith("kernels.")}, key=lambda c: -f[f"kernels.{c}.ms"])
        for c in classes[:12]:
            t.add_row(
                esc(c),
                _ms(f[f"kernels.{c}.ms"]),
                f"{f[f'kernels.{c}.count']:,.0f}",
                f"{f[f'kernels.{c}.share'] * 100:.1f}%",
            )
        console.print(t)
        console.print(
            f"GEMMs: {_ms(f['gemm.ms'])} ms; FP32 (no tensor cores) {f['gemm.fp32_share'] * 100:.1f}% of GEMM time"
            + (
                f" in {esc(', '.join(f['part.fp32_gemm_parts']))}: {esc(str(f['gemm.fp32_top_kernels'][0])[:60])}"
                if f["gemm.fp32_share"] > 0
                else ""
            )
        )
        parts = sorted(
            {k.split(".")[1] for k in f if k.startswith("part.") and k.endswith(".ms")},
            key=lambda p: -f[f"part.{p}.ms"],
        )
        console.print("GPU time by part: " + ", ".join(f"{esc(p)} {_ms(f[f'part.{p}.ms'])} ms" for p in parts))
        phases = [k.split(".")[1] for k in f if k.startswith("phase.") and k.endswith(".ms")]
        console.print(
            "by phase: "
            + ", ".join(f"{esc(p)} {_ms(f[f'phase.{p}.ms'])} ms" for p in phases)
            + f"; recompute: {esc(f['recompute.kind'])} ({f['recompute.share'] * 100:.1f}% of GPU time)"
        )
        console.print(
            f"launches: {f['launch.kernels']:,.0f} kernels/step, {f['launch.tiny_kernel_frac'] * 100:.0f}% under "
            f"10 µs, launch API {_ms(f['launch.api_ms'])} ms/step, launch-to-start median "
            f"{_ms(f.get('launch.delay_us_median'))} µs"
        )
        extra = []
        if "shapes.distinct_token_batches" in f:
            extra.append(f"token batch shapes: {esc(', '.join(map(str, f['shapes.token_batches'])))}")
        if "loss.logits_gb" in f:
            extra.append(f"logits {f['loss.logits_gb']:.2f} GiB ({esc(f['loss.logits_dtype'])})")
        elif f.get("ops.fused_linear_cross_entropy"):
            extra.append("logits not materialized (fused linear cross entropy)")
        liger = [f"{esc(k.split('.')[1])} {f[k]:.0f}" for k in f if k.startswith("liger.") and f[k]]
        if liger:
            extra.append("Liger launches/step: " + ", ".join(liger))
        backends = [esc(k.split(".")[2]) for k in f if k.startswith("attention.backend.")]
        if backends:
            extra.append("SDPA backend: " + ", ".join(backends))
        if extra:
            console.print("; ".join(extra))


def _gain_text(gain: dict[str, Any]) -> str:
    if gain["saves_ms_per_step"] is not None:
        g = f"-{gain['saves_ms_per_step']:,.1f} ms/step"
        if gain["share_of_step"] and gain.get("step_ms"):  # the ms and the step from one window, said
            g += f"\n({gain['share_of_step'] * 100:.0f}% of the {gain['step_ms']:,.1f} ms traced step)"
        elif gain["share_of_step"]:
            g += f"\n({gain['share_of_step'] * 100:.0f}% of the traced step)"
        return g
    if gain.get("throughput_x"):
        return f"x{gain['throughput_x']:.2f} throughput"
    return "n/a"


def _apply_text(f: dict[str, Any]) -> str:
    """The order of application: the fix's place in layer order, then its layer."""
    order = f.get("apply_order")
    return (f"{esc(order)}. " if order is not None else "") + f"layer {esc(f['layer'])}\n{esc(f['layer_name'])}"


def _gain_short(gain: dict[str, Any] | None) -> str:
    """A finding's expected gain in a few characters (x1.58, -3.1 ms/step, n/a), for the muted line."""
    from vlmdoctor.doctor.rules import gain_ratio

    ratio = gain_ratio(gain)
    if ratio is not None:
        return f"x{ratio:.2f}"
    saves = (gain or {}).get("saves_ms_per_step")
    return f"-{saves:,.1f} ms/step" if isinstance(saves, (int, float)) else "gain n/a"


def _gain_cell(f: dict[str, Any]) -> str:
    """The expected gain, then the throughput ratio and the severity it earns."""
    text = _gain_text(f["expected_gain"])
    ratio = _gain_short(f["expected_gain"])
    severity = esc(f.get("severity", ""))
    tail = f"{ratio}, {severity}" if ratio.startswith("x") and ratio not in text else severity
    return f"{text}\n{tail}"


def render_unprescribed(diagnosis: dict[str, Any], console: Console) -> None:
    """Each large account of the step that no finding speaks to, said as seen: no cost of that size goes unnamed."""
    for a in diagnosis.get("accounts") or []:
        if a["verdict"] != "no prescription known":
            continue
        where = f" (in {', '.join(a['where'])})" if a.get("where") else ""
        console.print(
            f"seen: {a['ms']:,.1f} ms/step ({a['share'] * 100:.0f}% of the traced step) in {a['account']}, "
            f"{a['meaning']}{where}; no prescription known",
            style="yellow",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )


def render_muted(diagnosis: dict[str, Any], console: Console) -> None:
    """One line naming every muted finding with its expected gain: muted, never silently dropped."""
    muted = diagnosis.get("muted") or []
    if not muted:
        return
    by = sorted({str(m.get("muted_by", "")).split(" ")[0] for m in muted})
    console.print(
        f"muted ({len(muted)}, by {', '.join(by)}): "
        + ", ".join(f"{m['id']} {_gain_short(m.get('expected_gain'))}" for m in muted),
        style="dim",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )


def render_findings(
    diagnosis: dict[str, Any], console: Console, command: Callable[[dict[str, Any]], str] | None = None
) -> None:
    """Prescriptions, biggest expected gain first: what was seen, what to change, what it should save, and
    the order in which to apply it (its layer).

    Each patch is then printed on a line of its own, as the command that runs it (`command`
    turns a patch into one), never wrapped or cut, so it can be copied whole at any width.
    """
    findings = diagnosis["findings"]
    if not findings:
        console.print("[bold green]no prescriptions[/bold green]: no rule fired on the measured facts")
    else:
        t = Table(
            title="prescriptions, biggest expected gain first (apply them in the 'apply' order)",
            show_header=True,
            header_style="bold",
            show_lines=True,
        )
        t.add_column("#", justify="right")
        t.add_column("apply")
        t.add_column("seen (measured)", ratio=3)
        t.add_column("change", ratio=2)
        t.add_column("expected gain", justify="right")
        for i, f in enumerate(findings, 1):
            t.add_row(
                str(i),
                _apply_text(f),
                f"[bold]{esc(f['title'])}[/bold]\n" + "\n".join(esc(e) for e in f["evidence"]),
                esc(f["fix"]),
                _gain_cell(f),
            )
        console.print(t)
        for i, f in enumerate(findings, 1):
            patch = f["config_patch"]
            advice = f.get("advice")  # the user's own training: the fix in their terms, not vlmdoctor knobs
            if advice and advice.get("lines"):
                console.print(
                    f"#{i} {f['id']}, in your {advice.get('audience', 'code')}:",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )
                for line in advice["lines"]:
                    console.print(f"  {line}", style="cyan", highlight=False, markup=False, soft_wrap=True)
                continue
            if not patch:
                continue
            knobs = ", ".join(f"{k}={v}" for k, v in patch.items())
            console.print(f"#{i} {f['id']}, run:", highlight=False, markup=False, soft_wrap=True)
            line = command(patch) if command else knobs
            console.print(f"  {line}", style="cyan", highlight=False, markup=False, soft_wrap=True)
    render_unprescribed(diagnosis, console)
    render_muted(diagnosis, console)
    for s in diagnosis["superseded"]:
        console.print(f"[dim]superseded: {esc(s['id'])} (covered by {esc(s['superseded_by'])})[/dim]")
    for n in diagnosis.get("not_applicable", []):
        if n.get("measured"):  # fired on the measurement, but the preset cannot take the fix
            console.print(f"[dim]seen, fix not applicable: {esc(n['id'])} ({esc(n['why'])})[/dim]", highlight=False)
    for n in diagnosis["not_evaluated"]:
        hint = f"; record with {n['hint']}" if n.get("hint") else ""
        console.print(
            f"[dim]not evaluated: {esc(n['id'])} (needs {esc(', '.join(n.get('missing') or []))}{esc(hint)})[/dim]",
            highlight=False,
        )
    gpu_only = [n["id"] for n in diagnosis.get("not_applicable", []) if "fact of GPU runs" in n["why"]]
    if gpu_only:
        console.print(
            f"[dim]not applicable to a CPU run ({len(gpu_only)} rules need GPU kernel facts): "
            f"{esc(', '.join(gpu_only))}[/dim]"
        )
    for p in diagnosis.get("problems", []):
        console.print(f"[yellow]rule problem:[/yellow] {esc(p)}", highlight=False)


def render_rule_page(page: dict[str, Any], console: Console) -> None:
    """`vlmdoctor rules show`: one rule as a readable page (in the manner of ruff's rule pages)."""
    console.print(f"[bold]{esc(page['id'])}[/bold]: {esc(page['title'])}", soft_wrap=False)
    console.print(
        f"layer {esc(page['layer'])} ({esc(page['layer_name'])}), severity {esc(page['severity'])}, "
        f"stages {esc(', '.join(map(str, page['stages'])))}; file {esc(page['file'])}",
        highlight=False,
    )

    def section(title: str, body: str | list[str] | None) -> None:
        if not body:
            return
        console.print(f"\n[bold]{title}[/bold]")
        for line in [body] if isinstance(body, str) else body:
            console.print(Padding(Text(line), (0, 0, 0, 2)))

    section("What it detects and why it matters", page["detects"])
    section(
        "Fires when (measured facts)",
        [page["when"]] + ([f"unless {page['unless']}"] if page.get("unless") else []),
    )
    section("Evidence it shows", page["evidence"])
    section("Fix", page["fix"])
    if page["patch"]:
        section("Config patch", [f"{k}={v}" for k, v in page["patch"].items()])
    gain = page.get("gain") or {}
    if gain:
        lines = []
        for k, v in gain.items():
            if k == "how":
                continue
            forms = v if isinstance(v, list) else [v]  # a GPU form, then a CPU form: the first measured one is used
            lines += [f"{k} = {e}" if i == 0 else f"  or, where not measured: {e}" for i, e in enumerate(forms)]
        section("Expected gain", lines + ([f"How: {gain['how']}"] if gain.get("how") else []))
    if page["thresholds"]:
        console.print("\n[bold]Thresholds and where they come from[/bold]")
        for c in page["thresholds"]:
            console.print(Padding(Text(f"{c['name']} = {c['value']}"), (0, 0, 0, 2)))
            console.print(Padding(Text(str(c["why"])), (0, 0, 0, 4)))
    section("Facts it reads", ", ".join(page["facts"]))
    section("Not prescribed together with", ", ".join(page["conflicts"]))
    section("Sources", page["sources"])


def render_ladder(result: dict[str, Any], console: Console) -> None:
    """The treat ladder: kept steps with their numbers, then the trials that were not kept."""
    cfg = result["start_config"]
    console.print(
        f"[bold]vlmdoctor treat: {esc(cfg['model'])} stage {esc(cfg['stage'])}[/bold] "
        f"({len(result['trials'])} trial(s); stopped: {esc(result.get('stopped_because'))})"
    )
    if not result["ladder"]:
        start = result.get("start") or {}
        console.print(
            f"[bold red]the start config did not run[/bold red]: {esc(start.get('status'))} "
            f"{esc(start.get('error') or '')}",
            highlight=False,
        )
        return
    t = Table(title="ladder (adopted rounds)", header_style="bold")
    for col, just in (
        ("#", "right"),
        ("change", "left"),
        ("tokens/s", "right"),
        ("x start", "right"),
        ("ms/step", "right"),
        ("MFU", "right"),
        ("GiB", "right"),
        ("at s", "right"),
    ):
        t.add_column(col, justify=just, overflow="fold")
    for r in result["ladder"]:
        t.add_row(
            esc(r["step"]),
            esc(r["change"]),
            _fmt(r.get("real_tokens_per_s"), "", 0),
            f"{r['speedup']:.2f}",
            _fmt(r.get("step_ms")),
            _fmt(r["mfu"] * 100 if r.get("mfu") else None, " %"),
            _fmt(r.get("peak_mem_gb"), "", 1),
            _fmt(r.get("elapsed_s"), "", 0),
        )
    console.print(t)
    own = [(r["step"], c) for r in result["ladder"] for c in r.get("changes") or []]
    if own:
        t = Table(title="each change's own contribution (leave-one-out)", header_style="bold")
        for col in ("#", "rule", "x own [95% CI]", "pairs", "verdict"):
            t.add_column(col)
        for step, c in own:
            k = c["contribution"]
            t.add_row(
                esc(step), esc(c["rule"]), _ci(k) or esc(k.get("why", "")), esc(k.get("pairs") or ""), esc(k["outcome"])
            )
        console.print(t)
    rejected = [x for x in result["trials"] if x.get("outcome") not in ("kept", "adopted")]
    if rejected:
        t = Table(title="trials not kept", header_style="bold")
        for col in ("trial", "what", "outcome", "x [95% CI]", "tokens/s"):
            t.add_column(col, justify="right" if col == "tokens/s" else "left")
        need = (result.get("decision") or {}).get("min_pairs", 3)
        for x in rejected:
            if "ratio" in x:
                measured = _ci(x)
            elif x.get("ratios"):  # a round the time cut short: the pairs it measured, which decided nothing
                measured = f"{_ci(x)} ({len(x['ratios'])} of {need} pairs)"
            elif "margin" in x:  # a treat.json of the first treat: gain against the spread-based margin
                measured = f"{x['gain'] * 100:+.1f}% vs +/-{x['margin'] * 100:.1f}%"
            else:
                measured = esc(str(x.get("error") or x.get("why") or "")[:40])
            what = x.get("name") or x["rule"]
            if x.get("kind") == "composition" and x.get("config_patch"):  # which knobs, not just "composition"
                what = ", ".join(f"{k}={v}" for k, v in x["config_patch"].items())
            t.add_row(
                esc(x["trial"]),
                esc(what),
                esc(x["outcome"]),
                measured,
                _fmt(x["real_tokens_per_s"], "", 0) if x.get("real_tokens_per_s") else "",
            )
        console.print(t)
    for s in result.get("skipped") or []:
        console.print(f"skipped {esc(s['rule'])}: {esc(s['why'])}", highlight=False)
    if result.get("wall_s"):
        console.print(f"treatment took {result['wall_s']:.0f} s")


def _ci(d: dict[str, Any]) -> str:
    if d.get("ratio") is None:  # undecided when the time ran out: the pairs it did measure
        return ", ".join(f"{r:.2f}" for r in d.get("ratios") or [])
    lo, hi = d.get("ci_low"), d.get("ci_high")
    if lo is None or hi is None or hi == float("inf"):
        return f"{d['ratio']:.2f}"
    return f"{d['ratio']:.2f} [{lo:.2f}-{hi:.2f}]"


def render_sweep(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="sweep", header_style="bold")
    for col, just in (
        ("stage", "right"),
        ("configuration", "left"),
        ("real tokens/s", "right"),
        ("pad %", "right"),
        ("ms/step (p10-p90)", "right"),
        ("MFU", "right"),
        ("peak GiB", "right"),
        ("status", "left"),
    ):
        t.add_column(col, justify=just)
    for r in rows:
        ok = r["status"] == "ok"
        t.add_row(
            esc(r["stage"]),
            esc(r["name"]),
            _fmt(r["real_tokens_per_s"], "", 0) if ok else "",
            _fmt(r["pad_fraction"] * 100 if ok else None),
            f"{_fmt(r['step_ms'])} ({_fmt(r['step_ms_p10'])}-{_fmt(r['step_ms_p90'])})" if ok else "",
            _fmt(r["mfu"] * 100 if r.get("mfu") else None, " %"),
            _fmt(r.get("peak_mem_gb"), "", 1),
            esc(r["status"]) if ok else f"{esc(r['status'])}: {esc(str(r.get('error') or '')[:50])}",
        )
    console.print(t)


def render_own(report: dict[str, Any], console: Console) -> None:
    """A report of the user's own training (Doctor, DoctorCallback, `vlmdoctor run`): what was seen, what to change."""
    cfg, env, model = report.get("config") or {}, report.get("env") or {}, report.get("model") or {}
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    stage = cfg.get("stage")
    stage_text = f"stage {esc(stage)} ({esc(cfg.get('stage_source'))})" if stage else "stage unknown"
    console.print(
        f"[bold]vlmdoctor: {esc(model.get('class') or 'your model')} ({esc(cfg.get('source'))}), {stage_text}, "
        f"on {esc(where)}[/bold]",
        highlight=False,
    )
    parts = model.get("parts") or {}
    if parts:
        console.print("parts: " + ", ".join(f"{esc(k)} {esc(v)}" for k, v in parts.items()), highlight=False)
    for n in report.get("notes") or []:
        console.print(f"[yellow]note:[/yellow] {esc(n)}", highlight=False)
    if report.get("status") not in ("ok", "nan_loss"):
        console.print(
            f"[bold red]{esc(report.get('status'))}[/bold red]: {esc((report.get('error') or {}).get('message'))}",
            highlight=False,
        )
        return
    m = report["metrics"]
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    tp = report.get("throughput") or {}
    spread = throughput.spread_text(tp)
    t.add_row("real tokens/s", _fmt(m.get("real_tokens_per_s"), "", 0) + (f" ({spread})" if spread else ""))
    t.add_row("loss tokens/s", _fmt(m.get("loss_tokens_per_s"), "", 0))
    pad = m.get("pad_fraction")
    t.add_row("pad fraction", _fmt(pad * 100 if pad is not None else None, " %"))
    t.add_row(
        "ms/step (median)",
        f"{_fmt(m['step_ms'], ' ms')} (p10 {_fmt(m['step_ms_p10'])}, "
        f"p90 {_fmt(m['step_ms_p90'])}, n={esc(m['steps_per_repeat'])})",
    )
    _flop_rows(t, m, report.get("flops") or {})
    if m.get("peak_mem_gb") is not None:
        t.add_row("peak memory allocated", _fmt(m["peak_mem_gb"], " GiB", 2))
    elif m.get("host_peak_rss_gb") is not None:  # a CPU run: its memory is the process's
        t.add_row("host peak RSS", _fmt(m["host_peak_rss_gb"], " GiB", 2))
    if m.get("final_loss") is not None:
        t.add_row("last loss", _fmt(m["final_loss"], "", 4))
    facts = report.get("facts") or {}
    console.print(t)
    if (report.get("distributed") or {}).get("global"):  # several ranks: the table above is the job's
        render_ranks(report["distributed"], console)
        if "dist.comm.ms" in facts:
            console.print(comm_line(facts, "dist.comm.", None).replace("collectives", "rank mean: collectives", 1))
    render_measurement_notes(report, console)
    if "trace.error" in facts:
        console.print(f"[yellow]the trace could not be analyzed:[/yellow] {esc(facts['trace.error'])}", highlight=False)
    tr = report.get("trace") or {}
    if tr.get("path"):
        from vlmdoctor.report.progress import WHOLE, wrap

        ranks = len(tr.get("rank_paths") or [])
        where = f"{tr['dir']} (one trace per rank)" if ranks > 1 and tr.get("dir") else tr["path"]
        console.print(esc(wrap(f"trace: {where}")), highlight=False, **WHOLE)  # the path stays whole
    if "diagnosis" in report:
        render_own_findings(report["diagnosis"], console)


def _flop_rows(t: Table, m: dict[str, Any], flops: dict[str, Any]) -> None:
    """FLOPs per step and MFU of a user's model: counted from a real step; MFU null says why."""
    fps = m.get("flops_per_step")
    t.add_row("FLOPs/step", f"{_fmt_small(fps / 1e9)} GFLOP (counted)" if fps else esc(flops.get("formula") or "n/a"))
    mfu = m.get("mfu")
    t.add_row(
        "MFU", _fmt(mfu * 100, " %", 2) if mfu is not None else f"n/a: {esc(m.get('mfu_reason') or 'not computed')}"
    )


def measurement_notes(report: dict[str, Any]) -> list[str]:
    """What to know before trusting the numbers: an unstable window, a warm-up that had not settled, the split."""
    tp = report.get("throughput") or {}
    out = []
    if tp.get("stable") is False:
        out.append(
            f"unstable window: {tp.get('unstable_reason')}. tokens/s is the median step's rate, which a few slow "
            f"steps barely move; {tp.get('advice')}"
        )
    if tp.get("settled") is False and tp.get("settle_note"):
        out.append(f"warm-up: {tp['settle_note']}")
    warm = report.get("warmup") or {}
    if warm.get("settle_steps"):
        out.append(
            f"warm-up extended by {warm['settle_steps']} step(s) until its last steps agreed"
            + (" (they never did: limit reached)" if warm.get("settled") is False else "")
        )
    return out


def render_measurement_notes(report: dict[str, Any], console: Console) -> None:
    for line in measurement_notes(report):
        console.print(f"[yellow]note:[/yellow] {esc(line)}", highlight=False)
    sp = report.get("split")
    if sp:
        timed = (report.get("metrics") or {}).get("step_ms")
        console.print(
            f"time split of the traced step ({sp['step_ms']:,.1f} ms, {esc(sp['basis'])}"
            + (f"; the timed median step is {timed:,.1f} ms" if timed else "")
            + "):",
            highlight=False,
        )
        console.print(
            "  " + ", ".join(f"{esc(r['part'])} {r['share'] * 100:.0f}% ({r['ms']:,.1f} ms)" for r in sp["rows"]),
            highlight=False,
        )
        if sp.get("note"):
            console.print(f"  {esc(sp['note'])}", highlight=False)


def _gain_line(gain: dict[str, Any]) -> str:
    """The table cell of `_gain_text` on one line, for the list form of the findings."""
    text = _gain_text(gain)
    return "expected gain: n/a" if text == "n/a" else "expected: " + text.replace("\n(", ", ").removesuffix(")")


def render_own_findings(diagnosis: dict[str, Any], console: Console) -> None:
    """Prescriptions as a list (not a table), so that code lines print whole in 80 columns."""
    findings = diagnosis["findings"]
    if not findings:
        console.print("[bold green]no prescriptions[/bold green]: no rule fired on the measured facts")
    else:
        console.print("[bold]prescriptions, biggest expected gain first[/bold]")
    for i, f in enumerate(findings, 1):
        order = f"apply {esc(f['apply_order'])}, " if f.get("apply_order") is not None else ""
        console.print(
            f"[bold]{i}. {esc(f['title'])}[/bold] [dim]({order}layer {esc(f['layer'])} {esc(f['layer_name'])}, "
            f"{esc(f['severity'])}; {_gain_line(f['expected_gain'])})[/dim]",
            highlight=False,
        )
        for e in f["evidence"]:
            console.print(f"   seen: {esc(e)}", highlight=False)
        console.print(f"   fix: {esc(f['fix'])}", highlight=False)
        advice = f.get("advice") or {}
        lines = advice.get("lines")
        if lines:
            where = "in your Trainer script" if advice.get("audience") == "trainer" else "in your loop"
            console.print(f"   change {where}:", highlight=False)
            for line in lines:
                console.print(f"     [cyan]{esc(line)}[/cyan]", highlight=False, overflow="fold")
        elif f.get("config_patch"):
            console.print(
                "   knobs: [cyan]" + esc(", ".join(f"{k}={v}" for k, v in f["config_patch"].items())) + "[/cyan]",
                highlight=False,
            )
    render_unprescribed(diagnosis, console)
    render_muted(diagnosis, console)
    for s in diagnosis.get("superseded") or []:
        console.print(f"[dim]superseded: {esc(s['id'])} (covered by {esc(s['superseded_by'])})[/dim]")
    skipped = [n["id"] for n in diagnosis.get("not_evaluated") or []]
    if skipped:
        console.print(
            f"[dim]not evaluated ({len(skipped)} rules need facts this trace lacks, e.g. GPU kernels): "
            f"{esc(', '.join(skipped))}[/dim]"
        )


def comm_line(f: dict[str, Any], prefix: str, rank: int | None = None) -> str:
    """Collective time per step, exposed vs hidden, and each collective's size and bus bandwidth."""
    who = f"rank {esc(rank)}: " if rank is not None else ""
    line = (
        f"{who}collectives {_ms(f[prefix + 'ms'])} ms/step, exposed {_ms(f[prefix + 'exposed_ms'])} ms, hidden "
        f"{_ms(f[prefix + 'hidden_ms'])} ms"
    )
    kinds = f.get(prefix + "kinds") or []
    parts = []
    for k in kinds:
        bw = f.get(f"{prefix}{k}.busbw_gbps")
        size = f.get(f"{prefix}{k}.bytes")
        parts.append(
            f"{esc(k)} {_ms(f.get(f'{prefix}{k}.ms'))} ms"
            + (f" {size / 2**20:,.1f} MiB" if size else "")
            + (f" busbw {bw:.2f} GB/s" if bw is not None else "")
        )
    return "\n".join([line] + [f"  {p}" for p in parts])


def render_cross_rank(cross: dict[str, Any], console: Console) -> None:
    """The ranks of one data-parallel job side by side: who was slow, who waited, how much communication showed."""
    if "skipped" in cross:
        console.print(f"[yellow]cross-rank:[/yellow] {esc(cross['skipped'])}", highlight=False)
        return
    f = cross["facts"]
    console.print(
        f"[bold]cross-rank[/bold]: {esc(f['dist.ranks'])} ranks of {esc(f['dist.world_size'])}, "
        f"{esc(f['dist.parallel'])} over {esc(f['dist.backend'])}"
    )
    for note in cross.get("notes", []):
        console.print(f"[yellow]note:[/yellow] {esc(note)}", highlight=False)
    t = Table(show_header=True, header_style="bold", title="per rank (ms per step)")
    for col in ("rank", "step", "waited", "busy", "tokens", "loader", "gaps", "comm", "exposed"):
        t.add_column(col, justify="right")
    for r in cross["ranks"]:
        t.add_row(
            esc(r["rank"]),
            *(_ms(r.get(k)) for k in ("step_ms", "wait_ms", "busy_ms")),
            f"{r['tokens']:,.0f}" if r.get("tokens") else "n/a",
            *(_ms(r.get(k)) for k in ("loader_ms", "gap_ms", "comm_ms", "exposed_ms")),
        )
    console.print(t)
    if "dist.straggler.rank" in f:
        console.print(
            f"slowest rank {esc(f['dist.straggler.rank'])}: busy {_ms(f['dist.step_skew_ms'])} ms/step more than the "
            f"fastest ({f.get('dist.step_skew_frac', 0) * 100:.0f}%)"
        )
        console.print(f"  cause: {esc(straggler_cause(f))}", highlight=False)
    if "dist.late_wait_ms" in f:
        console.print(
            f"waiting for late ranks in collectives: {_ms(f['dist.late_wait_ms'])} ms/step mean, "
            f"{_ms(f['dist.late_wait_ms_max'])} max"
        )
    if "dist.comm.ms" in f:
        console.print(comm_line(f, "dist.comm.", None).replace("collectives", "rank mean: collectives", 1))
        console.print(
            f"exposed, less the wait for late ranks: {_ms(f['dist.comm.exposed_own_ms'])} ms/step"
            + (f" ({f['dist.comm.exposed_share'] * 100:.1f}%)" if "dist.comm.exposed_share" in f else "")
        )
    if "dist.fsdp.prefetched_frac" in f:
        console.print(
            f"FSDP2 all-gathers issued ahead of their module: forward "
            f"{f.get('dist.fsdp.forward_prefetched_frac', 0) * 100:.0f}%, backward "
            f"{f.get('dist.fsdp.backward_prefetched_frac', 0) * 100:.0f}%"
        )
    if f.get("dist.micro_batches_per_step", 1) > 1:
        console.print(
            f"gradient sync in {f['dist.synced_micro_batches_per_step']:g} of {f['dist.micro_batches_per_step']:g} "
            f"micro-batches per step"
        )
        console.print(f"  {_ms(f['dist.grad_sync.extra_ms'])} ms/step of it before the last micro-batch")
    hta = cross.get("hta") or {}
    if "overlap_pct" in hta:
        ours = hta.get("ours_overlap_pct") or {}
        console.print("comm overlapped with compute, traceinsight vs vlmdoctor:")
        for r, v in sorted(hta["overlap_pct"].items()):
            console.print(f"  rank {esc(r)}: {v:.1f}% vs {ours.get(r) or 0:.1f}%")
    elif "skipped" in hta:
        console.print(f"[dim]traceinsight cross-check skipped: {esc(hta['skipped'])}[/dim]", highlight=False)
