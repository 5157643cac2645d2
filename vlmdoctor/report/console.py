"""The console report: rich tables of metrics, findings, ladders and sweeps; a trace's analysis (its tables:
analysis_tables.py) and the prescriptions (prescriptions.py) as `vlmdoctor analyze` prints them; a report of the
user's own training.

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
    Diagnosis,
    TreatResult,
    as_document,
)
from vlmdoctor.report.analysis_tables import (
    comm_line,
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


def render(report: dict[str, Any], console: Console) -> None:
    cfg, env, model = report["config"], report.get("env", {}), report.get("model", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu_count')} cores)"
    title = f"vlmdoctor profile: {esc(cfg['model'])} stage {esc(cfg['stage'])} on {esc(where)}"
    changed = changed_knobs(cfg)
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
                f"{fmt(err.get('peak_mem_gb_before_failure'), ' GiB', 2)} of "
                f"{fmt(err.get('device_mem_total_gb'), ' GiB', 1)}"
            )
        return
    m = report["metrics"]
    console.print(_metrics_table(report))
    render_measurement_notes(report, console)
    if report.get("distributed"):
        render_ranks(report["distributed"], console)
    versions = ", ".join(f"{k} {env.get(k)}" for k in ("torch", "transformers", "liger_kernel") if env.get(k))
    console.print(f"[dim]{esc(versions)}; driver {esc(env.get('driver') or 'n/a')}[/dim]", highlight=False)
    tr = report.get("trace")
    if tr and tr.get("lost"):  # the measurement above stands; the warning line says why the trace is gone
        console.print(f"trace: lost ({esc(tr['lost'])})", highlight=False)
    elif tr:
        traced = fmt_ms(sorted(tr["traced_step_ms"])[len(tr["traced_step_ms"]) // 2] if tr["traced_step_ms"] else None)
        where = tr["path"] or "analyzed, not kept (--trace-dir DIR keeps it)"
        console.print(
            f"trace: {esc(where)} ({esc(tr['steps'])} steps; traced step {traced} ms vs untraced median "
            f"{fmt_ms(m['step_ms'])} ms)",
            highlight=False,
        )
    if report["status"] == "nan_loss":
        console.print("[bold red]the loss was NaN or inf in a timed step[/bold red]")


def _metrics_table(report: dict[str, Any]) -> Table:
    """A profile report's numbers, each with its spread over the repeats."""
    m, stats = report["metrics"], report.get("stats", {})
    t = Table(show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_column(f"spread over {esc(m['repeats'])} repeat(s) x {esc(m['steps_per_repeat'])} steps", justify="right")

    def spread(key: str, unit: str = "", digits: int = 1) -> str:
        s = stats.get(key)
        if not s or s["n"] < 2:
            return ""
        return f"{fmt(s['min'], unit, digits)} .. {fmt(s['max'], unit, digits)}"

    tp = report.get("throughput") or {}
    t.add_row(
        "real tokens/s",
        fmt(throughput.headline(report), "", 0),
        throughput.spread_text(tp) or spread("real_tokens_per_s", "", 0),
    )
    t.add_row("loss tokens/s", fmt(m["loss_tokens_per_s"], "", 0), spread("loss_tokens_per_s", "", 0))
    t.add_row("pad fraction", fmt(m["pad_fraction"] * 100, " %"), "")
    step = stats.get("step_ms", {})
    t.add_row(
        "ms/step (median)",
        fmt(m["step_ms"], " ms"),
        f"p10 {fmt(m['step_ms_p10'])} / p90 {fmt(m['step_ms_p90'])} (n={esc(step.get('n'))})",
    )
    t.add_row(
        "MFU",
        fmt(m["mfu"] * 100 if m["mfu"] is not None else None, " %"),
        spread("mfu", "", 3) if m["mfu"] is not None else esc(m.get("mfu_reason") or ""),
    )
    t.add_row("model TFLOP/s", fmt_small(m["model_tflops_per_s"]), "")
    if m.get("peak_mem_gb") is not None:
        t.add_row(
            "peak memory allocated / reserved",
            f"{fmt(m['peak_mem_gb'], ' GiB', 2)} / {fmt(m['peak_mem_reserved_gb'], ' GiB', 2)}",
            f"of {fmt(m['device_mem_total_gb'], ' GiB')}",
        )
    else:
        t.add_row("host peak RSS", fmt(m["host_peak_rss_gb"], " GiB", 2), "")
    loss = m["final_loss"]
    t.add_row("final loss", fmt(loss, "", 4) if m["loss_finite"] else f"[red]{esc(loss)} (not finite)[/red]", "")
    return t


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
            fmt(r.get("step_ms")),
            fmt(r.get("real_tokens_per_s"), "", 0),
            esc(r.get("real_tokens")),
            fmt(r.get("peak_mem_gb"), "", 2),
            esc(str(r.get("host", ""))[:20]),
        )
    console.print(t)
    how = ", ".join(esc(x) for x in (d.get("parallel"), d.get("backend")) if x)  # a user's run may not say
    line = (
        f"{esc(d.get('world_size'))} ranks" + (f" ({how})" if how else "") + ": the job's numbers "
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
            f"{fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s); {esc(sc.get('remedy') or '')}"
        )
    elif sc:
        console.print(
            f"scaling efficiency {sc['efficiency'] * 100:.0f}% ({sc['speedup']:.2f}x one GPU's "
            f"{fmt(sc['one_gpu_real_tokens_per_s'], '', 0)} tokens/s, {esc(sc['source'])})"
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
            esc(r.step),
            fmt(r.real_tokens_per_s, "", 0),
            fmt(r.speedup, "", 2),
            fmt(r.step_ms),
            fmt(r.mfu * 100 if r.mfu else None, " %"),
            fmt(r.peak_mem_gb, "", 1),
            fmt(r.elapsed_s, "", 0),
            _knobs_cell(r.change or ""),
        )
    console.print(t)
    own = [(r.step, c) for r in r_.ladder for c in r.changes or []]
    if own:
        t = _lean_table("each change's own contribution (leave-one-out)")
        for col in ("#", "rule", "pairs", "verdict", "x own [95% CI]"):
            t.add_column(col, no_wrap=col != "x own [95% CI]", justify="right" if col in ("#", "pairs") else "left")
        for step, c in own:
            k = c["contribution"]
            t.add_row(
                esc(step), esc(c["rule"]), esc(k.get("pairs") or ""), esc(k["outcome"]), _ci(k) or esc(k.get("why", ""))
            )
        console.print(t)
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
                esc(x.trial),
                fmt(x.real_tokens_per_s, "", 0) if x.real_tokens_per_s else "",
                esc(x.outcome),
                measured,
                what,
            )
        console.print(t)
    for sk in r_.skipped:
        console.print(f"skipped {esc(sk['rule'])}: {esc(sk['why'])}", highlight=False)
    if r_.wall_s:
        console.print(f"treatment took {r_.wall_s:.0f} s")


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
    t.add_row("real tokens/s", fmt(m.get("real_tokens_per_s"), "", 0) + (f" ({spread})" if spread else ""))
    t.add_row("loss tokens/s", fmt(m.get("loss_tokens_per_s"), "", 0))
    pad = m.get("pad_fraction")
    t.add_row("pad fraction", fmt(pad * 100 if pad is not None else None, " %"))
    t.add_row(
        "ms/step (median)",
        f"{fmt(m['step_ms'], ' ms')} (p10 {fmt(m['step_ms_p10'])}, "
        f"p90 {fmt(m['step_ms_p90'])}, n={esc(m['steps_per_repeat'])})",
    )
    _flop_rows(t, m, report.get("flops") or {})
    if m.get("peak_mem_gb") is not None:
        t.add_row("peak memory allocated", fmt(m["peak_mem_gb"], " GiB", 2))
    elif m.get("host_peak_rss_gb") is not None:  # a CPU run: its memory is the process's
        t.add_row("host peak RSS", fmt(m["host_peak_rss_gb"], " GiB", 2))
    if m.get("final_loss") is not None:
        t.add_row("last loss", fmt(m["final_loss"], "", 4))
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
        ranks = len(tr.get("rank_paths") or [])
        where = f"{tr['dir']} (one trace per rank)" if ranks > 1 and tr.get("dir") else tr["path"]
        print_text(console, fill(f"trace: {where}", console.width))  # broken at spaces: the path stays whole
    if "diagnosis" in report:
        render_own_findings(report["diagnosis"], console)


def _flop_rows(t: Table, m: dict[str, Any], flops: dict[str, Any]) -> None:
    """FLOPs per step and MFU of a user's model: counted from a real step; MFU null says why."""
    fps = m.get("flops_per_step")
    t.add_row("FLOPs/step", f"{fmt_small(fps / 1e9)} GFLOP (counted)" if fps else esc(flops.get("formula") or "n/a"))
    mfu = m.get("mfu")
    t.add_row(
        "MFU", fmt(mfu * 100, " %", 2) if mfu is not None else f"n/a: {esc(m.get('mfu_reason') or 'not computed')}"
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
    """The table cell of `gain_text` on one line, for the list form of the findings."""
    text = gain_text(gain)
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
