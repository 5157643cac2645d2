"""The console report: rich tables of metrics, findings, ladders and sweeps; a trace's analysis (its tables:
analysis_tables.py) and the prescriptions (prescriptions.py) as `vlmdoctor analyze` prints them; a run report, of
`vlmdoctor profile` or of the user's own training, read by field through its declaration (documents/run_report.py).

`analyze`, `profile` and a report of the user's training print one screen by default (80 columns, under 80 lines):
the headline with its doubt, the step's largest accounts, the prescriptions one line each with their fix (the top
ones), what was seen without one, and where the full report is; verbose, every table and each prescription's
evidence.

Text is text: every console vlmdoctor prints through is a `SafeConsole`, and data placed inside a markup string
goes through `esc` (text.py says how).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from vlmdoctor.documents import (
    Analysis,
    DataInfo,
    Diagnosis,
    Distributed,
    Env,
    ExpectedGain,
    Finding,
    FlopsInfo,
    GlobalNumbers,
    Metrics,
    ModelInfo,
    RunReport,
    Spread,
    StepAccounts,
    Throughput,
    TraceInfo,
    TreatResult,
    Warmup,
    as_document,
    as_json,
    as_report,
)
from vlmdoctor.documents.run_report import RunError
from vlmdoctor.report.analysis_tables import (
    comm_line,
    effects_line,
    file_head,
    render_accounts_brief,
    render_cross_rank,
    render_facts,
    step_line,
)
from vlmdoctor.report.prescriptions import (
    Prescribed,
    analysis_prescriptions,
    gain_text,
    gain_x,
    render_muted,
    render_not_prescribed,
    render_prescriptions,
    render_unprescribed,
)
from vlmdoctor.report.text import esc, fill, fmt, fmt_ms, fmt_small, print_text
from vlmdoctor.run import throughput
from vlmdoctor.run.config import RunConfig, knob_table


def changed_knobs(config: dict[str, Any]) -> list[str]:
    defaults = RunConfig().to_dict()
    layer = {row["name"]: row["layer"] for row in knob_table()}
    # the measurement window (steps, warmup, repeats) is shown in the table; model and stage in the title
    shown = {"model", "stage", "device", "steps", "warmup", "repeats"}
    return [f"{k}={v}" for k, v in config.items() if v != defaults.get(k) and k in layer and k not in shown]


#: prescriptions printed with their fix by default (the others: one line each; --verbose: every fix)
TOP = 3
#: lines of a fix in the user's terms printed by default (the rest: --verbose, and the report)
FIX_LINES = 6


def _where(env: Env | None) -> str:
    env = env or Env()
    return env.gpu or f"CPU ({env.cpu_count} cores)"


def headline_tokens_per_s(r: RunReport) -> float | None:
    """The headline real tokens/s by the one estimator (run/throughput.py, which reads the report's JSON)."""
    return throughput.headline(as_json(r))


def _spread(r: RunReport) -> str:
    """'p10-p90 1,020-1,180, n=20' of the real tokens/s, or ''."""
    return throughput.spread_text(msgspec.structs.asdict(r.throughput)) if r.throughput is not None else ""


def _n(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:,.{digits}f}"


def headline_lines(
    report: RunReport | dict[str, Any], see: str = "see the report's note", split: bool = True
) -> list[str]:
    """tokens/s with its spread and, when the window is unstable, the doubt; step time; MFU (or why not); the split
    of the traced step (unless not `split`); the ranks. The first lines of every report: the console's default and
    the end summary."""
    r = as_report(report)
    m, tp = r.metrics or Metrics(), r.throughput
    spread = _spread(r)
    first = f"real tokens/s {_n(headline_tokens_per_s(r), 0)}" + (f" ({spread})" if spread else "")
    if tp is not None and tp.stable is False:
        first += f"; unstable window ({see})"
    out = [first]
    out.append(
        f"ms/step {_n(m.step_ms)} (p10 {_n(m.step_ms_p10)}, p90 {_n(m.step_ms_p90)}); "
        + (f"MFU {m.mfu * 100:.2f}%" if m.mfu is not None else f"MFU n/a ({m.mfu_reason or 'not computed'})")
    )
    sp = r.split  # a free-form map (documents/__init__.py): its rows as written
    if sp and split:
        out.append(
            f"split of the traced step ({sp['basis']}): "
            + ", ".join(f"{row['part']} {row['share'] * 100:.0f}%" for row in sp["rows"])
        )
    d = r.distributed
    if d is not None and d.ranks:
        g = d.global_ or GlobalNumbers()
        out.append(
            f"{d.world_size} ranks: the job's numbers above (all ranks' tokens over the slowest rank's "
            f"steps); slowest rank {g.slowest_rank}"
            + (f", {g.step_imbalance * 100:.0f}% slower than the fastest" if (g.step_imbalance or 0) >= 0.005 else "")
        )
    return out


def _memory_line(m: Metrics) -> str | None:
    """Peak memory: the device's, else the process's on a CPU."""
    if m.peak_mem_gb is not None:
        line = f"peak memory {fmt(m.peak_mem_gb, ' GiB', 2)} allocated"
        if m.device_mem_total_gb is not None:
            line += f" of {fmt(m.device_mem_total_gb, ' GiB')}"
        if m.alloc_retries:
            line += f"; {m.alloc_retries} allocator retries (the card was full)"
    elif m.host_peak_rss_gb is not None:
        line = f"host peak RSS {fmt(m.host_peak_rss_gb, ' GiB', 2)}"
    else:
        return None
    return line


def render_profile(
    report: RunReport | dict[str, Any],
    console: Console,
    verbose: bool = False,
    command: Callable[[dict[str, Any]], str] | None = None,
    written: list[str] | None = None,
) -> None:
    """`vlmdoctor profile`'s report. Compact (the default, one screen at 80 columns): the run, the headline with its
    doubt, the step's largest accounts, the prescriptions biggest gain first (the top ones with the command that
    runs them), what was seen without a prescription, the trace and the files written. Verbose: every table and each
    prescription's evidence (`render` and `render_findings`). `command(patch)`: the command that runs a patch."""
    r = as_report(report)
    if verbose:
        render(r, console)
        if r.diagnosis is not None:
            render_findings(r.diagnosis, console, command)
        return
    _profile_head(r, console, model_line=False)
    if r.status not in ("ok", "nan_loss"):
        _failure(r, console)
        return
    _brief_numbers(r, console)
    if r.trace is not None and r.trace.lost:
        console.print(f"trace: lost ({esc(r.trace.lost)})", highlight=False)
    _brief_diagnosis(r, console, command)
    if r.trace is not None and r.trace.path and r.trace.kept:
        print_text(console, fill(f"trace: {r.trace.path}", console.width))  # broken at spaces: the path stays whole
    paths = [p for p in written or [] if p]
    if paths:
        print_text(console, fill("the full report: " + ", ".join(paths), console.width, "", "  "))
    more = "every table and each fix's evidence: --verbose"
    if not any(str(p).endswith((".html", ".htm")) for p in paths):
        more += "; a page with charts: --html report.html"
    print_text(console, fill(more, console.width), "dim")


def _profile_head(r: RunReport, console: Console, model_line: bool = True) -> None:
    """The title, the model (verbose), the knobs changed, skipped records and warnings: the run, before its numbers."""
    cfg, k, model = r.config or {}, r.knobs, r.model or ModelInfo()
    title = f"vlmdoctor profile: {esc(k.model)} stage {esc(k.stage)} on {esc(_where(r.env))}"
    changed = changed_knobs(cfg)
    console.print(f"[bold]{title}[/bold]")
    if model_line:
        console.print(
            f"model: {esc(model.vision)} + {esc(model.projector)} + {esc(model.llm)}; "
            f"{esc(model.image_tokens)} image tokens"
        )
    console.print(
        "knobs changed from the default: " + (esc(", ".join(changed)) if changed else "none (the default config)")
    )
    data = r.data or DataInfo()
    if data.skipped:
        console.print(
            f"[yellow]data: {esc(data.skipped)} of {esc(data.records)} records skipped[/yellow] "
            f"(--bad-records skip; the first: {esc((data.problems or ['?'])[0])})",
            highlight=False,
        )
    for w in r.warnings or []:
        console.print(f"[yellow]warning:[/yellow] {esc(w)}", highlight=False)


def _failure(r: RunReport, console: Console) -> None:
    """A run that did not finish: how it ended, and for an out-of-memory what it asked for."""
    err = r.error or RunError()
    console.print(f"[bold red]{esc(r.status)}[/bold red]: {esc(err.message)}", highlight=False)
    if err.requested_gb is not None:
        console.print(
            f"asked for {err.requested_gb:.2f} GiB more; peak before failure "
            f"{fmt(err.peak_mem_gb_before_failure, ' GiB', 2)} of "
            f"{fmt(err.device_mem_total_gb, ' GiB', 1)}"
        )


def _brief_numbers(r: RunReport, console: Console) -> None:
    """The headline (tokens/s and its doubt, ms/step, MFU, the split where no accounts follow, ranks), memory, a
    loss that was not finite, what to know before trusting the numbers, and a job's scaling: the compact report's
    numbers, each line broken at spaces to the width."""
    lines = headline_lines(r, "see the note below", split=not r.accounts)  # the accounts say where the step went
    memory = _memory_line(r.metrics or Metrics())
    if memory:
        lines.insert(2, memory)
    for line in lines:
        print_text(console, fill(line, console.width, "", "  "))
    if r.status == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")
    for line in measurement_notes(r, brief=True):
        print_text(console, fill(f"note: {line}", console.width, "", "  "), "yellow")
    if r.distributed is not None:
        _scaling_lines(r.distributed, console)


def _brief_diagnosis(r: RunReport, console: Console, command: Callable[[dict[str, Any]], str] | None) -> None:
    """The step's largest accounts, then the prescriptions biggest gain first: the top TOP with their fix, the
    others one line each (a vlmdoctor run: with its knobs); then what was seen and not prescribed, counted."""
    if r.accounts:  # a free-form map in the report (documents/__init__.py), read here through its declaration
        render_accounts_brief(as_document(r.accounts, StepAccounts, "accounts"), console)
    d = r.diagnosis
    if d is None:  # not diagnosed: --no-diagnose, or the diagnosis failed (said on stderr when it did)
        return
    items = []
    for i, f in enumerate(by_rank(d.findings)):
        if i < TOP:
            items.append(Prescribed(_short_fix(f), [], command))
        else:  # one line: the knobs of a vlmdoctor run, nothing of a user's (their lines are in --verbose)
            keep = f.config_patch if command is not None else None
            items.append(Prescribed(msgspec.structs.replace(f, advice=None, config_patch=keep), [], None))
    render_prescriptions(items, console, False)
    render_not_prescribed([d], console, False)


def by_rank(findings: list[Finding]) -> list[Finding]:
    """Biggest expected win first (`rank`); findings without a rank by their expected gain, the same way."""

    def key(i_f: tuple[int, Finding]) -> tuple:
        i, f = i_f
        if f.rank is not None:
            return (0, f.rank, i)
        ratio = gain_x(f.expected_gain or ExpectedGain())
        return (1, ratio is None, -(ratio or 0.0), i)

    return [f for _, f in sorted(enumerate(findings), key=key)]


def _short_fix(f: Finding) -> Finding:
    """A finding whose fix in the user's terms is FIX_LINES lines at most, the rest said to be in --verbose."""
    lines = (f.advice or {}).get("lines") or []
    if len(lines) <= FIX_LINES:
        return f
    shown = [*lines[: FIX_LINES - 1], f"# ... {len(lines) - FIX_LINES + 1} more line(s): --verbose, or the report"]
    return msgspec.structs.replace(f, advice={**(f.advice or {}), "lines": shown})


def render(report: RunReport | dict[str, Any], console: Console) -> None:
    """A profile report's every table (`vlmdoctor profile --verbose`): the run, the metrics with their spreads, the
    notes, each rank, the versions and the trace."""
    r = as_report(report)
    _profile_head(r, console)
    if r.status not in ("ok", "nan_loss"):
        _failure(r, console)
        return
    m = r.metrics or Metrics()
    console.print(_metrics_table(r))
    render_measurement_notes(r, console)
    if r.distributed is not None:
        render_ranks(r.distributed, console)
    env = r.env or Env()
    known = ((k, getattr(env, k)) for k in ("torch", "transformers", "liger_kernel"))
    versions = ", ".join(f"{k} {v}" for k, v in known if v)
    console.print(f"[dim]{esc(versions)}; driver {esc(env.driver or 'n/a')}[/dim]", highlight=False)
    tr = r.trace
    if tr is not None and tr.lost:  # the measurement above stands; the warning line says why the trace is gone
        console.print(f"trace: lost ({esc(tr.lost)})", highlight=False)
    elif tr is not None:
        ms = sorted(tr.traced_step_ms or [])
        traced = fmt_ms(ms[len(ms) // 2] if ms else None)
        where = tr.path or "analyzed, not kept (--trace-dir DIR keeps it)"
        console.print(
            f"trace: {esc(where)} ({esc(tr.steps)} steps; traced step {traced} ms vs untraced median "
            f"{fmt_ms(m.step_ms)} ms)",
            highlight=False,
        )
    if r.status == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")


def _metrics_table(r: RunReport) -> Table:
    """A profile report's numbers, each with its spread over the repeats."""
    m, stats = r.metrics or Metrics(), r.stats or {}
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column(f"spread over {esc(m.repeats)} repeat(s) x {esc(m.steps_per_repeat)} steps", justify="right")

    def spread(key: str, unit: str = "", digits: int = 1) -> str:
        s = stats.get(key)  # a map of the declared Spread, by metric name
        if s is None or s.n is None or s.n < 2:
            return ""
        return f"{fmt(s.min, unit, digits)} .. {fmt(s.max, unit, digits)}"

    t.add_row("real tokens/s", fmt(headline_tokens_per_s(r), "", 0), _spread(r) or spread("real_tokens_per_s", "", 0))
    t.add_row("loss tokens/s", fmt(m.loss_tokens_per_s, "", 0), spread("loss_tokens_per_s", "", 0))
    t.add_row("pad fraction", fmt(m.pad_fraction * 100 if m.pad_fraction is not None else None, " %"), "")
    step = stats.get("step_ms") or Spread()
    t.add_row(
        "ms/step (median)",
        fmt(m.step_ms, " ms"),
        f"p10 {fmt(m.step_ms_p10)} / p90 {fmt(m.step_ms_p90)} (n={esc(step.n)})",
    )
    t.add_row(
        "MFU",
        fmt(m.mfu * 100 if m.mfu is not None else None, " %"),
        spread("mfu", "", 3) if m.mfu is not None else esc(m.mfu_reason or ""),
    )
    t.add_row("model TFLOP/s", fmt_small(m.model_tflops_per_s), "")
    if m.peak_mem_gb is not None:
        t.add_row(
            "peak memory allocated / reserved",
            f"{fmt(m.peak_mem_gb, ' GiB', 2)} / {fmt(m.peak_mem_reserved_gb, ' GiB', 2)}",
            f"of {fmt(m.device_mem_total_gb, ' GiB')}",
        )
        if m.alloc_retries:
            t.add_row("allocator retries", str(m.alloc_retries), "timed steps: card full")
    else:
        t.add_row("host peak RSS", fmt(m.host_peak_rss_gb, " GiB", 2), "")
    loss = m.final_loss
    t.add_row("final loss", fmt(loss, "", 4) if m.loss_finite else f"[red]{esc(loss)} (not finite)[/red]", "")
    return t


def render_ranks(d: Distributed | dict[str, Any], console: Console) -> None:
    """A multi-rank run: one row per rank, then the job's numbers (the table above is the job's)."""
    d = as_document(d, Distributed, "distributed") if isinstance(d, dict) else d
    t = Table(show_header=True, header_style="bold", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    for col in ("rank", "ms/step", "real tokens/s", "real tokens", "peak mem GiB", "host"):
        t.add_column(col, justify="left" if col == "host" else "right", no_wrap=col in ("rank", "host"))
    g = d.global_ or GlobalNumbers()
    for row in d.ranks or []:
        mark = " *" if row.rank == g.slowest_rank else ""
        t.add_row(
            f"{esc(row.rank)}{mark}",
            fmt(row.step_ms),
            fmt(row.real_tokens_per_s, "", 0),
            esc(row.real_tokens),
            fmt(row.peak_mem_gb, "", 2),
            esc((row.host or "")[:20]),
        )
    console.print(t)
    how = ", ".join(esc(x) for x in (d.parallel, d.backend) if x)  # a user's run may not say
    line = (
        f"{esc(d.world_size)} ranks" + (f" ({how})" if how else "") + ": the job's numbers "
        f"are the table's above, each row here one rank's own (* the slowest, rank {esc(g.slowest_rank)}"
    )
    if g.step_imbalance is not None:
        line += f", {g.step_imbalance * 100:.1f}% slower than the fastest"
    console.print(line + ")")
    _scaling_lines(d, console)


def _scaling_lines(d: Distributed, console: Console) -> None:
    """The scaling efficiency, or why it is no result; and weights that differ across ranks."""
    sc = d.scaling  # a free-form map (run/throughput.py `scaling`)
    if sc and sc.get("doubts"):  # no number that cannot be one: what went wrong, and what to do
        console.print(
            "[bold yellow]scaling efficiency not measured:[/bold yellow] "
            + esc("; ".join(sc["doubts"]))
            + f" (it read {sc['efficiency'] * 100:.0f}%, {sc['speedup']:.2f}x one GPU's "
            f"{fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s); {esc(sc.get('remedy') or '')}"
        )
    elif sc:
        console.print(
            f"scaling efficiency {sc['efficiency'] * 100:.0f}% ({sc['speedup']:.2f}x one GPU's "
            f"{fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s, {esc(sc['source'])})"
        )
    if d.params_identical is False:
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


def render_findings(
    diagnosis: dict[str, Any] | Diagnosis,
    console: Console,
    command: Callable[[dict[str, Any]], str] | None = None,
    verbose: bool = True,
) -> None:
    """Prescriptions, biggest expected gain first: what was seen, what to change, what it should save, and
    the order in which to apply it (its layer); then what was muted, superseded or not evaluated.

    A list, not a table: a table's narrow cells cut kernel and rule names. Each patch is printed as the
    command that runs it (`command` turns a patch into one), broken only between flags with a shell
    continuation, so it pastes whole at any width.
    """
    d = as_document(diagnosis, Diagnosis, "diagnosis") if isinstance(diagnosis, dict) else diagnosis
    rx = [Prescribed(f, [], command and (lambda patch, c=command: c(patch))) for f in d.findings]
    render_prescriptions(rx, console, verbose)
    render_not_prescribed([d], console, verbose)


def render_analysis(
    doc: Analysis | dict[str, Any],
    console: Console,
    verbose: bool = False,
    run_command: Callable[[dict[str, Any], dict[str, Any]], str] | None = None,
    written: list[str] | None = None,
) -> None:
    """`vlmdoctor analyze`. Compact (the default): each trace's headline and the step's largest accounts, the
    ranks side by side, then the prescriptions one line each with their fix, and where the full report is.
    Verbose: every table (accounts, host ops, kernel classes, parts, launches) and each prescription's evidence.
    `run_command(config, patch)` says a patch of a vlmdoctor trace as the command that runs it."""
    a = as_document(doc, Analysis, "analysis") if isinstance(doc, dict) else doc
    if verbose:
        render_facts(a, console)
        if a.cross_rank is not None:
            render_cross_rank(a.cross_rank, console)
    else:
        said: set[str] = set()  # the ranks' traces share their warnings: each said once
        for entry in a.files:
            file_head(entry, console, said)
            console.print(step_line(entry), highlight=False)
            if entry.effects:  # which optimizations took effect
                console.print(effects_line(entry.effects), highlight=False)
            if "comm.ms" in entry.facts:
                console.print(comm_line(entry.facts, "comm.", entry.rank).split("\n")[0], highlight=False)
            if entry.accounts is not None and len(a.files) == 1:
                render_accounts_brief(entry.accounts, console)
        if a.cross_rank is not None:
            render_cross_rank(a.cross_rank, console, brief=True)
    items, diagnoses = analysis_prescriptions(a, run_command)
    render_prescriptions(items, console, verbose)
    render_not_prescribed(diagnoses, console, verbose)
    if written:
        print_text(console, fill("the full report: " + ", ".join(written), console.width, "", "  "))
    elif not verbose:
        print_text(console, fill("every table: --verbose; the full report: --html report.html", console.width), "dim")


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


def _knobs_cell(text: str) -> str:
    """Knob changes one to a line ("a=1, b=2" -> "a=1\\nb=2"): a table may narrow the cell, never cut a knob."""
    return "\n".join(esc(k) for k in text.split(", "))


def _lean_table(title: str) -> Table:
    """A table of numbers with one text column last: a space between columns, a rule under the header, so
    that the text column keeps the width its longest knob needs at 80 columns."""
    return Table(
        title=title, header_style="bold", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0)
    )


def render_ladder(result: TreatResult | dict[str, Any], console: Console) -> None:
    """The treat ladder: kept steps with their numbers, then the trials that were not kept."""
    r_ = as_document(result, TreatResult, "treat result") if isinstance(result, dict) else result
    cfg = r_.start_config or {}
    console.print(
        f"[bold]vlmdoctor treat: {esc(cfg.get('model'))} stage {esc(cfg.get('stage'))}[/bold] "
        f"({len(r_.trials)} trial(s); stopped: {esc(r_.stopped_because)})"
    )
    if not r_.ladder:
        start = r_.start
        why = " ".join(x for x in ((start.status, start.error) if start else ()) if x) or "no report came back"
        console.print(f"[bold red]the start config did not run[/bold red]: {esc(why)}", highlight=False)
        return
    t = _lean_table("ladder (adopted rounds)")
    for col in ("#", "tokens/s", "x start", "ms/step", "MFU", "GiB", "at s"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("change")
    for r in r_.ladder:
        t.add_row(
            esc(f"{r.step}{'p' if r.in_process else ''}"),
            fmt(r.real_tokens_per_s, "", 0),
            fmt(r.speedup, "", 2),
            fmt(r.step_ms),
            fmt(r.mfu * 100 if r.mfu else None, " %"),
            fmt(r.peak_mem_gb, "", 1),
            fmt(r.elapsed_s, "", 0),
            _knobs_cell(r.change or ""),
        )
    console.print(t)
    if any(r.in_process for r in r_.ladder):
        console.print(
            "#p: adopted on pairs of windows in one run of the rung before (no room for fresh pairs); its tokens/s are "
            "its windows' median",
            highlight=False,
        )
    own = [(r.step, c) for r in r_.ladder for c in r.changes or []]
    if own:
        t = _lean_table("each change's own contribution (leave-one-out; its target in the traces)")
        for col in ("#", "rule", "pairs", "verdict", "target %\nsaved", "x own [95% CI]"):
            t.add_column(col, no_wrap=col != "x own [95% CI]", justify="right" if col in ("#", "pairs") else "left")
        for step, c in own:
            k = c["contribution"]
            t.add_row(
                esc(step),
                esc(c["rule"]),
                esc(f"{k['pairs']}{'p' if k.get('in_process') else ''}" if k.get("pairs") else ""),
                esc(k["outcome"]),
                _target_cell(c.get("trace")),
                _ci(k) or esc(k.get("why", "")),
            )
        console.print(t)
        if any(c["contribution"].get("in_process") for _, c in own):
            console.print(
                "p: pairs measured in one process, windows of the config with and without the change in turn (a "
                "change is dropped on fresh-process pairs only)",
                highlight=False,
            )
        if any((c.get("trace") or {}).get("start_share") is not None for _, c in own):
            console.print(
                "target %: the share of the traced step its rule's target took at the start -> in the adopted "
                "config, both measured (*: another change reads the same cost); saved: its drop per real token, as "
                "a share of the time per token the treatment saved",
                highlight=False,
            )
        att = r_.trace_attribution
        if att is not None and att.explained_share is not None:
            console.print(
                f"the targets' drops add up to {att.explained_share * 100:.0f}% of the time per real token saved "
                f"({att.start_us_per_token:,.1f} -> {att.final_us_per_token:,.1f} us per token)",
                highlight=False,
            )
    rejected = [x for x in r_.trials if x.outcome not in ("kept", "adopted")]
    if rejected:
        t = _lean_table("trials not kept")
        for col in ("trial", "tokens/s", "outcome", "x [95% CI]", "what"):
            t.add_column(col, justify="right" if col in ("trial", "tokens/s") else "left", no_wrap=col == "trial")
        need = (r_.decision.min_pairs if r_.decision else None) or 3
        for x in rejected:
            d = msgspec.structs.asdict(x)
            if x.ratio is not None:
                measured = _ci(d)
            elif x.ratios:  # a round the time cut short: the pairs it measured, which decided nothing
                measured = f"{_ci(d)} ({len(x.ratios)} of {need} pairs)"
            elif x.margin is not None and x.gain is not None:  # the first treat's gain against its margin
                measured = f"{x.gain * 100:+.1f}% vs +/-{x.margin * 100:.1f}%"
            else:
                measured = esc(x.error or x.why or "")
            what = esc(x.name or x.rule or "")
            if x.kind == "composition" and x.config_patch:  # which knobs, not just "composition"
                what = _knobs_cell(", ".join(f"{k}={v}" for k, v in x.config_patch.items()))
            t.add_row(
                esc(f"{x.trial}{'p' if x.in_process else ''}"),
                fmt(x.real_tokens_per_s, "", 0) if x.real_tokens_per_s else "",
                esc(x.outcome),
                measured,
                what,
            )
        console.print(t)
        if any(x.in_process for x in rejected):
            console.print("p: measured as an arm of one run of the config it would change", highlight=False)
    for sk in r_.skipped:
        console.print(f"skipped {esc(sk['rule'])}: {esc(sk['why'])}", highlight=False)
    if r_.wall_s:
        console.print(f"treatment took {r_.wall_s:.0f} s")


def _target_cell(tr: dict[str, Any] | None) -> str:
    """A change's target in the two traces, as % of each step, and its drop per real token as a share of the time
    per token saved ("61->18* 53%"; "*": shared with another change)."""
    if not tr or tr.get("start_share") is None:
        return ""
    cell = f"{tr['start_share'] * 100:.0f}->{tr['final_share'] * 100:.0f}" + ("*" if tr.get("shared_with") else "")
    share = tr.get("share_of_saving")
    return cell if share is None else f"{cell} {share * 100:.0f}%"


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
            fmt(r["real_tokens_per_s"], "", 0) if ok else "",
            fmt(r["pad_fraction"] * 100 if ok else None),
            f"{fmt(r['step_ms'])} ({fmt(r['step_ms_p10'])}-{fmt(r['step_ms_p90'])})" if ok else "",
            fmt(r["mfu"] * 100 if r.get("mfu") else None, " %"),
            fmt(r.get("peak_mem_gb"), "", 1),
            esc(r["status"]) if ok else f"{esc(r['status'])}: {esc(str(r.get('error') or '')[:50])}",
        )
    console.print(t)


def render_own(report: RunReport | dict[str, Any], console: Console, verbose: bool = False) -> None:
    """A report of the user's own training (Doctor, DoctorCallback, `vlmdoctor run`): what was seen, what to change.

    Compact (the default, one screen at 80 columns): the headline with its doubt, the step's largest accounts, the
    prescriptions biggest gain first (the top ones with their lines for your code). Verbose: the metrics table and
    each prescription's evidence and every line of its fix."""
    r = as_report(report)
    cfg, model = r.knobs, r.model or ModelInfo()
    stage = cfg.stage
    stage_text = f"stage {esc(stage)} ({esc((r.config or {}).get('stage_source'))})" if stage else "stage unknown"
    console.print(
        f"[bold]vlmdoctor: {esc(model.class_name or 'your model')} ({esc(cfg.source)}), {stage_text}, "
        f"on {esc(_where(r.env))}[/bold]",
        highlight=False,
    )
    parts = model.parts or {}
    if parts:
        console.print("parts: " + ", ".join(f"{esc(k)} {esc(v)}" for k, v in parts.items()), highlight=False)
    for n in r.notes or []:
        console.print(f"[yellow]note:[/yellow] {esc(n)}", highlight=False)
    if r.status not in ("ok", "nan_loss"):
        console.print(
            f"[bold red]{esc(r.status)}[/bold red]: {esc((r.error or RunError()).message)}",
            highlight=False,
        )
        return
    if verbose:
        _own_tables(r, console)
    else:
        _brief_numbers(r, console)
        _brief_diagnosis(r, console, None)
        _own_trace(r, console)
        more = "every table and each fix's evidence: --verbose (or verbose=True)"
        print_text(console, fill(more, console.width), "dim")


def _own_tables(r: RunReport, console: Console) -> None:
    """The metrics table, the ranks, the notes, the trace and each prescription with its evidence (verbose)."""
    m = r.metrics or Metrics()
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    spread = _spread(r)
    t.add_row("real tokens/s", fmt(m.real_tokens_per_s, "", 0) + (f" ({spread})" if spread else ""))
    t.add_row("loss tokens/s", fmt(m.loss_tokens_per_s, "", 0))
    t.add_row("pad fraction", fmt(m.pad_fraction * 100 if m.pad_fraction is not None else None, " %"))
    t.add_row(
        "ms/step (median)",
        f"{fmt(m.step_ms, ' ms')} (p10 {fmt(m.step_ms_p10)}, p90 {fmt(m.step_ms_p90)}, n={esc(m.steps_per_repeat)})",
    )
    _flop_rows(t, m, r.flops or FlopsInfo())
    if m.peak_mem_gb is not None:
        t.add_row("peak memory allocated", fmt(m.peak_mem_gb, " GiB", 2))
    elif m.host_peak_rss_gb is not None:  # a CPU run: its memory is the process's
        t.add_row("host peak RSS", fmt(m.host_peak_rss_gb, " GiB", 2))
    if m.final_loss is not None:
        t.add_row("last loss", fmt(m.final_loss, "", 4))
    facts = r.facts or {}
    console.print(t)
    if r.distributed is not None and r.distributed.global_ is not None:  # several ranks: the table above is the job's
        render_ranks(r.distributed, console)
        if "dist.comm.ms" in facts:
            console.print(comm_line(facts, "dist.comm.", None).replace("collectives", "rank mean: collectives", 1))
    render_measurement_notes(r, console)
    _own_trace(r, console)
    if r.diagnosis is not None:
        render_own_findings(r.diagnosis, console)


def _own_trace(r: RunReport, console: Console) -> None:
    """A trace that could not be analyzed, and where the trace is (a folder of rank traces for several ranks)."""
    facts = r.facts or {}
    if "trace.error" in facts:
        console.print(f"[yellow]the trace could not be analyzed:[/yellow] {esc(facts['trace.error'])}", highlight=False)
    tr = r.trace or TraceInfo()
    if tr.path:
        ranks = len(tr.rank_paths or [])
        where = f"{tr.dir} (one trace per rank)" if ranks > 1 and tr.dir else tr.path
        print_text(console, fill(f"trace: {where}", console.width))  # broken at spaces: the path stays whole


def _flop_rows(t: Table, m: Metrics, flops: FlopsInfo) -> None:
    """FLOPs per step and MFU of a user's model: counted from a real step; MFU null says why."""
    fps = m.flops_per_step
    t.add_row("FLOPs/step", f"{fmt_small(fps / 1e9)} GFLOP (counted)" if fps else esc(flops.formula or "n/a"))
    mfu = m.mfu
    t.add_row("MFU", fmt(mfu * 100, " %", 2) if mfu is not None else f"n/a: {esc(m.mfu_reason or 'not computed')}")


def measurement_notes(report: RunReport | dict[str, Any], brief: bool = False) -> list[str]:
    """What to know before trusting the numbers: an unstable window, a warm-up that had not settled, the split.
    `brief`: an unstable window's why and what to do, without what the median makes of it."""
    r = as_report(report)
    tp = r.throughput or Throughput()
    out = []
    if tp.stable is False and brief:
        out.append(f"unstable window: {tp.unstable_reason}; {tp.advice}")
    elif tp.stable is False:
        out.append(
            f"unstable window: {tp.unstable_reason}. tokens/s is the median step's rate, which a few slow "
            f"steps barely move; {tp.advice}"
        )
    if tp.settled is False and tp.settle_note:
        out.append(f"warm-up: {tp.settle_note}")
    warm = r.warmup or Warmup()
    if warm.settle_steps:
        out.append(
            f"warm-up extended by {warm.settle_steps} step(s) until its last steps agreed"
            + (" (they never did: limit reached)" if warm.settled is False else "")
        )
    return out


def render_measurement_notes(report: RunReport | dict[str, Any], console: Console) -> None:
    r = as_report(report)
    for line in measurement_notes(r):
        console.print(f"[yellow]note:[/yellow] {esc(line)}", highlight=False)
    sp = r.split  # a free-form map (documents/__init__.py): its rows as written
    if sp:
        timed = (r.metrics or Metrics()).step_ms
        console.print(
            f"time split of the traced step ({sp['step_ms']:,.1f} ms, {esc(sp['basis'])}"
            + (f"; the timed median step is {timed:,.1f} ms" if timed else "")
            + "):",
            highlight=False,
        )
        console.print(
            "  " + ", ".join(f"{esc(x['part'])} {x['share'] * 100:.0f}% ({x['ms']:,.1f} ms)" for x in sp["rows"]),
            highlight=False,
        )
        if sp.get("note"):
            console.print(f"  {esc(sp['note'])}", highlight=False)


def _gain_line(gain: ExpectedGain | None) -> str:
    """The table cell of `gain_text` on one line, for the list form of the findings."""
    text = gain_text(msgspec.structs.asdict(gain or ExpectedGain()))
    return "expected gain: n/a" if text == "n/a" else "expected: " + text.replace("\n(", ", ").removesuffix(")")


def render_own_findings(diagnosis: Diagnosis | dict[str, Any], console: Console) -> None:
    """Prescriptions as a list (not a table), so that code lines print whole in 80 columns."""
    d = as_document(diagnosis, Diagnosis, "diagnosis") if isinstance(diagnosis, dict) else diagnosis
    if not d.findings:
        console.print("[bold green]no prescriptions[/bold green]: no rule fired on the measured facts")
    else:
        console.print("[bold]prescriptions, biggest expected gain first[/bold]")
    for i, f in enumerate(d.findings, 1):
        order = f"apply {esc(f.apply_order)}, " if f.apply_order is not None else ""
        console.print(
            f"[bold]{i}. {esc(f.title)}[/bold] [dim]({order}layer {esc(f.layer)} {esc(f.layer_name)}, "
            f"{esc(f.severity)}; {_gain_line(f.expected_gain)})[/dim]",
            highlight=False,
        )
        for e in f.evidence or []:
            console.print(f"   seen: {esc(e)}", highlight=False)
        console.print(f"   fix: {esc(f.fix)}", highlight=False)
        advice = f.advice or {}  # the fix in the user's terms: a free-form map (doctor/advice.py)
        lines = advice.get("lines")
        if lines:
            where = "in your Trainer script" if advice.get("audience") == "trainer" else "in your loop"
            console.print(f"   change {where}:", highlight=False)
            for line in lines:
                console.print(f"     [cyan]{esc(line)}[/cyan]", highlight=False, overflow="fold")
        elif f.config_patch:
            console.print(
                "   knobs: [cyan]" + esc(", ".join(f"{k}={v}" for k, v in f.config_patch.items())) + "[/cyan]",
                highlight=False,
            )
    plain_d = msgspec.to_builtins(d)  # the shared renderers of prescriptions.py read the diagnosis as written
    render_unprescribed(plain_d, console)
    render_muted(plain_d, console)
    for s in d.superseded:
        console.print(f"[dim]superseded: {esc(s.id)} (covered by {esc(s.superseded_by)})[/dim]")
    skipped = [n.id for n in d.not_evaluated]
    if skipped:
        console.print(
            f"[dim]not evaluated ({len(skipped)} rules need facts this trace lacks, e.g. GPU kernels): "
            f"{esc(', '.join(skipped))}[/dim]"
        )
